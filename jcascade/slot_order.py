"""The slot order of ring caches (docs/semantics.md §4): which token each slot holds, from the row's clock alone.

Slot layout of every ring cache: [sinks | ring 0 | ... | ring N-1 | heavy] (`RingLayout`). K/V stay where they
were written: rings are circular buffers, nothing is concatenated, shifted or sorted. Where a token goes never
depends on scores, only on the row's clock t (non-sink tokens seen): the ring metadata (fill counts, ring heads)
is a closed-form function of t (`pallas_kernels.schedule`). Scores only decide *which* token sits in a ring's
newest slot.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jcascade.cache_state import CacheState
from jcascade.pallas_kernels.schedule import RingLayout, ring_schedules


def rank_by_position(pos: jax.Array) -> jax.Array:
    """int32 [..., S]: rank of each held slot (pos >= 0) among its row's held slots by position, -1 if empty."""
    held = pos >= 0
    order = jnp.argsort(jnp.where(held, pos, jnp.iinfo(jnp.int32).max), axis=-1)
    return jnp.where(held, jnp.argsort(order, axis=-1).astype(jnp.int32), -1)


def slot_ranks(layout: RingLayout, seen: jax.Array) -> jax.Array:
    """int32 [B, capacity]: rank of each slot's token in age order among held tokens (docs/semantics.md §4).

    Sinks come first (sink j -> j), then ring N-1 oldest to newest, ..., ring 0 newest last. Empty slots
    get -1. The rank is the RoPE position of `positions="cache"`.
    """
    S0, W = layout.sinks, layout.ring_size
    sink_slots = jnp.arange(S0, dtype=jnp.int32)
    held_sinks = jnp.minimum(seen, S0)
    ranks = [jnp.where(sink_slots[None] < held_sinks[:, None], sink_slots[None], -1)]
    t = jnp.maximum(seen - S0, 0)
    scheds = ring_schedules(layout)
    fills = [s.fill(t) for s in scheds]
    older = held_sinks  # tokens older than ring i: sinks and rings i+1..N-1
    ring_ranks = []
    for i in reversed(range(layout.num_rings)):
        oldest = (scheds[i].writes(t) - fills[i]) % W
        age = (jnp.arange(W, dtype=jnp.int32)[None] - oldest[:, None]) % W
        ring_ranks.append(jnp.where(age < fills[i][:, None], older[:, None] + age, -1))
        older = older + fills[i]
    ranks.extend(reversed(ring_ranks))
    return jnp.concatenate(ranks, axis=-1)


def tokens_held(layout: RingLayout, seen: jax.Array) -> jax.Array:
    """int32 [B]: number of tokens a row holds."""
    t = jnp.maximum(seen - layout.sinks, 0)
    held = jnp.minimum(seen, layout.sinks)
    for s in ring_schedules(layout):
        held = held + s.fill(t)
    if layout.heavy:  # the one ring pushes out every token past its first W
        held = held + jnp.minimum(jnp.maximum(t - layout.ring_size, 0), layout.heavy)
    return held


def append_fill(state: CacheState) -> jax.Array:
    """int32 [B]: the slot where a row of an append cache (`RingLayout.appends`, tokens in its first slots)
    places its next token: past every head's held tokens (heads hold different counts after `jc.AdaKV`'s
    compression; the others' empty slots stay masked)."""
    slot = jnp.arange(1, state.pos.shape[-1] + 1, dtype=jnp.int32)
    return jnp.max(jnp.where(state.pos >= 0, slot, 0), axis=(1, 2)).astype(jnp.int32)
