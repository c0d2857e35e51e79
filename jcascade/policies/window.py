"""The policies that keep no scores: Full (every token), SlidingWindow and Sink (StreamingLLM)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jcascade.cache_state import CacheState, Scores
from jcascade.pallas_kernels.attention_state import merge
from jcascade.pallas_kernels.schedule import RingLayout
from jcascade.policies.base import NonNegative, Positioned, Positions, Positive, Strided
from jcascade.policies.ring import AppendPolicy, RingPolicy
from jcascade.rope import rotate_chunk


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

    stores_rotated = True  # cache positions too: one query rotation per segment (attend)

    def attend(
        self, state: CacheState, q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, rope
    ) -> tuple[jax.Array, Scores | None]:
        """As `Policy.attend`. With positions="cache" over keys stored rotated at their own positions
        (`CacheState.rope`), one query rotation per segment instead of a rotation per key: the window's tokens and
        the chunk's have ranks equal to their own positions less one count per row (the tokens evicted between
        the sinks and the window), so the queries attend to them rotated at their own positions; the sinks' ranks
        are their own positions, which the queries attend to rotated at their ranks. The two attention states merge
        exactly (`attention_state.merge`)."""
        if self.positions != "cache" or state.rope is None:
            return super().attend(state, q, k, v, lengths, rope)
        sinks, f32 = self.layout_for(state).sinks, jnp.float32
        held = state.pos >= 0
        q_own, k_own = rotate_chunk(rope, q, k, state.seen)
        out, lse, _, _ = state.kernels.chunk_attention(
            q_own,
            k_own,
            v,
            state.k,
            state.v,
            held[..., sinks:],
            state.pos[..., sinks:],
            lengths,
            layer=state.layer,
            first_slot=sinks,
        )
        if not sinks:
            return out, None
        q_rank, _ = rotate_chunk(rope, q, None, self.key_positions(state)[1])
        sink_k, sink_v = (x.of_layer(state.layer).map(lambda a: a[:, :, :sinks]) for x in (state.k, state.v))
        sink_out, sink_lse = state.kernels.prefix_attention(
            q_rank, sink_k, sink_v, held[..., :sinks], state.pos[..., :sinks], None
        )
        out, _ = merge(out.astype(f32), jnp.swapaxes(lse, 1, 2), sink_out, sink_lse)
        queries = (jnp.arange(q.shape[1])[None, :] < lengths[:, None])[:, :, None, None]
        return jnp.where(queries, out, 0.0).astype(q.dtype), None


@dataclasses.dataclass(frozen=True)
class Sink(SlidingWindow):
    """StreamingLLM: the first `sinks` tokens plus the `window` most recent ones (= Cascade with N=1)."""

    sinks: NonNegative = 64

    @property
    def label(self) -> str:
        return f"Sink {self.window}"
