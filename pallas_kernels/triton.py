"""Pallas-Triton (GPU) kernels: chunk attention with exact EMA-score increments, and decode.

Chunk (T > 1), three launches, all deterministic (no atomics):
  1. forward, one program per (row, query head, query block): flash attention over the cache slots
     then causally over the chunk, giving out and the final log-sum-exp per query;
  2. scores over the cache, one program per (row, KV head, key block): recomputes q.k for every query
     of the group, p = exp(q.k - lse) with the exact final normaliser, and accumulates the weighted
     column sums, reduced over the group (max or mean) — one extra QK^T pass, no second PV;
  3. the same over the chunk's own keys, causally.
Decode (T == 1): split-K over the cache with RoPE applied to the keys in the kernel (they are stored
un-rotated): cos and sin of position x frequency computed in the loop from the slots' int32 positions (a
per-call cos|sin table in memory cost a launch and a write of 256 B per slot and row: 1.15 ms of an 8B
batch-16 step on an H100), writing each split's (v, lse) and the raw logits; then one more kernel, with no
loop, merges the splits with the new token's own key and turns the logits into exact probabilities for
the scores (the XLA epilogue it replaces took about ten small launches).

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

from . import attention_state
from .tuning import check_fields, power_of_two

LOG2E = math.log2(math.e)
MASK = -0.7 * float(np.finfo(np.float32).max)  # finite "minus infinity": keeps inf - inf out of the online softmax
F32 = jnp.float32
F16 = jnp.float16


@dataclasses.dataclass(frozen=True)
class TritonConfig:
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
    decode_num_stages: int = 3  # H200: 0.49 / 0.97 of the copy bandwidth at batch 1 / 32 (git history: RESULTS.md)
    decode_heads_first: bool = True  # decode grid (head, split, row), not (row, head, split): git history, RESULTS.md

    def __post_init__(self):
        check_fields(
            self,
            ("block_q", "block_k", "score_block_q", "score_block_k", "decode_block_k"),
            "a power of two >= 16",
            power_of_two(16),
        )
        check_fields(
            self,
            ("decode_programs", "num_warps", "num_stages", "decode_num_warps", "decode_num_stages"),
            "a positive int",
            lambda value: value >= 1,
        )
        if not isinstance(self.decode_heads_first, bool):
            raise ValueError(f"TritonConfig.decode_heads_first must be a bool, got {self.decode_heads_first!r}")

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
        return (
            keys,
            plgpu.load(keys_ref.at[blk, :], mask=ok, other=0.0),
            plgpu.load(values_ref.at[blk, :], mask=ok, other=0.0),
        )

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


def _forward(q, k, v, k_cache, v_cache, valid, lengths, cfg: TritonConfig, interpret: bool):
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


def _scores_kernel(
    len_ref, q_ref, lse_ref, w_ref, key_ref, valid_ref, inc_ref, *, T, S, G, bq, bk, scale, causal, reduction
):
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


def _scores(q, lse, weights, lengths, keys, valid, *, causal: bool, reduction: str, cfg: TritonConfig, interpret: bool):
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
        T=T,
        S=S,
        G=G,
        bq=bq,
        bk=bk,
        scale=D**-0.5,
        causal=causal,
        reduction=reduction,
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
# Decode: split-K over the cache, keys rotated in the kernel, then one kernel that merges the splits.


def layer_of(cache: jax.Array, layer, first_slot: int) -> jax.Array:
    """[B, Hkv, S, D]: the slots from `first_slot` of `cache` [B, Hkv, C, D], or of its layer `layer` when it
    is a stack [L, B, Hkv, C, D]."""
    return (cache if layer is None else cache[layer])[..., first_slot:, :]


def _scalar(x) -> jax.Array:
    """int32 [1], for an index read inside a kernel."""
    return jnp.reshape(x, (1,)).astype(jnp.int32)


def _decode_kernel(*refs, S, first, G, gp, split, bk, scale, rope, interpret, axes, scaled, logits, paired=None):
    """refs: layer_ref, len_ref, q_ref, kc_ref, vc_ref, valid_ref, pos_ref, freq_ref, (ks_ref, vs_ref when
    `scaled`), o_ref, lse_ref, (logits_ref when `logits`).
    q_ref: the KV head's G queries [G, D], read as gp rows (the rest zero); kc_ref, vc_ref: the whole stack
    [L, B, Hkv, C, D], of which this program reads (layer, row, head) at slots first + [its split of S];
    valid_ref [S]; pos_ref [S] the slots' RoPE positions and freq_ref [D / 2] the RoPE frequencies (read when
    `rope`: the keys are rotated here, cos and sin computed in the loop); ks_ref, vs_ref [S] the slots' scales of
    a quantized cache, whose codes kc_ref and vc_ref then hold: converted exactly to q's dtype in registers, a
    key's scale multiplying its logits and a value's its probabilities. axes: the grid axes of (row, head, split).
    paired: None, or the codes' dtype when kc_ref and vc_ref hold them as int16 pairs [L, B, Hkv, C, D / 2]
    (`as_pairs`: a stack too large to address by the byte, `addresses_fit`); q_ref then holds each half's even
    columns, then its odd ones (`_pair_order`), freq_ref the even frequencies then the odd ones, and o_ref gets the
    values' even columns, then their odd ones."""
    layer_ref, len_ref, q_ref, kc_ref, vc_ref, valid_ref, pos_ref, freq_ref, *refs = refs
    ks_ref, vs_ref, *refs = refs if scaled else (None, None, *refs)
    o_ref, lse_ref, logits_ref = refs if logits else (*refs, None)
    layer = layer_ref[0]
    b, h, s_idx = (pl.program_id(axis) for axis in axes)
    has_query = len_ref[...] > 0
    D = q_ref.shape[-1]
    half = D // 2
    rows_ok = jnp.arange(gp) < G
    qrows = pl.ds(0, gp)

    def load_q(cols):
        return plgpu.load(q_ref.at[qrows, cols], mask=rows_ok[:, None], other=0.0)

    if paired:
        quarter = D // 4
        quarters = [load_q(pl.ds(i * quarter, quarter)) for i in range(4)]  # each half's even, then odd columns
        if rope:
            freqs = freq_ref[pl.ds(0, quarter)], freq_ref[pl.ds(quarter, quarter)]
    elif rope:
        q1, q2 = load_q(pl.ds(0, half)), load_q(pl.ds(half, half))
        freq = freq_ref[...]
    else:
        q = load_q(slice(None))
    # 8-bit codes under bfloat16 queries: the products take float16 operands (codes convert to float16 exactly and
    # cheaply, `_codes_to_f16`; RoPE rotates keys in float16, 3 more bits than bfloat16). q is scaled by the power of
    # two `q_unit` that brings its largest entry into (128, 256]; each block's value scales by their largest, v_unit.
    f16 = scaled and q_ref.dtype != F32
    if f16:
        qs = [x.astype(F32) for x in (quarters if paired else (q1, q2) if rope else (q,))]
        top = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(x)) for x in qs])
        q_unit = jnp.exp2(jnp.ceil(jnp.log2(jnp.maximum(top, 2.0**-100))) - 8)
        qs = [(x / q_unit).astype(F16) for x in qs]
        if paired:
            quarters = qs
        elif rope:
            q1, q2 = qs
        else:
            (q,) = qs
    dtype = F16 if f16 else q_ref.dtype if scaled else vc_ref.dtype  # codes convert exactly to this dtype
    start = s_idx * split

    def load_rows(ref, rows, cols, ok, as_dtype):
        """A block of cached rows converted to `as_dtype`, zero past the cache's end (the fill value of the stored
        kind: an int for int8 codes; a fill applied after the load breaks the loads' pipelining)."""
        fill = 0 if jnp.issubdtype(ref.dtype, jnp.integer) else 0.0
        x = plgpu.load(ref.at[layer, b, h, rows, cols], mask=ok[:, None], other=fill)
        if as_dtype == F16:
            return _codes_to_f16(x, interpret)
        return (_int8_to_f32(x) if ref.dtype == jnp.int8 else x).astype(as_dtype)

    def load_pairs(ref, rows, cols, ok):
        """A block of int16 pairs of codes -> their even and odd codes, each exactly in `dtype` (float16) or float32."""
        x = plgpu.load(ref.at[layer, b, h, rows, cols], mask=ok[:, None], other=0)
        if f16:
            return _pairs_to_f16(x, paired, interpret)
        return tuple(_code_to_f32(byte, paired) for byte in _split_pairs(x))

    def paired_logits(kv_blk, blk, ok):
        """The G queries' logits against a block of int16-paired keys (rotated here when `rope`)."""
        k1e, k1o = load_pairs(kc_ref, kv_blk, pl.ds(0, quarter), ok)
        k2e, k2o = load_pairs(kc_ref, kv_blk, pl.ds(quarter, quarter), ok)
        keys = [k1e, k1o, k2e, k2o]
        if rope:  # the pairs (x[i], x[i + D/2]) of even i, then of odd i
            positions = plgpu.load(pos_ref.at[blk], mask=ok, other=0).astype(F32)
            for i, f in enumerate(freqs):
                cos, sin = (x.astype(keys[i].dtype) for x in _cos_sin(positions[:, None] * f[None, :], interpret))
                k1, k2 = keys[i], keys[2 + i]
                keys[i], keys[2 + i] = k1 * cos - k2 * sin, k2 * cos + k1 * sin
        return sum(_dot(qx, kx.astype(dtype), trans_b=True) for qx, kx in zip(quarters, keys))

    def body(j, carry):
        acc, m, l = carry
        off = start + j * bk
        keys = off + jnp.arange(bk)
        ok = keys < S
        blk, kv_blk = pl.ds(off, bk), pl.ds(first + off, bk)
        allowed = (plgpu.load(valid_ref.at[blk], mask=ok, other=0) != 0) & ok & has_query
        if paired:
            s = paired_logits(kv_blk, blk, ok)
        elif rope:  # rotate-half at the slots' positions
            rotation = F16 if f16 else F32
            k1, k2 = (load_rows(kc_ref, kv_blk, pl.ds(i * half, half), ok, rotation) for i in range(2))
            positions = plgpu.load(pos_ref.at[blk], mask=ok, other=0).astype(F32)
            cos, sin = (x.astype(rotation) for x in _cos_sin(positions[:, None] * freq[None, :], interpret))
            r1, r2 = (k1 * cos - k2 * sin).astype(q1.dtype), (k2 * cos + k1 * sin).astype(q1.dtype)
            s = _dot(q1, r1, trans_b=True) + _dot(q2, r2, trans_b=True)
        else:
            s = _dot(q, load_rows(kc_ref, kv_blk, slice(None), ok, dtype), trans_b=True)
        if scaled:
            s = s * (plgpu.load(ks_ref.at[blk], mask=ok, other=0.0) * (q_unit if f16 else 1.0))[None, :]
        s = jnp.where(allowed[None, :], s * scale, MASK)
        if logits_ref is not None:
            plgpu.store(logits_ref.at[:, blk], s, mask=rows_ok[:, None] & ok[None, :])
        s2 = jnp.where(allowed[None, :], s * LOG2E, MASK)
        m_new = jnp.maximum(m, s2.max(axis=1))
        corr = jnp.exp2(m - m_new)
        p = jnp.exp2(s2 - m_new[:, None])
        vs = plgpu.load(vs_ref.at[blk], mask=ok, other=0.0) if scaled else None
        v_unit = jnp.maximum(jnp.max(vs), 2.0**-126) if f16 else 1.0
        pv = (p * (vs / v_unit)[None, :] if scaled else p).astype(dtype)
        if paired:  # the values' even columns, then their odd ones
            acc = tuple(
                corr[:, None] * a + v_unit * _dot(pv, v.astype(dtype))
                for a, v in zip(acc, load_pairs(vc_ref, kv_blk, slice(None), ok))
            )
        else:
            acc = corr[:, None] * acc + v_unit * _dot(pv, load_rows(vc_ref, kv_blk, slice(None), ok, dtype))
        return acc, m_new, corr * l + p.sum(axis=1)

    zeros = (jnp.zeros((gp, half), F32),) * 2 if paired else jnp.zeros((gp, D), F32)
    acc, m, l = lax.fori_loop(0, split // bk, body, (zeros, jnp.full((gp,), MASK, F32), jnp.zeros((gp,), F32)))
    seen_any = ~(m <= 0.5 * MASK)  # NaN counts as seen: it propagates
    for cols, a in [(pl.ds(0, half), acc[0]), (pl.ds(half, half), acc[1])] if paired else [(slice(None), acc)]:
        plgpu.store(o_ref.at[:, cols], jnp.where(seen_any[:, None], a / l[:, None], 0.0))
    lse_ref[...] = jnp.where(seen_any, (m + jnp.log2(l)) / LOG2E, -jnp.inf)


MAGIC = 0x4B400000  # the bits of 1.5 * 2**23: an int c with |c| < 2**22 added to them gives the float 1.5 * 2**23 + c


def _code_to_f32(byte, dtype):
    """A code's byte (int32 in [-128, 127], sign-extended) -> its value in float32: an int8 code's, or that of the
    float8_e4m3fn code with these bits."""
    if dtype == jnp.int8:
        return _int8_to_f32(byte)
    return lax.bitcast_convert_type(byte.astype(jnp.int8), dtype).astype(F32)


def _pairs_to_f16(pairs, dtype, interpret: bool):
    """int16 pairs of 8-bit codes of `dtype` (`as_pairs`) -> (even codes, odd codes), each exactly in float16. int8
    as `_codes_to_f16` converts it, two pairs at a time (their even bytes, then their odd ones); float8 (and
    interpret mode) by splitting the bytes and converting each."""
    if dtype == jnp.int8 and not interpret:
        return tuple(
            _bytes_to_f16(pairs, [select], pack=2)[0] for select in ("0x4240", "0x4341")
        )  # bytes 0 and 2 (even codes), 1 and 3 (odd)
    return tuple(
        _codes_to_f16(lax.bitcast_convert_type(byte.astype(jnp.int8), dtype), interpret) for byte in _split_pairs(pairs)
    )


def _split_pairs(pairs):
    """int16 pairs -> (even codes' bytes, odd codes' bytes), each sign-extended into int32."""
    x = pairs.astype(jnp.int32)
    return lax.shift_right_arithmetic(x << 24, 24), lax.shift_right_arithmetic(x, 8)


def _bytes_to_f16(x, selects, *, pack: int) -> list:
    """Inline PTX, one float16 per element of `x`: each 32-bit word of `x` (`pack` int8 codes, or int16 pairs) gives
    one float16 pair per byte selector in `selects`: the bytes' sign bits flipped (code + 128 as an unsigned byte),
    the two selected bytes put under the float16 exponent byte 0x64 (1024 + code + 128), then 1152 subtracted."""
    outs = len(selects)
    permutes = "\n".join(
        f"prmt.b32 ${i}, t, 0x64646464, {sel};\nsub.rn.f16x2 ${i}, ${i}, m;" for i, sel in enumerate(selects)
    )
    asm = f"{{\n.reg .b32 t, m;\nxor.b32 t, ${outs}, 0x80808080;\nmov.b32 m, 0x64806480;\n{permutes}\n}}"
    return plgpu.elementwise_inline_asm(
        asm,
        args=[x],
        constraints=",".join(["=r"] * outs + ["r"]),
        pack=pack,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, F16)],
    )


def as_pairs(codes: jax.Array) -> jax.Array:
    """8-bit codes [..., D] as int16 pairs [..., D / 2] (element 2i the low byte of pair i): the same bytes, half the
    elements, so that a stack of 2**31 to 2**32 codes is addressed correctly (`addresses_fit`)."""
    as_int8 = lax.bitcast_convert_type(codes, jnp.int8) if codes.dtype != jnp.int8 else codes
    return lax.bitcast_convert_type(as_int8.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2), jnp.int16)


def from_pairs(pairs: jax.Array, dtype) -> jax.Array:
    """`as_pairs` undone: int16 pairs [..., D / 2] -> 8-bit codes of `dtype` [..., D]."""
    as_int8 = lax.bitcast_convert_type(pairs, jnp.int8).reshape(*pairs.shape[:-1], 2 * pairs.shape[-1])
    return lax.bitcast_convert_type(as_int8, dtype) if jnp.dtype(dtype) != jnp.int8 else as_int8


def reads_pairs(head_dim: int) -> bool:
    """Whether the decode kernel can read heads of `head_dim` as int16 pairs: four products of head_dim / 4 columns,
    each at least 16 (Triton's smallest)."""
    return head_dim % 4 == 0 and head_dim >= 64


def _pair_order(D: int) -> np.ndarray:
    """The columns of a head [D] as the paired decode reads the keys: each half's even columns, then its odd ones."""
    half = np.arange(D // 2).reshape(-1, 2).T.reshape(-1)
    return np.concatenate([half, D // 2 + half])


def _codes_to_f16(codes, interpret: bool):
    """8-bit codes -> exact float16. float8 by the hardware's paired conversion; int8 four at a time: each byte's
    sign bit flipped (c + 128 as an unsigned byte) and put under the exponent byte 0x64 (the float16 1024 + c + 128),
    then 1152 subtracted: one logic op, two byte permutes and two paired subtractions per four codes, where the
    float32 path spends an add, a subtraction and a conversion on each. In interpret mode XLA's conversion."""
    if codes.dtype != jnp.int8 or interpret:
        return codes.astype(F16)
    return _bytes_to_f16(codes, ["0x4140", "0x4342"], pack=4)[0]  # bytes 0 and 1, then 2 and 3


def _int8_to_f32(codes):
    """int8 codes -> exact float32 by an integer add and a float subtraction instead of int-to-float conversions,
    which issue at a quarter of the float rate on Hopper, on the unit the fused RoPE's sines and cosines use
    (int8 decode at batch 32 over 16K + 64 slots, H100: 0.71 ms against 0.76 ms; the same bit moves for float8
    codes took 1.09 ms against its hardware conversion's 0.77: docs/results/quantized.md)."""
    return lax.bitcast_convert_type(codes.astype(jnp.int32) + MAGIC, F32) - float(1.5 * 2**23)


def addresses_fit(array) -> bool:
    """Whether the Pallas-Triton kernels address every element of `array` correctly. jax 0.11's Triton lowering
    computes element offsets in signed 32 bits unless the array holds more than 2**32 bytes, so in an array of
    1-byte elements (8-bit codes) with 2**31 < size <= 2**32, offsets past 2**31 wrap negative: the loads read
    before the array (CUDA_ERROR_ILLEGAL_ADDRESS, or another buffer's bytes). The kernels that address a whole
    stack in place (decode, the single-token insertion) take such arrays as int16 pairs (`as_pairs`)."""
    size = math.prod(array.shape)
    return size <= 2**31 or size * jnp.dtype(array.dtype).itemsize > 2**32


def _reduce_heads(p: jax.Array, G: int, reduction: str) -> jax.Array:
    """[rows, n] -> [n]: max or mean over the G query heads of a group (rows past G hold zeros). A NaN in a
    column gives NaN, as in XLA (Triton's max drops NaN)."""
    nan = jnp.sum(jnp.where(p != p, 1.0, 0.0), axis=0) > 0
    reduced = p.max(axis=0) if reduction == "max" else p.sum(axis=0) / G
    return jnp.where(nan, jnp.nan, reduced)


def _finish_kernel(*refs, S, G, P, bs, dc, nblk, scale, reduction):
    """One (row, KV head): the exact merge of its P split states with the new token's own key, in every program;
    then program j < nblk turns logits block j (bs slots) into score increments, and program nblk + c merges the
    output columns [c * dc, (c + 1) * dc) (c == 0 also writes lse and the new token's increment). No loop: every
    split is one tile."""
    if nblk:
        len_ref, w_ref, q_ref, k_ref, v_ref, lse_p_ref, o_p_ref, logits_ref, o_ref, lse_ref, inc_ref, self_ref = refs
    else:
        len_ref, q_ref, k_ref, v_ref, lse_p_ref, o_p_ref, o_ref, lse_ref = refs
    j = pl.program_id(2)
    gq, Pp = pl.next_power_of_2(G), pl.next_power_of_2(P)
    rows_ok = jnp.arange(gq) < G
    qrows, parts = pl.ds(0, gq), pl.ds(0, Pp)
    parts_ok = jnp.arange(Pp) < P
    q = plgpu.load(q_ref.at[qrows, :], mask=rows_ok[:, None], other=0.0).astype(F32)  # [gq, D]
    self_logit = jnp.sum(q * k_ref[...].astype(F32)[None, :], axis=1) * scale  # [gq]
    self_logit = jnp.where(len_ref[...] > 0, self_logit, -jnp.inf)
    lse_p = plgpu.load(lse_p_ref.at[parts, qrows], mask=parts_ok[:, None], other=-jnp.inf)  # [Pp, gq]
    m = jnp.maximum(lse_p.max(axis=0), self_logit)
    m = jnp.where(m == -jnp.inf, 0.0, m)
    total = m + jnp.log(jnp.sum(jnp.exp(lse_p - m[None, :]), axis=0) + jnp.exp(self_logit - m))  # NaN stays NaN
    held = total != -jnp.inf  # as `attention_state.merge_all`: an empty row has weight 0 everywhere
    safe = jnp.where(held, total, 0.0)

    if nblk:
        w0 = w_ref[...]

        @pl.when(j < nblk)
        def _scores():
            cols = j * bs + jnp.arange(bs)
            ok = cols < S
            logits = plgpu.load(
                logits_ref.at[qrows, pl.ds(j * bs, bs)], mask=rows_ok[:, None] & ok[None, :], other=MASK
            )
            live = held[:, None] & ~(logits <= 0.5 * MASK)  # a NaN logit (a NaN key) is live: its slot scores NaN
            p = jnp.where(live, jnp.exp(logits - safe[:, None]), 0.0) * w0
            plgpu.store(inc_ref, _reduce_heads(p, G, reduction), mask=ok)

    @pl.when(j >= nblk)
    def _merge():
        c = j - nblk
        cols = pl.ds(c * dc, dc)
        o_p = plgpu.load(o_p_ref.at[parts, qrows, cols], mask=parts_ok[:, None, None], other=0.0)  # [Pp, gq, dc]
        w_p = jnp.where(held[None, :], jnp.exp(lse_p - safe[None, :]), 0.0)
        w_self = jnp.where(held, jnp.exp(self_logit - safe), 0.0)
        out = jnp.sum(w_p[:, :, None] * o_p, axis=0) + w_self[:, None] * plgpu.load(v_ref.at[cols]).astype(F32)[None, :]
        plgpu.store(o_ref.at[qrows, cols], out.astype(o_ref.dtype), mask=rows_ok[:, None])

        @pl.when(c == 0)
        def _lse():
            plgpu.store(lse_ref.at[qrows], total, mask=rows_ok)
            if nblk:
                p_self = jnp.where(rows_ok & held, jnp.exp(self_logit - safe), 0.0) * w0
                self_ref[...] = _reduce_heads(p_self[:, None], G, reduction)


def fuses_rope(rope) -> bool:
    """Whether the kernels rotate cached keys themselves: when `rope` has `inv_freq(head_dim)` (as
    `jcascade.RoPE`), it is taken to rotate the pairs (x[i], x[i + D/2]) by position * inv_freq[i] (the
    rotate-half convention). Any other callable rotates the keys outside the kernel."""
    return callable(getattr(rope, "inv_freq", None))


TWO_PI_F32 = float(np.float32(2 * math.pi))
TWO_PI_LO = float(np.float32(2 * math.pi - TWO_PI_F32))  # 2 pi = TWO_PI_F32 + TWO_PI_LO to about 1e-15


def _cos_sin(angle, interpret: bool):
    """cos and sin of float32 angles (position x frequency, as XLA's RoPE computes them): reduced to about
    [-pi, pi] by k = round(angle / 2 pi), r = fma(-k, 2 pi_hi, angle) - k 2 pi_lo (one rounding: r within about 1e-6 of
    the exact reduction for any angle below 2**24, which k's rounding covers), then the GPU's approximate sin/cos
    instructions (absolute error about 1e-6; benchmarks/check_kernels_gpu.py checks them at positions near 1M). In
    interpret
    mode (the CPU, where PTX cannot run) XLA's cos and sin of the angle, as the reference computes them."""
    if interpret:
        return jnp.cos(angle), jnp.sin(angle)

    def asm(code, *args):
        return plgpu.elementwise_inline_asm(
            code,
            args=list(args),
            constraints="=f" + ",f" * len(args),
            pack=1,
            result_shape_dtypes=[jax.ShapeDtypeStruct(angle.shape, F32)],
        )[0]

    # round to nearest by adding and subtracting 1.5 * 2**23 (two full-rate adds, kept apart by the asm: a floor
    # issues at a quarter of that rate on the unit the sine and cosine use); exact for |angle / 2 pi| < 2**22
    rounder = jnp.full(angle.shape, 1.5 * 2**23, F32)
    k = asm("sub.rn.f32 $0, $1, $2;", asm("add.rn.f32 $0, $1, $2;", angle * (1 / (2 * math.pi)), rounder), rounder)
    r = asm("fma.rn.f32 $0, $1, $2, $3;", -k, jnp.full(angle.shape, TWO_PI_F32, F32), angle) - k * TWO_PI_LO
    return asm("cos.approx.f32 $0, $1;", r), asm("sin.approx.f32 $0, $1;", r)


def _rope_inputs(rope, positions, D):
    """The decode kernels' RoPE inputs: positions int32 [B, 1 or Hkv, S] and frequencies f32 [D / 2] (ignored by
    the kernel when RoPE is not fused)."""
    freq = rope.inv_freq(D) if fuses_rope(rope) else np.zeros(D // 2, np.float32)
    return positions.astype(jnp.int32), jnp.asarray(freq, F32)


def _decode(
    q,
    k,
    v,
    k_cache,
    v_cache,
    cache_valid,
    cache_positions,
    lengths,
    weights,
    reduction,
    rope,
    layer,
    first_slot,
    cfg,
    interpret,
):
    """T == 1. q, k already rotated; cache keys rotated in the kernel when `fuses_rope(rope)`. k_cache, v_cache
    `Stored` [B, Hkv, C, D], or a stack [L, B, Hkv, C, D] read in place at `layer`, attended at slots [first_slot,
    C); a quantized cache's codes are dequantized in the kernel (RoPE then fused), with the layer's scales
    [B, Hkv, C]. Two launches: the split-K kernel (each split's state and the raw logits) and `_finish_kernel`."""
    B, _, Hq, D = q.shape
    Hkv, S = k.shape[2], cache_valid.shape[-1]
    G = Hq // Hkv
    scaled = k_cache.quantized
    (k_cache, k_scale), (v_cache, v_scale) = ((c.data, c.scale) for c in (k_cache, v_cache))
    if scaled and rope is not None and not fuses_rope(rope):
        raise ValueError("a quantized cache's Triton decode needs a RoPE the kernel fuses (jcascade.RoPE) or none")
    if rope is not None and not fuses_rope(rope):
        k_cache = rope(layer_of(k_cache, layer, first_slot), cache_positions)[None]
        v_cache, layer, first_slot = layer_of(v_cache, layer, first_slot)[None], 0, 0
    elif layer is None:
        k_cache, v_cache, layer = k_cache[None], v_cache[None], 0
    paired = None  # a stack too large to address by the byte is read as int16 pairs of codes
    if scaled and not (addresses_fit(k_cache) and addresses_fit(v_cache)):
        if not reads_pairs(D):
            raise ValueError(
                f"k_cache {k_cache.dtype}{list(k_cache.shape)}: a stack the Triton decode cannot address "
                f"by the byte (`addresses_fit`) is read as pairs, which needs head_dim a multiple of 4 "
                f"and >= 64; Kernels.chunk_attention routes such a stack elsewhere"
            )
        paired, k_cache, v_cache = k_cache.dtype, as_pairs(k_cache), as_pairs(v_cache)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not addresses_fit(cache):
            raise ValueError(
                f"{name} {cache.dtype}{list(cache.shape)}: the Triton decode cannot address it in place "
                f"(`addresses_fit`); Kernels.chunk_attention routes such a stack elsewhere"
            )
    gp = max(16, pl.next_power_of_2(G))
    bk = _block(S, cfg.decode_block_k)
    splits = int(np.clip(cfg.decode_programs // (B * Hkv), 1, pl.cdiv(S, bk)))
    split = pl.cdiv(pl.cdiv(S, splits), bk) * bk
    splits = pl.cdiv(S, split)
    qg = q.reshape(B, Hkv, G, D)
    positions, freq = _rope_inputs(rope, cache_positions, D)
    position_heads = positions.shape[1]
    want_scores = weights is not None
    kernel = functools.partial(
        _decode_kernel,
        S=S,
        first=first_slot,
        G=G,
        gp=gp,
        split=split,
        bk=bk,
        scale=D**-0.5,
        rope=fuses_rope(rope),
        interpret=interpret,
        axes=(2, 0, 1) if cfg.decode_heads_first else (0, 1, 2),
        scaled=scaled,
        logits=want_scores,
        paired=paired,
    )
    # grid (head, split, row): the programs of a row's split run side by side (with RoPE tables, rows first made
    # each head re-read its row's table from memory: at batch 64 on an H100, 1.15x slower)
    if cfg.decode_heads_first:
        grid, spec = (Hkv, splits, B), lambda shape, index: pl.BlockSpec(shape, lambda h, s, b: index(b, h, s))
    else:
        grid, spec = (B, Hkv, splits), pl.BlockSpec
    head = lambda b, h, s: (b, h, 0, 0)
    out_specs = [
        spec((None, None, None, gp, D), lambda b, h, s: (b, h, s, 0, 0)),
        spec((None, None, None, gp), lambda b, h, s: (b, h, s, 0)),
    ]
    out_shape = [jax.ShapeDtypeStruct((B, Hkv, splits, gp, D), F32), jax.ShapeDtypeStruct((B, Hkv, splits, gp), F32)]
    if want_scores:
        out_specs.append(spec((None, None, gp, S), head))
        out_shape.append(jax.ShapeDtypeStruct((B, Hkv, gp, S), F32))
    parts = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[
            pl.BlockSpec(),
            spec((None,), lambda b, h, s: (b,)),
            spec((None, None, G, D), head),
            pl.BlockSpec(),  # the whole stack: each program addresses its own (layer, row, head)
            pl.BlockSpec(),
            spec((None, None, S), lambda b, h, s: (b, h, 0)),
            spec((None, None, S), lambda b, h, s: (b, h if position_heads > 1 else 0, 0)),
            pl.BlockSpec(),
            *[spec((None, None, S), lambda b, h, s: (b, h, 0))] * (2 if scaled else 0),
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=cfg.params(decode=True),
        interpret=interpret,
        name="jcascade_decode",
    )(
        _scalar(layer),
        lengths,
        qg if paired is None else qg[..., _pair_order(D)],
        k_cache,
        v_cache,
        cache_valid.astype(jnp.int32),
        positions,
        freq if paired is None else jnp.concatenate([freq[0::2], freq[1::2]]),
        *((k_scale[..., first_slot:], v_scale[..., first_slot:]) if scaled else ()),
    )
    if paired is None:
        return _finish(qg, k, v, lengths, weights, parts, reduction, interpret)
    values = np.concatenate([np.arange(0, D, 2), np.arange(1, D, 2)])  # o's columns: the values' even, then odd
    out, *rest = _finish(qg, k, v[..., values], lengths, weights, parts, reduction, interpret)
    return out[..., np.argsort(values)], *rest


def _finish(qg, k, v, lengths, weights, parts, reduction, interpret):
    """`_finish_kernel` over the split states `parts` (o [B, Hkv, P, gp, D], lse [B, Hkv, P, gp], logits
    [B, Hkv, gp, S] with scores): out [B, 1, Hq, D], lse [B, Hq, 1], inc_cache [B, Hkv, S], inc_chunk [B, Hkv, 1]."""
    B, Hkv, G, D = qg.shape
    P, S = parts[0].shape[2], (parts[2].shape[-1] if weights is not None else 0)
    bs = _block(S, 1024)
    nblk = pl.cdiv(S, bs) if weights is not None else 0
    dc = int(np.clip(4096 // (pl.next_power_of_2(P) * pl.next_power_of_2(G)), 1, D))
    head = lambda b, h, j: (b, h, 0, 0)
    row = lambda b, h, j: (b, h, 0)
    in_specs = [pl.BlockSpec((None,), lambda b, h, j: (b,))]
    args = [lengths]
    if nblk:
        in_specs.append(pl.BlockSpec((None,), lambda b, h, j: (b,)))
        args.append(weights.reshape(B).astype(F32))
    in_specs += [
        pl.BlockSpec((None, None, G, D), head),
        pl.BlockSpec((None, None, D), row),
        pl.BlockSpec((None, None, D), row),
        pl.BlockSpec((None, None) + parts[1].shape[2:], lambda b, h, j: (b, h, 0, 0)),
        pl.BlockSpec((None, None) + parts[0].shape[2:], lambda b, h, j: (b, h, 0, 0, 0)),
    ]
    args += [qg, k.reshape(B, Hkv, D), v.reshape(B, Hkv, D), parts[1], parts[0]]
    out_specs = [pl.BlockSpec((None, None, G, D), head), pl.BlockSpec((None, None, G), row)]
    out_shape = [jax.ShapeDtypeStruct((B, Hkv, G, D), qg.dtype), jax.ShapeDtypeStruct((B, Hkv, G), F32)]
    if nblk:
        in_specs.append(pl.BlockSpec((None, None) + parts[2].shape[2:], head))
        args.append(parts[2])
        out_specs += [
            pl.BlockSpec((None, None, bs), lambda b, h, j: (b, h, jnp.minimum(j, nblk - 1))),
            pl.BlockSpec((None, None, 1), row),
        ]
        out_shape += [jax.ShapeDtypeStruct((B, Hkv, S), F32), jax.ShapeDtypeStruct((B, Hkv, 1), F32)]
    kernel = functools.partial(
        _finish_kernel, S=S, G=G, P=P, bs=bs, dc=dc, nblk=nblk, scale=D**-0.5, reduction=reduction
    )
    outs = pl.pallas_call(
        kernel,
        grid=(B, Hkv, nblk + D // dc),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="jcascade_decode_finish",
    )(*args)
    out, lse = outs[0].reshape(B, 1, Hkv * G, D), outs[1].reshape(B, Hkv * G, 1)
    return (out, lse, outs[2], outs[3]) if nblk else (out, lse, None, None)


# --------------------------------------------------------------------------------------------------
# Shared prefix: the decode kernel with many queries per KV head, each prefix K/V tile read once for all.


def prefix_attention(
    q,
    k_cache,
    v_cache,
    cache_valid,
    cache_positions,
    rope,
    *,
    config: TritonConfig = TritonConfig(),
    interpret: bool = False,
):
    """Same contract as `reference.prefix_attention`, over the prefix as it is stored (k_cache, v_cache: `Stored`
    [P, Hkv, S, D]): grid (prefix row, KV head, split, query block), so every query of a prefix row's requests
    shares the loads of each key block of its split. A quantized prefix's codes are dequantized in registers as
    the decode kernel does (RoPE then fused, or none)."""
    P, R, Hq, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    fuse = fuses_rope(rope)
    scaled = k_cache.quantized
    (k_cache, k_scale), (v_cache, v_scale) = ((c.data, c.scale) for c in (k_cache, v_cache))
    if scaled and rope is not None and not fuse:
        raise ValueError("a quantized prefix's Triton kernel needs a RoPE the kernel fuses (jcascade.RoPE) or none")
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
    positions, freq = _rope_inputs(rope, cache_positions, D)
    position_heads = positions.shape[1]
    kernel = functools.partial(
        _decode_kernel,
        S=S,
        first=0,
        G=bq,
        gp=bq,
        split=split,
        bk=bk,
        scale=D**-0.5,
        rope=fuse,
        interpret=interpret,
        axes=(0, 1, 2),
        scaled=scaled,
        logits=False,
    )
    slots = pl.BlockSpec((None, None, S), lambda p, h, s, i: (p, h, 0))
    o_parts, lse_parts = pl.pallas_call(
        kernel,
        grid=(P, Hkv, splits, q_blocks),
        in_specs=[
            pl.BlockSpec(),
            pl.BlockSpec((None,), lambda p, h, s, i: (p,)),
            pl.BlockSpec((None, None, bq, D), lambda p, h, s, i: (p, h, i, 0)),
            pl.BlockSpec(),
            pl.BlockSpec(),
            slots,
            pl.BlockSpec((None, None, S), lambda p, h, s, i: (p, h if position_heads > 1 else 0, 0)),
            pl.BlockSpec(),
            *[slots] * (2 if scaled else 0),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, bq, D), lambda p, h, s, i: (p, h, s, i, 0)),
            pl.BlockSpec((None, None, None, bq), lambda p, h, s, i: (p, h, s, i)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((P, Hkv, splits, q_blocks * bq, D), F32),
            jax.ShapeDtypeStruct((P, Hkv, splits, q_blocks * bq), F32),
        ],
        compiler_params=config.params(decode=True),
        interpret=interpret,
        name="jcascade_shared_prefix",
    )(
        _scalar(0),
        jnp.ones((P,), jnp.int32),
        qg,
        k_cache[None],
        v_cache[None],
        cache_valid.astype(jnp.int32),
        positions,
        freq,
        *((k_scale, v_scale) if scaled else ()),
    )
    out, lse = attention_state.merge_all(o_parts[..., :rows, :], lse_parts[..., :rows], axis=2)  # [P, Hkv, rows, (D)]
    out = out.reshape(P, Hkv, R, G, D).transpose(0, 2, 1, 3, 4).reshape(P, R, Hq, D)
    return out, lse.reshape(P, Hkv, R, G).transpose(0, 2, 1, 3).reshape(P, R, Hq)


# --------------------------------------------------------------------------------------------------


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
    layer=None,
    first_slot=0,
    *,
    config: TritonConfig = TritonConfig(),
    interpret: bool = False,
):
    """Same contract as `reference.chunk_attention`, on Pallas-Triton, over a cache as it is stored (k_cache,
    v_cache: `Stored`), with `layer` and `first_slot` as in `Kernels.chunk_attention`: the decode kernel reads the
    cache in place (a quantized one's codes with their scales); a chunk's kernels take a copy of the attended slots
    (in the model's dtype)."""
    if q.shape[1] == 1:
        return _decode(
            q,
            k,
            v,
            k_cache,
            v_cache,
            cache_valid,
            cache_positions,
            lengths,
            query_weights,
            head_reduction,
            rope,
            layer,
            first_slot,
            config,
            interpret,
        )
    if k_cache.quantized:
        raise ValueError("the Triton chunk kernels take a quantized cache dequantized (Kernels.chunk_attention does)")
    k_cache, v_cache = layer_of(k_cache.data, layer, first_slot), layer_of(v_cache.data, layer, first_slot)
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


# Tiles for heads wider than WIDE_HEAD_DIM (Gemma 4's global layers: 512), where the default ones ask for more shared
# memory than a Hopper GPU has (283 KB of 227 KB, H100). Measured on an H100 at 8 query / 4 KV heads of 512
# (benchmarks/bench_wide_heads.py, docs/results/kernels.md): decode over 16K + 64 slots 0.40 / 2.26 ms at
# batch 1 / 16 (the XLA reference: 0.47 / 3.30 ms; 4 decode warps spill at batch 16: 10.8 ms), a 4096-token chunk
# 4.4 ms (XLA: 14.9 ms).
WIDE_HEAD_DIM = 256
WIDE = TritonConfig(
    block_q=32,
    block_k=32,
    score_block_q=32,
    score_block_k=32,
    decode_block_k=32,
    decode_num_stages=2,
    decode_num_warps=8,
)
