"""The Zoology MQAR study's data and a two-step run of it (bench/mqar_study.py)."""

import json

import jax
import numpy as np
import pytest

from bench import mqar_study


def test_rows_hold_pairs_and_score_each_key_once_for_its_value():
    inputs, targets, weights = jax.device_get(
        mqar_study.mqar_batch(jax.random.key(3), rows=5, seq_len=64, num_pairs=8, vocab=256))
    assert inputs.shape == targets.shape == weights.shape == (5, 64)
    for row in range(5):
        keys, values = inputs[row, 0:16:2], inputs[row, 1:16:2]
        assert len(set(keys)) == 8 and all(0 < k < 128 <= v < 256 for k, v in zip(keys, values))
        scored = np.flatnonzero(weights[row])
        assert len(scored) == 8 and all(t >= 16 and t % 2 == 0 for t in scored)
        pairs = dict(zip(keys, values))
        assert sorted(inputs[row, scored]) == sorted(keys)  # every key queried once
        assert all(targets[row, t] == pairs[inputs[row, t]] for t in scored)
    with pytest.raises(ValueError, match="num_pairs"):
        mqar_study.mqar_batch(jax.random.key(0), rows=1, seq_len=64, num_pairs=17)


def test_study_runs_resumes_and_merges(tmp_path, capsys):
    common = ["--out", str(tmp_path), "--seq-lens", "32", "--pairs", "4", "8", "--widths", "64",
              "--steps", "2", "--chunk", "1", "--rows-per-count", "2", "--lrs", "1e-3",
              "--eval-rows", "2", "--eval-batches", "1", "--dtype", "float32"]
    report = mqar_study.main(common + ["--kinds", "linear"])
    (result,) = report["results"]
    assert result["kind"] == "linear" and set(result["best"]["accuracy"]) == {"4", "8"}
    # A second run with --resume-from leaves the finished configuration out.
    again = mqar_study.main(common + ["--kinds", "linear", "--resume-from", str(tmp_path),
                                      "--tag", "again"])
    assert again["results"] == []
    table = mqar_study.main(["--merge", str(tmp_path)])
    assert "| linear |" in table and (tmp_path / "mqar_study.md").exists()
    saved = json.loads((tmp_path / "mqar_shard0of1.json").read_text())
    assert saved["results"][0]["runs"][0]["lr"] == 1e-3
