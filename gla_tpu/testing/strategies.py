"""Hypothesis strategies over the ops' problem space, from menus of awkward valid sizes.

Use with a deterministic profile: `settings(derandomize=True, deadline=None, database=None)`.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st

from gla_tpu.testing.problems import GATE_STRENGTHS, AttentionCase, GLACase

# T = 1, odd lengths, non-multiples of 64, one past a block boundary.
SEQ_LENS = (1, 7, 63, 64, 65, 100, 129)
HEAD_GROUPS = ((1, 1), (2, 1), (4, 2), (4, 4), (3, 1))  # (H, Hkv)


@st.composite
def attention_cases(draw, *, head_dims=(16, 32, 64), seq_lens=SEQ_LENS, max_batch=2):
    """Attention problems with at least two keys: with one key every query's softmax is exactly 1,
    dq and dk vanish, and a relative error has no scale (tests/ops/test_attention.py checks that
    case on its own)."""
    t = draw(st.sampled_from(seq_lens))
    s = draw(st.sampled_from([n for n in seq_lens if n > 1]))
    h, hkv = draw(st.sampled_from(HEAD_GROUPS))
    segments = draw(st.sampled_from(("none", "pair") + (("shared",) if t == s else ())))
    return AttentionCase(
        batch=draw(st.integers(1, max_batch)), q_len=t, kv_len=s, num_heads=h, num_kv_heads=hkv,
        head_dim=draw(st.sampled_from(head_dims)), causal=draw(st.booleans()), segments=segments,
    )


@st.composite
def gla_cases(draw, *, key_dims=(16, 32, 64), value_dims=(16, 48, 64), seq_lens=SEQ_LENS,
              gates=("key", "head", "none"), strengths=GATE_STRENGTHS, max_batch=2, max_heads=2):
    return GLACase(
        batch=draw(st.integers(1, max_batch)),
        seq_len=draw(st.sampled_from(seq_lens)),
        num_heads=draw(st.integers(1, max_heads)),
        key_dim=draw(st.sampled_from(key_dims)),
        value_dim=draw(st.sampled_from(value_dims)),
        gate=draw(st.sampled_from(gates)),
        gate_strength=draw(st.sampled_from(strengths)),
        initial_state=draw(st.booleans()),
        segments=draw(st.booleans()),
        output_final_state=draw(st.booleans()),
    )


def budget(max_examples: int, full: int | None = None) -> settings:
    """`max_examples` examples under the deterministic "ci" profile (the default, see
    tests/conftest.py), `full` of them (if given) under "ci-full", the profile of `pytest --full`;
    the loaded profile's own budget when exploring at random."""
    if settings.default.derandomize:
        if full is not None and settings.get_current_profile_name() == "ci-full":
            return settings(max_examples=full)
        return settings(max_examples=max_examples)
    return settings()
