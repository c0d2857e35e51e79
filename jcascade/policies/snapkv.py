"""SnapKV and PyramidKV: full attention over the prompt, then one compression chosen by the attention of
an observation window (docs/semantics.md §5).

Both keep an append cache (slot j holds the j-th held token) whose scores are the attention that the
last `window` queries of the newest chunk gave each token (summed over those queries, reduced over the
query heads of a KV head). `compress`, run once after the prompt, keeps the selected tokens, in position
order, at the front of a smaller append cache; decoding then appends.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

from jcascade.policies.base import HEAD_REDUCTIONS, POSITION_MODES, check_choice, check_int, last_queries
from jcascade.policies.ring import AppendPolicy
from jcascade.slots import CacheState

POOLINGS = ("max", "avg")


def pool(x: jax.Array, valid: jax.Array, kernel: int, pooling: str) -> jax.Array:
    """1-D pooling over the last axis, stride 1, padding kernel // 2 (as torch's max_pool1d/avg_pool1d
    with their default count_include_pad): x f32 [..., S], valid bool [..., S] (invalid entries count
    as padding). Returns f32 [..., S], -inf at invalid entries."""
    if kernel == 1:
        return jnp.where(valid, x, -jnp.inf)
    pad = [(0, 0)] * (x.ndim - 1) + [(kernel // 2, kernel // 2)]
    window, strides = (1,) * (x.ndim - 1) + (kernel,), (1,) * x.ndim
    if pooling == "max":
        out = jax.lax.reduce_window(jnp.where(valid, x, -jnp.inf), -jnp.inf, jax.lax.max, window, strides, pad)
    else:
        out = jax.lax.reduce_window(jnp.where(valid, x, 0.0), 0.0, jax.lax.add, window, strides, pad) / kernel
    return jnp.where(valid, out, -jnp.inf)


def top_per_head(scores: jax.Array, count: jax.Array) -> jax.Array:
    """bool [B, H, S]: each head's `count` (int32, broadcast to [B, H, 1]) largest scores, the lower slot first on
    ties."""
    order = jnp.argsort(-scores, axis=-1, stable=True)
    return jnp.argsort(order, axis=-1) < count


def window_slots(state: CacheState, window: int) -> jax.Array:
    """bool [B, H, cap]: the slots of the last `window` tokens of an append cache holding `state.seen` tokens."""
    slot = jnp.arange(state.pos.shape[-1], dtype=jnp.int32)[None, None, :]
    q_len = state.seen[:, None, None]
    return (slot >= q_len - jnp.minimum(window, q_len)) & (slot < q_len)


def keep_in_position_order(state: CacheState, keep: jax.Array, capacity: int) -> CacheState:
    """One layer of an append cache reduced to the slots `keep` (bool [B, H, cap]) marks, in position order at
    the front of `capacity` slots per head, the rest empty."""
    B, H, _ = state.pos.shape
    dest = jnp.where(keep, jnp.cumsum(keep, axis=-1) - 1, capacity)
    bi, hi = jnp.arange(B)[:, None, None], jnp.arange(H)[None, :, None]
    moved = lambda x, empty: jnp.full((B, H, capacity, *x.shape[3:]), empty, x.dtype).at[bi, hi, dest].set(  # noqa: E731
        x, mode="drop")
    return dataclasses.replace(state, k=moved(state.k, 0), v=moved(state.v, 0), score=moved(state.score, 0),
                               pos=moved(state.pos, -1))


def compress_by_ranking(state: CacheState, ranking, budget: int, room: int) -> CacheState:
    """Per (row, KV head), the `budget` prompt tokens (the `state.seen` first slots) that `ranking(layer)` (f32
    [B, H, cap], larger kept) ranks highest, in position order in `budget + room` slots. state: one layer, or
    layers stacked on a leading axis."""
    def one(layer: CacheState) -> CacheState:
        slot = jnp.arange(layer.pos.shape[-1], dtype=jnp.int32)[None, None, :]
        prompt = slot < layer.seen[:, None, None]
        ranked = jnp.where(prompt, ranking(layer), -jnp.inf)
        return keep_in_position_order(layer, top_per_head(ranked, budget) & prompt, budget + room)

    return one(state) if state.seen.ndim == 1 else jax.vmap(one)(state)


class _Selection(AppendPolicy):
    """What SnapKV and PyramidKV share: the append cache, the observation-window scores and `compress`;
    they differ in how many prompt tokens each layer keeps (`prefix_budget`)."""

    bounded = False
    keeps_scores = True
    needs_prompt = True

    def _check_fields(self) -> None:
        check_int(self, "budget", self.budget, 2)
        check_int(self, "window", self.window, 1)
        if self.window >= self.budget:
            raise ValueError(
                f"{type(self).__name__}.window ({self.window}) must be < budget ({self.budget}): the budget "
                "includes the observation window"
            )
        check_int(self, "kernel", self.kernel, 1)
        if self.kernel % 2 == 0:
            raise ValueError(f"{type(self).__name__}.kernel must be odd (pooling keeps the length), got {self.kernel}")
        check_choice(self, "pooling", self.pooling, POOLINGS)
        check_choice(self, "head_reduction", self.head_reduction, HEAD_REDUCTIONS)
        check_choice(self, "positions", self.positions, POSITION_MODES)
        check_int(self, "stride", self.stride, 1)

    @property
    def observation_window(self) -> int:
        return self.window

    @abc.abstractmethod
    def prefix_budget(self, prompt_len: jax.Array, layer, num_layers: int) -> jax.Array:
        """int32 [B]: prompt tokens before the window that a layer keeps (prompt_len int32 [B]); a prompt
        shorter than `budget` is kept whole."""

    @abc.abstractmethod
    def kept_slots(self, num_heads: int) -> int:
        """Most tokens any KV head of any layer keeps after compression (num_heads: KV heads of a layer)."""

    def query_weights(self, lengths: jax.Array, chunk_len: int) -> jax.Array:
        """1 for the last `window` valid queries (the observation window)."""
        return last_queries(lengths, chunk_len, self.window)

    def accumulate(self, score, increments, live, n, layout):
        """The newest chunk's window attention replaces the old."""
        return jnp.where(live, increments, score)

    def pooled_scores(self, state: CacheState) -> jax.Array:
        """f32 [B, H, cap]: the observation window's attention pooled over positions, -inf outside the
        prompt's tokens before the window (the candidates)."""
        cap = state.pos.shape[-1]
        window = jnp.minimum(self.window, state.seen)[:, None, None]
        prefix = jnp.arange(cap, dtype=jnp.int32)[None, None, :] < (state.seen[:, None, None] - window)
        return pool(state.score, prefix, self.kernel, self.pooling)

    def keep(self, state: CacheState, layer, num_layers: int) -> jax.Array:
        """bool [B, H, cap]: the slots a layer keeps, the top `prefix_budget` candidates per head and the
        observation window."""
        pooled = self.pooled_scores(state)
        budget = self.prefix_budget(state.seen, layer, num_layers)[:, None, None]
        return (top_per_head(pooled, budget) & (pooled > -jnp.inf)) | window_slots(state, self.window)

    def _compress_layer(self, state: CacheState, layer, num_layers: int, capacity: int) -> CacheState:
        return keep_in_position_order(state, self.keep(state, layer, num_layers), capacity)

    def compress(self, state: CacheState, room: int) -> CacheState:
        """A cache of capacity `kept_slots(H) + room` holding, per (row, KV head), the kept tokens in position
        order followed by empty slots. state: one layer, or L layers stacked on a leading axis (PyramidKV
        reads the layer index from that axis; a single layer counts as a bottom layer)."""
        capacity = self.kept_slots(state.pos.shape[-2]) + room
        if state.seen.ndim == 1:
            return self._compress_layer(state, 0, 1, capacity)
        L = state.seen.shape[0]
        layers = jnp.arange(L, dtype=jnp.int32)
        return jax.vmap(lambda s, l: self._compress_layer(s, l, L, capacity))(state, layers)


@dataclasses.dataclass(frozen=True)
class SnapKV(_Selection):
    """SnapKV (Li et al. 2024; a baseline of the PyramidKV paper, arXiv 2406.02069): full attention over the prompt,
    then one compression.

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
    attention of the last `window` queries of each chunk.
    """

    budget: int
    window: int = 32
    kernel: int = 7
    pooling: Literal["max", "avg"] = "max"
    head_reduction: Literal["max", "mean"] = "mean"
    positions: Literal["cache", "original"] = "original"
    stride: int = 4096

    @property
    def label(self) -> str:
        return f"SnapKV {self.budget}"

    def __post_init__(self):
        self._check_fields()

    def prefix_budget(self, prompt_len: jax.Array, layer, num_layers: int) -> jax.Array:
        kept = jnp.full_like(prompt_len, self.budget - self.window)
        return jnp.where(prompt_len < self.budget, prompt_len, kept)

    def kept_slots(self, num_heads: int) -> int:
        return self.budget


@dataclasses.dataclass(frozen=True)
class PyramidKV(_Selection):
    """PyramidKV (Cai et al., arXiv 2406.02069): SnapKV's selection with per-layer budgets falling linearly with depth.

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

    @property
    def label(self) -> str:
        return f"PyramidKV {self.budget}"

    def __post_init__(self):
        self._check_fields()
        check_int(self, "beta", self.beta, 1)

    def prefix_budget(self, prompt_len: jax.Array, layer, num_layers: int) -> jax.Array:
        C, w = self.budget, self.window
        low = (C - w) // self.beta
        high = jnp.full_like(prompt_len, 2 * (C - w) - low)
        clamp = high >= prompt_len - w
        high = jnp.where(clamp, prompt_len - w, high)
        low = jnp.where(clamp, 2 * (C - w) - high, low)
        steps = (high - low) // (num_layers - 1) if num_layers > 1 else 0
        kept = jnp.where(prompt_len < 2 * (C - w), C - w, high - layer * steps)
        return jnp.where(prompt_len < C, prompt_len, kept)

    def kept_slots(self, num_heads: int) -> int:
        C, w = self.budget, self.window
        return max(C, 2 * (C - w) - (C - w) // self.beta + w)
