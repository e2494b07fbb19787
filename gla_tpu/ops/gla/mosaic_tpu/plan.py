"""Tiling plan of the Mosaic TPU GLA kernels: block sizes, the layouts arrays take in HBM, and
VMEM budgets (docs/gla_mosaic_tpu.md, docs/gla_mosaic_tpu_recurrent.md).

Chunked modes: [B, T, H, D] arrays are read as [B, T, H*D] views (no copy) when D is a multiple of
128, else as head-major copies [B, H, T, D] (a [C, 64] block of the view would break the (8, 128)
tiling); states are held transposed, [V, K].

fused_recurrent, per head dim D (K for q, k, per-key g; V for v, o):
- D a multiple of 128: [B, T, H*D] views, no copy.
- D = 64: a head-major copy [B, H, T, 64].
- 192, 320, 448: zero-padded to the next multiple of 128, then viewed (zero key rows or value
  columns of the state stay zero and are sliced off).
T is zero-padded to a multiple of the time block (k = v = 0 and g = 0 leave the state unchanged).
T = 1 with few enough heads' states in VMEM takes a decode kernel with no padding and no copy.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from gla_tpu.ops.common.padding import pad_time
from gla_tpu.ops.common.tpu import LANES, SUBLANES

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


# Token rows per sub-block of the recurrent kernels: one float32 sublane tile.
SUBBLOCK = SUBLANES
GATE_KINDS = ("key", "head", "none")


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Performance knobs of the mosaic_tpu GLA kernels (results do not depend on them); None picks
    automatically.

    Attributes:
      block_v: chunked modes: V columns per grid step (a multiple of 128 dividing V; None: all of
        V). The state block is [block_v, K] float32 in VMEM; a smaller block gives more parallel
        grid steps and recomputes the [C, C] scores once per V block.
      block_t_recurrent: fused_recurrent: tokens per grid step (a multiple of 8), also the
        backward's recompute interval.
      block_v_recurrent: fused_recurrent: V columns of the state per grid step (a multiple of 128
        dividing the padded V, or V).
      block_h_decode: heads per grid step of the T = 1 decode kernel (a multiple of 8 dividing H,
        or H); 0 disables the decode kernel.
      profiler_safe: chunked modes: zero the intra-chunk masks by 0/1 products (and, per-key
        gates, round the pair levels' operand for db by integer ops) instead of selects that
        libtpu folds into masked MXU pushes (and a bfloat16 round trip). The same values;
        libtpu's static profiler (`bench.tpu_static`) takes these kernels' forward+backward on
        v5e and v5p only so, and they cost about 0.5% more cycles by its estimate on v6e
        (docs/tpu_static_estimate.md, "`BlockSizes(profiler_safe=True)`"). Off by default.

    Example:
      >>> BlockSizes(block_v=128, block_t_recurrent=32)  # doctest: +ELLIPSIS
      BlockSizes(block_v=128, block_t_recurrent=32, ...)
    """

    block_v: int | None = None
    block_t_recurrent: int | None = None
    block_v_recurrent: int | None = None
    block_h_decode: int | None = None
    profiler_safe: bool = False

    def __post_init__(self):
        if not isinstance(self.profiler_safe, bool):
            raise ValueError(
                f"BlockSizes.profiler_safe must be True or False; got {self.profiler_safe!r}.")
        for name in ("block_v", "block_t_recurrent", "block_v_recurrent", "block_h_decode"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 0):
                raise ValueError(
                    f"BlockSizes.{name} must be None or a non-negative int; got {value!r}.")
        bv = self.block_v
        if bv is not None and (bv == 0 or bv % LANES):
            raise ValueError(
                f"BlockSizes.block_v must be None or a positive multiple of {LANES}; got {bv!r}.")
        bt = self.block_t_recurrent
        if bt is not None and (bt == 0 or bt % SUBBLOCK):
            raise ValueError(
                f"BlockSizes.block_t_recurrent={bt} must be a positive multiple of {SUBBLOCK}.")
        if self.block_v_recurrent == 0:
            raise ValueError("BlockSizes.block_v_recurrent=0 must be positive.")

    def resolve_block_v(self, value_dim: int) -> int:
        """The chunked kernels' V block for this V."""
        if self.block_v is None or self.block_v >= value_dim:
            return value_dim
        if value_dim % self.block_v:
            raise ValueError(f"BlockSizes.block_v={self.block_v} must divide V={value_dim}.")
        return self.block_v


# Chunked modes.


@dataclasses.dataclass(frozen=True)
class ChunkConfig:
    """Static description of one chunked problem, as the kernels see it (T already padded)."""

    batch: int
    seq_len: int  # padded to a multiple of chunk
    num_heads: int
    key_dim: int
    value_dim: int
    chunk: int
    block_v: int
    gate_kind: str
    has_segments: bool
    has_initial_state: bool
    scale: float
    dtype: jnp.dtype
    chunks_per_step: int = 1  # G: chunks one grid step walks (`chunks_per_grid_step`)
    profiler_safe: bool = False  # BlockSizes.profiler_safe
    group: int = 1  # heads (grid rows) per q/k head: the delta rule's grouped value heads

    @property
    def num_chunks(self) -> int:
        return self.seq_len // self.chunk

    @property
    def num_steps(self) -> int:
        return self.num_chunks // self.chunks_per_step

    @property
    def num_v_blocks(self) -> int:
        return self.value_dim // self.block_v

    @property
    def key_grad_dtype(self):
        """dtype in which the backward kernels write dq and dk: the input dtype where one V block
        makes them whole and no gate gradient outside the kernels reads them (per-head gates sum
        q*dq - k*dk over K in XLA), float32 partial sums otherwise."""
        direct = self.num_v_blocks == 1 and self.gate_kind != "head"
        return self.dtype if direct else jnp.dtype(jnp.float32)


# Tokens one grid step of the chunked kernels covers at most, by the larger of K and V (the
# blocks, and so VMEM, grow with both). A grid step costs about 0.35 us of fixed overhead on TPU:
# at one chunk of 128 tokens a step, the states kernel was mostly that overhead
# (docs/gla_mosaic_tpu.md, "Chunks per grid step").
_TOKENS_PER_STEP = ((128, 512), (256, 256))


def chunks_per_grid_step(num_chunks: int, chunk: int, key_dim: int, value_dim: int) -> int:
    """G, the number of chunks one grid step of the chunked kernels walks: the largest power of
    two that divides num_chunks and keeps G * chunk within the token budget for max(K, V)."""
    widest = max(key_dim, value_dim)
    budget = next((tokens for dim, tokens in _TOKENS_PER_STEP if widest <= dim), chunk)
    g = 1
    while num_chunks % (2 * g) == 0 and 2 * g * chunk <= budget:
        g *= 2
    return g


def seq_shape(b: int, t: int, h: int, d: int):
    """Shape of `seq_pack` of a [B, T, H, D] array."""
    return (b, t, h * d) if d % LANES == 0 else (b, h, t, d)


def seq_pack(x):
    """[B, T, H, D] -> the array the kernels read: [B, T, H*D] (free view) when D % 128 == 0,
    else a head-major copy [B, H, T, D] (a [C, 64] block of the view would break the (8, 128)
    tiling)."""
    b, t, h, d = x.shape
    if d % LANES == 0:
        return x.reshape(b, t, h * d)
    return jnp.transpose(x, (0, 2, 1, 3))


def seq_unpack(y, num_heads: int, d: int):
    """Inverse of `seq_pack`."""
    if d % LANES == 0:
        b, t, _ = y.shape
        return y.reshape(b, t, num_heads, d)
    return jnp.transpose(y, (0, 2, 1, 3))


def chunk_kernel_arrays(cfg, q, k, v, gates, s0, rel, head_gate_names=("bcol", "brow")):
    """Arrays in the layouts the kernels read (docs/gla_mosaic_tpu.md). `gates`: per-key log
    gates g [B, T, H, K] float32 (the kernels take their sums), per-head [B, T, H] float32 (GLA:
    chunk-local sums; the delta rule: log gates, as "gcol", "grow"), or None. The per-head array
    goes in as a column [B, H, T, 1] and as rows [B, H, N, 1, C], named `head_gate_names`."""
    arrays = {"q": seq_pack(q), "k": seq_pack(k), "v": seq_pack(v)}
    if cfg.gate_kind == "key":
        arrays["g"] = seq_pack(gates)
    elif cfg.gate_kind == "head":
        bh = jnp.transpose(gates, (0, 2, 1))  # [B, H, T]
        col, row = head_gate_names
        arrays[col] = bh[..., None]
        arrays[row] = bh.reshape(cfg.batch, cfg.num_heads, cfg.num_chunks, 1, cfg.chunk)
    if rel is not None:
        arrays["segcol"] = rel[..., None]
        arrays["segrow"] = rel.reshape(cfg.batch, cfg.num_chunks, 1, cfg.chunk)
    if s0 is not None:
        arrays["s0"] = transpose_state(s0)
    return arrays


def transpose_state(s):
    return jnp.swapaxes(s, -1, -2)  # [B, H, K, V] <-> [B, H, V, K]


# fused_recurrent.


@dataclasses.dataclass(frozen=True)
class RecurrentConfig:
    """Static description of one fused_recurrent kernel launch (semantics and tiling), hashable."""

    gate_kind: str  # "key", "head" or "none"
    has_keep: bool  # segment resets present (keep_t input)
    scale: float
    key_dim: int  # K as laid out for the kernel (padded)
    block_t: int  # tokens per grid step, a multiple of SUBBLOCK
    block_v: int  # V columns of the state per grid step
    # The delta rule (docs/delta_rule_mosaic_tpu.md): each token writes beta_t * (v_t - k_t S')
    # instead of v_t, S' the decayed state; a per-head beta input, a dbeta output.
    delta: bool = False
    group: int = 1  # grid (value) heads per q/k head: grid head h reads q, k head h // group

    def __post_init__(self):
        if self.gate_kind not in GATE_KINDS:
            raise ValueError(f"gate_kind must be one of {GATE_KINDS}; got {self.gate_kind!r}.")
        if self.block_t <= 0 or self.block_t % SUBBLOCK:
            raise ValueError(f"block_t={self.block_t} must be a positive multiple of {SUBBLOCK}.")

    @property
    def has_decay(self) -> bool:
        return self.gate_kind != "none" or self.has_keep


@dataclasses.dataclass(frozen=True)
class TimeOperand:
    """How one [B, T, H, D]-shaped operand sits in HBM for the time-blocked kernels.

    "view": [B, T, H*D] (free reshape), blocks [block_t, block_d] at column block h * nd + j.
    "head_major": [B, H, T, D] (a transposed copy; for D = 64), blocks [block_t, D].
    "head_column": [B, H, T, 1] (per-head gate), blocks [block_t, 1].
    "row_column": [B, T, 1] (segment keep), blocks [block_t, 1].
    `per_v_block`: the block follows the V-block grid index j (v, o, do, dv) or not (q, k, g).
    `partial`: an output with a leading [NV] axis of partial sums over V blocks (dq, dk, dg).
    `group`: grid head h reads head h // group of this operand (q and k under grouped value
    heads).
    """

    kind: str
    block_d: int
    per_v_block: bool = False
    partial: bool = False
    group: int = 1

    def block_spec(self, block_t: int, nv: int, time_index) -> pl.BlockSpec:
        kind, bd, per_v, partial = self.kind, self.block_d, self.per_v_block, self.partial
        group = self.group

        def head(h):
            return h if group == 1 else jax.lax.div(h, group)

        def col(h, j):
            return h * nv + j if per_v else head(h)

        if kind == "view":
            shape = (None, block_t, bd)

            def index(b, h, j, t):
                return (b, time_index(t), col(h, j))
        elif kind == "head_major":
            shape = (None, None, block_t, bd)

            def index(b, h, j, t):
                return (b, head(h), time_index(t), 0)
        elif kind == "head_column":
            shape = (None, None, block_t, 1)

            def index(b, h, j, t):
                return (b, h, time_index(t), 0)
        elif kind == "row_column":
            shape = (None, block_t, 1)

            def index(b, h, j, t):
                return (b, time_index(t), 0)
        else:
            raise ValueError(f"unknown operand layout {kind!r}")
        if not partial:
            return pl.BlockSpec(shape, index)
        return pl.BlockSpec((None,) + shape, lambda b, h, j, t: (j,) + index(b, h, j, t))


@dataclasses.dataclass(frozen=True)
class DimLayout:
    """How one head dim D is stored for the time-blocked kernels."""

    size: int  # D
    padded: int  # D rounded up for the kernels
    kind: str  # "view" ([B, T, H*Dp]) or "head_major" ([B, H, T, D])

    @staticmethod
    def of(d: int) -> "DimLayout":
        if d % LANES == 0:
            return DimLayout(d, d, "view")
        if d < LANES:
            return DimLayout(d, d, "head_major")
        return DimLayout(d, -(-d // LANES) * LANES, "view")

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
class RecurrentPlan:
    cfg: RecurrentConfig
    keys: DimLayout
    values: DimLayout
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
        shared = TimeOperand(kk, kp, group=self.cfg.group)  # q, k: per q/k head
        return {
            "q": shared,
            "k": shared,
            "g": gate,
            "beta": TimeOperand("head_column", 1),
            "dbeta": TimeOperand("head_column", 1, partial=True),
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


def _value_blocks(values: DimLayout) -> list[int]:
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


def vmem_bytes_time_blocked(*, key_dim: int, block_v: int, block_t: int, itemsize: int,
                            delta: bool = False) -> dict:
    """Planned VMEM bytes of the forward and backward time-blocked kernels: double-buffered
    blocks, scratch, and the values the compiler keeps live (state-sized values and [K, SUBBLOCK]
    token columns, which pad to [K, 128]). Calibrated against Mosaic's totals (see docs). The
    delta rule adds beta (and dbeta) blocks and the decayed state S' with its products."""
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
    if delta:
        fwd += 2 * small + 2 * state
        bwd += 4 * small + 4 * state
    return {"forward": fwd, "backward": bwd}


def vmem_bytes_decode(*, key_dim: int, block_v: int, block_h: int, itemsize: int) -> int:
    """Planned VMEM bytes of the decode kernel: double-buffered blocks plus live values."""
    state = block_h * key_dim * block_v * 4
    tiles = block_h * (2 * _lanes(key_dim) * (itemsize + 4) + 2 * _lanes(block_v) * itemsize)
    return 2 * (2 * state + tiles) + key_dim * block_v * 4 * 2


@functools.cache
def recurrent_plan(problem, block_sizes: BlockSizes, delta: bool = False) -> RecurrentPlan:
    """Layouts and blocks of the fused_recurrent kernels for `problem` (GLA's, or with `delta` the
    delta rule's: grid heads are its value heads); NotImplementedError when no block sizes fit the
    VMEM budget."""
    keys, values = DimLayout.of(problem.key_dim), DimLayout.of(problem.value_dim)
    itemsize = jnp.dtype(problem.dtype).itemsize
    t = problem.seq_len
    bvs = _value_blocks(values)
    if block_sizes.block_v_recurrent is not None:
        if block_sizes.block_v_recurrent not in bvs:
            raise ValueError(
                f"BlockSizes.block_v_recurrent={block_sizes.block_v_recurrent} must be one of "
                f"{bvs} for V={problem.value_dim}."
            )
        bvs = [block_sizes.block_v_recurrent]
    fixed_t = block_sizes.block_t_recurrent
    bts = _time_blocks(t) if fixed_t is None else [fixed_t]
    chosen = None
    for bv in bvs:
        for bt in bts:
            need = vmem_bytes_time_blocked(
                key_dim=keys.padded, block_v=bv, block_t=bt, itemsize=itemsize, delta=delta)
            if max(need.values()) <= VMEM_BUDGET_BYTES or fixed_t is not None:
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
    cfg = RecurrentConfig(
        gate_kind=problem.gate_kind, has_keep=problem.has_segments and t > 1,
        scale=float(problem.scale), key_dim=keys.padded, block_t=bt, block_v=bv, delta=delta,
        group=problem.group if delta else 1,
    )
    # The delta rule's T = 1 step has its own kernel (delta_rule/mosaic_tpu/kernels_decode.py).
    decode_h, decode_v = (0, 0) if delta else _decode_blocks(problem, block_sizes, itemsize)
    return RecurrentPlan(
        cfg=cfg, keys=keys, values=values, padded_len=-(-t // bt) * bt,
        output_final_state=problem.output_final_state, decode_block_h=decode_h,
        decode_block_v=decode_v,
    )


def _decode_blocks(problem, block_sizes: BlockSizes, itemsize: int) -> tuple[int, int]:
    """(block_h, block_v) of the decode kernel, or (0, 0) when T > 1 or nothing fits."""
    h, vd = problem.num_heads, problem.value_dim
    if problem.seq_len != 1 or block_sizes.block_h_decode == 0:
        return 0, 0
    if block_sizes.block_h_decode is not None:
        if h % block_sizes.block_h_decode or (block_sizes.block_h_decode % SUBBLOCK
                                              and block_sizes.block_h_decode != h):
            raise ValueError(
                f"BlockSizes.block_h_decode={block_sizes.block_h_decode} must divide H={h} and "
                f"be a multiple of {SUBBLOCK} or H itself."
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


def head_column(x, padded_len: int):
    """A per-head [B, T, H] operand as the kernels' [B, H, Tp, 1] column, zero-padded in time."""
    return jnp.transpose(pad_time(x, padded_len), (0, 2, 1))[..., None]


def recurrent_inputs(plan: RecurrentPlan, q, k, v, g, keep):
    """q, k, v, g, keep in the time-blocked kernels' layout."""
    tp = plan.padded_len
    kin = lambda x: None if x is None else plan.keys.to_kernel(x, tp)  # noqa: E731
    gk = None
    if g is not None:
        gk = kin(g) if g.ndim == 4 else head_column(g, tp)
    kp = None if keep is None else pad_time(keep, tp, value=1.0)[..., None]  # [B, Tp, 1]
    return kin(q), kin(k), plan.values.to_kernel(v, tp), gk, kp


def pad_state(plan: RecurrentPlan, s):
    if s is None:
        return None
    dk = plan.keys.padded - plan.keys.size
    dv = plan.values.padded - plan.values.size
    if dk or dv:
        s = jnp.pad(s, ((0, 0), (0, 0), (0, dk), (0, dv)))
    return s


def unpad_state(plan: RecurrentPlan, s):
    return None if s is None else s[:, :, : plan.keys.size, : plan.values.size]


