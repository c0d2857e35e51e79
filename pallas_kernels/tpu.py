"""Pallas-Mosaic (TPU) kernels: chunk attention with exact EMA-score increments (decode is T = 1).

TPU has no atomics, so everything accumulates along "arbitrary" grid axes, which also makes the
results deterministic:
  1. a segment kernel, grid (row, KV head, query block, key block), runs the online softmax of all the
     group's query heads over one key segment; it runs once over the cache slots (with validity) and
     once causally over the chunk's keys, and the two (v, lse) states are merged exactly;
  2. a scores kernel, grid (row, KV head, key block, query block), recomputes q.k against the final
     lse and accumulates the weighted column sums of the group in VMEM, then reduces them (max/mean).
Keys are rotated by XLA before the kernels (a quantized cache's keys dequantized in the same pass); a quantized
cache's values are read as codes, converted to q's dtype in the segment kernel, their scales applied to the
probabilities. Blocks at the ends of the arrays may be partial: their out-of-range rows are masked (values) or
dropped (writes).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import attention_state
from .storage import Stored
from .tuning import check_fields

MASK = -0.7 * float(np.finfo(np.float32).max)
F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class TpuConfig:
    """Block sizes, positive multiples of 8 (a TPU's sublanes); on a TPU, multiples of 128 (its lanes) unless the
    chunk or the cache is smaller than the block (interpret mode on the CPU takes any)."""

    block_q: int = 256
    block_k: int = 512

    def __post_init__(self):
        check_fields(
            self, ("block_q", "block_k"), "a positive multiple of 8", lambda value: value >= 8 and value % 8 == 0
        )


def _blocks(T: int, S: int, cfg: TpuConfig) -> tuple[int, int]:
    return (T if T <= cfg.block_q else cfg.block_q), (S if S <= cfg.block_k else cfg.block_k)


def _overlaps(i, j, bq, bk, causal):
    """Whether query block i sees any key of block j (always, unless causal and above the diagonal)."""
    return j * bk <= i * bq + bq - 1 if causal else True


def _allowed(G, bq, bk, i, j, n, T, S, causal, valid_ref):
    """bool (G, bq, bk): query i sees key j (valid query, key in range, causal or valid slot)."""
    qpos = i * bq + lax.broadcasted_iota(jnp.int32, (G, bq, bk), 1)
    kpos = j * bk + lax.broadcasted_iota(jnp.int32, (G, bq, bk), 2)
    allowed = (qpos < n) & (qpos < T) & (kpos < S)
    return allowed & (kpos <= qpos) if causal else allowed & (valid_ref[...][None] != 0)


def _qk(q_ref, k_ref, scale):
    G, bq, D = q_ref.shape
    q, k = q_ref[...].reshape(G * bq, D), k_ref[...]
    if k.shape[0] < 8:  # a decode step's own key: Mosaic's matrix-vector lowering wants float32 operands
        q, k = q.astype(F32), k.astype(F32)
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=F32)
    return (s * scale).reshape(G, bq, k_ref.shape[0])


def _segment_kernel(len_ref, q_ref, k_ref, v_ref, *refs, causal, T, S, scale, scaled):
    valid_ref = None if causal else refs[0]
    vs_ref = refs[0 if causal else 1] if scaled else None
    o_ref, lse_ref, m_sc, l_sc, acc_sc = refs[-5:]
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    G, bq, D = q_ref.shape
    bk = k_ref.shape[0]

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, MASK, F32)
        l_sc[...] = jnp.zeros(l_sc.shape, F32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, F32)

    @pl.when(_overlaps(i, j, bq, bk, causal))
    def _compute():
        allowed = _allowed(G, bq, bk, i, j, len_ref[b], T, S, causal, valid_ref)
        s = jnp.where(allowed, _qk(q_ref, k_ref, scale), MASK).reshape(G * bq, bk)
        key_in_range = j * bk + lax.broadcasted_iota(jnp.int32, (bk, D), 0) < S
        v = jnp.where(key_in_range, v_ref[...], jnp.zeros((), v_ref.dtype))
        m_prev = m_sc[...]
        m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
        corr = jnp.exp(m_prev - m_new)
        p = jnp.exp(s - m_new)
        l_sc[...] = corr * l_sc[...] + p.sum(axis=1, keepdims=True)
        if scaled:  # value codes: exact in q's dtype, each value's scale on its probabilities
            in_range = j * bk + lax.broadcasted_iota(jnp.int32, (1, bk), 1) < S
            p, v = p * jnp.where(in_range, vs_ref[...], 0.0), v.astype(q_ref.dtype)
        acc_sc[...] = corr * acc_sc[...] + jnp.dot(p.astype(v.dtype), v, preferred_element_type=F32)
        m_sc[...] = m_new

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        m, l = m_sc[...], l_sc[...]
        seen_any = ~(m <= 0.5 * MASK)  # NaN counts as seen: it propagates
        o_ref[...] = jnp.where(seen_any, acc_sc[...] / l, 0.0).reshape(G, bq, D)
        lse_ref[...] = jnp.where(seen_any, m + jnp.log(l), -jnp.inf).reshape(G, bq)


def _segment(q, keys, values: Stored, valid, lengths, *, causal, cfg, interpret):
    """Online softmax of q [B, Hkv, G, T, D] over keys [B, Hkv, S, D] and values (`Stored` [B, Hkv, S, D]: floats,
    or codes with their scales) -> o f32, lse f32."""
    B, Hkv, G, T, D = q.shape
    S = keys.shape[2]
    bq, bk = _blocks(T, S, cfg)
    in_specs = [
        pl.BlockSpec((None, None, G, bq, D), lambda b, h, i, j, n: (b, h, 0, i, 0)),
        pl.BlockSpec((None, None, bk, D), lambda b, h, i, j, n: (b, h, j, 0)),
        pl.BlockSpec((None, None, bk, D), lambda b, h, i, j, n: (b, h, j, 0)),
    ]
    args = [q, keys, values.data]
    scales = [values.scale[:, :, None, :]] if values.quantized else []
    for per_slot in [valid] * (not causal) + scales:
        in_specs.append(pl.BlockSpec((None, None, 1, bk), lambda b, h, i, j, n: (b, h, 0, j)))
        args.append(per_slot)
    return pl.pallas_call(
        functools.partial(_segment_kernel, causal=causal, T=T, S=S, scale=D**-0.5, scaled=values.quantized),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(B, Hkv, pl.cdiv(T, bq), pl.cdiv(S, bk)),
            in_specs=in_specs,
            out_specs=[
                pl.BlockSpec((None, None, G, bq, D), lambda b, h, i, j, n: (b, h, 0, i, 0)),
                pl.BlockSpec((None, None, G, bq), lambda b, h, i, j, n: (b, h, 0, i)),
            ],
            scratch_shapes=[pltpu.VMEM((G * bq, 1), F32), pltpu.VMEM((G * bq, 1), F32), pltpu.VMEM((G * bq, D), F32)],
        ),
        out_shape=[jax.ShapeDtypeStruct((B, Hkv, G, T, D), F32), jax.ShapeDtypeStruct((B, Hkv, G, T), F32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="jcascade_segment_attention",
    )(lengths, *args)


def _scores_kernel(len_ref, q_ref, lse_ref, w_ref, k_ref, *refs, causal, T, S, scale, reduction):
    valid_ref = None if causal else refs[0]
    inc_ref, colsum_sc = refs[-2:]
    b, j, i = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    G, bq, _ = q_ref.shape
    bk = k_ref.shape[0]

    @pl.when(i == 0)
    def _init():
        colsum_sc[...] = jnp.zeros(colsum_sc.shape, F32)

    @pl.when(_overlaps(i, j, bq, bk, causal))
    def _compute():
        allowed = _allowed(G, bq, bk, i, j, len_ref[b], T, S, causal, valid_ref)
        p = jnp.exp(_qk(q_ref, k_ref, scale) - lse_ref[...][..., None])
        weighted = jnp.where(allowed, p * w_ref[...][:, :, None], 0.0)
        colsum_sc[...] += weighted.sum(axis=1)

    @pl.when(i == pl.num_programs(3) - 1)
    def _finish():
        colsum = colsum_sc[...]
        total = colsum.max(axis=0, keepdims=True) if reduction == "max" else colsum.mean(axis=0, keepdims=True)
        inc_ref[...] = total


def _scores(q, lse, weights, keys, valid, lengths, *, causal, reduction, cfg, interpret):
    """Increments [B, Hkv, S] of keys [B, Hkv, S, D] for queries q [B, Hkv, G, T, D] with final lse."""
    B, Hkv, G, T, D = q.shape
    S = keys.shape[2]
    bq, bk = _blocks(T, S, cfg)
    in_specs = [
        pl.BlockSpec((None, None, G, bq, D), lambda b, h, j, i, n: (b, h, 0, i, 0)),
        pl.BlockSpec((None, None, G, bq), lambda b, h, j, i, n: (b, h, 0, i)),
        pl.BlockSpec((None, 1, bq), lambda b, h, j, i, n: (b, 0, i)),
        pl.BlockSpec((None, None, bk, D), lambda b, h, j, i, n: (b, h, j, 0)),
    ]
    args = [q, lse, weights[:, None, :], keys]
    if not causal:
        in_specs.append(pl.BlockSpec((None, None, 1, bk), lambda b, h, j, i, n: (b, h, 0, j)))
        args.append(valid)
    inc = pl.pallas_call(
        functools.partial(_scores_kernel, causal=causal, T=T, S=S, scale=D**-0.5, reduction=reduction),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(B, Hkv, pl.cdiv(S, bk), pl.cdiv(T, bq)),
            in_specs=in_specs,
            out_specs=pl.BlockSpec((None, None, 1, bk), lambda b, h, j, i, n: (b, h, 0, j)),
            scratch_shapes=[pltpu.VMEM((G, bk), F32)],
        ),
        out_shape=jax.ShapeDtypeStruct((B, Hkv, 1, S), F32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="jcascade_segment_scores",
    )(lengths, *args)
    return inc[:, :, 0]


def chunk_attention(
    q,
    k,
    v,
    k_cache,
    v_cache,
    cache_valid,
    cache_positions,
    lengths,
    query_weights=None,
    head_reduction="max",
    rope=None,
    *,
    config: TpuConfig = TpuConfig(),
    interpret: bool = False,
):
    """Same contract as `reference.chunk_attention`, on Pallas-Mosaic TPU, over a cache as it is stored (k_cache,
    v_cache: `Stored` [B, Hkv, S, D]). A quantized cache: the keys are dequantized (to q's dtype) where XLA rotates
    them, the values read as codes by the segment kernel, their scales applied to the probabilities."""
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    k_cache = k_cache.decode(q.dtype) if k_cache.quantized else k_cache.data
    if rope is not None:
        k_cache = rope(k_cache, cache_positions)
    qt = q.reshape(B, T, Hkv, G, D).transpose(0, 2, 3, 1, 4)  # [B, Hkv, G, T, D]
    kt, vt = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, Hkv, T, D]
    valid = cache_valid.astype(jnp.int32)[:, :, None, :]
    common = dict(cfg=config, interpret=interpret)
    o_cache, lse_cache = _segment(
        qt,
        k_cache,
        v_cache,
        valid,
        lengths,
        causal=False,
        **common,
    )
    o_chunk, lse_chunk = _segment(qt, kt, Stored(vt), None, lengths, causal=True, **common)
    o, lse = attention_state.merge(o_cache, lse_cache, o_chunk, lse_chunk)
    out = o.transpose(0, 3, 1, 2, 4).reshape(B, T, Hq, D).astype(q.dtype)
    lse_out = lse.reshape(B, Hq, T)
    if query_weights is None:
        return out, lse_out, None, None
    weights = query_weights.astype(F32)
    common.update(reduction=head_reduction)
    inc_cache = _scores(qt, lse, weights, k_cache, valid, lengths, causal=False, **common)
    inc_chunk = _scores(qt, lse, weights, kt, None, lengths, causal=True, **common)
    return out, lse_out, inc_cache, inc_chunk
