"""Attention-selected caches: SnapKV / PyramidKV compression and Recycled Attention (DESIGN §5).

SnapKV and PyramidKV keep an append cache (slot j holds the j-th held token) whose scores are the
attention that the last `window` queries of the newest chunk gave each token (summed over those
queries, reduced over the query heads of a KV head). `compress`, run once after the prompt, keeps the
selected tokens, in position order, at the front of a smaller append cache; decoding then appends.

Recycled keeps three regions in one state: [full cache (max_tokens slots, slot = position) |
top_k recycled copies | tokens fed since the last full step]. Its steps are told apart by the state
alone: a row is due for a full step when its newest region holds refresh_every - 1 tokens.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jcascade import pallas_kernels
from jcascade import policies as P
from jcascade.rope import rotate_chunk


def pool(x: jax.Array, valid: jax.Array, kernel: int, pooling: str) -> jax.Array:
    """1-D pooling over the last axis, stride 1, padding kernel // 2 (as torch's max_pool1d/avg_pool1d
    with their default count_include_pad): x f32 [..., S], valid bool [..., S] (invalid entries count
    as padding). Returns f32 [..., S], -inf at invalid entries."""
    if kernel == 1:
        return jnp.where(valid, x, -jnp.inf)
    pad = [(0, 0)] * (x.ndim - 1) + [(kernel // 2, kernel // 2)]
    window, strides = (1,) * (x.ndim - 1) + (kernel,), (1,) * x.ndim
    if pooling == "max":
        out = jax.lax.reduce_window(jnp.where(valid, x, -jnp.inf), -jnp.inf, jax.lax.max, window, strides, pad)
    else:
        out = jax.lax.reduce_window(jnp.where(valid, x, 0.0), 0.0, jax.lax.add, window, strides, pad) / kernel
    return jnp.where(valid, out, -jnp.inf)


def rank_by_position(pos: jax.Array) -> jax.Array:
    """int32 [..., S]: rank of each held slot (pos >= 0) among its row's held slots by position, -1 if empty."""
    held = pos >= 0
    order = jnp.argsort(jnp.where(held, pos, jnp.iinfo(jnp.int32).max), axis=-1)
    return jnp.where(held, jnp.argsort(order, axis=-1).astype(jnp.int32), -1)


# ---------------------------------------------------------------------------------------------------
# SnapKV / PyramidKV


def prefix_budget(policy: P.SnapKV | P.PyramidKV, prompt_len: jax.Array, layer, num_layers: int) -> jax.Array:
    """int32 [B]: prompt tokens before the window that a layer keeps (the reference code's rules, see the
    policies' docstrings); a prompt shorter than `budget` is kept whole."""
    C, w = policy.budget, policy.window
    whole = prompt_len
    if isinstance(policy, P.SnapKV):
        kept = jnp.full_like(prompt_len, C - w)
    else:
        low = (C - w) // policy.beta
        high = jnp.full_like(prompt_len, 2 * (C - w) - low)
        clamp = high >= prompt_len - w
        high = jnp.where(clamp, prompt_len - w, high)
        low = jnp.where(clamp, 2 * (C - w) - high, low)
        steps = (high - low) // (num_layers - 1) if num_layers > 1 else 0
        kept = jnp.where(prompt_len < 2 * (C - w), C - w, high - layer * steps)
    return jnp.where(prompt_len < C, whole, kept)


def compressed_capacity(policy: P.SnapKV | P.PyramidKV) -> int:
    """Most tokens any layer keeps after compression (PyramidKV's bottom layer, or the budget)."""
    if isinstance(policy, P.SnapKV):
        return policy.budget
    C, w = policy.budget, policy.window
    return max(C, 2 * (C - w) - (C - w) // policy.beta + w)


def _compress_layer(policy, state, layer, num_layers: int, capacity: int):
    B, H, cap = state.pos.shape
    q_len = state.seen
    window = jnp.minimum(policy.window, q_len)[:, None, None]
    slot = jnp.arange(cap, dtype=jnp.int32)[None, None, :]
    prefix = slot < (q_len[:, None, None] - window)
    pooled = pool(state.score, prefix, policy.kernel, policy.pooling)
    order = jnp.argsort(-pooled, axis=-1, stable=True)  # descending, lower slot first on ties
    rank = jnp.argsort(order, axis=-1)
    budget = prefix_budget(policy, q_len, layer, num_layers)[:, None, None]
    keep = (prefix & (rank < budget)) | (~prefix & (slot < q_len[:, None, None]))
    dest = jnp.where(keep, jnp.cumsum(keep, axis=-1) - 1, capacity)  # position order kept
    bi, hi = jnp.arange(B)[:, None, None], jnp.arange(H)[None, :, None]
    moved = lambda x, empty: jnp.full((B, H, capacity, *x.shape[3:]), empty, x.dtype).at[bi, hi, dest].set(x, mode="drop")
    return dataclasses.replace(state, k=moved(state.k, 0), v=moved(state.v, 0), score=moved(state.score, 0),
                               pos=moved(state.pos, -1))


def compress(policy: P.SnapKV | P.PyramidKV, state, room: int):
    """The post-prompt compression of SnapKV / PyramidKV.

    state: the append cache after the prompt (its last chunk being the observation window), one layer
    or L layers stacked on a leading axis (PyramidKV reads the layer index from that axis; a single
    layer counts as a bottom layer). room: slots to leave for the tokens decoded afterwards.
    Returns a cache of capacity `compressed_capacity(policy) + room` holding, per (row, KV head), the
    kept tokens in position order followed by empty slots.
    """
    if not isinstance(policy, (P.SnapKV, P.PyramidKV)):
        raise TypeError(f"compress applies to SnapKV and PyramidKV, got {type(policy).__name__}")
    if isinstance(room, bool) or not isinstance(room, int) or room < 0:
        raise ValueError(f"room must be an int >= 0, got {room!r}")
    capacity = compressed_capacity(policy) + room
    if state.seen.ndim == 1:
        return _compress_layer(policy, state, 0, 1, capacity)
    L = state.seen.shape[0]
    layers = jnp.arange(L, dtype=jnp.int32)
    return jax.vmap(lambda s, l: _compress_layer(policy, s, l, L, capacity))(state, layers)


# ---------------------------------------------------------------------------------------------------
# Recycled Attention


def recycled_regions(policy: P.Recycled, capacity: int) -> tuple[int, int]:
    """(M, M + top_k): starts of the recycled-copies region and of the new-tokens region."""
    full = capacity - policy.top_k - policy.refresh_every
    if full < 1:
        raise ValueError(f"state capacity {capacity} is too small for {policy}: was it made by init_cache?")
    return full, full + policy.top_k


def _since_refresh(policy: P.Recycled, state) -> jax.Array:
    """int32 [B]: tokens fed since the row's last full-attention step."""
    _, recent = recycled_regions(policy, state.capacity)
    return jnp.sum(state.pos[:, 0, recent:] >= 0, axis=-1).astype(jnp.int32)


def full_step_rows(policy: P.Recycled, since: jax.Array, chunk_len: int) -> jax.Array:
    """bool [B]: rows whose chunk is a full-attention step (every chunk longer than one token, and the
    decode step after refresh_every - 1 recycled ones); since: `_since_refresh`."""
    return (since >= policy.refresh_every - 1) | (chunk_len > 1)


def recycled_attend(policy: P.Recycled, state, q, k, v, n, rope, implementation, weights):
    """`attend` for Recycled: full rows attend to the full region, the others to the recycled copies
    and the new tokens. Returns (out, inc_cache [B, H, cap], inc_chunk [B, H, T])."""
    B, T, Hkv, _ = k.shape
    M, _ = recycled_regions(policy, state.capacity)
    full = full_step_rows(policy, _since_refresh(policy, state), T)
    slot = jnp.arange(state.capacity)

    def run(valid, key_pos, start, k_cache, v_cache, w):
        qr, kr = rotate_chunk(rope, q, k, start)
        return pallas_kernels.chunk_attention(qr, kr, v, k_cache, v_cache, valid, key_pos, n, w, "max", rope,
                                              implementation=implementation)

    def full_attention():
        valid = (state.pos >= 0) & (slot < M)
        out, _, inc_cache, inc_chunk = run(valid, state.pos, state.seen, state.k, state.v, weights)
        return out, inc_cache, inc_chunk

    if T > 1:
        return full_attention()

    pos = state.pos[..., M:]
    held = pos >= 0
    if policy.positions == "original":
        key_pos, start = pos, state.seen
    else:  # rank among the attended tokens
        key_pos, start = rank_by_position(pos), jnp.sum(held[:, 0], axis=-1).astype(jnp.int32)
    small, _, _, _ = run(held, key_pos, start, state.k[..., M:, :], state.v[..., M:, :], None)
    zeros = (jnp.zeros((B, Hkv, state.capacity), jnp.float32), jnp.zeros((B, Hkv, T), jnp.float32))

    def with_full():
        out, inc_cache, inc_chunk = full_attention()
        pick = full[:, None, None]
        return jnp.where(pick[..., None], out, small), jnp.where(pick, inc_cache, 0.0), jnp.where(pick, inc_chunk, 0.0)

    return jax.lax.cond(jnp.any(full & (n > 0)), with_full, lambda: (small, *zeros))


def recycled_update(policy: P.Recycled, state, k, v, scores, n):
    """`update` for Recycled: appends the chunk to the full region; full rows then take the attention of
    their last query as the full region's scores, re-select the top_k copies and empty the new-tokens
    region; the other rows append their token to the new-tokens region."""
    B, T, H, _ = k.shape
    M, recent = recycled_regions(policy, state.capacity)
    since = _since_refresh(policy, state)
    full = full_step_rows(policy, since, T) & (n > 0)
    bi, hi = jnp.arange(B)[:, None, None], jnp.arange(H)[None, :, None]
    j = jnp.arange(T, dtype=jnp.int32)[None, :]
    ck, cv = jnp.swapaxes(k, 1, 2).astype(state.k.dtype), jnp.swapaxes(v, 1, 2).astype(state.v.dtype)
    chunk_pos = jnp.broadcast_to((state.seen[:, None] + j)[:, None, :], (B, H, T))
    chunk_score = jnp.where(full[:, None, None], scores.chunk, 0.0)

    def write(st, dest, score):
        dest = jnp.broadcast_to(dest[:, None, :], (B, H, T))
        put = lambda x, val: x.at[bi, hi, dest].set(val.astype(x.dtype), mode="drop")
        return dataclasses.replace(st, k=put(st.k, ck), v=put(st.v, cv), score=put(st.score, score),
                                   pos=put(st.pos, chunk_pos))

    fresh_scores = jnp.where(full[:, None, None] & (jnp.arange(state.capacity) < M), scores.cache, state.score)
    state = dataclasses.replace(state, score=fresh_scores)
    to_full = state.seen[:, None] + j
    state = write(state, jnp.where((j < n[:, None]) & (to_full < M), to_full, state.capacity), chunk_score)
    if T == 1:  # recycled rows also keep their token among the new ones
        state = write(state, jnp.where(~full & (n > 0), recent + since, state.capacity)[:, None], chunk_score)

    def reselect(st):
        held = (st.pos[..., :M] >= 0)
        pooled = pool(st.score[..., :M], held, policy.kernel, policy.pooling)
        top, idx = jax.lax.top_k(pooled, min(policy.top_k, M))  # lower slot first on ties
        missing = policy.top_k - idx.shape[-1]  # a full region smaller than top_k: pad with empty slots
        top = jnp.pad(top, ((0, 0), (0, 0), (0, missing)), constant_values=-jnp.inf)
        idx = jnp.pad(idx, ((0, 0), (0, 0), (0, missing)))
        chosen = top > -jnp.inf
        take = lambda x: jnp.take_along_axis(x, idx.reshape(*idx.shape, *(1,) * (x.ndim - 3)), axis=2)
        pick = full[:, None, None]
        region = slice(M, None)
        new_pos = jnp.concatenate([jnp.where(chosen, take(st.pos), -1), jnp.full((B, H, policy.refresh_every), -1)], -1)
        new_score = jnp.concatenate([take(st.score), jnp.zeros((B, H, policy.refresh_every), jnp.float32)], -1)
        new_k = jnp.concatenate([take(st.k), jnp.zeros_like(st.k[..., recent:, :])], -2)
        new_v = jnp.concatenate([take(st.v), jnp.zeros_like(st.v[..., recent:, :])], -2)
        return dataclasses.replace(
            st,
            k=st.k.at[..., region, :].set(jnp.where(pick[..., None], new_k, st.k[..., region, :])),
            v=st.v.at[..., region, :].set(jnp.where(pick[..., None], new_v, st.v[..., region, :])),
            score=st.score.at[..., region].set(jnp.where(pick, new_score, st.score[..., region])),
            pos=st.pos.at[..., region].set(jnp.where(pick, new_pos, st.pos[..., region])),
        )

    state = jax.lax.cond(jnp.any(full), reselect, lambda st: st, state)
    return dataclasses.replace(state, seen=state.seen + n)
