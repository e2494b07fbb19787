"""The "mosaic_tpu" backend's fused_recurrent mode: token-by-token GLA as Pallas TPU kernels.

The mode dispatcher (gla_tpu/ops/gla/mosaic_tpu.py) calls `check_supported_recurrent(problem)` and
`fused_recurrent(...)`. This module picks block sizes, lays the [B, T, H, D] arrays out for the
kernels (gla_tpu/ops/gla/mosaic_tpu_recurrent_kernels.py) and wires forward and backward with
`jax.custom_vjp`. docs/gla_mosaic_tpu_recurrent.md has the design and the backward's derivation.

Layout per head dim D (K for q, k, per-key g; V for v, o):
- D a multiple of 128: [B, T, H*D] views, no copy.
- D = 64: a head-major copy [B, H, T, 64] (a 64-lane block of an [.., H*64] view is not a legal
  TPU block).
- 192, 320, 448: zero-padded to the next multiple of 128, then viewed (zero key rows or value
  columns of the state stay zero and are sliced off).
T is zero-padded to a multiple of the time block (k = v = 0 and g = 0 leave the state unchanged).
T = 1 with few enough heads' states in VMEM takes a decode kernel with no padding and no copy.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from gla_tpu.ops.common.gating import pad_time, segment_index
from gla_tpu.ops.gla import mosaic_tpu_recurrent_kernels as kernels
from gla_tpu.ops.gla.mosaic_tpu_recurrent_kernels import SUB, KernelConfig, TimeOperand
from gla_tpu.ops.common.tpu_interpret import tpu_interpret_params

LANES = 128
# Head dims the kernels take: multiples of MIN_HEAD_DIM up to MAX_HEAD_DIM.
MIN_HEAD_DIM = 64
MAX_HEAD_DIM = 512
# Time blocks tried, and the per-grid-step overhead in token-equivalents used to choose one.
TIME_BLOCKS = (64, 32, 16, 8)
STEP_COST_TOKENS = 8
# VMEM the kernels may plan for: under the 16 MiB default scoped limit of v4 / v5e / v5p.
VMEM_BUDGET_BYTES = 12 * 2**20
# Heads per decode grid step tried (multiples of 8, the sublane tile of a [B, H, D] block).
DECODE_HEAD_BLOCKS = (16, 8)


@dataclasses.dataclass(frozen=True)
class RecurrentBlockSizes:
    """Performance knobs of the fused_recurrent kernels; None picks automatically.

    block_t: tokens per grid step of the time-blocked kernels (a multiple of 8), also the
      backward's recompute interval.
    block_v: V columns of the state per grid step (a multiple of 128 dividing the padded V, or V).
    block_h_decode: heads per grid step of the T = 1 decode kernel (a multiple of 8 dividing H,
      or H); 0 disables the decode kernel.
    """

    block_t: int | None = None
    block_v: int | None = None
    block_h_decode: int | None = None

    def __post_init__(self):
        for name in ("block_t", "block_v", "block_h_decode"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 0):
                raise ValueError(f"{name} must be None or a non-negative int; got {value!r}.")
        if self.block_t is not None and (self.block_t == 0 or self.block_t % SUB):
            raise ValueError(f"block_t={self.block_t} must be a positive multiple of {SUB}.")
        if self.block_v is not None and self.block_v == 0:
            raise ValueError(f"block_v={self.block_v} must be positive.")


def check_supported_recurrent(problem) -> None:
    """Raises NotImplementedError when the fused_recurrent kernels cannot take `problem`."""
    if problem.mode != "fused_recurrent":
        raise NotImplementedError(
            "mosaic_tpu_recurrent implements mode='fused_recurrent' only; "
            f"got mode={problem.mode!r}."
        )
    dims = (("K (key head dim)", problem.key_dim), ("V (value head dim)", problem.value_dim))
    for name, d in dims:
        if d % MIN_HEAD_DIM or not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM:
            raise NotImplementedError(
                f"the 'mosaic_tpu' gla backend needs {name} to be a multiple of {MIN_HEAD_DIM} "
                f"from {MIN_HEAD_DIM} to {MAX_HEAD_DIM}; got {d}. backend='xla' takes any size."
            )
    _plan(problem, RecurrentBlockSizes())


def fused_recurrent(q, k, v, g, *, problem, initial_state, segment_ids, interpret,
                    block_sizes: RecurrentBlockSizes | None = None):
    """Token-by-token gated linear attention, differentiable (custom_vjp).

    Args:
      q, k: [B, T, H, K]; v: [B, T, H, V]; one dtype.
      g: [B, T, H, K], [B, T, H] or None (log forget gate, <= 0), any float dtype.
      problem: the validated GLAProblem (mode "fused_recurrent").
      initial_state: [B, H, K, V] float32 or None.
      segment_ids: [B, T] int32 or None; the state resets where the id changes.
      interpret: False, True (TPU interpret mode, uninitialized memory NaN) or a
        pltpu.InterpretParams.
      block_sizes: RecurrentBlockSizes or None.
    Returns:
      (o [B, T, H, V] in v's dtype, final state [B, H, K, V] float32 or None).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from gla_tpu.ops.gla.validation import validate_gla
      >>> q = k = v = jnp.ones((1, 10, 2, 64))
      >>> g = jax.nn.log_sigmoid(jnp.ones((1, 10, 2)))
      >>> problem, s0, seg = validate_gla(q, k, v, g, scale=None, initial_state=None,
      ...     output_final_state=True, segment_ids=None, mode="fused_recurrent", chunk_size=None)
      >>> o, s = fused_recurrent(q, k, v, g, problem=problem, initial_state=s0, segment_ids=seg,
      ...     interpret=True)
      >>> o.shape, s.shape
      ((1, 10, 2, 64), (1, 2, 64, 64))
    """
    check_supported_recurrent(problem)
    if block_sizes is None:
        block_sizes = RecurrentBlockSizes()
    elif not isinstance(block_sizes, RecurrentBlockSizes):
        raise ValueError(
            f"block_sizes must be None or a RecurrentBlockSizes; got {block_sizes!r}."
        )
    plan = _plan(problem, block_sizes)
    gates = None if g is None else g.astype(jnp.float32)
    keep = None
    if plan.cfg.has_keep:
        seg = segment_index(segment_ids)
        keep = jnp.concatenate(
            [jnp.ones((seg.shape[0], 1), bool), seg[:, 1:] == seg[:, :-1]], axis=1
        ).astype(jnp.float32)  # [B, T]: 0 where a new segment starts
    core = _make_core(plan, tpu_interpret_params(interpret))
    o, final = core(q, k, v, gates, keep, initial_state)
    return o, (final if problem.output_final_state else None)


@dataclasses.dataclass(frozen=True)
class _DimLayout:
    """How one head dim D is stored for the time-blocked kernels."""

    size: int  # D
    padded: int  # D rounded up for the kernels
    kind: str  # "view" ([B, T, H*Dp]) or "head_major" ([B, H, T, D])

    @staticmethod
    def of(d: int) -> "_DimLayout":
        if d % LANES == 0:
            return _DimLayout(d, d, "view")
        if d < LANES:
            return _DimLayout(d, d, "head_major")
        return _DimLayout(d, -(-d // LANES) * LANES, "view")

    def to_kernel(self, x, padded_len: int):
        """[B, T, H, D] -> the kernel layout, zero padding in time and D."""
        x = pad_time(x, padded_len)
        if self.padded != self.size:
            x = jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, self.padded - self.size)))
        b, t, h, d = x.shape
        if self.kind == "view":
            return x.reshape(b, t, h * d)
        return jnp.transpose(x, (0, 2, 1, 3))

    def from_kernel(self, y, *, heads: int, seq_len: int, partial: bool):
        """The kernel layout -> [B, T, H, D] (partial sums over V blocks added first)."""
        if partial:
            y = jnp.sum(y, axis=0) if y.shape[0] > 1 else y[0]
        if self.kind == "view":
            b, t, _ = y.shape
            y = y.reshape(b, t, heads, self.padded)
        else:
            y = jnp.transpose(y, (0, 2, 1, 3))
        return y[:, :seq_len, :, : self.size]


@dataclasses.dataclass(frozen=True)
class _Plan:
    cfg: KernelConfig
    keys: _DimLayout
    values: _DimLayout
    padded_len: int
    output_final_state: bool
    decode_block_h: int  # 0: no decode kernel
    decode_block_v: int

    @property
    def num_time_blocks(self) -> int:
        return self.padded_len // self.cfg.block_t

    @property
    def num_v_blocks(self) -> int:
        return self.values.padded // self.cfg.block_v

    def layouts(self) -> dict[str, TimeOperand]:
        kk, kv, kp, bv = self.keys.kind, self.values.kind, self.keys.padded, self.cfg.block_v
        per_key = self.cfg.gate_kind == "key"
        gate = TimeOperand(kk, kp) if per_key else TimeOperand("head_column", 1)
        return {
            "q": TimeOperand(kk, kp),
            "k": TimeOperand(kk, kp),
            "g": gate,
            "keep": TimeOperand("row_column", 1),
            "v": TimeOperand(kv, bv, per_v_block=True),
            "o": TimeOperand(kv, bv, per_v_block=True),
            "do": TimeOperand(kv, bv, per_v_block=True),
            "dv": TimeOperand(kv, bv, per_v_block=True),
            "dq": TimeOperand(kk, kp, partial=True),
            "dk": TimeOperand(kk, kp, partial=True),
            "dg": dataclasses.replace(gate, partial=True),
        }


def _lanes(d: int) -> int:
    return -(-d // LANES) * LANES


def _value_blocks(values: _DimLayout) -> list[int]:
    """Candidate block_v, largest first: multiples of 128 dividing the padded V, or V itself."""
    if values.kind == "head_major":
        return [values.padded]
    return [d for d in range(values.padded, 0, -LANES) if values.padded % d == 0]


def _time_blocks(seq_len: int) -> list[int]:
    """Candidate block_t ordered by padded tokens plus per-step overhead."""
    def cost(bt):
        padded = -(-seq_len // bt) * bt
        return padded + STEP_COST_TOKENS * (padded // bt)

    return sorted(TIME_BLOCKS, key=lambda bt: (cost(bt), -bt))


def vmem_bytes_time_blocked(*, key_dim: int, block_v: int, block_t: int, itemsize: int) -> dict:
    """Planned VMEM bytes of the forward and backward time-blocked kernels: double-buffered
    blocks, scratch, and the values the compiler keeps live (state-sized values and [K, SUB]
    token columns, which pad to [K, 128]). Calibrated against Mosaic's totals (see docs)."""
    kl, vl = _lanes(key_dim), _lanes(block_v)
    state = key_dim * block_v * 4
    columns = key_dim * LANES * 4
    small = 2 * block_t * LANES * 4  # a [block_t, 1] block (gate per head, keep) pads to 128 lanes
    fwd = (
        state  # scratch
        + 2 * 3 * state  # initial state, final state, checkpoint blocks
        + 2 * block_t * kl * (2 * itemsize + 4)  # q, k, per-key g
        + 2 * block_t * vl * 2 * itemsize  # v, o
        + 2 * small
        + 2 * state + 4 * columns  # live values
    )
    bwd = (
        (block_t + 2) * state  # per-token states scratch, carry
        + 2 * 3 * state  # checkpoint, final-state cotangent, initial-state gradient
        + 2 * block_t * kl * (2 * itemsize + 4 + 3 * 4)  # q, k, g in; dq, dk, dg out (f32)
        + 2 * block_t * vl * 3 * itemsize  # v, do, dv
        + 4 * small
        + 6 * state + 8 * columns  # live values
    )
    return {"forward": fwd, "backward": bwd}


def vmem_bytes_decode(*, key_dim: int, block_v: int, block_h: int, itemsize: int) -> int:
    """Planned VMEM bytes of the decode kernel: double-buffered blocks plus live values."""
    state = block_h * key_dim * block_v * 4
    tiles = block_h * (2 * _lanes(key_dim) * (itemsize + 4) + 2 * _lanes(block_v) * itemsize)
    return 2 * (2 * state + tiles) + key_dim * block_v * 4 * 2


def _plan(problem, block_sizes: RecurrentBlockSizes) -> _Plan:
    keys, values = _DimLayout.of(problem.key_dim), _DimLayout.of(problem.value_dim)
    itemsize = jnp.dtype(problem.dtype).itemsize
    t = problem.seq_len
    bvs = _value_blocks(values)
    if block_sizes.block_v is not None:
        if block_sizes.block_v not in bvs:
            raise ValueError(
                f"block_sizes.block_v={block_sizes.block_v} must be one of {bvs} for "
                f"V={problem.value_dim}."
            )
        bvs = [block_sizes.block_v]
    bts = _time_blocks(t) if block_sizes.block_t is None else [block_sizes.block_t]
    chosen = None
    for bv in bvs:
        for bt in bts:
            need = vmem_bytes_time_blocked(
                key_dim=keys.padded, block_v=bv, block_t=bt, itemsize=itemsize)
            if max(need.values()) <= VMEM_BUDGET_BYTES or block_sizes.block_t is not None:
                chosen = (bt, bv)
                break
        if chosen:
            break
    if chosen is None:
        raise NotImplementedError(
            f"the 'mosaic_tpu' fused_recurrent kernels find no block sizes within "
            f"{VMEM_BUDGET_BYTES} bytes of VMEM for K={problem.key_dim}, V={problem.value_dim}; "
            "backend='xla' takes it."
        )
    bt, bv = chosen
    cfg = KernelConfig(
        gate_kind=problem.gate_kind, has_keep=problem.has_segments and t > 1,
        scale=float(problem.scale), key_dim=keys.padded, block_t=bt, block_v=bv,
    )
    decode_h, decode_v = _decode_blocks(problem, block_sizes, itemsize)
    return _Plan(
        cfg=cfg, keys=keys, values=values, padded_len=-(-t // bt) * bt,
        output_final_state=problem.output_final_state, decode_block_h=decode_h,
        decode_block_v=decode_v,
    )


def _decode_blocks(problem, block_sizes: RecurrentBlockSizes, itemsize: int) -> tuple[int, int]:
    """(block_h, block_v) of the decode kernel, or (0, 0) when T > 1 or nothing fits."""
    h, vd = problem.num_heads, problem.value_dim
    if problem.seq_len != 1 or block_sizes.block_h_decode == 0:
        return 0, 0
    if block_sizes.block_h_decode is not None:
        if h % block_sizes.block_h_decode or (block_sizes.block_h_decode % SUB
                                              and block_sizes.block_h_decode != h):
            raise ValueError(
                f"block_sizes.block_h_decode={block_sizes.block_h_decode} must divide H={h} and "
                f"be a multiple of {SUB} or H itself."
            )
        hbs = [block_sizes.block_h_decode]
    else:
        hbs = [hb for hb in DECODE_HEAD_BLOCKS if h % hb == 0] or [h]
    bvs = [vd] if vd % LANES else [d for d in range(vd, 0, -LANES) if vd % d == 0]
    for hb in hbs:
        for bv in bvs:
            need = vmem_bytes_decode(
                key_dim=problem.key_dim, block_v=bv, block_h=hb, itemsize=itemsize)
            if need <= VMEM_BUDGET_BYTES:
                return hb, bv
    return 0, 0


def _make_core(plan: _Plan, interpret):
    """The custom_vjp function of (q, k, v, g float32 | None, keep | None, s0 | None)."""

    @jax.custom_vjp
    def core(q, k, v, g, keep, s0):
        return _forward(plan, interpret, q, k, v, g, keep, s0)

    def core_fwd(q, k, v, g, keep, s0):
        return _forward(plan, interpret, q, k, v, g, keep, s0), (q, k, v, g, keep, s0)

    def core_bwd(res, cts):
        q, k, v, g, keep, s0 = res
        do, dfinal = cts
        dq, dk, dv, dg, ds0 = _backward(plan, interpret, q, k, v, g, keep, s0, do, dfinal)
        dkeep = None if keep is None else jnp.zeros_like(keep)
        return dq, dk, dv, dg, dkeep, ds0

    core.defvjp(core_fwd, core_bwd)
    return core


def _kernel_inputs(plan: _Plan, q, k, v, g, keep):
    """q, k, v, g, keep in the time-blocked kernels' layout."""
    tp = plan.padded_len
    kin = lambda x: None if x is None else plan.keys.to_kernel(x, tp)  # noqa: E731
    gk = None
    if g is not None:
        if g.ndim == 4:
            gk = kin(g)
        else:  # [B, T, H] -> [B, H, T, 1]
            gk = jnp.transpose(pad_time(g, tp), (0, 2, 1))[..., None]
    kp = None if keep is None else pad_time(keep, tp, value=1.0)[..., None]  # [B, Tp, 1]
    return kin(q), kin(k), plan.values.to_kernel(v, tp), gk, kp


def _pad_state(plan: _Plan, s):
    if s is None:
        return None
    dk = plan.keys.padded - plan.keys.size
    dv = plan.values.padded - plan.values.size
    if dk or dv:
        s = jnp.pad(s, ((0, 0), (0, 0), (0, dk), (0, dv)))
    return s


def _unpad_state(plan: _Plan, s):
    return None if s is None else s[:, :, : plan.keys.size, : plan.values.size]


def _forward(plan: _Plan, interpret, q, k, v, g, keep, s0):
    _, t, h, _ = q.shape
    if plan.decode_block_h:
        return _decode(plan, interpret, q, k, v, g, s0)
    qk, kk, vk, gk, kp = _kernel_inputs(plan, q, k, v, g, keep)
    o, *rest = kernels.recurrent_forward(
        qk, kk, vk, gk, kp, _pad_state(plan, s0), cfg=plan.cfg, layouts=plan.layouts(),
        nt=plan.num_time_blocks, nv=plan.num_v_blocks, emit_o=True,
        emit_final=plan.output_final_state, emit_checkpoints=False, o_shape=vk.shape,
        o_dtype=v.dtype, interpret=interpret,
    )
    o = plan.values.from_kernel(o, heads=h, seq_len=t, partial=False)
    final = _unpad_state(plan, rest[0]) if plan.output_final_state else None
    return o, final


def _decode(plan: _Plan, interpret, q, k, v, g, s0):
    b, _, h, kd = q.shape
    vd = v.shape[-1]
    gk = None
    if g is not None:
        gk = g.reshape(b, h, kd) if g.ndim == 4 else g.reshape(b, h, 1)
    cfg = dataclasses.replace(plan.cfg, key_dim=kd, block_v=plan.decode_block_v)
    o, final = kernels.recurrent_decode(
        q.reshape(b, h, kd), k.reshape(b, h, kd), v.reshape(b, h, vd), gk, s0, cfg=cfg,
        block_h=plan.decode_block_h, emit_final=plan.output_final_state, interpret=interpret,
    )
    return o.reshape(b, 1, h, vd), final


def _backward(plan: _Plan, interpret, q, k, v, g, keep, s0, do, dfinal):
    _, t, h, _ = q.shape
    layouts = plan.layouts()
    nv = plan.num_v_blocks
    qk, kk, vk, gk, kp = _kernel_inputs(plan, q, k, v, g, keep)
    dok = plan.values.to_kernel(do.astype(v.dtype), plan.padded_len)
    (checkpoints,) = kernels.recurrent_forward(
        None, kk, vk, gk, kp, _pad_state(plan, s0), cfg=plan.cfg, layouts=layouts,
        nt=plan.num_time_blocks, nv=nv, emit_o=False, emit_final=False, emit_checkpoints=True,
        o_shape=None, o_dtype=None, interpret=interpret,
    )
    direct = nv == 1
    grad_dtypes = {
        "dq": q.dtype if direct else jnp.float32,
        "dk": k.dtype if direct else jnp.float32,
        "dv": v.dtype,
        "dg": jnp.float32,
    }
    dfinal = _pad_state(plan, dfinal) if plan.output_final_state else None
    dq, dk, dv, dg, ds0 = kernels.recurrent_backward(
        qk, kk, vk, gk, kp, dok, checkpoints, dfinal, cfg=plan.cfg, layouts=layouts,
        nt=plan.num_time_blocks, nv=nv, has_initial_state=s0 is not None,
        grad_dtypes=grad_dtypes, interpret=interpret,
    )
    unk = lambda x: plan.keys.from_kernel(x, heads=h, seq_len=t, partial=True)  # noqa: E731
    dq = unk(dq).astype(q.dtype)
    dk = unk(dk).astype(k.dtype)
    dv = plan.values.from_kernel(dv, heads=h, seq_len=t, partial=False)
    if dg is not None:
        if g.ndim == 4:
            dg = unk(dg)
        else:  # [NV, B, H, Tp, 1] -> [B, T, H]
            dg = jnp.sum(dg[..., 0], axis=0)
            dg = jnp.transpose(dg, (0, 2, 1))[:, :t]
    return dq, dk, dv, dg, _unpad_state(plan, ds0)
