"""The Cascading KV Cache: sinks + cascading rings of EMA-scored tokens (docs/semantics.md §3).

Willette et al., "Training-Free Exponential Context Extension via Cascading KV Cache", ICLR 2025
(arXiv 2406.17808).
"""

from __future__ import annotations

import dataclasses
from typing import Annotated

import jax
import jax.numpy as jnp

from jcascade.pallas_kernels.schedule import RingLayout
from jcascade.policies.base import HeadReduced, HeadReduction, Ints, NonNegative, Positions, Positive, Reals
from jcascade.policies.ring import RingPolicy


@dataclasses.dataclass(frozen=True)
class Cascade(RingPolicy, HeadReduced):
    """Cascading KV cache (arXiv 2406.17808): `sinks` + `num_cascades` rings of cache_size/num_cascades slots.

    Tokens carry an EMA attention score with decay `gamma`; scores of the query heads sharing a KV head
    are reduced by `head_reduction` ("max", as in the paper, or "mean"). Defaults are the paper's:
    64 sinks, 4 cascades, gamma 0.9999, max reduction, cache-index positions, stride 4096.
    """

    keeps_scores = True
    cache_size: Positive
    sinks: NonNegative = 64
    num_cascades: Annotated[int, Ints(1, 30)] = 4  # ring i accepts every 2**i tokens of an int32 clock
    gamma: Annotated[float, Reals(0, 1, open=True)] = 0.9999
    head_reduction: HeadReduction = dataclasses.field(default="max", kw_only=True)
    positions: Positions = dataclasses.field(default="cache", kw_only=True)

    @property
    def label(self) -> str:
        return f"Cascade {self.cache_size}x{self.num_cascades}"

    def __post_init__(self):
        super().__post_init__()
        if self.cache_size % self.num_cascades:
            raise ValueError(
                f"Cascade.cache_size ({self.cache_size}) must be divisible by "
                f"Cascade.num_cascades ({self.num_cascades})"
            )

    def layout(self, capacity: int | None = None) -> RingLayout:
        return RingLayout(
            sinks=self.sinks,
            ring_size=self.cache_size // self.num_cascades,
            num_rings=self.num_cascades,
        )

    def query_weights(self, lengths: jax.Array, chunk_len: int) -> jax.Array:
        """w_q = (1 - gamma) * gamma**(n - 1 - q) for q < n, 0 for padding queries, so that a chunk
        of n tokens moves the EMA exactly as n single-token steps would."""
        q = jnp.arange(chunk_len, dtype=jnp.int32)[None, :]
        age = (lengths[:, None] - 1 - q).astype(jnp.float32)
        w = jnp.float32(1.0 - self.gamma) * jnp.power(jnp.float32(self.gamma), age)
        return jnp.where(q < lengths[:, None], w, 0.0)

    def accumulate(self, score, increments, live, n, layout):
        """The EMA: non-sink residents decay by gamma**n and gain their increments; sinks keep their score."""
        decay = jnp.power(jnp.float32(self.gamma), n.astype(jnp.float32))[:, None, None]
        return jnp.where(live & (jnp.arange(score.shape[-1]) >= layout.sinks), decay * score + increments, score)
