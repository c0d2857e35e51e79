"""Cache policies: frozen, hashable dataclasses (static under `jit`), validated at construction.

Every policy carries its prefill `stride` (tokens per chunk of the strided prefill, DESIGN §9).
Policies that keep a bounded cache are described internally by a `RingLayout`: `sinks` slots that are
never evicted, followed by `num_rings` circular buffers of `ring_size` slots (DESIGN §3).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

HEAD_REDUCTIONS = ("max", "mean")
POSITION_MODES = ("cache", "original")


def _check_int(policy: object, name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{type(policy).__name__}.{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{type(policy).__name__}.{name} must be >= {minimum}, got {value}")


def _check_choice(policy: object, name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{type(policy).__name__}.{name} must be one of {choices}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class RingLayout:
    """Slot layout of a bounded cache: [sinks | ring 0 | ring 1 | ... | ring N-1].

    Ring 0 receives every non-sink token; ring i+1 receives the tokens ring i evicts. Ring i, once full,
    accepts (appends and evicts its oldest) on clocks t with t mod 2**i == 0; otherwise the incoming
    token replaces the ring's newest token only if its score is strictly larger (DESIGN §3).
    """

    sinks: int
    ring_size: int
    num_rings: int
    heavy: int = 0  # H2O: slots after the rings for the highest-scoring tokens the last ring evicts

    @property
    def capacity(self) -> int:
        return self.sinks + self.ring_size * self.num_rings + self.heavy


@dataclasses.dataclass(frozen=True)
class Full:
    """Keeps every token (quadratic attention): the reference policy.

    Its capacity is the `max_tokens` given to `init_cache`. A row that receives more tokens than that
    loses them: `update` raises when it can see this (concrete inputs), and under `jit` `attend`
    returns NaN for such rows, so an overflow never passes silently.
    """

    stride: int = 4096

    def __post_init__(self):
        _check_int(self, "stride", self.stride, 1)

    def layout(self, capacity: int) -> RingLayout:
        return RingLayout(sinks=capacity, ring_size=0, num_rings=0)


@dataclasses.dataclass(frozen=True)
class SlidingWindow:
    """The `window` most recent tokens (no sinks). `positions`: see DESIGN §4."""

    window: int
    positions: Literal["cache", "original"] = "cache"
    stride: int = 4096

    def __post_init__(self):
        _check_int(self, "window", self.window, 1)
        _check_choice(self, "positions", self.positions, POSITION_MODES)
        _check_int(self, "stride", self.stride, 1)

    def layout(self, capacity: int | None = None) -> RingLayout:
        return RingLayout(sinks=0, ring_size=self.window, num_rings=1)


@dataclasses.dataclass(frozen=True)
class Sink:
    """StreamingLLM: the first `sinks` tokens plus the `window` most recent ones (= Cascade with N=1)."""

    window: int
    sinks: int = 64
    positions: Literal["cache", "original"] = "cache"
    stride: int = 4096

    def __post_init__(self):
        _check_int(self, "window", self.window, 1)
        _check_int(self, "sinks", self.sinks, 0)
        _check_choice(self, "positions", self.positions, POSITION_MODES)
        _check_int(self, "stride", self.stride, 1)

    def layout(self, capacity: int | None = None) -> RingLayout:
        return RingLayout(sinks=self.sinks, ring_size=self.window, num_rings=1)


@dataclasses.dataclass(frozen=True)
class Cascade:
    """Cascading KV cache (papers/000): `sinks` + `num_cascades` rings of cache_size/num_cascades slots.

    Tokens carry an EMA attention score with decay `gamma`; scores of the query heads sharing a KV head
    are reduced by `head_reduction` ("max", as in the paper, or "mean"). Defaults are the paper's:
    64 sinks, 4 cascades, gamma 0.9999, max reduction, cache-index positions, stride 4096.
    """

    cache_size: int
    sinks: int = 64
    num_cascades: int = 4
    gamma: float = 0.9999
    head_reduction: Literal["max", "mean"] = "max"
    positions: Literal["cache", "original"] = "cache"
    stride: int = 4096

    def __post_init__(self):
        _check_int(self, "cache_size", self.cache_size, 1)
        _check_int(self, "sinks", self.sinks, 0)
        _check_int(self, "num_cascades", self.num_cascades, 1)
        if self.cache_size % self.num_cascades:
            raise ValueError(
                f"Cascade.cache_size ({self.cache_size}) must be divisible by "
                f"Cascade.num_cascades ({self.num_cascades})"
            )
        if self.num_cascades > 30:
            raise ValueError(
                f"Cascade.num_cascades must be <= 30 (ring i accepts every 2**i tokens of an int32 "
                f"clock), got {self.num_cascades}"
            )
        if isinstance(self.gamma, bool) or not isinstance(self.gamma, (int, float)):
            raise ValueError(f"Cascade.gamma must be a float in (0, 1), got {self.gamma!r}")
        if not 0.0 < self.gamma < 1.0:
            raise ValueError(f"Cascade.gamma must be in (0, 1), got {self.gamma}")
        _check_choice(self, "head_reduction", self.head_reduction, HEAD_REDUCTIONS)
        _check_choice(self, "positions", self.positions, POSITION_MODES)
        _check_int(self, "stride", self.stride, 1)

    def layout(self, capacity: int | None = None) -> RingLayout:
        return RingLayout(
            sinks=self.sinks,
            ring_size=self.cache_size // self.num_cascades,
            num_rings=self.num_cascades,
        )


@dataclasses.dataclass(frozen=True)
class H2O:
    """Heavy-Hitter Oracle (papers/004's baseline, Zhang et al. 2023): the `recent` newest tokens plus the
    `heavy` tokens with the largest accumulated attention (the plain sum over every query since the token
    arrived, not an EMA), reduced over the query heads of a KV head by `head_reduction`.

    Evicts during strided prefill and decode. Within a chunk, scores are those `attend` returned for it;
    the heavy set keeps the top `heavy` of its residents and the tokens the recent window pushes out,
    residents winning ties. Positions default to cache-index (the rolling positions of H2O's streaming
    code); "original" is available.
    """

    heavy: int
    recent: int
    head_reduction: Literal["max", "mean"] = "mean"
    positions: Literal["cache", "original"] = "cache"
    stride: int = 4096

    def __post_init__(self):
        _check_int(self, "heavy", self.heavy, 1)
        _check_int(self, "recent", self.recent, 1)
        _check_choice(self, "head_reduction", self.head_reduction, HEAD_REDUCTIONS)
        _check_choice(self, "positions", self.positions, POSITION_MODES)
        _check_int(self, "stride", self.stride, 1)

    def layout(self, capacity: int | None = None) -> RingLayout:
        return RingLayout(sinks=0, ring_size=self.recent, num_rings=1, heavy=self.heavy)


POOLINGS = ("max", "avg")


def _check_selection(policy) -> None:
    """Checks the fields SnapKV and PyramidKV share: budget, window, kernel, pooling, head_reduction."""
    _check_int(policy, "budget", policy.budget, 2)
    _check_int(policy, "window", policy.window, 1)
    if policy.window >= policy.budget:
        raise ValueError(
            f"{type(policy).__name__}.window ({policy.window}) must be < budget ({policy.budget}): the budget "
            "includes the observation window"
        )
    _check_int(policy, "kernel", policy.kernel, 1)
    if policy.kernel % 2 == 0:
        raise ValueError(f"{type(policy).__name__}.kernel must be odd (pooling keeps the length), got {policy.kernel}")
    _check_choice(policy, "pooling", policy.pooling, POOLINGS)
    _check_choice(policy, "head_reduction", policy.head_reduction, HEAD_REDUCTIONS)
    _check_choice(policy, "positions", policy.positions, POSITION_MODES)
    _check_int(policy, "stride", policy.stride, 1)


@dataclasses.dataclass(frozen=True)
class SnapKV:
    """SnapKV (Li et al. 2024; papers/004's baseline): full attention over the prompt, then one compression.

    After the prompt, each KV head keeps the top (budget - window) prompt tokens ranked by the attention
    the last `window` prompt queries give them (summed over those queries, reduced over the query heads
    of the KV head by `head_reduction`, then 1-D pooled over positions with `kernel`/`pooling`, padding
    kernel // 2), plus those `window` tokens; a prompt shorter than `budget` is kept whole (the
    reference code's rule). Decoding then only appends. Defaults are the paper's (window 32, kernel 7,
    max pooling). GQA: one selection per KV head, "mean" over its query heads by default (the reference
    code selects per query head after repeating K/V; we never expand the cache). Positions: "original"
    (the reference code keeps the keys rotated at their original positions).

    `jc.generate` and `jc.score(prefix=...)` run the prompt in `stride` chunks with the observation
    window as its last chunk and call `jc.compress`; at the attend/update level, scores are the
    attention of the last `window` queries of each chunk (see `jcascade.selection`).
    """

    budget: int
    window: int = 32
    kernel: int = 7
    pooling: Literal["max", "avg"] = "max"
    head_reduction: Literal["max", "mean"] = "mean"
    positions: Literal["cache", "original"] = "original"
    stride: int = 4096

    def __post_init__(self):
        _check_selection(self)

    def layout(self, capacity: int) -> RingLayout:
        return RingLayout(sinks=capacity, ring_size=0, num_rings=0)


@dataclasses.dataclass(frozen=True)
class PyramidKV:
    """PyramidKV (papers/004): SnapKV's selection with per-layer budgets falling linearly with depth.

    With C = budget and w = window, layer l of L keeps (prefix_l + w) tokens, where, as in the reference
    code (KVCache-Factory `PyramidKVCluster`) for a prompt of q tokens: q < C keeps the whole prompt;
    q < 2(C - w) gives prefix_l = C - w in every layer; otherwise min = (C - w) // beta,
    max = 2(C - w) - min, and if max >= q - w then max = q - w and min = 2(C - w) - max;
    prefix_l = max - l * ((max - min) // (L - 1)). The mean over layers is therefore about `budget`.
    Selection is per KV head (never the reference code's expansion to query heads). Per-layer
    capacities differ: the compressed state allocates the largest and leaves the rest of a layer's slots
    empty (masked). Defaults as the paper's code: window 8, beta 20, kernel 7, max pooling.
    """

    budget: int
    window: int = 8
    beta: int = 20
    kernel: int = 7
    pooling: Literal["max", "avg"] = "max"
    head_reduction: Literal["max", "mean"] = "mean"
    positions: Literal["cache", "original"] = "original"
    stride: int = 4096

    def __post_init__(self):
        _check_selection(self)
        _check_int(self, "beta", self.beta, 1)

    def layout(self, capacity: int) -> RingLayout:
        return RingLayout(sinks=capacity, ring_size=0, num_rings=0)


@dataclasses.dataclass(frozen=True)
class Recycled:
    """Recycled Attention (papers/002): the full cache is kept; most decode steps attend to a small set.

    A full-attention step (every chunk of more than one token, and every `refresh_every`-th decode
    step after it) attends to the whole cache and re-selects, per KV head, the `top_k` tokens its last
    query attended most (max over the query heads of the group, as the paper; pooled over positions
    with `kernel` as SnapKV when kernel > 1, max pooling). The decode steps in between attend only to
    that set plus the tokens fed since the full step (the paper's fixed-size variant instead drops the
    lowest-scored recycled token; we follow DESIGN §5). So with refresh_every=S, after a prompt the
    first token comes from the prompt's full attention, decode steps 1..S-1 are recycled, step S is
    full, and so on.

    Positions: "original" (the paper keeps the full cache with its positions). The cache allocates
    max_tokens + top_k + refresh_every slots: the full cache, the recycled copies, the new tokens.
    """

    top_k: int
    refresh_every: int
    kernel: int = 1
    positions: Literal["cache", "original"] = "original"
    stride: int = 4096

    def __post_init__(self):
        _check_int(self, "top_k", self.top_k, 1)
        _check_int(self, "refresh_every", self.refresh_every, 1)
        _check_int(self, "kernel", self.kernel, 1)
        if self.kernel % 2 == 0:
            raise ValueError(f"Recycled.kernel must be odd (pooling keeps the length), got {self.kernel}")
        _check_choice(self, "positions", self.positions, POSITION_MODES)
        _check_int(self, "stride", self.stride, 1)

    @property
    def head_reduction(self) -> str:
        return "max"

    @property
    def pooling(self) -> str:
        return "max"

    def layout(self, capacity: int) -> RingLayout:
        return RingLayout(sinks=capacity, ring_size=0, num_rings=0)


Policy = Full | SlidingWindow | Sink | Cascade | H2O | SnapKV | PyramidKV | Recycled
POLICIES = (Full, SlidingWindow, Sink, Cascade, H2O, SnapKV, PyramidKV, Recycled)
APPEND_POLICIES = (Full, SnapKV, PyramidKV, Recycled)  # caches sized by init_cache's max_tokens


def check_policy(policy: object) -> None:
    if not isinstance(policy, POLICIES):
        names = ", ".join(p.__name__ for p in POLICIES)
        raise TypeError(f"policy must be one of jcascade.{{{names}}}, got {type(policy).__name__}")


def position_mode(policy: Policy) -> str:
    """"cache" (rank in the cache, DESIGN §4) or "original". Under Full both are the same."""
    return getattr(policy, "positions", "original")


def uses_scores(policy: Policy) -> bool:
    """Whether the policy selects tokens by attention score (then `attend` returns `Scores`)."""
    return isinstance(policy, (Cascade, H2O, SnapKV, PyramidKV, Recycled))
