"""H2O (Zhang et al. 2023): the newest tokens plus the heavy hitters of accumulated attention."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jcascade.checks import CLOCK_LIMIT
from jcascade.pallas_kernels.ring_insertion import compact, take
from jcascade.pallas_kernels.schedule import RingLayout
from jcascade.policies.base import HeadReduced, Positions, Positive
from jcascade.policies.ring import RingPolicy


@dataclasses.dataclass(frozen=True)
class H2O(RingPolicy, HeadReduced):
    """Heavy-Hitter Oracle (Zhang et al. 2023; a baseline of the PyramidKV paper, arXiv 2406.02069): the `recent`
    newest tokens plus the `heavy` tokens with the largest accumulated attention (the plain sum over every
    query since the token arrived, not an EMA), reduced over the query heads of a KV head by `head_reduction`.

    Evicts during strided prefill and decode. Within a chunk, scores are those `attend` returned for it;
    the heavy set keeps the top `heavy` of its residents and the tokens the recent window pushes out,
    residents winning ties. Positions default to cache-index (the rolling positions of H2O's streaming
    code); "original" is available. Layout: one ring of `recent` slots, then `heavy` heavy slots.
    """

    keeps_scores = True
    heavy: Positive
    recent: Positive
    positions: Positions = dataclasses.field(default="cache", kw_only=True)

    def layout(self, capacity: int | None = None) -> RingLayout:
        return RingLayout(sinks=0, ring_size=self.recent, num_rings=1, heavy=self.heavy)

    @property
    def label(self) -> str:
        return f"H2O {self.heavy}+{self.recent}"

    def query_weights(self, lengths: jax.Array, chunk_len: int) -> jax.Array:
        """Accumulated attention: every valid query counts once."""
        return (jnp.arange(chunk_len, dtype=jnp.int32)[None, :] < lengths[:, None]).astype(jnp.float32)

    def accumulate(self, score, increments, live, n, layout):
        """Accumulates without decay."""
        return jnp.where(live, score + increments, score)

    def place_evicted(self, layout: RingLayout, score, held, src, mu, valid):
        return keep_top_scores("H2O.heavy", layout, score, held, src, mu, valid)


def keep_top_scores(field: str, layout: RingLayout, score, held, src, mu, valid):
    """`ring_insertion.PlaceEvicted` of H2O and TOVA: the heavy slots keep the top `heavy` scores among their residents
    and the arriving tokens (residents first, so they win ties); winning arrivals take the slots of the
    residents that lost or of empty slots. Raises ValueError naming `field` (the policy's field that sets the heavy
    slots) if they and the arrivals are more than int32 indices address."""
    B, H, M = src.shape
    if layout.heavy + M > CLOCK_LIMIT:
        raise ValueError(
            f"{field}={layout.heavy}: its heavy slots and the {M} tokens a chunk brings them are more than "
            f"the {CLOCK_LIMIT} that int32 indices address"
        )
    base, cap = layout.capacity - layout.heavy, layout.capacity
    residents = jnp.where(held[..., base:], score[..., base:], -jnp.inf)
    key = jnp.concatenate([residents, jnp.where(valid[:, None, :], mu, -jnp.inf)], -1)
    _, top = jax.lax.top_k(key, layout.heavy)
    bi, hi = jnp.arange(B)[:, None, None], jnp.arange(H)[None, :, None]
    chosen = jnp.zeros(key.shape, bool).at[bi, hi, top].set(True) & (key > -jnp.inf)
    heavy_slots = jnp.broadcast_to(base + jnp.arange(layout.heavy, dtype=jnp.int32), (B, H, layout.heavy))
    free_slots = compact(heavy_slots, ~chosen[..., : layout.heavy], layout.heavy)
    new = chosen[..., layout.heavy :]
    rank = jnp.cumsum(new, axis=-1) - 1
    return jnp.where(new, take(free_slots, rank), cap), src, mu
