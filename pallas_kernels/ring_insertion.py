"""The ring insertion in plain XLA (docs/semantics.md §3, step 2): a chunk into a ring-layout cache.

The arrivals of ring i form units (a write, plus the compare that may follow it), each unit keeps its first
strict maximum, and the units a ring pushes out are the arrivals of ring i+1: one vectorised pass per ring,
no loop over tokens. Every decision is made on scores and slot indices; K/V then move once, by one gather
and one scatter. This is the path of chunks (T > 1) and the reference of the single-token Triton kernel
(`triton_insert.insert_one`); `Kernels.insert` chooses between them.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from .schedule import RingLayout, ring_schedules
from .storage import Stored

# place_evicted(layout, score, held, src, mu, valid) -> (dest, src, mu): where the tokens the last ring
# evicts go, for layouts with heavy slots (H2O). src, mu [B, H, M] are the evictees (codes and scores as
# in `_insertions`), valid bool [B, M]; dest int32 [B, H, M] is a heavy slot or capacity (dropped).
PlaceEvicted = Callable[..., tuple[jax.Array, jax.Array, jax.Array]]


def take(x: jax.Array, idx: jax.Array) -> jax.Array:
    """x [B, H, S], idx [B, H or 1, M] (clipped to range) -> [B, H, M]."""
    idx = jnp.broadcast_to(jnp.clip(idx, 0, x.shape[-1] - 1), (*x.shape[:2], idx.shape[-1]))
    return jnp.take_along_axis(x, idx, axis=-1)


def compact(x: jax.Array, keep: jax.Array, size: int) -> jax.Array:
    """Moves x[..., k] with keep[b, (h,) k] to the front, in order: x [B, H, M], keep [B, M] or
    [B, H, M] -> [B, H, size]."""
    keep = keep if keep.ndim == 3 else keep[:, None, :]
    dest = jnp.where(keep, jnp.cumsum(keep, axis=-1) - 1, size)
    B, H = x.shape[:2]
    bi, hi = jnp.arange(B)[:, None, None], jnp.arange(H)[None, :, None]
    return jnp.zeros((B, H, size), x.dtype).at[bi, hi, dest].set(x, mode="drop")


def _shift_left(x: jax.Array, fill) -> jax.Array:
    """x[..., k+1] at position k, `fill` at the end."""
    return jnp.concatenate([x[..., 1:], jnp.full((*x.shape[:-1], 1), fill, x.dtype)], axis=-1)


def _insertions(
    layout: RingLayout,
    score: jax.Array,
    held: jax.Array,
    chunk_score: jax.Array,
    seen,
    n,
    place_evicted: PlaceEvicted | None,
):
    """Where each chunk token and each moving resident goes (docs/semantics.md §3, step 2).

    score: f32 [B, H, cap] resident scores after step 1; held: bool [B, H, cap] slots holding a token;
    chunk_score: f32 [B, H, T]; seen, n: int32 [B].
    Sources are codes into [old slots (0..cap-1) | chunk tokens (cap..cap+T-1)].
    Returns dest int32 [B, H, L] (cap = no write), src int32 [B, H, L], mu f32 [B, H, L]: slot
    dest[b, h, l] receives item src[b, h, l] with score mu[b, h, l]. Destinations of a (row, head) are
    distinct.
    """
    S0, W, cap = layout.sinks, layout.ring_size, layout.capacity
    B, H, T = chunk_score.shape
    need = jnp.clip(S0 - seen, 0, n)  # chunk tokens that become sinks
    dests, srcs, mus = [], [], []

    if S0:
        d = jnp.arange(min(S0, T), dtype=jnp.int32)[None]
        dests.append(jnp.where(d < need[:, None], seen[:, None] + d, cap))
        srcs.append(jnp.broadcast_to((cap + d)[:, None], (B, H, d.shape[-1])))
        mus.append(chunk_score[..., : d.shape[-1]])

    # Arrivals of ring 0: the non-sink chunk tokens, clocks t0, t0+1, ...
    t0 = jnp.maximum(seen - S0, 0)
    k = jnp.arange(T, dtype=jnp.int32)[None]
    valid = k < (n - need)[:, None]  # [B, M]
    clock = t0[:, None] + k
    a_src = jnp.broadcast_to((cap + jnp.minimum(need[:, None] + k, T - 1))[:, None], (B, H, T))
    a_mu = take(chunk_score, (need[:, None] + k)[:, None])

    for i, sched in enumerate(ring_schedules(layout)):
        M = a_src.shape[-1]
        base = S0 + i * W
        first_write = sched.writes(t0)  # [B] ring writes before this chunk (write k goes to slot k mod W)
        arrival = sched.arrivals(t0)[:, None] + jnp.arange(M, dtype=jnp.int32)[None]
        is_fill = valid & (arrival < W)
        is_accept = valid & ~is_fill & sched.accepting(clock)
        is_compare = valid & ~is_fill & ~is_accept
        starts = is_fill | is_accept
        unit = jnp.cumsum(starts, axis=-1) - 1  # chunk-local write index of each arrival's unit
        num_units = unit[:, -1] + 1

        # A unit is a fill or accept plus the compare that may follow it; the first strict max stays.
        next_wins = _shift_left(is_compare, False)[:, None] & (_shift_left(a_mu, -jnp.inf) > a_mu)
        w_src = jnp.where(next_wins, _shift_left(a_src, 0), a_src)
        w_mu = jnp.where(next_wins, _shift_left(a_mu, 0.0), a_mu)
        app_src, app_mu = compact(w_src, starts, M), compact(w_mu, starts, M)

        # A compare arriving first plays against the ring's newest resident.
        res_code = base + (first_write - 1) % W  # [B]
        res_mu = take(score, res_code[:, None, None])[..., 0]  # [B, H]
        res_wins = is_compare[:, :1] & (a_mu[..., 0] > res_mu)
        res_src = jnp.where(res_wins, a_src[..., 0], res_code[:, None])
        res_mu = jnp.where(res_wins, a_mu[..., 0], res_mu)

        # Slots written in this chunk: the last min(W, units) unit winners, and the resident.
        d = jnp.arange(min(W, M), dtype=jnp.int32)[None]
        u = num_units[:, None] - 1 - d
        dests.append(jnp.where(d < jnp.minimum(num_units, W)[:, None], base + (first_write[:, None] + u) % W, cap))
        srcs.append(take(app_src, u[:, None]))
        mus.append(take(app_mu, u[:, None]))
        dests.append(jnp.where(is_compare[:, 0] & (num_units < W), res_code, cap)[:, None])
        srcs.append(res_src[..., None])
        mus.append(res_mu[..., None])

        if i + 1 == layout.num_rings and not layout.heavy:
            break
        # Each accept pushes out the item written W writes earlier: the arrivals of ring i+1.
        evicted = first_write[:, None] + unit - W  # ring write index of the evictee
        in_chunk = (evicted >= first_write[:, None])[:, None]
        is_res = (evicted == first_write[:, None] - 1)[:, None]
        old_code = (base + evicted % W)[:, None]
        e_src = jnp.where(
            in_chunk,
            take(app_src, (evicted - first_write[:, None])[:, None]),
            jnp.where(is_res, res_src[..., None], old_code),
        )
        e_mu = jnp.where(
            in_chunk,
            take(app_mu, (evicted - first_write[:, None])[:, None]),
            jnp.where(is_res, res_mu[..., None], take(score, old_code)),
        )
        a_src = compact(e_src, is_accept, M)
        a_mu = compact(e_mu, is_accept, M)
        clock = compact(clock[:, None], is_accept, M)[:, 0]
        valid = jnp.arange(M)[None] < jnp.sum(is_accept, axis=-1, keepdims=True)

    if not dests:  # heavy slots only (TOVA): every chunk token competes for them
        dests, srcs, mus = [jnp.zeros((B, 0), jnp.int32)], [jnp.zeros((B, H, 0), jnp.int32)], [jnp.zeros((B, H, 0))]
    dest = jnp.broadcast_to(jnp.concatenate(dests, -1)[:, None], (B, H, sum(d.shape[-1] for d in dests)))
    src, mu = jnp.concatenate(srcs, -1), jnp.concatenate(mus, -1)
    if layout.heavy:  # the last ring's evictees (now the arrivals a_*) compete for the heavy slots
        heavy_dest, heavy_src, heavy_mu = place_evicted(layout, score, held, a_src, a_mu, valid)
        dest = jnp.concatenate([dest, heavy_dest], -1)
        src, mu = jnp.concatenate([src, heavy_src], -1), jnp.concatenate([mu, heavy_mu], -1)
    return dest, src, mu


def _gather_items(old: jax.Array, chunk: jax.Array, src: jax.Array) -> jax.Array:
    """Rows src [B, H, L] of [old [B, H, cap, ...] | chunk [B, H, T, ...]] -> [B, H, L, ...]."""
    cap, T = old.shape[2], chunk.shape[2]
    extra = (1,) * (old.ndim - 3)
    from_chunk = (src >= cap).reshape(*src.shape, *extra)
    old_idx = jnp.clip(src, 0, cap - 1).reshape(*src.shape, *extra)
    chunk_idx = jnp.clip(src - cap, 0, T - 1).reshape(*src.shape, *extra)
    return jnp.where(
        from_chunk,
        jnp.take_along_axis(chunk, chunk_idx, axis=2),
        jnp.take_along_axis(old, old_idx, axis=2),
    )


def insert_chunk(
    layout: RingLayout,
    k_cache: Stored,
    v_cache: Stored,
    layer: jax.Array | None,
    score: jax.Array,
    pos: jax.Array,
    seen: jax.Array,
    k: Stored,
    v: Stored,
    chunk_score: jax.Array,
    placed: jax.Array,
    n: jax.Array,
    place_evicted: PlaceEvicted | None = None,
):
    """A chunk into a ring cache. k_cache, v_cache `Stored` [B, H, cap, D], or a stack [L, B, H, cap, D] written at
    `layer` (an int32 scalar; None: not a stack; the layer's own scales [B, H, cap] for codes); score f32 [B, H, cap]
    the residents' scores after step 1; pos int32 [B, H, cap]; seen int32 [B] tokens each row has received; k, v
    `Stored` [B, T, H, D] the chunk un-rotated, in the cache's format; chunk_score f32 [B, H, T]; placed int32 [B]
    the row's slot clock (tokens placed so far: `seen`, or the first free slot of an append cache); n int32 [B]
    valid tokens. A quantized token's scale moves with its codes. Returns the new (k_cache, v_cache, score, pos)."""
    B, T, H, _ = k.shape
    dest, src, mu = _insertions(layout, score, pos >= 0, chunk_score, placed, n, place_evicted)
    index = (jnp.arange(B)[:, None, None], jnp.arange(H)[None, :, None], dest)
    write = lambda x, val: x.at[index].set(val.astype(x.dtype), mode="drop")
    kv_index = index if layer is None else (layer, *index)
    chunk_pos = jnp.broadcast_to(seen[:, None, None] + jnp.arange(T, dtype=jnp.int32), (B, H, T))
    moved = []
    for cache, chunk in ((k_cache, k), (v_cache, v)):
        chunk = chunk.map(lambda x: jnp.swapaxes(x, 1, 2))  # [B, H, T, ...]
        items = _gather_items(cache.of_layer(layer).data, chunk.data.astype(cache.dtype), src)
        data = cache.data.at[kv_index].set(items, mode="drop")
        moved.append(Stored(data, cache.map_scale(lambda old: write(old, _gather_items(old, chunk.scale, src))).scale))
    return moved[0], moved[1], write(score, mu), write(pos, _gather_items(pos, chunk_pos, src))
