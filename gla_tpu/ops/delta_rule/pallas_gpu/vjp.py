"""The chunk-serial part of the delta rule on Mosaic GPU, as a jax.custom_vjp.

Forward: GLA's state pass with Pass.delta (kernels_mosaic_state.py) walks the chunks with the
state in registers: u = u0 - w S, o = q_in S + M u, S <- exp(b_last) S + k_out^T u; under
differentiation it also stores u and each chunk's entering state (two 16-bit parts).
Backward: the reversed pass gives du = M^T do + k_out dS' and dS <- exp(b_last) dS' + q_in^T do
- w^T du per chunk (dS' stored per chunk, one 16-bit part), the state term of d b_last and
d initial_state; the rest is per chunk in parallel, in XLA (the cotangents of the state pass's
inputs, docs/delta_rule_math.md "Backward"):

    d q_in = do S^T,   d k_out = u dS'^T,   d w = -du S^T,   d u0 = du,   d M = do u^T,
    d b_last = exp(b_last) sum_V S dS'

Every array is token-major [B, Tp, HV, .] (per chunk: [B, N, HV, .]); M, q_in carry the scale.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero, custom_vjp_primal_tree_values

from gla_tpu.ops.gla.pallas_gpu.kernels_mosaic_state import Pass, state_pass

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Passes:
    """The three state passes of one call (static)."""

    block_v: int = 64
    out_parts: int = 2  # 16-bit parts of S in u = u0 - w S and q_in S (2: float32-accurate)

    def forward(self, training: bool) -> Pass:
        return Pass(reverse=False, outputs=True, store_parts=2 if training else 0,
                    state_term=False, delta=True, block_v=self.block_v,
                    out_parts=self.out_parts)

    def reversed(self) -> Pass:
        return Pass(reverse=True, outputs=True, store_parts=2, state_term=True, delta=True,
                    block_v=self.block_v, out_parts=1, term_parts=2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def state_passes(k_out, u0, last, s0, q_in, scores, w_neg, dtype, passes: Passes, interpret):
    """k_out, q_in, w_neg (= -w) [B, Tp, HV, K], u0 [B, Tp, HV, V], scores [B, Tp, HV, C] (the
    rows of each chunk's M), float32, which the kernels read rounded to the 16-bit `dtype` (their
    cotangents stay float32); last [B, N, HV, K] float32 (b_last); s0 [B, HV, K, V] float32 or
    None -> (o [B, Tp, HV, V] in `dtype`, final state [B, HV, K, V] float32)."""
    k_out, u0, q_in, scores, w_neg = (x.astype(dtype) for x in (k_out, u0, q_in, scores, w_neg))
    o, _, final = state_pass(k_out, u0, last, s0, w=q_in, a=scores, w_neg=w_neg,
                             p=passes.forward(training=False), interpret=interpret)
    return o, final


def _fwd(k_out, u0, last, s0, q_in, scores, w_neg, dtype, passes, interpret):
    k_out, u0, last, s0, q_in, scores, w_neg = custom_vjp_primal_tree_values(
        (k_out, u0, last, s0, q_in, scores, w_neg))
    k_out, u0, q_in, scores, w_neg = (x.astype(dtype) for x in (k_out, u0, q_in, scores, w_neg))
    o, u, hi, lo, final = state_pass(k_out, u0, last, s0, w=q_in, a=scores, w_neg=w_neg,
                                     p=passes.forward(training=True), interpret=interpret)
    return (o, final), (k_out, last, s0, q_in, scores, w_neg, u, hi, lo)


def _bwd(dtype, passes, interpret, residuals, cotangents):
    k_out, last, s0, q_in, scores, w_neg, u, hi, lo = residuals
    do, dfinal = cotangents
    do = (jnp.zeros(u.shape, dtype) if isinstance(do, SymbolicZero) else do.astype(dtype))
    dfinal = None if isinstance(dfinal, SymbolicZero) else dfinal.astype(F32)
    du, dh_hi, dh_lo, term, ds0 = state_pass(q_in, do, last, dfinal, w=k_out, a=scores,
                                             w_neg=w_neg, h_parts=(hi, lo), p=passes.reversed(),
                                             interpret=interpret)
    b, tp, hv, _ = u.shape
    n = last.shape[1]
    c = tp // n

    def chunks(x):  # [B, Tp, HV, D] -> [B, N, C, HV, D]
        return x.reshape(b, n, c, hv, x.shape[-1])

    def tokens(x):  # [B, N, C, HV, D] -> [B, Tp, HV, D]
        return x.reshape(b, tp, hv, x.shape[-1])

    def times_state_t(x, parts):
        """Per chunk x [C, V] @ S^T, S [K, V] given as 16-bit parts (hi + lo: float32-accurate),
        [B, N, HV, K, V] each; 16-bit products, float32 sums."""
        return tokens(sum(jnp.einsum("bnchv,bnhkv->bnchk", chunks(x), part,
                                     preferred_element_type=F32) for part in parts))

    d_q_in = times_state_t(do, (hi, lo))  # the state entering each chunk
    d_k_out = times_state_t(u, (dh_hi, dh_lo))  # the cotangent of the state leaving it
    d_w_neg = times_state_t(du, (hi, lo))
    d_scores = tokens(jnp.einsum("bnihv,bnjhv->bnihj", chunks(do), chunks(u),
                                 preferred_element_type=F32))
    d_last = jnp.exp(last) * jnp.sum(term, axis=3)  # [B, N, HV, K]
    return (d_k_out, du.astype(F32), d_last, None if s0 is None else ds0, d_q_in, d_scores,
            d_w_neg)


state_passes.defvjp(_fwd, _bwd, symbolic_zeros=True)
