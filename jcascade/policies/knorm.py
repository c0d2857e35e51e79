"""KNorm (Devoto et al. 2024): after the prompt, keep the keys with the smallest L2 norm."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jcascade.policies.base import POSITION_MODES, check_choice, check_int
from jcascade.policies.ring import AppendPolicy
from jcascade.policies.snapkv import compress_by_ranking
from jcascade.slots import CacheState, cached_kv


@dataclasses.dataclass(frozen=True)
class KNorm(AppendPolicy):
    """Full attention over the prompt, then each KV head keeps the `budget` prompt tokens whose (un-rotated)
    keys have the smallest L2 norm (a prompt of at most `budget` tokens is kept whole); decoding appends.
    Needs no attention scores. The prompt's last token runs as a chunk of its own before the compression
    (`observation_window` 1: how generate and score find the end of a prompt); it is ranked like the others.
    Positions "original" (as kvpress keeps the rotated keys).
    """

    bounded = False
    needs_prompt = True
    observation_window = 1  # the prompt's last token, a chunk of its own
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

    def compress(self, state: CacheState, room: int) -> CacheState:
        """A cache of `budget + room` slots per (row, KV head): the kept tokens in position order, then empty
        slots. state: one layer, or layers stacked on a leading axis."""
        smallest = lambda layer: -jnp.linalg.norm(cached_kv(layer)[0].astype(jnp.float32), axis=-1)  # noqa: E731
        return compress_by_ranking(state, smallest, self.budget, room)
