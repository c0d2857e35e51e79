"""AdaKV (Feng et al. 2024): SnapKV's or PyramidKV's selection with the budget of a layer shared by its KV heads."""

from __future__ import annotations

import dataclasses
from typing import Annotated

import jax
import jax.numpy as jnp

from jcascade.cache_state import CacheState
from jcascade.policies.base import Reals
from jcascade.policies.selection import WindowSelection, top_per_head, window_slots
from jcascade.policies.snapkv import PyramidKV, SnapKV


@dataclasses.dataclass(frozen=True)
class AdaKV(WindowSelection):
    """Head-adaptive budgets over a scoring policy (`scorer`: a `jc.SnapKV` or `jc.PyramidKV`).

    The scorer gives each layer a prompt budget of P tokens per KV head before its observation window (its
    `prefix_budget`). AdaKV keeps the same H * P tokens per layer, chosen across the layer's H KV heads
    jointly by the scorer's pooled scores, each head first getting its own top floor(`floor` * P) (the
    safeguard; kvpress's `alpha_safeguard`, 0.2). So heads keep different counts; every head also keeps
    the observation window. The cache is dense, so each head is allocated the most any head may keep,
    P + (H - 1) * (P - floor(floor * P)) slots (+ the window): `jc.cache_occupancy` reports resident vs
    allocated slots. Decoding appends past the fullest head (the others' empty slots stay masked). Positions
    are the original ones (a scorer with positions="cache" is refused). Other fields (window, kernel, pooling,
    head_reduction, positions, stride, kv_dtype) are the scorer's.
    """

    scorer: SnapKV | PyramidKV
    floor: Annotated[float, Reals(0, 1)] = 0.2

    def __post_init__(self):
        super().__post_init__()
        if self.scorer.positions != "original":
            raise ValueError(
                'AdaKV.scorer must keep positions="original": its heads hold different counts, so '
                f"slot ranks are no positions; got {self.scorer.positions!r}"
            )

    # the scorer's settings
    window = property(lambda self: self.scorer.window)
    kernel = property(lambda self: self.scorer.kernel)
    pooling = property(lambda self: self.scorer.pooling)
    head_reduction = property(lambda self: self.scorer.head_reduction)
    positions = property(lambda self: self.scorer.positions)
    stride = property(lambda self: self.scorer.stride)
    kv_dtype = property(lambda self: self.scorer.kv_dtype)

    @property
    def label(self) -> str:
        return f"AdaKV-{self.scorer.label}"

    def prefix_budget(self, prompt_len: jax.Array, layer, num_layers: int) -> jax.Array:
        return self.scorer.prefix_budget(prompt_len, layer, num_layers)

    def kept_slots(self, num_heads: int) -> int:
        budget = self.scorer.kept_slots(num_heads) - self.window  # the largest prefix budget of a layer
        return budget + (num_heads - 1) * (budget - int(self.floor * budget)) + self.window

    def keep(self, state: CacheState, layer, num_layers: int) -> jax.Array:
        """bool [B, H, cap]: per row, each head's top floor * P candidates, then the best of the rest across
        heads up to H * P in all, and the observation window."""
        B, H, cap = state.pos.shape
        pooled = self.pooled_scores(state)
        budget = self.prefix_budget(state.seen, layer, num_layers)  # [B]
        safe = top_per_head(pooled, (self.floor * budget).astype(jnp.int32)[:, None, None]) & (pooled > -jnp.inf)
        ranked = jnp.where(safe, jnp.inf, pooled).reshape(B, H * cap)  # the safeguarded first
        joint = top_per_head(ranked[:, None], (H * budget)[:, None, None])[:, 0].reshape(B, H, cap)
        return (joint & (pooled > -jnp.inf)) | window_slots(state, self.window)
