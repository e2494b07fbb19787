"""The three GLA modes of the mosaic_tpu backend compute one function (interpret mode)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gla_tpu import ops
from gla_tpu.testing import GLACase, make_gla_inputs, relative_rms_error

MODES = ("chunk", "fused_chunk", "fused_recurrent")


@pytest.mark.parametrize("gate", ["key", "head", "none"])
def test_mosaic_tpu_modes_agree(gate):
    case = GLACase(1, 100, 2, 64, 128, gate=gate, initial_state=True, segments=True)
    inputs = make_gla_inputs(case, jax.random.key(21))
    results = {
        mode: ops.gla(**inputs, output_final_state=True, mode=mode, backend="mosaic_tpu",
                      interpret=True)
        for mode in MODES
    }
    ref_o, ref_s = ops.gla_reference(**inputs, output_final_state=True)
    for mode, (o, s) in results.items():
        assert np.all(np.isfinite(o)) and np.all(np.isfinite(s)), mode
        # Each mode is float32-accurate against float64, hence within 2e-5 of every other mode.
        assert relative_rms_error(o, ref_o) < 1e-5, mode
        assert relative_rms_error(s, ref_s) < 1e-5, mode
    for a in MODES:
        for b in MODES:
            assert relative_rms_error(results[a][0], jnp.asarray(results[b][0])) < 2e-5, (a, b)
