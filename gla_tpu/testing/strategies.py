"""Hypothesis strategies over the DESIGN.md problem space, from menus of awkward valid sizes.

Use with a deterministic profile: `settings(derandomize=True, deadline=None, database=None)`.
"""

from __future__ import annotations

from hypothesis import strategies as st

from gla_tpu.testing.problems import GATE_STRENGTHS, AttentionCase, GLACase

# T = 1, odd lengths, non-multiples of 64, one past a block boundary.
SEQ_LENS = (1, 7, 63, 64, 65, 100, 129)
HEAD_GROUPS = ((1, 1), (2, 1), (4, 2), (4, 4), (3, 1))  # (H, Hkv)


@st.composite
def attention_cases(draw, *, head_dims=(16, 32, 64), seq_lens=SEQ_LENS, max_batch=2):
    t = draw(st.sampled_from(seq_lens))
    s = draw(st.one_of(st.just(t), st.sampled_from(seq_lens)))
    h, hkv = draw(st.sampled_from(HEAD_GROUPS))
    segments = draw(st.sampled_from(("none", "pair") + (("shared",) if t == s else ())))
    return AttentionCase(
        batch=draw(st.integers(1, max_batch)), q_len=t, kv_len=s, num_heads=h, num_kv_heads=hkv,
        head_dim=draw(st.sampled_from(head_dims)), causal=draw(st.booleans()), segments=segments,
    )


@st.composite
def gla_cases(draw, *, key_dims=(16, 32, 64), value_dims=(16, 48, 64), seq_lens=SEQ_LENS,
              gates=("key", "head", "none"), max_batch=2, max_heads=2):
    return GLACase(
        batch=draw(st.integers(1, max_batch)),
        seq_len=draw(st.sampled_from(seq_lens)),
        num_heads=draw(st.integers(1, max_heads)),
        key_dim=draw(st.sampled_from(key_dims)),
        value_dim=draw(st.sampled_from(value_dims)),
        gate=draw(st.sampled_from(gates)),
        gate_strength=draw(st.sampled_from(GATE_STRENGTHS)),
        initial_state=draw(st.booleans()),
        segments=draw(st.booleans()),
        output_final_state=draw(st.booleans()),
    )
