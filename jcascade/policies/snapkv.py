"""SnapKV and PyramidKV: full attention over the prompt, then one compression chosen by the attention of
an observation window (docs/semantics.md §5).

Both keep an append cache (slot j holds the j-th held token) whose scores are the attention that the
last `window` queries of the newest chunk gave each token (summed over those queries, reduced over the
query heads of a KV head). `compress`, run once after the prompt, keeps the selected tokens, in position
order, at the front of a smaller append cache; decoding then appends (`jcascade.policies.selection`).
"""

from __future__ import annotations

import dataclasses
from typing import Annotated

import jax
import jax.numpy as jnp

from jcascade.policies.base import HeadReduced, Ints, OddPositive, Positive
from jcascade.policies.selection import Pooling, WindowSelection


@dataclasses.dataclass(frozen=True)
class SnapKVFields(WindowSelection, HeadReduced):
    """The fields SnapKV and PyramidKV share (AdaKV reads them from its scorer), and their rule."""

    budget: Annotated[int, Ints(2)]
    window: Positive
    _: dataclasses.KW_ONLY
    kernel: OddPositive = 7
    pooling: Pooling = "max"

    @property
    def label(self) -> str:
        return f"{type(self).__name__} {self.budget}"

    def __post_init__(self):
        super().__post_init__()
        if self.window >= self.budget:
            raise ValueError(
                f"{type(self).__name__}.window ({self.window}) must be < budget ({self.budget}): the "
                "budget includes the observation window"
            )


@dataclasses.dataclass(frozen=True)
class SnapKV(SnapKVFields):
    """SnapKV (Li et al. 2024; a baseline of the PyramidKV paper, arXiv 2406.02069): full attention over the prompt,
    then one compression.

    After the prompt, each KV head keeps the top (budget - window) prompt tokens ranked by the attention
    the last `window` prompt queries give them (summed over those queries, reduced over the query heads
    of the KV head by `head_reduction`, then 1-D pooled over positions with `kernel`/`pooling`, padding
    kernel // 2), plus those `window` tokens; a prompt shorter than `budget` is kept whole (the
    reference code's rule). Decoding then only appends. Defaults are the paper's (window 32, kernel 7,
    max pooling). GQA: one selection per KV head, "mean" over its query heads by default (the reference
    code selects per query head after repeating K/V; we never expand the cache). Positions: "original"
    (the reference code keeps the keys rotated at their original positions).

    `jc.generate` and `jc.score(prefix=...)` run the prompt in `stride` chunks with the observation
    window as its last chunk and call `jc.compress`; at the attend/update level, scores are the
    attention of the last `window` queries of each chunk.
    """

    window: Positive = 32

    def prefix_budget(self, prompt_len: jax.Array, layer, num_layers: int) -> jax.Array:
        kept = jnp.full_like(prompt_len, self.budget - self.window)
        return jnp.where(prompt_len < self.budget, prompt_len, kept)

    def kept_slots(self, num_heads: int) -> int:
        return self.budget


@dataclasses.dataclass(frozen=True)
class PyramidKV(SnapKVFields):
    """PyramidKV (Cai et al., arXiv 2406.02069): SnapKV's selection with per-layer budgets falling linearly with depth.

    With C = budget and w = window, layer l of L keeps (prefix_l + w) tokens, where, as in the reference
    code (KVCache-Factory `PyramidKVCluster`) for a prompt of q tokens: q < C keeps the whole prompt;
    q < 2(C - w) gives prefix_l = C - w in every layer; otherwise min = (C - w) // beta,
    max = 2(C - w) - min, and if max >= q - w then max = q - w and min = 2(C - w) - max;
    prefix_l = max - l * ((max - min) // (L - 1)). The mean over layers is therefore about `budget`.
    Selection is per KV head (never the reference code's expansion to query heads). Per-layer
    capacities differ: the compressed state allocates the largest and leaves the rest of a layer's slots
    empty (masked). Defaults as the paper's code: window 8, beta 20, kernel 7, max pooling.
    """

    window: Positive = 8
    beta: Positive = 20

    def prefix_budget(self, prompt_len: jax.Array, layer, num_layers: int) -> jax.Array:
        C, w = self.budget, self.window
        low = (C - w) // self.beta
        high = jnp.full_like(prompt_len, 2 * (C - w) - low)
        clamp = high >= prompt_len - w
        high = jnp.where(clamp, prompt_len - w, high)
        low = jnp.where(clamp, 2 * (C - w) - high, low)
        steps = (high - low) // (num_layers - 1) if num_layers > 1 else 0
        kept = jnp.where(prompt_len < 2 * (C - w), C - w, high - layer * steps)
        return jnp.where(prompt_len < C, prompt_len, kept)

    def kept_slots(self, num_heads: int) -> int:
        C, w = self.budget, self.window
        return max(C, 2 * (C - w) - (C - w) // self.beta + w)
