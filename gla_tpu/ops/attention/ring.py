"""Ring attention: softmax attention with the time axis split over mesh axes.

Runs per device inside `jax.shard_map` (common/sharding.py). Each device keeps its block of
queries; the key/value blocks travel around the ring of time shards (`lax.ppermute` to the next
device, P - 1 times), and each step's partial attention is merged into the running one by
log-sum-exp. The backward runs the same ring with dk and dv travelling along with their keys and
values, and one last hop brings them home. docs/scale_out.md derives it and gives the traffic.

Causal attention is balanced by the zigzag layout: the T axis is cut into 2P half-blocks and
device p holds halves p and 2P-1-p. Then, with halves of m tokens:
- step 0 (its own keys): half p sees half p causally; half 2P-1-p sees half p wholly and itself
  causally, which is one bottom-right causal call of m queries over 2m keys;
- keys from an earlier device r < p: their first half precedes both query halves, their second
  follows both: one call of 2m queries over m keys;
- keys from a later device r > p: both halves precede the second query half only: one call of m
  queries over 2m keys.
Every step after the first costs 2m^2 scores on every device. The op takes and returns the
contiguous layout; the reordering is two `ppermute`s each way (`to_zigzag`, `from_zigzag`).

A local window (left L, right R; causal: R = 0) keeps the contiguous layout, whose work is then
balanced already, and visits only the blocks the window reaches: with blocks of n tokens, the
ceil(L / n) blocks before the device's own (k and v passed to the next device, as above) and the
ceil(R / n) after it (passed to the previous device), or every block where those cover the ring.
The block from device r = p - d is a window call with (L - d n, R + d n) in block-local
positions; where r wraps around the ring (r < 0 or r >= P) a `lax.cond` picks d = s - P.

A backend serves the ring through two functions on one (query block, key block) pair,
`attention_block` (o and lse, float32) and `attention_block_grads` (dq, dk, dv, float32, given
the whole attention's lse and delta = rowsum(o * do)); see the xla backend for their contract.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax


@dataclasses.dataclass(frozen=True)
class Ring:
    """One ring call's static description.

    Attributes:
      axes: the mesh axes over T (one ring over their product).
      shards: P, the number of devices in the ring.
      causal: zigzag-balanced causal attention; else every step sees every key.
      block: (q, k, v, q_seg, kv_seg, causal, window) -> (o f32 [B, n, H, D], lse f32
        [B, H, n]); window None or (left, right) in the block's own positions (either may be
        negative).
      block_grads: (q, k, v, do, lse, delta, q_seg, kv_seg, causal, window) -> (dq, dk, dv) f32.
      window: the call's (left, right) key reach (causal: right 0), or None.
    """

    axes: tuple[str, ...]
    shards: int
    causal: bool
    block: Callable
    block_grads: Callable
    window: tuple | None = None

    def send_to_next(self, x):
        """x from device p to device p + 1 (mod P); None passes through."""
        return self.send(x, 1)

    def send(self, x, shift: int):
        """x from device p to device p + shift (mod P); None passes through."""
        if x is None:
            return None
        perm = [(i, (i + shift) % self.shards) for i in range(self.shards)]
        return lax.ppermute(x, self.axes, perm)


# The zigzag layout: contiguous device d holds halves 2d and 2d + 1; zigzag device e holds halves
# e and 2P-1-e. Half c's zigzag device:


def _zigzag_device(c: int, shards: int) -> int:
    return c if c < shards else 2 * shards - 1 - c


def to_zigzag(x, axes, shards: int):
    """[B, n, ...] contiguous blocks -> the zigzag layout's blocks (n even).

    Of the two halves a device receives, one has an even and one an odd index (e + (2P-1-e) is
    odd), so one ppermute of every device's even half and one of its odd half do it."""
    if x is None:
        return None
    m = x.shape[1] // 2
    even = lax.ppermute(x[:, :m], axes, [(d, _zigzag_device(2 * d, shards))
                                          for d in range(shards)])
    odd = lax.ppermute(x[:, m:], axes, [(d, _zigzag_device(2 * d + 1, shards))
                                         for d in range(shards)])
    e_is_even = lax.axis_index(axes) % 2 == 0  # device e's half e is its even one
    return jnp.where(e_is_even, jnp.concatenate([even, odd], axis=1),
                     jnp.concatenate([odd, even], axis=1))


def from_zigzag(x, axes, shards: int):
    """The inverse of `to_zigzag`."""
    m = x.shape[1] // 2
    e_is_even = lax.axis_index(axes) % 2 == 0
    even = jnp.where(e_is_even, x[:, :m], x[:, m:])
    odd = jnp.where(e_is_even, x[:, m:], x[:, :m])
    even = lax.ppermute(even, axes, [(_zigzag_device(2 * d, shards), d) for d in range(shards)])
    odd = lax.ppermute(odd, axes, [(_zigzag_device(2 * d + 1, shards), d)
                                   for d in range(shards)])
    return jnp.concatenate([even, odd], axis=1)


def _halves(x):
    if x is None:
        return None, None
    m = x.shape[1] // 2
    return x[:, :m], x[:, m:]


def _pad_time(x, before: int, after: int):
    """Zeros around axis 1 of [B, n, ...]."""
    return jnp.pad(x, [(0, 0), (before, after)] + [(0, 0)] * (x.ndim - 2))


def _rows_to_tokens(w):
    """[B, H, n] -> [B, n, H, 1]."""
    return jnp.swapaxes(w, 1, 2)[..., None]


def merge(o_a, lse_a, o_b, lse_b):
    """Two attentions of the same queries over disjoint key sets -> the attention over both.

    o [B, n, H, D] float32, each normalized over its keys; lse [B, H, n] (-inf: no key)."""
    lse = jnp.logaddexp(lse_a, lse_b)
    shift = jnp.where(jnp.isfinite(lse), lse, 0.0)
    w_a, w_b = jnp.exp(lse_a - shift), jnp.exp(lse_b - shift)  # 0 for a side with no key
    return o_a * _rows_to_tokens(w_a) + o_b * _rows_to_tokens(w_b), lse


def _step_forward(ring: Ring, step: int, q, q_seg, kv):
    """(o, lse) of the local queries over the key block held at `step` (from device p - step)."""
    k, v, kv_seg = kv
    if not ring.causal:
        return ring.block(q, k, v, q_seg, kv_seg, False)
    (q0, q1), (s0, s1) = _halves(q), _halves(q_seg)
    (k0, _), (v0, _), (ks0, _) = _halves(k), _halves(v), _halves(kv_seg)
    if step == 0:
        o0, l0 = ring.block(q0, k0, v0, s0, ks0, True)
        o1, l1 = ring.block(q1, k, v, s1, kv_seg, True)  # bottom-right: half 0 wholly
        return jnp.concatenate([o0, o1], axis=1), jnp.concatenate([l0, l1], axis=2)

    def earlier():
        return ring.block(q, k0, v0, q_seg, ks0, False)

    def later():
        o1, l1 = ring.block(q1, k, v, s1, kv_seg, False)
        return (_pad_time(o1, q0.shape[1], 0),
                jnp.concatenate([jnp.full(l1.shape, -jnp.inf, l1.dtype), l1], axis=2))

    return lax.cond(step <= lax.axis_index(ring.axes), earlier, later)


def _step_grads(ring: Ring, step: int, q, q_seg, do, lse, delta, kv):
    """This step's float32 (dq, dk, dv) terms, shaped as q, k, v."""
    k, v, kv_seg = kv
    if not ring.causal:
        return ring.block_grads(q, k, v, do, lse, delta, q_seg, kv_seg, False)
    m, mk = q.shape[1] // 2, k.shape[1] // 2
    (q0, q1), (s0, s1), (do0, do1) = _halves(q), _halves(q_seg), _halves(do)
    l0, l1 = lse[..., :m], lse[..., m:]
    d0, d1 = delta[..., :m], delta[..., m:]
    (k0, _), (v0, _), (ks0, _) = _halves(k), _halves(v), _halves(kv_seg)
    if step == 0:
        dq0, dk0, dv0 = ring.block_grads(q0, k0, v0, do0, l0, d0, s0, ks0, True)
        dq1, dk, dv = ring.block_grads(q1, k, v, do1, l1, d1, s1, kv_seg, True)
        return (jnp.concatenate([dq0, dq1], axis=1), dk + _pad_time(dk0, 0, mk),
                dv + _pad_time(dv0, 0, mk))

    def earlier():
        dq, dk0, dv0 = ring.block_grads(q, k0, v0, do, lse, delta, q_seg, ks0, False)
        return dq, _pad_time(dk0, 0, mk), _pad_time(dv0, 0, mk)

    def later():
        dq1, dk, dv = ring.block_grads(q1, k, v, do1, l1, d1, s1, kv_seg, False)
        return _pad_time(dq1, m, 0), dk, dv

    return lax.cond(step <= lax.axis_index(ring.axes), earlier, later)


def _ring_forward(ring: Ring, q, k, v, q_seg, kv_seg):
    kv = (k, v, kv_seg)
    o = lse = None
    for step in range(ring.shards):
        # the next block's transfer does not wait for this block's compute
        following = tuple(map(ring.send_to_next, kv)) if step + 1 < ring.shards else None
        o_step, lse_step = _step_forward(ring, step, q, q_seg, kv)
        o, lse = (o_step, lse_step) if o is None else merge(o, lse, o_step, lse_step)
        kv = following
    return o.astype(q.dtype), lse


def _window_schedule(ring: Ring, n: int) -> tuple[int, int]:
    """(blocks before, blocks after) the device's own that its queries' window reaches, each
    visited through its own direction of the ring; (P - 1, 0) where they cover the ring."""
    left, right = ring.window
    p = ring.shards
    before = -(-left // n) if left > 0 else 0
    after = -(-right // n) if right > 0 else 0
    if before + after >= p - 1:
        return p - 1, 0
    return before, after


def _window_of(ring: Ring, distance: int, n: int) -> tuple[int, int]:
    """The block-local window of the keys from device p - distance."""
    left, right = ring.window
    return left - distance * n, right + distance * n


def _windowed_block(ring: Ring, fn, step: int, shift: int, n: int):
    """fn(window) for the block `step` hops away in direction `shift` (+1: from earlier devices,
    -1: from later ones); a `lax.cond` on whether it wrapped around the ring."""
    p = lax.axis_index(ring.axes)
    distance = shift * step  # r = p - distance without wrapping
    wrapped = p < step if shift > 0 else p + step >= ring.shards
    plain = functools.partial(fn, _window_of(ring, distance, n))
    around = functools.partial(fn, _window_of(ring, distance - shift * ring.shards, n))
    return lax.cond(wrapped, around, plain)


def _windowed_forward(ring: Ring, q, k, v, q_seg, kv_seg):
    n = q.shape[1]
    before, after = _window_schedule(ring, n)
    o, lse = ring.block(q, k, v, q_seg, kv_seg, False, _window_of(ring, 0, n))
    for shift, count in ((1, before), (-1, after)):
        kv = (k, v, kv_seg)
        for step in range(1, count + 1):
            kv = tuple(ring.send(x, shift) for x in kv)
            o_step, lse_step = _windowed_block(
                ring, lambda w, kv=kv: ring.block(q, kv[0], kv[1], q_seg, kv[2], False, w),
                step, shift, n)
            o, lse = merge(o, lse, o_step, lse_step)
    return o.astype(q.dtype), lse


def _windowed_grads(ring: Ring, q, k, v, q_seg, kv_seg, do, lse, delta):
    n = q.shape[1]
    before, after = _window_schedule(ring, n)

    def grads(kv, window):
        return ring.block_grads(q, kv[0], kv[1], do, lse, delta, q_seg, kv[2], False, window)

    dq, dk, dv = grads((k, v, kv_seg), _window_of(ring, 0, n))
    for shift, count in ((1, before), (-1, after)):
        kv = (k, v, kv_seg)
        dkv = None
        for step in range(1, count + 1):
            kv = tuple(ring.send(x, shift) for x in kv)
            if dkv is not None:
                dkv = tuple(ring.send(x, shift) for x in dkv)
            ddq, ddk, ddv = _windowed_block(ring, lambda w, kv=kv: grads(kv, w), step, shift, n)
            dq = dq + ddq
            dkv = (ddk, ddv) if dkv is None else (dkv[0] + ddk, dkv[1] + ddv)
        if dkv is not None:  # home: the keys' device, `count` hops back
            dk, dv = dk + ring.send(dkv[0], -shift * count), dv + ring.send(dkv[1],
                                                                            -shift * count)
    return dq, dk, dv


def _ring_grads(ring: Ring, q, k, v, q_seg, kv_seg, do, lse, delta):
    """Float32 (dq, dk, dv) of the whole ring: k, v and their gradients travel together."""
    kv = (k, v, kv_seg)
    dq = jnp.zeros(q.shape, jnp.float32)
    dkv = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    for step in range(ring.shards):
        if step:
            dkv = tuple(map(ring.send_to_next, dkv))
        # the next block's transfer does not wait for this block's compute (as the forward's)
        following = tuple(map(ring.send_to_next, kv)) if step + 1 < ring.shards else None
        ddq, ddk, ddv = _step_grads(ring, step, q, q_seg, do, lse, delta, kv)
        dq, dkv = dq + ddq, (dkv[0] + ddk, dkv[1] + ddv)
        kv = following
    # after P - 1 hops device p holds the gradients of device p + 1's keys: one more hop home
    dk, dv = map(ring.send_to_next, dkv)
    return dq, dk, dv


def ring_attention(ring: Ring, q, k, v, q_seg, kv_seg):
    """o [B, n, H, D] in q's dtype: the local queries over every device's keys.

    q [B, n, H, D], k, v [B, n, Hkv, D], segment ids [B, n] or None: this device's blocks, in the
    zigzag layout where causal without a window (contiguous under a window)."""
    if ring.window is None:
        forward, grads = _ring_forward, _ring_grads
    else:
        forward, grads = _windowed_forward, _windowed_grads

    @jax.custom_vjp
    def attend(q, k, v, q_seg, kv_seg):
        return forward(ring, q, k, v, q_seg, kv_seg)[0]

    def attend_fwd(q, k, v, q_seg, kv_seg):
        o, lse = forward(ring, q, k, v, q_seg, kv_seg)
        return o, (q, k, v, q_seg, kv_seg, o, lse)

    def attend_bwd(residuals, do):
        q, k, v, q_seg, kv_seg, o, lse = residuals
        delta = jnp.einsum("bthd,bthd->bht", o.astype(jnp.float32), do.astype(jnp.float32))
        dq, dk, dv = grads(ring, q, k, v, q_seg, kv_seg, do, lse, delta)
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None

    attend.defvjp(attend_fwd, attend_bwd)
    return attend(q, k, v, q_seg, kv_seg)
