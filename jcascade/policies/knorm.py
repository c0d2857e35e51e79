"""KNorm (Devoto et al. 2024): after the prompt, keep the keys with the smallest L2 norm."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jcascade.pallas_kernels.schedule import RingLayout
from jcascade.policies.base import POSITION_MODES, check_choice, check_int
from jcascade.policies.ring import RingPolicy
from jcascade.policies.snapkv import keep_in_position_order, top_per_head
from jcascade.slots import CacheState, cached_kv


@dataclasses.dataclass(frozen=True)
class KNorm(RingPolicy):
    """Full attention over the prompt, then each KV head keeps the `budget` prompt tokens whose (un-rotated)
    keys have the smallest L2 norm (a prompt of at most `budget` tokens is kept whole); decoding appends.
    Needs no attention scores. The prompt's last token runs as a chunk of its own before the compression
    (`observation_window` 1: how generate and score find the end of a prompt); it is ranked like the others.
    Positions "original" (as kvpress keeps the rotated keys).
    """

    bounded = False
    needs_prompt = True
    budget: int
    positions: str = "original"
    stride: int = 4096

    @property
    def label(self) -> str:
        return f"KNorm {self.budget}"

    def __post_init__(self):
        check_int(self, "budget", self.budget, 1)
        check_choice(self, "positions", self.positions, POSITION_MODES)
        check_int(self, "stride", self.stride, 1)

    @property
    def observation_window(self) -> int:
        return 1

    def key_positions(self, state: CacheState) -> tuple[jax.Array, jax.Array]:
        """Each head holds its own tokens after the compression: its own positions."""
        if self.positions == "original":
            return state.pos, state.seen
        return super().key_positions(state)

    def layout(self, capacity: int | None = None) -> RingLayout:
        return RingLayout(sinks=capacity, ring_size=0, num_rings=0)

    def _compress_layer(self, state: CacheState, capacity: int) -> CacheState:
        k, _ = cached_kv(state)
        slot = jnp.arange(state.pos.shape[-1], dtype=jnp.int32)[None, None, :]
        prompt = slot < state.seen[:, None, None]
        smallest = jnp.where(prompt, -jnp.linalg.norm(k.astype(jnp.float32), axis=-1), -jnp.inf)
        return keep_in_position_order(state, top_per_head(smallest, self.budget) & prompt, capacity)

    def compress(self, state: CacheState, room: int) -> CacheState:
        """A cache of `budget + room` slots per (row, KV head): the kept tokens in position order, then empty
        slots. state: one layer, or layers stacked on a leading axis."""
        if state.seen.ndim == 1:
            return self._compress_layer(state, self.budget + room)
        return jax.vmap(lambda s: self._compress_layer(s, self.budget + room))(state)
