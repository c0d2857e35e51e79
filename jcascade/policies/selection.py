"""Selection after a prompt: the append cache holds the whole prompt, then `compress` keeps each KV head's best
tokens in position order. The helpers the compressing policies share, and their two bases: `ScorerPolicy` (a
policy that only scores tokens: KNorm, ExpectedAttention, KVzip) and `WindowSelection` (SnapKV, PyramidKV, AdaKV:
the pooled attention of an observation window, docs/semantics.md §5).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

from jcascade.cache_state import CacheState
from jcascade.policies.base import Positive, Strided, last_queries
from jcascade.policies.ring import AppendPolicy

Pooling = Literal["max", "avg"]


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
    moved = lambda x, empty: (
        jnp.full((B, H, capacity, *x.shape[3:]), empty, x.dtype).at[bi, hi, dest].set(x, mode="drop")
    )
    move = lambda x: moved(x, 0)
    return dataclasses.replace(
        state, k=state.k.map(move), v=state.v.map(move), score=moved(state.score, 0), pos=moved(state.pos, -1)
    )


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


@dataclasses.dataclass(frozen=True)
class ScorerPolicy(AppendPolicy, Strided):
    """A policy that only scores tokens: full attention over the prompt, then each KV head keeps the `budget` prompt
    tokens that `score` ranks highest, in position order (a prompt of at most `budget` tokens is kept whole);
    decoding appends. The prompt's last token runs as a chunk of its own before the compression
    (`observation_window` 1: how generate and score find the end of a prompt); it is ranked like the others. A
    subclass is its `score` and its fields (kvpress's scorer presses)."""

    bounded = False
    needs_prompt = True
    observation_window = 1
    budget: Positive

    @property
    def label(self) -> str:
        return f"{type(self).__name__} {self.budget}"

    @abc.abstractmethod
    def score(self, state: CacheState) -> jax.Array:
        """f32 [B, H, cap]: the score of each held token of one layer's cache after the prompt (larger kept)."""

    def compress(self, state: CacheState, room: int) -> CacheState:
        """A cache of `budget + room` slots per (row, KV head): the kept tokens in position order, then empty
        slots. state: one layer, or layers stacked on a leading axis."""
        return compress_by_ranking(state, self.score, self.budget, room)


class WindowSelection(AppendPolicy):
    """What SnapKV, PyramidKV and AdaKV share: the append cache, the observation-window scores and `compress`;
    they differ in how many prompt tokens each layer and KV head keeps (`prefix_budget`, `keep`). Reads the
    `window`, `kernel` and `pooling` of its subclass."""

    bounded = False
    keeps_scores = True
    needs_prompt = True

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

    def compress(self, state: CacheState, room: int) -> CacheState:
        """A cache of capacity `kept_slots(H) + room` holding, per (row, KV head), the kept tokens in position
        order followed by empty slots. state: one layer, or L layers stacked on a leading axis (PyramidKV
        reads the layer index from that axis; a single layer counts as a bottom layer)."""
        capacity = self.kept_slots(state.pos.shape[-2]) + room
        one = lambda s, layer, L: keep_in_position_order(s, self.keep(s, layer, L), capacity)
        if state.seen.ndim == 1:
            return one(state, 0, 1)
        L = state.seen.shape[0]
        return jax.vmap(lambda s, layer: one(s, layer, L))(state, jnp.arange(L, dtype=jnp.int32))
