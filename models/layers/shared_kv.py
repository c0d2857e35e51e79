"""Layers that share a cache (`ModelConfig.kv_shared_layers`, Gemma 4): each of the last layers attends, with its own
queries, to the cache and the chunk's keys and values of the last earlier layer of its type (the source).

The source attends as a layer of its type does but leaves its chunk's keys, values and score increments in `pending`
(by layer type) instead of updating its cache; its readers attend to the same cache and chunk; `finish` updates the
cache after every layer has read it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jcascade.models.config import GLOBAL, SLIDING
from jcascade.models.layers import Context, cache_attention, kind_of, projections, view, window

from jcascade import cache_api

ATTEND = {GLOBAL: cache_attention.attend, SLIDING: window.attend}


def source(ctx: Context, layer_type: str, rotary: bool):
    """The mixer of a layer whose cache later layers read."""
    rope, attend = ctx.rope(layer_type, rotary), ATTEND[layer_type]

    def call(fetch, h, state, pending, index, layer_prefixes):
        q, gate, k, v = projections.qkv(ctx, layer_type, fetch, h, with_kv=True)
        cache = view.layer(state.of(layer_type), index, rope)
        out, scores = attend(ctx, rope, cache, q, k, v, ctx.lengths, layer_prefixes)
        return projections.output(ctx, layer_type, fetch, out, gate), state, {**pending, layer_type: (k, v, scores)}

    return call


def reader(ctx: Context, layer_type: str, rotary: bool):
    """The mixer of a layer reading an earlier layer's cache (and that layer's chunk, from `pending`)."""
    rope, attend = ctx.rope(layer_type, rotary), ATTEND[layer_type]

    def call(fetch, h, state, pending, index, layer_prefixes):
        q, gate, _, _ = projections.qkv(ctx, layer_type, fetch, h, with_kv=False)
        k, v, _ = pending[layer_type]
        out, _ = attend(ctx, rope, view.layer(state.of(layer_type), index, rope), q, k, v, ctx.lengths, layer_prefixes)
        return projections.output(ctx, layer_type, fetch, out, gate), state, pending

    return call


def sources(cfg) -> dict[str, tuple[int, bool]]:
    """Each layer type's source layer, by type: its index in the type's stack, and whether it rotates."""
    out = {}
    for layer in range(cfg.num_layers):
        kind, layer_type, rotary = kind_of(cfg, layer)
        if kind == "shared_source":
            out[layer_type] = cfg.layers_with_state(layer_type).index(layer), rotary
    return out


def initial_pending(ctx: Context, state, dtype) -> dict:
    """Zeros of each source's chunk keys, values and score increments (by layer type), carried through the layers
    before it."""
    cfg, B, T = ctx.cfg, ctx.batch, ctx.tokens
    pending = {}
    for layer_type, (index, rotary) in sources(cfg).items():
        D, Hkv = cfg.head_size(layer_type), cfg.kv_heads(layer_type)
        q = jax.ShapeDtypeStruct((B, T, cfg.num_heads, D), dtype)
        kv = jax.ShapeDtypeStruct((B, T, Hkv, D), dtype)
        attend, rope = ATTEND[layer_type], ctx.rope(layer_type, rotary)
        cache = view.layer(state.of(layer_type), jnp.int32(index), rope)
        scores = jax.eval_shape(lambda q, k, v: attend(ctx, rope, cache, q, k, v, ctx.lengths, ())[1], q, kv, kv)
        pending[layer_type] = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), (kv, kv, scores))
    return pending


def finish(ctx: Context, state, pending: dict):
    """`state` with each source's cache updated by its chunk (`pending`), after its readers have read it."""
    for layer_type, (index, rotary) in sources(ctx.cfg).items():
        k, v, scores = pending[layer_type]
        stack = state.of(layer_type)
        cache = view.layer(stack, jnp.int32(index), ctx.rope(layer_type, rotary))
        cache = cache_api.update(ctx.layer_policy(layer_type), cache, k, v, scores, ctx.lengths)
        state = state.replaced(layer_type, view.written_back(stack, cache, jnp.int32(index)))
    return state
