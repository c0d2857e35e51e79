"""A layer's view of a stacked cache, and the stack after that layer's update.

The stacked cache is the layer scan's carry and is never sliced: each layer sees the whole K/V stack with its layer
index (`CacheState.layer`), the kernels and scatters read and write that layer in place, and only the small per-slot
arrays (scores, positions) are sliced and written back."""

from __future__ import annotations

import jax

from jcascade import cache_state


def layer(state: cache_state.CacheState, index: jax.Array, rope) -> cache_state.CacheState:
    """Layer `index`'s view of the stacked cache: the whole K/V stack with its layer index, its own small arrays;
    `rope` the layer's RoPE: a stack storing keys rotated (`CacheState.rope`) stores a layer's without rotary
    positions (rope None) as they are."""
    return cache_state.map_layer_fields(lambda x: x[index], state, layer=index, rope=stored_rope(state, rope))


def stored_rope(state: cache_state.CacheState, rope):
    """The `CacheState.rope` of a layer's view of `state` for a layer rotating with `rope` (None: not rotating)."""
    return None if state.rope is None else rope


def written_back(
    state: cache_state.CacheState, layer_state: cache_state.CacheState, index: jax.Array
) -> cache_state.CacheState:
    """The stacked cache after a layer's update: its K/V stack (written in place) and its small arrays set at
    `index`."""
    return cache_state.map_layer_fields(
        lambda own, stack: stack.at[index].set(own), layer_state, state, layer=None, rope=state.rope
    )


def ordered(out, state: cache_state.CacheState):
    """(out, state) as one value: every read of the K/V stack by the attention that made `out` precedes the update's
    in-place writes to `state`, and nothing downstream recomputes `out` from the stack (else XLA copies the stack to
    keep an unordered read valid; tests/models/test_decoder.py)."""
    return jax.lax.optimization_barrier((out, state))
