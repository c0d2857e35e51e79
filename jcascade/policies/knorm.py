"""KNorm (Devoto et al. 2024): after the prompt, keep the keys with the smallest L2 norm."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jcascade.cache_state import CacheState, stored_kv
from jcascade.policies.base import Positioned
from jcascade.policies.selection import ScorerPolicy


@dataclasses.dataclass(frozen=True)
class KNorm(ScorerPolicy, Positioned):
    """Each KV head keeps the `budget` prompt tokens whose (un-rotated) keys have the smallest L2 norm (`ScorerPolicy`).
    Needs no attention scores. Positions "original" (as kvpress keeps the rotated keys)."""

    def score(self, state: CacheState) -> jax.Array:
        return -jnp.linalg.norm(stored_kv(state)[0].decode(), axis=-1)  # a rotation keeps a key's norm
