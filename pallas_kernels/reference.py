"""Plain-XLA reference of chunk attention with EMA-score increments (docs/semantics.md §3, §7).

Exact and simple: it materialises the [T, S] logits, so it is meant for tests, the CPU and small
shapes; the Pallas kernels compute the same function blockwise.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST


def chunk_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    cache_valid: jax.Array,
    cache_positions: jax.Array,
    lengths: jax.Array,
    query_weights: jax.Array | None = None,
    head_reduction: str = "max",
    rope=None,
):
    """Queries of a chunk against [cached keys | chunk keys], GQA without repeating K/V.

    q: [B, T, Hq, D] and k, v: [B, T, Hkv, D], the chunk (q and k already rotated);
    k_cache, v_cache: [B, Hkv, S, D] un-rotated; cache_valid: bool [B, Hkv, S];
    cache_positions: int32 [B, Hkv or 1, S] RoPE positions of the cached keys (used when rope is given);
    lengths: int32 [B] valid queries per row. Query i sees every valid cached key and chunk keys
    j <= i; queries i >= lengths[b] see nothing and give zeros. Scale 1/sqrt(D).

    query_weights: f32 [B, T] or None. With weights w, the increment of key s for KV head h is
    reduce_{g in group h} sum_i w[i] * p[g, i, s] (reduce = max or mean), p the exact softmax.

    Returns out [B, T, Hq, D] (q.dtype), lse f32 [B, Hq, T] (natural log, -inf for empty rows),
    inc_cache f32 [B, Hkv, S] and inc_chunk f32 [B, Hkv, T] (both None without weights).
    """
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    f32 = jnp.float32
    if rope is not None:
        k_cache = rope(k_cache, cache_positions)
    qg = q.reshape(B, T, Hkv, G, D).astype(f32) * (D**-0.5)
    s_cache = jnp.einsum("bthgd,bhsd->bhgts", qg, k_cache.astype(f32), precision=HIGHEST)
    s_chunk = jnp.einsum("bthgd,bjhd->bhgtj", qg, k.astype(f32), precision=HIGHEST)
    valid_q = jnp.arange(T)[None, :] < lengths[:, None]  # [B, T]
    rows = valid_q[:, None, None, :, None]
    causal = jnp.arange(T)[None, :] <= jnp.arange(T)[:, None]  # [i, j]
    s_cache = jnp.where(rows & cache_valid[:, :, None, None, :], s_cache, -jnp.inf)
    s_chunk = jnp.where(rows & causal, s_chunk, -jnp.inf)
    m = jnp.maximum(s_cache.max(-1, initial=-jnp.inf), s_chunk.max(-1))
    m = jnp.where(jnp.isneginf(m), 0.0, m)[..., None]  # NaN stays NaN: a non-finite key poisons its query
    e_cache, e_chunk = jnp.exp(s_cache - m), jnp.exp(s_chunk - m)
    denom = e_cache.sum(-1, keepdims=True) + e_chunk.sum(-1, keepdims=True)
    empty = denom == 0
    safe = jnp.where(empty, 1.0, denom)
    p_cache = jnp.where(empty, 0.0, e_cache / safe)
    p_chunk = jnp.where(empty, 0.0, e_chunk / safe)
    out = jnp.einsum("bhgts,bhsd->bthgd", p_cache, v_cache.astype(f32), precision=HIGHEST)
    out = out + jnp.einsum("bhgtj,bjhd->bthgd", p_chunk, v.astype(f32), precision=HIGHEST)
    lse = jnp.where(empty, -jnp.inf, m + jnp.log(safe))[..., 0].reshape(B, Hq, T)
    out = out.reshape(B, T, Hq, D).astype(q.dtype)
    if query_weights is None:
        return out, lse, None, None
    w = query_weights.astype(f32)
    reduce = jnp.max if head_reduction == "max" else jnp.mean
    inc_cache = reduce(jnp.einsum("bhgts,bt->bhgs", p_cache, w, precision=HIGHEST), axis=2)
    inc_chunk = reduce(jnp.einsum("bhgtj,bt->bhgj", p_chunk, w, precision=HIGHEST), axis=2)
    return out, lse, inc_cache, inc_chunk


def prefix_attention(q, k_cache, v_cache, cache_valid, cache_positions, rope=None):
    """Queries of many requests against the prefix they share, with no causal part (docs/semantics.md §6).

    q: [P, R, Hq, D] already rotated, the R queries served by each of the P prefix rows;
    k_cache, v_cache: [P, Hkv, S, D] un-rotated; cache_valid: bool [P, Hkv, S];
    cache_positions: int32 [P, Hkv or 1, S] (used when rope is given).
    Returns out f32 [P, R, Hq, D] and lse f32 [P, R, Hq] (natural log, -inf when no key is valid).
    """
    P, R, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    f32 = jnp.float32
    if rope is not None:
        k_cache = rope(k_cache, cache_positions)
    qg = q.reshape(P, R, Hkv, Hq // Hkv, D).astype(f32) * (D**-0.5)
    s = jnp.einsum("prhgd,phsd->phgrs", qg, k_cache.astype(f32), precision=HIGHEST)
    s = jnp.where(cache_valid[:, :, None, None, :], s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    empty = jnp.isneginf(lse)
    p = jnp.where(empty[..., None], 0.0, jnp.exp(s - jnp.where(empty, 0.0, lse)[..., None]))
    out = jnp.einsum("phgrs,phsd->prhgd", p, v_cache.astype(f32), precision=HIGHEST)
    return out.reshape(P, R, Hq, D), lse.transpose(0, 3, 1, 2).reshape(P, R, Hq)
