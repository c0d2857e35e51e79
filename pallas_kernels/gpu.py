"""Pallas-Triton (GPU) kernels: chunk attention with exact EMA-score increments, and decode.

Chunk (T > 1), three launches, all deterministic (no atomics):
  1. forward, one program per (row, query head, query block): flash attention over the cache slots
     then causally over the chunk, giving out and the final log-sum-exp per query;
  2. scores over the cache, one program per (row, KV head, key block): recomputes q.k for every query
     of the group, p = exp(q.k - lse) with the exact final normaliser, and accumulates the weighted
     column sums, reduced over the group (max or mean) — one extra QK^T pass, no second PV;
  3. the same over the chunk's own keys, causally.
Decode (T == 1): split-K over the cache with RoPE applied to the keys in the kernel (they are stored
un-rotated) from cos/sin tables computed once per call (shared by the heads of a row under cache-index
positions), writing each split's (v, lse) and the raw logits; a small XLA epilogue merges the splits
with the new token's own key and turns the logits into exact probabilities for the scores.

Every in-kernel shape is a power of two; lengths that are not multiples of a block are masked.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from . import states

LOG2E = math.log2(math.e)
MASK = -0.7 * float(np.finfo(np.float32).max)  # finite "minus infinity": keeps inf - inf out of the online softmax
F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class GpuConfig:
    """Tile sizes (powers of two >= 16) and Triton launch parameters."""

    block_q: int = 64  # queries per forward program
    block_k: int = 64  # keys per forward step
    score_block_q: int = 64  # queries per scores step
    score_block_k: int = 64  # keys per scores program
    decode_block_k: int = 64  # keys per decode step
    decode_programs: int = 256  # aim for about this many decode programs (split-K)
    num_warps: int = 4
    num_stages: int = 2
    decode_num_warps: int = 4
    decode_num_stages: int = 3  # H200: 0.49 / 0.97 of the copy bandwidth at batch 1 / 32 (RESULTS.md, kernels d)

    def params(self, decode: bool = False) -> plgpu.CompilerParams:
        if decode:
            return plgpu.CompilerParams(num_warps=self.decode_num_warps, num_stages=self.decode_num_stages)
        return plgpu.CompilerParams(num_warps=self.num_warps, num_stages=self.num_stages)


def _dot(a, b, trans_b=False):
    """f32 accumulate; full float32 precision for float32 operands (no TF32)."""
    precision = lax.Precision.HIGHEST if a.dtype == F32 else None
    return plgpu.dot(a, b, trans_b=trans_b, precision=precision)


def _block(n: int, preferred: int) -> int:
    return max(16, min(preferred, pl.next_power_of_2(n)))


# --------------------------------------------------------------------------------------------------
# Chunk forward.


def _forward_kernel(len_ref, q_ref, k_ref, v_ref, kc_ref, vc_ref, valid_ref, o_ref, lse_ref, *, T, S, bq, bk, scale):
    i = pl.program_id(2)
    rows = i * bq + jnp.arange(bq)
    in_chunk = rows < T
    row_ok = rows < len_ref[...]
    q = plgpu.load(q_ref, mask=in_chunk[:, None], other=0.0)
    qk_scale = scale * LOG2E

    def step(carry, k, v, allowed):
        acc, m, l = carry
        s = jnp.where(allowed, _dot(q, k, trans_b=True) * qk_scale, MASK)
        m_new = jnp.maximum(m, s.max(axis=1))
        corr = jnp.exp2(m - m_new)
        p = jnp.exp2(s - m_new[:, None])
        return corr[:, None] * acc + _dot(p.astype(v.dtype), v), m_new, corr * l + p.sum(axis=1)

    def load(keys_ref, values_ref, j, size):
        """Key block j (positions, K, V), rows past `size` masked to zero."""
        keys = j * bk + jnp.arange(bk)
        ok = (keys < size)[:, None]
        blk = pl.ds(j * bk, bk)
        return keys, plgpu.load(keys_ref.at[blk, :], mask=ok, other=0.0), plgpu.load(values_ref.at[blk, :], mask=ok, other=0.0)

    def cache_step(j, carry):
        keys, k, v = load(kc_ref, vc_ref, j, S)
        valid = plgpu.load(valid_ref.at[pl.ds(j * bk, bk)], mask=keys < S, other=0) != 0
        return step(carry, k, v, row_ok[:, None] & valid[None, :])

    def chunk_step(j, carry):
        keys, k, v = load(k_ref, v_ref, j, T)
        return step(carry, k, v, row_ok[:, None] & (keys[None, :] <= rows[:, None]))

    D = q.shape[-1]
    carry = (jnp.zeros((bq, D), F32), jnp.full((bq,), MASK, F32), jnp.zeros((bq,), F32))
    carry = lax.fori_loop(0, pl.cdiv(S, bk), cache_step, carry)
    last = jnp.minimum((i + 1) * bq, T)
    acc, m, l = lax.fori_loop(0, lax.div(last + bk - 1, bk), chunk_step, carry)
    out = jnp.where(row_ok[:, None], acc / l[:, None], 0.0)
    lse = jnp.where(row_ok, (m + jnp.log2(l)) / LOG2E, -jnp.inf)
    plgpu.store(o_ref, out.astype(o_ref.dtype), mask=in_chunk[:, None])
    plgpu.store(lse_ref, lse, mask=in_chunk)


def _forward(q, k, v, k_cache, v_cache, valid, lengths, cfg: GpuConfig, interpret: bool):
    B, T, Hq, D = q.shape
    Hkv, S = k.shape[2], k_cache.shape[2]
    G = Hq // Hkv
    bq, bk = _block(T, cfg.block_q), _block(max(S, T), cfg.block_k)
    kernel = functools.partial(_forward_kernel, T=T, S=S, bq=bq, bk=bk, scale=D**-0.5)
    chunk_spec = pl.BlockSpec((None, T, None, D), lambda b, h, i: (b, 0, h // G, 0))
    cache_spec = pl.BlockSpec((None, None, S, D), lambda b, h, i: (b, h // G, 0, 0))
    return pl.pallas_call(
        kernel,
        grid=(B, Hq, pl.cdiv(T, bq)),
        in_specs=[
            pl.BlockSpec((None,), lambda b, h, i: (b,)),
            pl.BlockSpec((None, bq, None, D), lambda b, h, i: (b, i, h, 0)),
            chunk_spec,
            chunk_spec,
            cache_spec,
            cache_spec,
            pl.BlockSpec((None, None, S), lambda b, h, i: (b, h // G, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, bq, None, D), lambda b, h, i: (b, i, h, 0)),
            pl.BlockSpec((None, None, bq), lambda b, h, i: (b, h, i)),
        ],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((B, Hq, T), F32)],
        compiler_params=cfg.params(),
        interpret=interpret,
        name="jcascade_chunk_forward",
    )(lengths, q, k, v, k_cache, v_cache, valid)


# --------------------------------------------------------------------------------------------------
# Scores: weighted column sums of the exact softmax, one program per key block.


def _scores_kernel(len_ref, q_ref, lse_ref, w_ref, key_ref, valid_ref, inc_ref, *, T, S, G, bq, bk, scale, causal, reduction):
    h, j = pl.program_id(1), pl.program_id(2)
    n = len_ref[...]
    keys = j * bk + jnp.arange(bk)
    in_range = keys < S
    k = plgpu.load(key_ref, mask=in_range[:, None], other=0.0)
    key_ok = in_range
    if valid_ref is not None:
        key_ok &= plgpu.load(valid_ref, mask=in_range, other=0) != 0
    qk_scale = scale * LOG2E
    first = (j * bk) // bq if causal else 0
    total = None
    for g in range(G):
        head = h * G + g

        def body(qb, acc, head=head):
            rows = qb * bq + jnp.arange(bq)
            in_chunk = rows < T
            blk = pl.ds(qb * bq, bq)
            q = plgpu.load(q_ref.at[blk, head, :], mask=in_chunk[:, None], other=0.0)
            lse = plgpu.load(lse_ref.at[head, blk], mask=in_chunk, other=0.0)
            w = plgpu.load(w_ref.at[blk], mask=in_chunk, other=0.0)
            allowed = (rows < n)[:, None] & key_ok[None, :]
            if causal:
                allowed &= keys[None, :] <= rows[:, None]
            s = _dot(q, k, trans_b=True) * qk_scale
            return acc + jnp.where(allowed, jnp.exp2(s - (lse * LOG2E)[:, None]) * w[:, None], 0.0)

        # Accumulate [bq, bk] elementwise; one reduction over the rows per head, not one per step.
        colsum = lax.fori_loop(first, pl.cdiv(T, bq), body, jnp.zeros((bq, bk), F32)).sum(axis=0)
        if total is None:
            total = colsum
        elif reduction == "max":
            total = jnp.maximum(total, colsum)
        else:
            total = total + colsum
    if reduction == "mean":
        total = total / G
    plgpu.store(inc_ref, total, mask=in_range)


def _scores(q, lse, weights, lengths, keys, valid, *, causal: bool, reduction: str, cfg: GpuConfig, interpret: bool):
    """Increments of `keys` (cache [B, Hkv, S, D] with valid, or the chunk's own [B, T, Hkv, D])."""
    B, T, Hq, D = q.shape
    Hkv, S = (keys.shape[2], T) if causal else (keys.shape[1], keys.shape[2])
    G = Hq // Hkv
    bq, bk = _block(T, cfg.score_block_q), _block(S, cfg.score_block_k)
    if causal:
        key_spec = pl.BlockSpec((None, bk, None, D), lambda b, h, j: (b, j, h, 0))
    else:
        key_spec = pl.BlockSpec((None, None, bk, D), lambda b, h, j: (b, h, j, 0))
    in_specs = [
        pl.BlockSpec((None,), lambda b, h, j: (b,)),
        pl.BlockSpec((None, T, Hq, D), lambda b, h, j: (b, 0, 0, 0)),
        pl.BlockSpec((None, Hq, T), lambda b, h, j: (b, 0, 0)),
        pl.BlockSpec((None, T), lambda b, h, j: (b, 0)),
        key_spec,
    ]
    args = [lengths, q, lse, weights, keys]
    if valid is not None:
        in_specs.append(pl.BlockSpec((None, None, bk), lambda b, h, j: (b, h, j)))
        args.append(valid)
    kernel = functools.partial(
        _scores_kernel if valid is not None else functools.partial(_no_valid, _scores_kernel),
        T=T, S=S, G=G, bq=bq, bk=bk, scale=D**-0.5, causal=causal, reduction=reduction,
    )
    return pl.pallas_call(
        kernel,
        grid=(B, Hkv, pl.cdiv(S, bk)),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, None, bk), lambda b, h, j: (b, h, j)),
        out_shape=jax.ShapeDtypeStruct((B, Hkv, S), F32),
        compiler_params=cfg.params(),
        interpret=interpret,
        name="jcascade_chunk_scores",
    )(*args)


def _no_valid(kernel, len_ref, q_ref, lse_ref, w_ref, key_ref, inc_ref, **kw):
    return kernel(len_ref, q_ref, lse_ref, w_ref, key_ref, None, inc_ref, **kw)


# --------------------------------------------------------------------------------------------------
# Decode: split-K over the cache, keys rotated in the kernel.


def _layer_of(cache: jax.Array, layer) -> jax.Array:
    """[B, Hkv, S, D]: `cache` itself, or its layer `layer` when it is a stack [L, B, Hkv, S, D]."""
    return cache if layer is None else cache[layer]


def _scalar(x) -> jax.Array:
    """int32 [1], for an index read inside a kernel."""
    return jnp.reshape(x, (1,)).astype(jnp.int32)


def _decode_kernel(layer_ref, len_ref, q_ref, kc_ref, vc_ref, valid_ref, cos_ref, sin_ref, o_ref, lse_ref, logits_ref,
                   *, S, G, split, bk, scale, rope):
    """kc_ref, vc_ref: the whole stack [L, B, Hkv, S, D]; this program reads (layer, row, head)."""
    layer, b, h, s_idx = layer_ref[0], pl.program_id(0), pl.program_id(1), pl.program_id(2)
    has_query = len_ref[...] > 0
    gp, D = q_ref.shape
    half = D // 2
    rows_ok = jnp.arange(gp) < G
    if rope:
        q1, q2 = q_ref[:, pl.ds(0, half)], q_ref[:, pl.ds(half, half)]
    else:
        q = q_ref[...]
    start = s_idx * split

    def body(j, carry):
        acc, m, l = carry
        off = start + j * bk
        keys = off + jnp.arange(bk)
        ok = keys < S
        blk = pl.ds(off, bk)
        allowed = (plgpu.load(valid_ref.at[blk], mask=ok, other=0) != 0) & ok & has_query
        if rope:  # rotate-half with the call's cos/sin tables: no transcendental in the loop
            k1 = plgpu.load(kc_ref.at[layer, b, h, blk, pl.ds(0, half)], mask=ok[:, None], other=0.0).astype(F32)
            k2 = plgpu.load(kc_ref.at[layer, b, h, blk, pl.ds(half, half)], mask=ok[:, None], other=0.0).astype(F32)
            cos = plgpu.load(cos_ref.at[blk, :], mask=ok[:, None], other=0.0).astype(F32)
            sin = plgpu.load(sin_ref.at[blk, :], mask=ok[:, None], other=0.0).astype(F32)
            r1, r2 = (k1 * cos - k2 * sin).astype(q_ref.dtype), (k2 * cos + k1 * sin).astype(q_ref.dtype)
            s = _dot(q1, r1, trans_b=True) + _dot(q2, r2, trans_b=True)
        else:
            k = plgpu.load(kc_ref.at[layer, b, h, blk, :], mask=ok[:, None], other=0.0)
            s = _dot(q, k, trans_b=True)
        s = jnp.where(allowed[None, :], s * scale, MASK)
        if logits_ref is not None:
            plgpu.store(logits_ref.at[:, blk], s, mask=rows_ok[:, None] & ok[None, :])
        s2 = jnp.where(allowed[None, :], s * LOG2E, MASK)
        m_new = jnp.maximum(m, s2.max(axis=1))
        corr = jnp.exp2(m - m_new)
        p = jnp.exp2(s2 - m_new[:, None])
        v = plgpu.load(vc_ref.at[layer, b, h, blk, :], mask=ok[:, None], other=0.0)
        return corr[:, None] * acc + _dot(p.astype(v.dtype), v), m_new, corr * l + p.sum(axis=1)

    init = (jnp.zeros((gp, D), F32), jnp.full((gp,), MASK, F32), jnp.zeros((gp,), F32))
    acc, m, l = lax.fori_loop(0, split // bk, body, init)
    seen_any = ~(m <= 0.5 * MASK)  # NaN counts as seen: it propagates
    o_ref[...] = jnp.where(seen_any[:, None], acc / l[:, None], 0.0)
    lse_ref[...] = jnp.where(seen_any, (m + jnp.log2(l)) / LOG2E, -jnp.inf)


def fuses_rope(rope) -> bool:
    """Whether the kernels rotate cached keys themselves: when `rope` has `inv_freq(head_dim)` (as
    `jcascade.RoPE`), it is taken to rotate the pairs (x[i], x[i + D/2]) by position * inv_freq[i] (the
    rotate-half convention). Any other callable rotates the keys outside the kernel."""
    return callable(getattr(rope, "inv_freq", None))


def rope_tables(rope, positions: jax.Array, head_dim: int, dtype) -> tuple[jax.Array, jax.Array]:
    """cos, sin [..., head_dim // 2] at integer positions (angle = position * rope.inv_freq(head_dim), in float32),
    in `dtype`."""
    angle = positions.astype(F32)[..., None] * jnp.asarray(rope.inv_freq(head_dim))
    return jnp.cos(angle).astype(dtype), jnp.sin(angle).astype(dtype)


def _decode(q, k, v, k_cache, v_cache, cache_valid, cache_positions, lengths, weights, reduction, rope, layer, cfg,
            interpret):
    """T == 1. q, k already rotated; cache keys rotated in the kernel when `fuses_rope(rope)`. k_cache, v_cache
    [B, Hkv, S, D], or a stack [L, B, Hkv, S, D] read in place at `layer`."""
    B, _, Hq, D = q.shape
    Hkv, S = k.shape[2], k_cache.shape[-2]
    G = Hq // Hkv
    fuse = fuses_rope(rope)
    if rope is not None and not fuse:
        k_cache, v_cache, layer = rope(_layer_of(k_cache, layer), cache_positions)[None], _layer_of(v_cache, layer)[None], 0
    elif layer is None:
        k_cache, v_cache, layer = k_cache[None], v_cache[None], 0
    gp = max(16, pl.next_power_of_2(G))
    bk = _block(S, cfg.decode_block_k)
    splits = int(np.clip(cfg.decode_programs // (B * Hkv), 1, pl.cdiv(S, bk)))
    split = pl.cdiv(pl.cdiv(S, splits), bk) * bk
    splits = pl.cdiv(S, split)
    qg = jnp.pad(q.reshape(B, Hkv, G, D), ((0, 0), (0, 0), (0, gp - G), (0, 0)))
    table_dtype = F32 if k_cache.dtype == F32 else k_cache.dtype
    if fuse:
        cos, sin = rope_tables(rope, cache_positions, D, table_dtype)  # [B, 1 or Hkv, S, D/2]
    else:
        cos = sin = jnp.zeros((B, 1, S, D // 2), table_dtype)
    table_heads = cos.shape[1]
    want_logits = weights is not None
    kernel = functools.partial(
        _decode_kernel if want_logits else functools.partial(_no_logits, _decode_kernel),
        S=S, G=G, split=split, bk=bk, scale=D**-0.5, rope=fuse,
    )
    full = lambda b, h, s: (b, h, 0, 0)
    out_specs = [
        pl.BlockSpec((None, None, None, gp, D), lambda b, h, s: (b, h, s, 0, 0)),
        pl.BlockSpec((None, None, None, gp), lambda b, h, s: (b, h, s, 0)),
    ]
    out_shape = [jax.ShapeDtypeStruct((B, Hkv, splits, gp, D), F32), jax.ShapeDtypeStruct((B, Hkv, splits, gp), F32)]
    if want_logits:
        out_specs.append(pl.BlockSpec((None, None, gp, S), full))
        out_shape.append(jax.ShapeDtypeStruct((B, Hkv, gp, S), F32))
    outs = pl.pallas_call(
        kernel,
        grid=(B, Hkv, splits),
        in_specs=[
            pl.BlockSpec(),
            pl.BlockSpec((None,), lambda b, h, s: (b,)),
            pl.BlockSpec((None, None, gp, D), full),
            pl.BlockSpec(),  # the whole stack: each program addresses its own (layer, row, head)
            pl.BlockSpec(),
            pl.BlockSpec((None, None, S), lambda b, h, s: (b, h, 0)),
            pl.BlockSpec((None, None, S, D // 2), lambda b, h, s: (b, h if table_heads > 1 else 0, 0, 0)),
            pl.BlockSpec((None, None, S, D // 2), lambda b, h, s: (b, h if table_heads > 1 else 0, 0, 0)),
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=cfg.params(decode=True),
        interpret=interpret,
        name="jcascade_decode",
    )(_scalar(layer), lengths, qg, k_cache, v_cache, cache_valid.astype(jnp.int32), cos, sin)
    o_parts, lse_parts = outs[0][..., :G, :], outs[1][..., :G]  # [B, Hkv, P, G, (D)]

    # Epilogue: the new token's own key, then every split, merged exactly.
    qf = q.reshape(B, Hkv, G, D).astype(F32)
    self_logit = jnp.sum(qf * k[:, 0, :, None, :].astype(F32), axis=-1) * D**-0.5  # a fused reduction, not a GEMM launch
    self_logit = jnp.where((lengths > 0)[:, None, None], self_logit, -jnp.inf)
    self_v = jnp.broadcast_to(v[:, 0, :, None, :].astype(F32), (B, Hkv, G, D))
    v_all = jnp.concatenate([o_parts, self_v[:, :, None]], axis=2)
    lse_all = jnp.concatenate([lse_parts, self_logit[:, :, None]], axis=2)
    out, lse = states.merge_all(v_all, lse_all, axis=2)  # [B, Hkv, G, D], [B, Hkv, G]
    out = out.reshape(B, 1, Hq, D).astype(q.dtype)
    lse_out = lse.reshape(B, Hq, 1)
    if not want_logits:
        return out, lse_out, None, None
    logits = outs[2][:, :, :G]  # [B, Hkv, G, S]
    held = ~jnp.isneginf(lse)  # NaN stays NaN
    safe = jnp.where(held, lse, 0.0)[..., None]
    w0 = weights[:, 0][:, None, None, None]
    masked = logits <= 0.5 * MASK  # a NaN logit (a NaN key) is not masked: its slot's score is NaN, as in the reference
    p_cache = jnp.where(held[..., None] & ~masked, jnp.exp(logits - safe), 0.0) * w0
    p_self = jnp.where(held, jnp.exp(self_logit - safe[..., 0]), 0.0) * w0[..., 0]
    reduce = jnp.max if reduction == "max" else jnp.mean
    return out, lse_out, reduce(p_cache, axis=2), reduce(p_self, axis=2)[..., None]


def _no_logits(kernel, layer_ref, len_ref, q_ref, kc_ref, vc_ref, valid_ref, cos_ref, sin_ref, o_ref, lse_ref, **kw):
    return kernel(layer_ref, len_ref, q_ref, kc_ref, vc_ref, valid_ref, cos_ref, sin_ref, o_ref, lse_ref, None, **kw)


# --------------------------------------------------------------------------------------------------
# Shared prefix: the decode kernel with many queries per KV head, each prefix K/V tile read once for all.


def prefix_attention(q, k_cache, v_cache, cache_valid, cache_positions, rope, *, config: GpuConfig = GpuConfig(),
                     interpret: bool = False):
    """Same contract as `reference.prefix_attention`: grid (prefix row, KV head, split, query block), so
    every query of a prefix row's requests shares the loads of each key block of its split."""
    P, R, Hq, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    fuse = fuses_rope(rope)
    if rope is not None and not fuse:
        k_cache = rope(k_cache, cache_positions)
    rows = R * G
    bq = _block(rows, config.block_q)
    q_blocks = pl.cdiv(rows, bq)
    bk = _block(S, config.decode_block_k)
    splits = int(np.clip(config.decode_programs // (P * Hkv * q_blocks), 1, pl.cdiv(S, bk)))
    split = pl.cdiv(pl.cdiv(S, splits), bk) * bk
    splits = pl.cdiv(S, split)
    qg = q.reshape(P, R, Hkv, G, D).transpose(0, 2, 1, 3, 4).reshape(P, Hkv, rows, D)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, q_blocks * bq - rows), (0, 0)))
    table_dtype = F32 if k_cache.dtype == F32 else k_cache.dtype
    if fuse:
        cos, sin = rope_tables(rope, cache_positions, D, table_dtype)
    else:
        cos = sin = jnp.zeros((P, 1, S, D // 2), table_dtype)
    table_heads = cos.shape[1]
    kernel = functools.partial(_no_logits, _decode_kernel, S=S, G=bq, split=split, bk=bk, scale=D**-0.5,
                               rope=fuse)
    full = lambda p, h, s, i: (p, h, 0, 0)
    table = lambda p, h, s, i: (p, h if table_heads > 1 else 0, 0, 0)
    o_parts, lse_parts = pl.pallas_call(
        kernel,
        grid=(P, Hkv, splits, q_blocks),
        in_specs=[
            pl.BlockSpec(),
            pl.BlockSpec((None,), lambda p, h, s, i: (p,)),
            pl.BlockSpec((None, None, bq, D), lambda p, h, s, i: (p, h, i, 0)),
            pl.BlockSpec(),
            pl.BlockSpec(),
            pl.BlockSpec((None, None, S), lambda p, h, s, i: (p, h, 0)),
            pl.BlockSpec((None, None, S, D // 2), table),
            pl.BlockSpec((None, None, S, D // 2), table),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, bq, D), lambda p, h, s, i: (p, h, s, i, 0)),
            pl.BlockSpec((None, None, None, bq), lambda p, h, s, i: (p, h, s, i)),
        ],
        out_shape=[jax.ShapeDtypeStruct((P, Hkv, splits, q_blocks * bq, D), F32),
                   jax.ShapeDtypeStruct((P, Hkv, splits, q_blocks * bq), F32)],
        compiler_params=config.params(decode=True),
        interpret=interpret,
        name="jcascade_shared_prefix",
    )(_scalar(0), jnp.ones((P,), jnp.int32), qg, k_cache[None], v_cache[None], cache_valid.astype(jnp.int32), cos, sin)
    out, lse = states.merge_all(o_parts[..., :rows, :], lse_parts[..., :rows], axis=2)  # [P, Hkv, rows, (D)]
    out = out.reshape(P, Hkv, R, G, D).transpose(0, 2, 1, 3, 4).reshape(P, R, Hq, D)
    return out, lse.reshape(P, Hkv, R, G).transpose(0, 2, 1, 3).reshape(P, R, Hq)


# --------------------------------------------------------------------------------------------------


def chunk_attention(q, k, v, k_cache, v_cache, cache_valid, cache_positions, lengths, query_weights=None,
                    head_reduction="max", rope=None, layer=None, *, config: GpuConfig = GpuConfig(),
                    interpret: bool = False):
    """Same contract as `reference.chunk_attention`, on Pallas-Triton. The decode kernel reads a stacked
    cache in place at `layer`; a chunk's kernels take that layer's copy."""
    if q.shape[1] == 1:
        return _decode(q, k, v, k_cache, v_cache, cache_valid, cache_positions, lengths, query_weights,
                       head_reduction, rope, layer, config, interpret)
    k_cache, v_cache = _layer_of(k_cache, layer), _layer_of(v_cache, layer)
    if rope is not None:
        k_cache = rope(k_cache, cache_positions)
    valid = cache_valid.astype(jnp.int32)
    out, lse = _forward(q, k, v, k_cache, v_cache, valid, lengths, config, interpret)
    if query_weights is None:
        return out, lse, None, None
    weights = query_weights.astype(F32)
    common = dict(reduction=head_reduction, cfg=config, interpret=interpret)
    inc_cache = _scores(q, lse, weights, lengths, k_cache, valid, causal=False, **common)
    inc_chunk = _scores(q, lse, weights, lengths, k, None, causal=True, **common)
    return out, lse, inc_cache, inc_chunk
