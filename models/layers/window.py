"""A sliding layer: attention over its window cache (under `CausalLM.window_policy`), masked as Hugging Face masks
it, then the cache's update."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jcascade.models.config import SLIDING
from jcascade.models.layers import Context, projections, view

from jcascade import cache_api, cache_state


def window_attention(
    policy,
    state: cache_state.CacheState,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lengths: jax.Array,
    rope,
    window: int,
) -> tuple[jax.Array, cache_state.Scores | None]:
    """Sliding-window attention (Gemma 3's sliding layers, masked as Hugging Face masks them): the query at
    position p sees the keys at positions p - window + 1 .. p that the layer's cache (`state`, under `policy`)
    holds, and the chunk's. Exact when the cache holds the window - 1 tokens before the chunk (the default
    window cache). Keys are rotated at `policy.key_positions` (`cache_state.held_keys`: from where the cache stores
    them); the window counts original positions.
    q [B, T, Hq, D], k, v [B, T, Hkv, D] un-rotated; lengths [B] valid queries. Returns out [B, T, Hq, D]
    (zeros for padding queries) and, for a policy that keeps scores, its increments (`Scores`, as
    `pallas_kernels.reference.chunk_attention` defines them). Plain XLA."""
    B, T, Hq, D = q.shape
    Hkv, f32, highest = k.shape[2], jnp.float32, jax.lax.Precision.HIGHEST
    key_pos, start = policy.key_positions(state)
    rot_pos = start[:, None] + jnp.arange(T)  # [B, T] the chunk's RoPE positions
    q_pos = state.seen[:, None] + jnp.arange(T)  # [B, T] its original positions
    chunk = lambda x: x.transpose(0, 2, 1, 3)  # [B, T, H, D] -> [B, H, T, D]
    held_v = cache_state.stored_kv(state)[1].decode()
    keys = jnp.concatenate([cache_state.held_keys(state, rope, key_pos), chunk(rope(k, rot_pos[:, :, None]))], axis=2)
    values = jnp.concatenate([held_v, chunk(v)], axis=2)
    k_pos = jnp.concatenate([state.pos, jnp.broadcast_to(q_pos[:, None, :], (B, Hkv, T))], axis=2)  # [B, Hkv, S]
    k_valid = jnp.concatenate(
        [state.pos >= 0, jnp.broadcast_to((jnp.arange(T) < lengths[:, None])[:, None, :], (B, Hkv, T))], axis=2
    )
    qg = rope(q, rot_pos[:, :, None]).reshape(B, T, Hkv, Hq // Hkv, D).astype(f32) * D**-0.5
    scores = jnp.einsum("bthgd,bhsd->bhgts", qg, keys.astype(f32), precision=highest)
    behind = q_pos[:, None, :, None] - k_pos[:, :, None, :]  # [B, Hkv, T, S]
    seen = (
        k_valid[:, :, None, :]
        & (behind >= 0)
        & (behind < window)
        & (jnp.arange(T) < lengths[:, None])[:, None, :, None]
    )
    scores = jnp.where(seen[:, :, None], scores, -jnp.inf)
    top = jnp.max(scores, axis=-1, keepdims=True)
    e = jnp.exp(scores - jnp.where(jnp.isneginf(top), 0.0, top))
    total = e.sum(-1, keepdims=True)
    p = jnp.where(total > 0, e / jnp.where(total > 0, total, 1.0), 0.0)  # [B, Hkv, G, T, S]
    out = jnp.einsum("bhgts,bhsd->bthgd", p, values.astype(f32), precision=highest).reshape(B, T, Hq, D).astype(q.dtype)
    weights = policy.query_weights(lengths, T)
    if weights is None:
        return out, None
    reduce = jnp.max if policy.head_reduction == "max" else jnp.mean
    increments = reduce(jnp.einsum("bhgts,bt->bhgs", p, weights.astype(f32), precision=highest), axis=2)
    capacity = held_v.shape[2]
    return out, cache_state.Scores(cache=increments[..., :capacity], chunk=increments[..., capacity:])


def attend(ctx: Context, rope, cache, q, k, v, lengths, layer_prefixes):
    """`window_attention` of one sliding layer's view of its cache, under the window policy (`layer_prefixes`:
    unused, the decoder refuses shared prefixes for models with sliding layers)."""
    return window_attention(ctx.window_policy, cache, q, k, v, lengths, rope, ctx.cfg.sliding_window)


def mixer(ctx: Context):
    """The mixer of a sliding layer keeping its own window cache."""
    rope = ctx.rope(SLIDING, True)

    def call(fetch, h, state, pending, index, layer_prefixes):
        q, gate, k, v = projections.qkv(ctx, SLIDING, fetch, h, with_kv=True)
        cache = view.layer(state.window, index, rope)
        out, cache = view.ordered(attend(ctx, rope, cache, q, k, v, ctx.lengths, layer_prefixes), cache)
        cache = cache_api.update(ctx.window_policy, cache, k, v, out[1], ctx.lengths)
        written = view.written_back(state.window, cache, index)
        return projections.output(ctx, SLIDING, fetch, out[0], gate), state.replaced(SLIDING, written), pending

    return call
