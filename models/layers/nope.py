"""A global layer without rotary positions (SmolLM3's every `no_rope_layer_interval`-th layer): attention over the
cache policy's cache as `cache_attention`, with neither q nor k rotated. Its keys share the cache of the rotating
layers, so a policy that moves tokens (to cache positions, say) moves them alike in every layer."""

from __future__ import annotations

from jcascade.models.layers import Context, cache_attention


def mixer(ctx: Context):
    """The mixer of a global layer that keeps its own cache and rotates nothing."""
    return cache_attention.mixer(ctx, rotary=False)
