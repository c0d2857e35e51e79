"""A global layer: attention over the cache policy's cache (`jcascade.attend`), then its update (`jcascade.update`);
under shared prefixes, over the prefixes and the rows' own caches (`jcascade.attend_shared`)."""

from __future__ import annotations

import dataclasses

import jax
from jcascade.models.config import GLOBAL
from jcascade.models.layers import Context, projections, view

from jcascade import cache_api, shared


def attend(ctx: Context, rope, cache, q, k, v, lengths, layer_prefixes):
    """(out [B, T, H, D], the policy's score increments or None) of one global layer's view of the cache."""
    if layer_prefixes:  # requests' own caches keep no scores under shared prefixes
        return shared.attend_shared(ctx.policy, cache, q, k, v, layer_prefixes, lengths, rope), None
    return cache_api.attend(ctx.policy, cache, q, k, v, lengths, rope)


def attend_and_update(ctx: Context, rope):
    """`(cache, q, k, v, lengths, layer_prefixes) -> (out, cache)` of one layer's view of the cache. On a sharded
    model each device runs it (and so the Pallas kernels) on its own rows and KV heads: every cache decision is per
    (row, KV head), so nothing is communicated."""

    def run(cache, q, k, v, lengths, layer_prefixes):
        out, cache = view.ordered(attend(ctx, rope, cache, q, k, v, lengths, layer_prefixes), cache)
        return out[0], cache_api.update(ctx.policy, cache, k, v, out[1], lengths)

    if ctx.specs is None:
        return run
    s = ctx.specs
    state = dataclasses.replace(s["state"], rope=view.stored_rope(s["state"], rope))  # as the layer's view
    return jax.shard_map(
        run,
        mesh=ctx.mesh,
        check_vma=False,
        in_specs=(state, s["chunk"], s["chunk"], s["chunk"], s["lengths"], s["prefixes"]),
        out_specs=(s["chunk"], state),
    )


def mixer(ctx: Context, rotary: bool = True):
    """The mixer of a global layer keeping its own cache (`rotary` False: `nope`)."""
    rope = ctx.rope(GLOBAL, rotary)
    run = attend_and_update(ctx, rope)

    def call(fetch, h, state, pending, index, layer_prefixes):
        q, gate, k, v = projections.qkv(ctx, GLOBAL, fetch, h, with_kv=True)
        out, cache = run(view.layer(state.cache, index, rope), q, k, v, ctx.lengths, layer_prefixes)
        written = view.written_back(state.cache, cache, index)
        return projections.output(ctx, GLOBAL, fetch, out, gate), state.replaced(GLOBAL, written), pending

    return call
