"""`RingPolicy`: the policies whose cache is a `RingLayout` (sinks + cascading rings + heavy slots, or an
append cache of sinks only). They share attention positions and the ring insertion (`Kernels.insert`);
each says its layout, how resident scores change with a chunk and, with heavy slots, where the last
ring's evictees go.
"""

from __future__ import annotations

import abc
import dataclasses

import jax
import jax.numpy as jnp

from jcascade import checks, slot_order
from jcascade.cache_state import CacheState, Scores, encode_chunk
from jcascade.pallas_kernels.schedule import RingLayout
from jcascade.policies.base import Policy


class RingPolicy(Policy):
    """A policy stored as a `RingLayout`. Implements cache_slots, key_positions and update."""

    @abc.abstractmethod
    def layout(self, capacity: int | None = None) -> RingLayout:
        """The slot layout; `capacity` sizes append caches (bounded layouts ignore it)."""

    def accumulate(
        self, score: jax.Array, increments: jax.Array, live: jax.Array, n: jax.Array, layout: RingLayout
    ) -> jax.Array:
        """docs/semantics.md §3 step 1 for policies that keep scores: the residents' scores f32 [B, H, cap] after a
        chunk, from their scores before, the chunk's increments f32 [B, H, cap] (attend's Scores.cache),
        live bool [B, H, cap] (held slots of rows with tokens in the chunk) and n int32 [B]."""
        raise NotImplementedError(f"{type(self).__name__} keeps scores but does not define accumulate")

    def place_evicted(self, layout: RingLayout, score, held, src, mu, valid):
        """Layouts with heavy slots: where the last ring's evictees go (`ring_insertion.PlaceEvicted`)."""
        raise NotImplementedError(f"{type(self).__name__} has heavy slots but does not define place_evicted")

    def cache_slots(self, max_tokens: int | None) -> int:
        return self.layout(max_tokens).capacity

    def layout_for(self, state: CacheState) -> RingLayout:
        """The layout of `state`, checked against its capacity."""
        layout = self.layout(state.capacity)
        if layout.capacity != state.capacity:
            raise ValueError(
                f"state has capacity {state.capacity} but {self} needs {layout.capacity}: "
                "was it made by init_cache with another policy?"
            )
        return layout

    def key_positions(self, state: CacheState) -> tuple[jax.Array, jax.Array]:
        """As `Policy.key_positions`, from the closed-form slot order (docs/semantics.md §4) where there is one."""
        layout = self.layout_for(state)
        if self.positions != "cache":  # heads place tokens alike unless scores or a compression (KNorm) tell
            alike = not self.keeps_scores and not self.observation_window  # them apart: then one row serves all
            return (state.pos[:, :1] if alike else state.pos), state.seen
        if layout.appends:  # held slots come first, in position order
            slot = jnp.arange(state.capacity, dtype=jnp.int32)[None, None, :]
            return jnp.where(state.pos >= 0, slot, -1), slot_order.append_fill(state)
        if layout.heavy:  # heavy slots are not in age order: rank each head's tokens by position
            return slot_order.rank_by_position(state.pos), slot_order.tokens_held(layout, state.seen)
        return slot_order.slot_ranks(layout, state.seen)[:, None, :], slot_order.tokens_held(layout, state.seen)

    def update(
        self, state: CacheState, k: jax.Array, v: jax.Array, scores: Scores | None, lengths: jax.Array
    ) -> CacheState:
        """Step 1 (`accumulate`), then the ring insertion; append caches place each token at the row's
        first free slot (compression leaves fewer slots than tokens seen) and refuse to overflow."""
        layout = self.layout_for(state)
        B, T, H, _ = k.shape
        if scores is None:
            score, chunk_score = state.score, jnp.zeros((B, H, T), jnp.float32)
        else:
            live = (state.pos >= 0) & (lengths > 0)[:, None, None]
            score = self.accumulate(state.score, scores.cache, live, lengths, layout)
            chunk_score = scores.chunk.astype(jnp.float32)
        placed = slot_order.append_fill(state) if layout.appends else state.seen
        if layout.appends:
            checks.check_overflow(self, placed, lengths, state.capacity)
        evicted = self.place_evicted if layout.heavy else None
        k, v = encode_chunk(state, k, v)  # the chunk as the cache stores it (rotated, codes and scales)
        new_k, new_v, score, pos = state.kernels.insert(
            layout,
            state.k,
            state.v,
            state.layer,
            score,
            state.pos,
            state.seen,
            k,
            v,
            chunk_score,
            placed,
            lengths,
            evicted,
        )
        return dataclasses.replace(state, k=new_k, v=new_v, score=score, pos=pos, seen=state.seen + lengths)


class AppendPolicy(RingPolicy):
    """A cache that keeps every token it receives, slot j holding the j-th (sinks only, `capacity` of them):
    Full, and the policies that hold the whole prompt and compress it afterwards."""

    def layout(self, capacity: int | None = None) -> RingLayout:
        return RingLayout(sinks=capacity, ring_size=0, num_rings=0)
