"""What each backend takes, declared as data.

Every backend's entry module holds one `Capabilities` per op. From it come the backend's support
check (`Capabilities.check`, which raises NotImplementedError naming the constraint and the
backend that takes the problem, so that backend="auto" can fall back), the parameterized test
suites (which run what a backend declares and expect NotImplementedError for everything else),
and the backend tables of the README (`backend_table`, checked against the README by a test).
Limits no table can hold (VMEM plans, tile fits) stay in the entry's `check_supported`.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

ATTENTION_FEATURES = ("causal", "gqa", "segment_ids", "local_window", "logits_soft_cap")
GLA_FEATURES = ("segment_ids", "initial_state", "final_state")
DELTA_RULE_FEATURES = GLA_FEATURES + ("grouped_value_heads", "qk_l2norm")
FEATURE_NAMES = {
    "causal": "causal=True",
    "gqa": "GQA/MQA (fewer k/v heads than q heads)",
    "segment_ids": "segment_ids",
    "initial_state": "initial_state",
    "final_state": "output_final_state=True",
    "grouped_value_heads": "grouped value heads (more v heads than q/k heads)",
    "qk_l2norm": "use_qk_l2norm=True",
    "local_window": "local_window_size",
    "logits_soft_cap": "logits_soft_cap",
}
# The ops whose problems carry a mode, a gate kind and a chunk size.
CHUNKED_OPS = ("gla", "delta_rule")


@dataclasses.dataclass(frozen=True)
class Dims:
    """Accepted sizes of one head dim: the listed `values`, or else the multiples of `multiple`
    from `low` to `high` (None: no upper bound)."""

    values: tuple[int, ...] = ()
    multiple: int = 1
    low: int = 1
    high: int | None = None

    def accepts(self, d: int) -> bool:
        if self.values:
            return d in self.values
        return d % self.multiple == 0 and d >= self.low and (self.high is None or d <= self.high)

    def describe(self) -> str:
        if self.values:
            return ", ".join(map(str, self.values))
        if self.multiple == 1:
            return "any" if self.high is None else f"up to {self.high}"
        upper = "" if self.high is None else f" to {self.high}"
        return f"multiples of {self.multiple} from {self.low}{upper}"


ANY_DIM = Dims()


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What one backend takes for one op.

    Attributes:
      op: "flash_attention", "gla" or "delta_rule".
      backend: the backend's name.
      platform: where it runs (for the README).
      dtypes: names of the q/k/v dtypes it takes.
      dims: (name, Dims) pairs: ("head_dim", ...) for attention, ("K", ...), ("V", ...) for gla
        and delta_rule.
      modes, gates, chunk_sizes: the modes, gate kinds ("key", "head", "none") and chunk sizes
        of the chunked modes of gla and delta_rule.
      default_chunks: the chunk size for `chunk_size=None` as ((largest K, chunk), ...): the
        first entry whose K bound holds; the first of `chunk_sizes` when none does.
      features: the optional features it takes (ATTENTION_FEATURES / GLA_FEATURES /
        DELTA_RULE_FEATURES).
      notes: how it runs (for the README).
      block_sizes: the backend's BlockSizes class, or None for a backend without tiles.
    """

    op: str
    backend: str
    platform: str
    dtypes: tuple[str, ...]
    dims: tuple[tuple[str, Dims], ...]
    features: tuple[str, ...]
    modes: tuple[str, ...] = ()
    gates: tuple[str, ...] = ()
    chunk_sizes: tuple[int, ...] = ()
    default_chunks: tuple[tuple[int, int], ...] = ()
    notes: str = ""
    block_sizes: type | None = None

    def default_chunk_size(self, key_dim: int) -> int:
        """The chunk size when the caller gives none, for key dim `key_dim`."""
        for largest_k, chunk in self.default_chunks:
            if key_dim <= largest_k:
                return chunk
        return self.chunk_sizes[0]

    def refusal(self, problem) -> str | None:
        """Why this backend cannot take `problem` (a validated AttentionProblem, GLAProblem or
        DeltaRuleProblem), or None when it can."""
        dtype = jnp.dtype(problem.dtype).name
        if dtype not in self.dtypes:
            return f"takes {_words(self.dtypes)} q, k, v; got {dtype}"
        for name, dims in self.dims:
            value = problem.sizes()[name]
            if not dims.accepts(value):
                return f"takes {name} {dims.describe()}; got {name}={value}"
        if self.op in CHUNKED_OPS:
            if problem.mode not in self.modes:
                return f"takes mode {_words(self.modes)}; got mode={problem.mode!r}"
            if problem.gate_kind not in self.gates:
                return f"takes gates {_words(self.gates)}; got a {problem.gate_kind!r} gate"
            if (problem.mode != "fused_recurrent" and problem.chunk_size is not None
                    and problem.chunk_size not in self.chunk_sizes):
                return (f"runs chunk_size {_words(self.chunk_sizes)}; "
                        f"got chunk_size={problem.chunk_size}")
        for feature in problem.features():
            if feature not in self.features:
                return f"does not take {FEATURE_NAMES[feature]}"
        return None

    def check(self, problem, block_sizes=None) -> None:
        """ValueError for block sizes of another type than this backend's; NotImplementedError
        naming the constraint when this backend cannot take `problem` (or, for a backend without
        tiles, any block sizes)."""
        if block_sizes is not None:
            if self.block_sizes is None:
                raise NotImplementedError(
                    f"block_sizes={block_sizes!r} tunes the Pallas kernels; the {self.backend!r} "
                    "backend takes None.")
            if not isinstance(block_sizes, self.block_sizes):
                cls = self.block_sizes
                raise ValueError(
                    f"block_sizes for backend={self.backend!r} must be None or "
                    f"{cls.__module__.removesuffix('.plan')}.{cls.__name__}; got "
                    f"{block_sizes!r}.")
        reason = self.refusal(problem)
        if reason is not None:
            raise NotImplementedError(
                f"the {self.backend!r} {self.op} {reason}. backend='xla' takes it.")


def _words(values) -> str:
    return ", ".join(str(v) for v in values)


def _chunk_sizes(cap: Capabilities) -> str:
    """The chunk sizes, each with the key dims it is the default for."""
    notes, bound = {}, 0
    for largest_k, chunk in cap.default_chunks:
        notes[chunk] = f"default for K <= {largest_k}"
        bound = max(bound, largest_k)
    fallback = cap.chunk_sizes[0]
    notes.setdefault(fallback, f"default for K > {bound}" if bound else "default")
    return ", ".join(f"{c} ({notes[c]})" if c in notes else str(c) for c in cap.chunk_sizes)


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def backend_table(capabilities: list[Capabilities]) -> str:
    """The README's markdown table of one op's backends."""
    op = capabilities[0].op
    if op == "flash_attention":
        header = ["backend", "platform", "dtypes", "head_dim", "causal", "GQA/MQA", "segment_ids",
                  "local_window_size", "logits_soft_cap", "how it runs"]
    else:
        header = ["backend", "platform", "dtypes", "K", "V", "modes", "gates", "chunk_size",
                  "segment_ids", "initial / final state", "how it runs"]
    if op == "delta_rule":
        header[-1:-1] = ["grouped value heads", "use_qk_l2norm"]
    rows = [header, ["---"] * len(header)]
    for cap in capabilities:
        dims = [d.describe() for _, d in cap.dims]
        if op == "flash_attention":
            flags = [_yes(f in cap.features) for f in ATTENTION_FEATURES]
            rows.append([f"`{cap.backend}`", cap.platform, _words(cap.dtypes), *dims, *flags,
                         cap.notes])
        else:
            state = _yes("initial_state" in cap.features and "final_state" in cap.features)
            flags = [_yes("segment_ids" in cap.features), state]
            if op == "delta_rule":
                flags += [_yes(f in cap.features) for f in ("grouped_value_heads", "qk_l2norm")]
            rows.append([f"`{cap.backend}`", cap.platform, _words(cap.dtypes), *dims,
                         _words(cap.modes), _words(cap.gates), _chunk_sizes(cap), *flags,
                         cap.notes])
    return "\n".join("| " + " | ".join(row) + " |" for row in rows) + "\n"
