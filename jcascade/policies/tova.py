"""TOVA (Oren et al. 2024): a fixed-size cache that keeps the tokens the newest query attends to most."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jcascade.pallas_kernels.schedule import RingLayout
from jcascade.policies.base import HeadReduced, Positive
from jcascade.policies.h2o import keep_top_scores
from jcascade.policies.ring import RingPolicy


@dataclasses.dataclass(frozen=True)
class TOVA(RingPolicy, HeadReduced):
    """Token Omission Via Attention: `cache_size` slots; after each token the cache keeps the `cache_size`
    tokens (held ones and the new one) with the largest attention from the newest query, averaged over the
    query heads of a KV head (`head_reduction="mean"`, the paper's rule; "max" available). The scores are
    not accumulated: each step's attention replaces the last.

    With `stride=1` (every decode step) this is TOVA exactly; a longer prefill chunk is decided by its last
    valid query (the chunk's earlier queries attend to everything held and to the chunk). Held tokens win
    ties. Layout: `cache_size` heavy slots, no rings.
    """

    keeps_scores = True
    cache_size: Positive

    @property
    def label(self) -> str:
        return f"TOVA {self.cache_size}"

    def layout(self, capacity: int | None = None) -> RingLayout:
        return RingLayout(sinks=0, ring_size=0, num_rings=0, heavy=self.cache_size)

    def query_weights(self, lengths: jax.Array, chunk_len: int) -> jax.Array:
        """1 for each row's last valid query (the newest token), 0 elsewhere."""
        return (jnp.arange(chunk_len, dtype=jnp.int32)[None, :] == lengths[:, None] - 1).astype(jnp.float32)

    def accumulate(self, score, increments, live, n, layout):
        """The newest query's attention replaces the scores."""
        return jnp.where(live, increments, score)

    def place_evicted(self, layout: RingLayout, score, held, src, mu, valid):
        return keep_top_scores("TOVA.cache_size", layout, score, held, src, mu, valid)
