"""Pallas Mosaic GPU (Hopper, sm_90) kernels: chunk attention with exact EMA-score increments.

The chunk's keys are laid out after the cache's as one key sequence [cache slots | chunk], padded to whole
key blocks; one int32 vector per (row, KV head) gives, for every key, the first chunk query allowed to see
it (-1: a valid cache slot, seen by all; the key's own index: a chunk key, seen causally; 2**30: an empty
or padding slot). Two launches, both warp-specialised (one warpgroup issues TMA copies into a ring of
shared-memory stages, two warpgroups compute with wgmma) and deterministic:
  1. forward, one program per (query head, pair of query blocks, row): flash attention over the key blocks
     up to the pair's last query, giving out and the final log-sum-exp; cache blocks add -inf to the
     columns of empty slots (whose keys XLA zeroes), chunk blocks below the diagonal take no mask and those
     on it a causal one;
  2. scores, one program per (KV head, pair of key blocks, row): each compute warpgroup holds one key block
     and streams the group's queries past it, recomputing q.k, p = exp(q.k - lse) with the exact final
     normaliser, and accumulating the weighted column sums per query head, then reduces them over the
     group (max or mean); chunk keys skip the query blocks before them.
Keys are rotated by XLA before the kernels (as the Triton chunk path does). Decode (T = 1) stays on the
Triton split-K kernel.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from . import attention_state
from .tuning import check_fields

LOG2E = math.log2(math.e)
F32 = jnp.float32
HIDDEN = 1 << 30  # "first query allowed" of an empty or padding slot: no query sees it
DTYPES = (jnp.bfloat16, jnp.float16)


@dataclasses.dataclass(frozen=True)
class MosaicGpuConfig:
    """Block sizes (multiples of 64) and pipeline depths."""

    block_q: int = 64  # queries per compute warpgroup in the forward (two per program)
    block_k: int = 128  # keys per forward step
    stages: int = 2  # forward: key blocks in flight
    score_block_k: int = 128  # keys per compute warpgroup in the scores pass (two per program)
    score_block_q: int = 128  # queries per scores step
    score_stages: int = 2  # scores: query blocks in flight

    def __post_init__(self):
        check_fields(
            self,
            ("block_q", "block_k", "score_block_k", "score_block_q"),
            "a positive multiple of 64",
            lambda value: value >= 64 and value % 64 == 0,
        )
        check_fields(self, ("stages", "score_stages"), "an int >= 2", lambda value: value >= 2)


HEAD_DIMS = (64, 128)  # 256 would need smaller blocks to fit the shared memory


def supports(q: jax.Array, k_cache: jax.Array) -> bool:
    """Whether these kernels take the call: a chunk (T > 1) in bf16 or f16 with head_dim 64 or 128."""
    return q.shape[1] > 1 and q.dtype in DTYPES and k_cache.dtype == q.dtype and q.shape[-1] in HEAD_DIMS


def _smem_tile(shape, dtype):
    """A 16-bit shared-memory buffer laid out for TMA and wgmma (8 x 64-element tiles, 128-byte swizzle)."""
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))


def _matmul(a, b, shape, staging=None) -> jax.Array:
    """a @ b in float32 on the tensor cores (wgmma): a [m, k] in shared memory or registers, b [k, n] in shared
    memory. A fresh accumulator each time, which the caller adds to in registers, and a register `a` staged
    through the shared-memory buffer `staging` when one is given: GPU interpret mode's wgmma reads its operands
    from shared memory only and cannot start from a register accumulator (on the GPU, staging is None)."""
    if staging is not None:
        staging[...] = a
        plgpu.commit_smem()
        a = staging

    def run(acc_ref):
        plgpu.wgmma(acc_ref, a, b)
        return acc_ref[...]

    return pl.run_scoped(run, plgpu.ACC(shape, F32))


# --------------------------------------------------------------------------------------------------
# Forward.


def _forward(q, keys, values, first_query, *, cached_blocks: int, cfg: MosaicGpuConfig, interpret, splits: int = 0):
    """q [B, T, Hq, D] (T a multiple of 2 * block_q), keys/values [B, Hkv, K, D] (K a multiple of block_k, the
    cache's cached_blocks key blocks first), first_query int32 [B, Hkv, K]. Returns out [B, T, Hq, D] (rows
    with no visible key are NaN) and lse f32 [B, Hq, T] (natural log).
    splits > 0: no chunk; the K = splits * cached_blocks * block_k keys are `splits` parts, each attended by
    every query on its own: out [B, splits * T, Hq, D], lse [B, Hq, splits * T], part s at rows [s T, (s+1) T)."""
    B, T, Hq, D = q.shape
    Hkv = keys.shape[1]
    G = Hq // Hkv
    bq, bk, stages = cfg.block_q, cfg.block_k, cfg.stages
    pairs = T // (2 * bq)
    c = D**-0.5 * LOG2E
    dtype = q.dtype

    def kernel(
        q_ref,
        k_ref,
        v_ref,
        fq_ref,
        out_ref,
        lse_ref,
        qo_smem2,
        k_smem,
        v_smem,
        fq_smem,
        lse_smem2,
        q_barriers,
        k_barriers,
        v_barriers,
        fq_barriers,
        k_consumed,
        v_consumed,
        *p_smem2,
    ):
        b, h, pair, wg = (lax.axis_index(n) for n in ("row", "head", "pair", "wg"))
        kvh = lax.div(h, jnp.array(G, h.dtype))
        part = lax.div(pair, jnp.array(pairs, pair.dtype)) if splits else 0
        pair = lax.rem(pair, jnp.array(pairs, pair.dtype)) if splits else pair
        first_block, out_row = part * cached_blocks, part * T  # this part's keys and output rows
        k_ref, v_ref, fq_ref = k_ref.at[b, kvh], v_ref.at[b, kvh], fq_ref.at[b, kvh]
        pair_end = (pair + 1) * (2 * bq)  # the chunk blocks up to the pair's last query
        pair_steps = cached_blocks + (0 if splits else lax.div(pair_end + bk - 1, jnp.array(bk, pair_end.dtype)))

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            q_smem, lse_smem = qo_smem2.at[wg], lse_smem2.at[wg]
            q0 = pair * (2 * bq) + wg * bq
            steps = cached_blocks + (0 if splits else lax.div(q0 + bq + bk - 1, jnp.array(bk, q0.dtype)))
            plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q0, bq), h], q_smem, q_barriers.at[wg])
            plgpu.barrier_wait(q_barriers.at[wg])

            def step(j, carry, mask):
                """mask: "cache" (a column mask: the invalid slots' -inf added in the scaling FMA), "causal"
                (a compare and select per element) or None (a chunk block below the diagonal)."""
                acc, m, l = carry
                slot = lax.rem(j, jnp.array(stages, j.dtype))
                plgpu.barrier_wait(k_barriers.at[slot])
                plgpu.barrier_wait(fq_barriers.at[slot])
                first = plgpu.load(fq_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))

                s = _matmul(q_smem, k_smem.at[slot].transpose((1, 0)), (bq, bk))
                plgpu.barrier_arrive(k_consumed.at[slot])  # the key block and its mask are read
                if mask == "cache":  # first is -1 or HIDDEN; the keys of invalid slots are zeros, so finite
                    s = s * c + lax.broadcast_in_dim(jnp.where(first < 0, 0.0, -jnp.inf), s.shape, [1])
                elif mask == "causal":
                    query = plgpu.broadcasted_iota(jnp.int32, (bq, bk), 0, layout=plgpu.Layout.WGMMA) + q0
                    s = jnp.where(lax.broadcast_in_dim(first, s.shape, [1]) <= query, s * c, -jnp.inf)
                else:
                    s = s * c
                m_new = jnp.maximum(m, s.max(axis=1))
                m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # nothing seen yet: p = 0, not NaN
                alpha = jnp.exp2(m - m_safe)
                p = jnp.exp2(s - lax.broadcast_in_dim(m_safe, s.shape, [0]))
                l = l * alpha + p.sum(axis=1)
                plgpu.barrier_wait(v_barriers.at[slot])
                pv = _matmul(p.astype(dtype), v_smem.at[slot], (bq, D), *(buf.at[wg] for buf in p_smem2))
                plgpu.barrier_arrive(v_consumed.at[slot])
                return acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv, m_new, l

            acc = plgpu.layout_cast(jnp.zeros((bq, D), F32), plgpu.Layout.WGMMA)
            m = plgpu.layout_cast(jnp.full((bq,), -jnp.inf, F32), plgpu.Layout.WGMMA.reduce(1))
            l = plgpu.layout_cast(jnp.zeros((bq,), F32), plgpu.Layout.WGMMA.reduce(1))
            below_diagonal = cached_blocks + (0 if splits else lax.div(q0 + 1, jnp.array(bk, q0.dtype)))
            carry = lax.fori_loop(0, cached_blocks, functools.partial(step, mask="cache"), (acc, m, l))
            carry = lax.fori_loop(cached_blocks, below_diagonal, functools.partial(step, mask=None), carry)
            acc, m, l = lax.fori_loop(below_diagonal, steps, functools.partial(step, mask="causal"), carry)

            @pl.loop(steps, pair_steps)  # the other warpgroup's last block: take it and release its stage
            def _release(j):
                slot = lax.rem(j, jnp.array(stages, j.dtype))
                for loaded, consumed in ((k_barriers, k_consumed), (fq_barriers, None), (v_barriers, v_consumed)):
                    plgpu.barrier_wait(loaded.at[slot])
                    if consumed is not None:
                        plgpu.barrier_arrive(consumed.at[slot])

            q_smem[...] = (acc / lax.broadcast_in_dim(l, acc.shape, [0])).astype(dtype)
            lse_smem[...] = (m + jnp.log2(l)) / LOG2E
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_smem, out_ref.at[b, pl.ds(out_row + q0, bq), h])
            plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, h, pl.ds(out_row + q0, bq)])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")

            @pl.loop(0, pair_steps)
            def _load(j):
                slot = lax.rem(j, jnp.array(stages, j.dtype))
                block = pl.ds((first_block + j) * bk, bk)

                @pl.when(j >= stages)
                def _wait_k():
                    plgpu.barrier_wait(k_consumed.at[slot])

                plgpu.copy_gmem_to_smem(k_ref.at[block], k_smem.at[slot], k_barriers.at[slot])
                plgpu.copy_gmem_to_smem(fq_ref.at[block], fq_smem.at[slot], fq_barriers.at[slot])

                @pl.when(j >= stages)
                def _wait_v():
                    plgpu.barrier_wait(v_consumed.at[slot])

                plgpu.copy_gmem_to_smem(v_ref.at[block], v_smem.at[slot], v_barriers.at[slot])

            @pl.loop(jnp.maximum(pair_steps - stages, 0), pair_steps)  # every stage released: the kernel may end
            def _drain(j):
                slot = lax.rem(j, jnp.array(stages, j.dtype))
                plgpu.barrier_wait(k_consumed.at[slot])
                plgpu.barrier_wait(v_consumed.at[slot])

    rows = T * max(splits, 1)
    out, lse = plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct((B, rows, Hq, D), dtype), jax.ShapeDtypeStruct((B, Hq, rows), F32)),
        grid=(B, Hq, pairs * max(splits, 1)),
        grid_names=("row", "head", "pair"),
        num_threads=3,
        thread_name="wg",
        scratch_types=[
            _smem_tile((2, bq, D), dtype),
            _smem_tile((stages, bk, D), dtype),
            _smem_tile((stages, bk, D), dtype),
            plgpu.SMEM((stages, bk), jnp.int32),
            plgpu.SMEM((2, bq), F32),
            plgpu.Barrier(num_barriers=2),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            *([_smem_tile((2, bq, bk), dtype)] if interpret else []),
        ],
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
    )(q, keys, values, first_query)
    return out, lse


# --------------------------------------------------------------------------------------------------
# Scores: weighted column sums of the exact softmax, key-major.


def _scores(q, keys, first_query, lse2, weights, *, cached_keys: int, reduction: str, cfg: MosaicGpuConfig, interpret):
    """q [B, T, Hq, D] (T a multiple of score_block_q), keys [B, Hkv, K, D] (K a multiple of 2 * score_block_k,
    the first cached_keys of them the cache's), first_query int32 [B, Hkv, K], lse2 f32 [B, Hq, T] (log2 of the
    normaliser; +inf for padding queries), weights f32 [B, T] (0 for padding queries). Returns the increments
    f32 [B, Hkv, K]: reduce over the group's heads g of sum_i weights[i] * p[g, i, key]."""
    B, T, Hq, D = q.shape
    Hkv, K = keys.shape[1], keys.shape[2]
    G = Hq // Hkv
    bk, bq, stages = cfg.score_block_k, cfg.score_block_q, cfg.score_stages
    c = D**-0.5 * LOG2E
    query_blocks = T // bq

    def kernel(
        q_ref,
        k_ref,
        fq_ref,
        lse_ref,
        w_ref,
        inc_ref,
        k_smem2,
        fq_smem2,
        inc_smem2,
        q_smem,
        lse_smem,
        w_smem,
        k_barriers,
        fq_barriers,
        q_barriers,
        lse_barriers,
        w_barriers,
        consumed,
    ):
        b, kvh, pair, wg = (lax.axis_index(n) for n in ("row", "head", "pair", "wg"))
        pair_first = pair * (2 * bk)
        # chunk keys are seen from their own query on: skip the query blocks before the pair's first key
        first_block = lax.div(jnp.maximum(pair_first - cached_keys, 0), jnp.array(bq, pair_first.dtype))
        per_head = query_blocks - first_block

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            k_smem, fq_smem, inc_smem = k_smem2.at[wg], fq_smem2.at[wg], inc_smem2.at[wg]
            k0 = pair_first + wg * bk
            plgpu.copy_gmem_to_smem(k_ref.at[b, kvh, pl.ds(k0, bk)], k_smem, k_barriers.at[wg])
            plgpu.copy_gmem_to_smem(fq_ref.at[b, kvh, pl.ds(k0, bk)], fq_smem, fq_barriers.at[wg])
            plgpu.barrier_wait(k_barriers.at[wg])
            plgpu.barrier_wait(fq_barriers.at[wg])
            first = plgpu.load(fq_smem, layout=plgpu.Layout.WGMMA.reduce(1))
            first = lax.broadcast_in_dim(first, (bk, bq), [0])
            query = plgpu.broadcasted_iota(jnp.int32, (bk, bq), 1, layout=plgpu.Layout.WGMMA)

            def head(g, total):
                def step(j, colsum):
                    i = g * per_head + j - first_block
                    slot = lax.rem(i, jnp.array(stages, i.dtype))
                    plgpu.barrier_wait(q_barriers.at[slot])
                    s = _matmul(k_smem, q_smem.at[slot].transpose((1, 0)), (bk, bq))
                    plgpu.barrier_wait(lse_barriers.at[slot])
                    plgpu.barrier_wait(w_barriers.at[slot])
                    lse = plgpu.load(lse_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
                    w = plgpu.load(w_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
                    plgpu.barrier_arrive(consumed.at[slot])
                    p = jnp.exp2(s * c - lax.broadcast_in_dim(lse, s.shape, [1])) * lax.broadcast_in_dim(
                        w, s.shape, [1]
                    )
                    p = jnp.where(first <= query + j * bq, p, 0.0)
                    return colsum + p.sum(axis=1)

                zeros = plgpu.layout_cast(jnp.zeros((bk,), F32), plgpu.Layout.WGMMA.reduce(1))
                colsum = lax.fori_loop(first_block, query_blocks, step, zeros)
                return jnp.maximum(total, colsum) if reduction == "max" else total + colsum  # sums are >= 0

            total = plgpu.layout_cast(jnp.zeros((bk,), F32), plgpu.Layout.WGMMA.reduce(1))
            total = lax.fori_loop(0, G, head, total)
            inc_smem[...] = total if reduction == "max" else total / G
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(inc_smem, inc_ref.at[b, kvh, pl.ds(k0, bk)])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")

            @pl.loop(0, G * per_head)
            def _load(i):
                slot = lax.rem(i, jnp.array(stages, i.dtype))
                g = lax.div(i, per_head)
                block = pl.ds((first_block + lax.rem(i, per_head)) * bq, bq)
                h = kvh * G + g

                @pl.when(i >= stages)
                def _wait():
                    plgpu.barrier_wait(consumed.at[slot])

                plgpu.copy_gmem_to_smem(q_ref.at[b, block, h], q_smem.at[slot], q_barriers.at[slot])
                plgpu.copy_gmem_to_smem(lse_ref.at[b, h, block], lse_smem.at[slot], lse_barriers.at[slot])
                plgpu.copy_gmem_to_smem(w_ref.at[b, block], w_smem.at[slot], w_barriers.at[slot])

            @pl.loop(jnp.maximum(G * per_head - stages, 0), G * per_head)  # every stage released
            def _drain(i):
                plgpu.barrier_wait(consumed.at[lax.rem(i, jnp.array(stages, i.dtype))])

    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((B, Hkv, K), F32),
        grid=(B, Hkv, K // (2 * bk)),
        grid_names=("row", "head", "pair"),
        num_threads=3,
        thread_name="wg",
        scratch_types=[
            _smem_tile((2, bk, D), q.dtype),
            plgpu.SMEM((2, bk), jnp.int32),
            plgpu.SMEM((2, bk), F32),
            _smem_tile((stages, bq, D), q.dtype),
            plgpu.SMEM((stages, bq), F32),
            plgpu.SMEM((stages, bq), F32),
            plgpu.Barrier(num_barriers=2),
            plgpu.Barrier(num_barriers=2),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        ],
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
    )(q, keys, first_query, lse2, weights)


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
    *,
    config: MosaicGpuConfig = MosaicGpuConfig(),
    interpret=False,
):
    """Same contract as `reference.chunk_attention`, for chunks (T > 1; see `supports`), on Mosaic GPU.
    interpret: False, or a `plgpu.InterpretGPUParams` (GPU interpret mode, on the CPU)."""
    B, T, Hq, D = q.shape
    Hkv, S = k.shape[2], k_cache.shape[2]
    key_block = math.lcm(config.block_k, 2 * config.score_block_k)
    query_block = math.lcm(key_block, 2 * config.block_q, config.score_block_q)
    Sp, Tp = -(-S // key_block) * key_block, -(-T // query_block) * query_block
    if rope is not None:
        k_cache = rope(k_cache, cache_positions)
    k_cache = jnp.where(cache_valid[..., None], k_cache, 0)  # empty slots' keys finite: the forward adds -inf

    def pad(x, axis, n, value=0):
        return jnp.pad(
            x, [(0, n - x.shape[axis]) if a == axis else (0, 0) for a in range(x.ndim)], constant_values=value
        )

    keys = jnp.concatenate([pad(k_cache, 2, Sp), pad(k.swapaxes(1, 2), 2, Tp)], axis=2)
    values = jnp.concatenate([pad(v_cache, 2, Sp), pad(v.swapaxes(1, 2), 2, Tp)], axis=2)
    first_query = jnp.concatenate(
        [pad(jnp.where(cache_valid, -1, HIDDEN), 2, Sp, HIDDEN), jnp.broadcast_to(jnp.arange(Tp), (B, Hkv, Tp))], axis=2
    ).astype(jnp.int32)
    q = pad(q, 1, Tp)
    out, lse = _forward(
        q, keys, values, first_query, cached_blocks=Sp // config.block_k, cfg=config, interpret=interpret
    )
    valid = jnp.arange(Tp)[None, :] < lengths[:, None]  # [B, Tp]
    out = jnp.where(valid[:, :, None, None], out, 0)[:, :T]
    lse = jnp.where(valid[:, None, :], lse, -jnp.inf)
    if query_weights is None:
        return out, lse[..., :T], None, None
    lse2 = jnp.where(valid[:, None, :], lse * LOG2E, jnp.inf)
    weights = jnp.where(valid, pad(query_weights.astype(F32), 1, Tp), 0.0)
    inc = _scores(
        q, keys, first_query, lse2, weights, cached_keys=Sp, reduction=head_reduction, cfg=config, interpret=interpret
    )
    return out, lse[..., :T], inc[..., :S], inc[..., Sp : Sp + T]


PREFIX_PROGRAMS = 256  # aim for about this many programs in the prefix pass (split-K over the prefix's keys)


def supports_prefix(q: jax.Array, k_cache: jax.Array, config: MosaicGpuConfig = MosaicGpuConfig()) -> bool:
    """Whether `prefix_attention` takes the call: bf16 or f16, head_dim 64 or 128, and at least 2 * block_q query
    rows (requests x heads of a group) per prefix row and KV head (fewer would leave the 64-row tiles mostly empty:
    the Triton kernel serves those)."""
    P, R, Hq, D = q.shape
    rows = R * (Hq // k_cache.shape[1])
    return q.dtype in DTYPES and k_cache.dtype == q.dtype and D in HEAD_DIMS and rows >= 2 * config.block_q


def prefix_attention(q, k_cache, v_cache, cache_valid, *, config: MosaicGpuConfig = MosaicGpuConfig(), interpret=False):
    """`reference.prefix_attention` with the keys already rotated (rope=None) and finite keys and values in the
    empty slots (`SharedPrefix` stores zeros there), for calls that `supports_prefix`. The R x G queries of each
    (prefix row, KV head) are the rows of the forward kernel with no chunk part; the prefix's key blocks are cut
    into parts that the kernel attends to separately (enough programs to fill the GPU), merged exactly after.
    A prefix whose slots are not a multiple of block_k is padded (copied) on every call."""
    P, R, Hq, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    G, bk, bq2 = Hq // Hkv, config.block_k, 2 * config.block_q
    rows = R * G
    T = -(-rows // bq2) * bq2
    blocks = -(-S // bk)
    want = max(1, PREFIX_PROGRAMS // (P * Hkv * (T // bq2)))
    splits = max(d for d in range(1, blocks + 1) if blocks % d == 0 and d <= want)
    if blocks * bk != S:
        pad = lambda x, value=0: jnp.pad(
            x, [(0, 0), (0, 0), (0, blocks * bk - S)] + [(0, 0)] * (x.ndim - 3), constant_values=value
        )
        k_cache, v_cache, cache_valid = pad(k_cache), pad(v_cache), pad(cache_valid, False)
    first_query = jnp.where(cache_valid, -1, HIDDEN).astype(jnp.int32)
    qg = q.reshape(P, R, Hkv, G, D).transpose(0, 1, 3, 2, 4).reshape(P, rows, Hkv, D)  # row = request * G + g
    qg = jnp.pad(qg, ((0, 0), (0, T - rows), (0, 0), (0, 0)))
    out, lse = _forward(
        qg,
        k_cache,
        v_cache,
        first_query,
        cached_blocks=blocks // splits,
        cfg=config,
        interpret=interpret,
        splits=splits,
    )
    out = out.reshape(P, splits, T, Hkv, D)
    lse = lse.reshape(P, Hkv, splits, T).transpose(0, 2, 3, 1)  # [P, splits, T, Hkv]
    out = jnp.where(jnp.isneginf(lse)[..., None], 0, out)  # a part with no valid slot: (0, -inf), not NaN
    out, lse = attention_state.merge_all(out, lse, axis=1)  # [P, T, Hkv, (D)]
    out = out[:, :rows].reshape(P, R, G, Hkv, D).transpose(0, 1, 3, 2, 4).reshape(P, R, Hq, D)
    return out, lse[:, :rows].reshape(P, R, G, Hkv).transpose(0, 1, 3, 2).reshape(P, R, Hq)
