"""The policies that keep no scores: Full (every token), SlidingWindow and Sink (StreamingLLM)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jcascade.cache_state import CacheState, Scores
from jcascade.pallas_kernels.schedule import RingLayout
from jcascade.policies.base import NonNegative, Positioned, Positions, Positive, Strided
from jcascade.policies.ring import AppendPolicy, RingPolicy


@dataclasses.dataclass(frozen=True)
class Full(AppendPolicy, Strided):
    """Keeps every token (quadratic attention): the reference policy.

    Its capacity is the `max_tokens` given to `init_cache`. A row that receives more tokens than that
    loses them: `update` raises when it can see this (concrete inputs), and under `jit` `attend`
    returns NaN for such rows, so an overflow never passes silently.
    """

    bounded = False

    def attend(
        self, state: CacheState, q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, rope
    ) -> tuple[jax.Array, Scores | None]:
        out, scores = super().attend(state, q, k, v, lengths, rope)
        return jnp.where((state.seen > state.capacity)[:, None, None, None], jnp.nan, out), scores


@dataclasses.dataclass(frozen=True)
class SlidingWindow(RingPolicy, Positioned):
    """The `window` most recent tokens (no sinks). `positions`: see docs/semantics.md §4."""

    sinks = 0  # a field of Sink
    window: Positive
    positions: Positions = dataclasses.field(default="cache", kw_only=True)

    @property
    def label(self) -> str:
        return f"Window {self.window}"

    def layout(self, capacity: int | None = None) -> RingLayout:
        return RingLayout(sinks=self.sinks, ring_size=self.window, num_rings=1)


@dataclasses.dataclass(frozen=True)
class Sink(SlidingWindow):
    """StreamingLLM: the first `sinks` tokens plus the `window` most recent ones (= Cascade with N=1)."""

    sinks: NonNegative = 64

    @property
    def label(self) -> str:
        return f"Sink {self.window}"
