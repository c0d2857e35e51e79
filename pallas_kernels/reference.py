"""Plain-XLA reference of chunk attention with EMA-score increments (docs/semantics.md §3, §7).

Exact and simple: `chunk_attention` materialises the [T, S] logits, so it is meant for tests and small shapes;
`chunk_attention_blocked`, the CPU's XLA path, takes the queries a block at a time, and the Pallas kernels
compute the same function blockwise.
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
    if rope is not None:
        k_cache = rope(k_cache, cache_positions)
    qg = q.reshape(B, T, Hkv, Hq // Hkv, D).astype(jnp.float32) * (D**-0.5)
    w = None if query_weights is None else query_weights.astype(jnp.float32)
    out, lse, sum_cache, sum_chunk = _block(qg, 0, k, v, k_cache, v_cache, cache_valid, lengths, w)
    out = out.reshape(B, T, Hq, D).astype(q.dtype)
    if query_weights is None:
        return out, lse.reshape(B, Hq, T), None, None
    reduce = jnp.max if head_reduction == "max" else jnp.mean
    return out, lse.reshape(B, Hq, T), reduce(sum_cache, axis=2), reduce(sum_chunk, axis=2)


def _block(qg, first, k, v, k_cache, v_cache, cache_valid, lengths, w):
    """Queries first .. first + Tb - 1 of a chunk (qg [B, Tb, Hkv, G, D], scaled f32) against the cache and the
    chunk's keys (`chunk_attention`'s k, v, k_cache rotated, v_cache, cache_valid, lengths; w f32 [B, T] or None).
    Returns out f32 [B, Tb, Hkv, G, D], lse [B, Hkv, G, Tb] and, with w, the query-weighted softmax sums of each
    query head before the head reduction: f32 [B, Hkv, G, S] and [B, Hkv, G, T] (else None)."""
    B, Tb = qg.shape[:2]
    T = k.shape[1]
    f32 = jnp.float32
    s_cache = jnp.einsum("bthgd,bhsd->bhgts", qg, k_cache.astype(f32), precision=HIGHEST)
    s_chunk = jnp.einsum("bthgd,bjhd->bhgtj", qg, k.astype(f32), precision=HIGHEST)
    index = first + jnp.arange(Tb)  # the block's queries' places in the chunk
    rows = (index[None, :] < lengths[:, None])[:, None, None, :, None]  # [B, 1, 1, Tb, 1]
    causal = jnp.arange(T)[None, :] <= index[:, None]  # [Tb, T]
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
    lse = jnp.where(empty, -jnp.inf, m + jnp.log(safe))[..., 0]
    if w is None:
        return out, lse, None, None
    wb = w if isinstance(first, int) else jax.lax.dynamic_slice_in_dim(w, first, Tb, axis=1)
    return (
        out,
        lse,
        jnp.einsum("bhgts,bt->bhgs", p_cache, wb, precision=HIGHEST),
        jnp.einsum("bhgtj,bt->bhgj", p_chunk, wb, precision=HIGHEST),
    )


def chunk_attention_blocked(
    q,
    k,
    v,
    k_cache,
    v_cache,
    cache_valid,
    cache_positions,
    lengths,
    query_weights=None,
    head_reduction: str = "max",
    rope=None,
    *,
    block: int,
):
    """`chunk_attention` over blocks of `block` queries in turn (a `lax.scan`; the last block padded), so that
    no more than [B, Hq, block, S + T] logits are alive at once: the XLA path of the CPU, whose chunks of a few
    thousand tokens would otherwise materialise every query's logits (gigabytes at a 4K stride). Equal to
    `chunk_attention` up to the order of the sums of the score increments."""
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    if block >= T:
        return chunk_attention(
            q, k, v, k_cache, v_cache, cache_valid, cache_positions, lengths, query_weights, head_reduction, rope
        )
    if rope is not None:
        k_cache = rope(k_cache, cache_positions)
    blocks = -(-T // block)
    qg = q.reshape(B, T, Hkv, Hq // Hkv, D).astype(jnp.float32) * (D**-0.5)
    qg = jnp.pad(qg, ((0, 0), (0, blocks * block - T), (0, 0), (0, 0), (0, 0)))  # padded queries see nothing
    w = None if query_weights is None else jnp.pad(query_weights.astype(jnp.float32), ((0, 0), (0, block)))
    sums = (
        None
        if w is None
        else (
            jnp.zeros((B, Hkv, Hq // Hkv, k_cache.shape[2]), jnp.float32),
            jnp.zeros((B, Hkv, Hq // Hkv, T), jnp.float32),
        )
    )

    def step(carry, i):
        qb = jax.lax.dynamic_slice_in_dim(qg, i * block, block, axis=1)
        out, lse, sum_cache, sum_chunk = _block(qb, i * block, k, v, k_cache, v_cache, cache_valid, lengths, w)
        carry = None if carry is None else (carry[0] + sum_cache, carry[1] + sum_chunk)
        return carry, (out, lse)

    sums, (out, lse) = jax.lax.scan(step, sums, jnp.arange(blocks, dtype=jnp.int32))
    out = out.transpose(1, 0, 2, 3, 4, 5).reshape(B, blocks * block, Hq, D)[:, :T].astype(q.dtype)
    lse = lse.transpose(1, 2, 3, 0, 4).reshape(B, Hq, blocks * block)[..., :T]
    if query_weights is None:
        return out, lse, None, None
    reduce = jnp.max if head_reduction == "max" else jnp.mean
    return out, lse, reduce(sums[0], axis=2), reduce(sums[1], axis=2)


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
