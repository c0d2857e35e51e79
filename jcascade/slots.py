"""Cache state and slot machinery (docs/semantics.md §2-4): the arrays every policy keeps, the slot order of ring
caches, and the ring insertion that the ring policies share (`jcascade.policies.ring`).

Slot layout of every ring cache: [sinks | ring 0 | ... | ring N-1 | heavy] (`RingLayout`). K/V stay
where they were written: rings are circular buffers, nothing is concatenated, shifted or sorted.

Where a token goes never depends on scores, only on the row's clock t (non-sink tokens seen): the ring
metadata (fill counts, ring heads) is a closed-form function of t (`pallas_kernels.schedule`). Scores only
decide *which* token sits in a ring's newest slot. So the state stores K, V, score and original position
per slot plus one token counter per row.

`insert` puts a chunk into a ring cache with one vectorised pass per ring, with no loop over tokens: the
arrivals of ring i form units (a write, plus the compare that may follow it), each unit keeps its first
strict maximum, and the units a ring pushes out are the arrivals of ring i+1. Every decision is made on
scores and slot indices; K/V then move once, by one gather and one scatter.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from jcascade import pallas_kernels
from jcascade.pallas_kernels.insert import insert_one
from jcascade.pallas_kernels.schedule import RingLayout, ring_schedules


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CacheState:
    """KV cache of one layer (or of L layers stacked on a leading axis).

    k, v:  [B, Hkv, capacity, D] un-rotated keys/values, in the library's slot order.
    score: f32 [B, Hkv, capacity] EMA attention score per slot (0 for policies that keep none).
    pos:   int32 [B, Hkv, capacity] original token index per slot, -1 for an empty slot.
    seen:  int32 [B] number of tokens each row has received.
    layer: None, or an int32 scalar when this is one layer of a model's stacked cache as its layer loop
           sees it: k and v are then the whole stack [L, B, Hkv, capacity, D], read and written in place
           at `layer` (`cached_kv`, `write_kv`, the kernels' `layer` argument), and the other fields are
           the layer's own. Nothing is copied out of the stack or back.
    """

    k: jax.Array
    v: jax.Array
    score: jax.Array
    pos: jax.Array
    seen: jax.Array
    layer: jax.Array | None = None

    @property
    def capacity(self) -> int:
        return self.k.shape[-2]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Scores:
    """EMA increments returned by `attend` (docs/semantics.md §3): cache f32 [B, Hkv, capacity], chunk f32
    [B, Hkv, T]."""

    cache: jax.Array
    chunk: jax.Array


def cached_positions(state: CacheState) -> jax.Array:
    """int32 [B, Hkv, capacity] (or [L, B, Hkv, capacity] for a stacked cache): original token index held by
    each slot, -1 for empty slots."""
    check_state(state, stacked_ok=True)
    return state.pos


def cached_scores(state: CacheState) -> jax.Array:
    """f32 [B, Hkv, capacity] (or [L, B, Hkv, capacity] for a stacked cache): EMA score of each slot (same
    slot order as `cached_positions`)."""
    check_state(state, stacked_ok=True)
    return state.score


def cached_kv(state: CacheState) -> tuple[jax.Array, jax.Array]:
    """(k, v), each [B, Hkv, capacity, D] (or [L, ...] for a stacked cache), un-rotated, same slot order as
    `cached_positions` (the state's layer of a stacked cache when `state.layer` is set)."""
    check_state(state, stacked_ok=True)
    if state.layer is None:
        return state.k, state.v
    return state.k[state.layer], state.v[state.layer]


def write_kv(state: CacheState, index: tuple, k: jax.Array, v: jax.Array) -> CacheState:
    """The state with its (layer's) k and v set to `k`, `v` at `index` (a NumPy-style index tuple into
    [B, Hkv, capacity, D], `()` for all of it; out-of-range scatter indices are dropped). With `state.layer`
    set this is one scatter into the stack: only the written rows move. state: one layer (`check_state`)."""
    check_state(state)
    if not isinstance(index, tuple):
        raise TypeError(f"index must be a tuple of indices into [batch, num_kv_heads, capacity, head_dim] (() for "
                        f"all of it), got {type(index).__name__}")
    index = index if state.layer is None else (state.layer, *index)
    put = lambda x, val: x.at[index].set(val.astype(x.dtype), mode="drop")
    return dataclasses.replace(state, k=put(state.k, k), v=put(state.v, v))


def rank_by_position(pos: jax.Array) -> jax.Array:
    """int32 [..., S]: rank of each held slot (pos >= 0) among its row's held slots by position, -1 if empty."""
    held = pos >= 0
    order = jnp.argsort(jnp.where(held, pos, jnp.iinfo(jnp.int32).max), axis=-1)
    return jnp.where(held, jnp.argsort(order, axis=-1).astype(jnp.int32), -1)


def slot_ranks(layout: RingLayout, seen: jax.Array) -> jax.Array:
    """int32 [B, capacity]: rank of each slot's token in age order among held tokens (docs/semantics.md §4).

    Sinks come first (sink j -> j), then ring N-1 oldest to newest, ..., ring 0 newest last. Empty slots
    get -1. The rank is the RoPE position of `positions="cache"`.
    """
    S0, W = layout.sinks, layout.ring_size
    sink_slots = jnp.arange(S0, dtype=jnp.int32)
    held_sinks = jnp.minimum(seen, S0)
    ranks = [jnp.where(sink_slots[None] < held_sinks[:, None], sink_slots[None], -1)]
    t = jnp.maximum(seen - S0, 0)
    scheds = ring_schedules(layout)
    fills = [s.fill(t) for s in scheds]
    older = held_sinks  # tokens older than ring i: sinks and rings i+1..N-1
    ring_ranks = []
    for i in reversed(range(layout.num_rings)):
        oldest = (scheds[i].writes(t) - fills[i]) % W
        age = (jnp.arange(W, dtype=jnp.int32)[None] - oldest[:, None]) % W
        ring_ranks.append(jnp.where(age < fills[i][:, None], older[:, None] + age, -1))
        older = older + fills[i]
    ranks.extend(reversed(ring_ranks))
    return jnp.concatenate(ranks, axis=-1)


def tokens_held(layout: RingLayout, seen: jax.Array) -> jax.Array:
    """int32 [B]: number of tokens a row holds."""
    t = jnp.maximum(seen - layout.sinks, 0)
    held = jnp.minimum(seen, layout.sinks)
    for s in ring_schedules(layout):
        held = held + s.fill(t)
    if layout.heavy:  # the one ring pushes out every token past its first W
        held = held + jnp.minimum(jnp.maximum(t - layout.ring_size, 0), layout.heavy)
    return held


# ---------------------------------------------------------------------------------------------------
# The ring insertion.

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


def _insertions(layout: RingLayout, score: jax.Array, held: jax.Array, chunk_score: jax.Array, seen, n,
                place_evicted: PlaceEvicted | None):
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
        e_src = jnp.where(in_chunk, take(app_src, (evicted - first_write[:, None])[:, None]),
                          jnp.where(is_res, res_src[..., None], old_code))
        e_mu = jnp.where(in_chunk, take(app_mu, (evicted - first_write[:, None])[:, None]),
                         jnp.where(is_res, res_mu[..., None], take(score, old_code)))
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


def append_fill(state: CacheState) -> jax.Array:
    """int32 [B]: the slot where a row of an append cache (`RingLayout.appends`, tokens in its first slots)
    places its next token: past every head's held tokens (heads hold different counts after `jc.AdaKV`'s
    compression; the others' empty slots stay masked)."""
    slot = jnp.arange(1, state.pos.shape[-1] + 1, dtype=jnp.int32)
    return jnp.max(jnp.where(state.pos >= 0, slot, 0), axis=(1, 2)).astype(jnp.int32)


CLOCK_LIMIT = 2**31 - 1  # tokens a row can receive: its clock (`seen`) and positions are int32


def check_clock(seen: jax.Array, n: jax.Array) -> None:
    """Raises ValueError (when the values are concrete) if a row's token clock would pass CLOCK_LIMIT."""
    if concrete(seen, n):
        after = np.asarray(seen, np.int64) + np.asarray(n, np.int64)
        if after.max() > CLOCK_LIMIT:
            rows = np.flatnonzero(after > CLOCK_LIMIT).tolist()
            raise ValueError(f"rows {rows} would receive more than {CLOCK_LIMIT} tokens, the limit of the int32 token "
                             "clock: start a new cache (init_cache) for a longer stream")


def check_overflow(policy, placed: jax.Array, n: jax.Array, capacity: int) -> None:
    """Raises on concrete inputs when a row would hold more than `capacity` tokens. Under `jit` it cannot
    raise (the policy decides what an overflowing row does: Full returns NaN for the row's attention,
    the others drop the excess tokens); under `jax.experimental.checkify.checkify` it becomes a checkify
    error naming the first such row and how many tokens it would hold."""
    if concrete(placed, n):
        over = np.asarray(placed) + np.asarray(n) - capacity
        if over.max() > 0:
            raise ValueError(
                f"{type(policy).__name__} cache of {capacity} slots overflows by {over.tolist()} tokens per row "
                "(give init_cache a larger max_tokens)"
            )
        return
    total = placed + n
    checkify.debug_check(jnp.all(total <= capacity), f"{type(policy).__name__} cache of {capacity} slots overflows: "
                         "row {row} would hold {tokens} tokens (give init_cache a larger max_tokens)",
                         row=jnp.argmax(total), tokens=jnp.max(total))


def concrete(*arrays) -> bool:
    """Whether every array has a value now (not traced under jit), so that it can be validated."""
    return not any(isinstance(x, jax.core.Tracer) for x in arrays)


def int_array(x, name: str, shape: tuple[int, ...], low: int, high: int, rule: str, where=None) -> jax.Array:
    """`x` as int32, once checked: an integer array of any width (not float or bool) of `shape` whose entries
    (where `where` is true, if given) lie in [low, high), `rule` in words. The values are compared in x's own
    dtype, before any narrowing (jnp.asarray would turn an int64 2**32 + 5 into 5 without a word). Traced
    values (inside a user's jit) cannot be checked here: there the check is a `checkify.debug_check`, an error
    only under `jax.experimental.checkify.checkify` (docs/reliability.md)."""
    if not isinstance(x, jax.Array):
        x = np.asarray(x)
    wanted = f"{name} must be an integer array of shape {list(shape)}, got {x.dtype}{list(x.shape)}"
    if not np.issubdtype(x.dtype, np.integer):
        raise TypeError(wanted)
    if x.shape != shape:
        raise ValueError(wanted)
    values = np.asarray(x) if concrete(x) else x
    info = np.iinfo(x.dtype)  # bounds beyond the dtype's range cannot be crossed (and would not convert)
    bad = (values < low if low > info.min else np.zeros(shape, bool)) | (values >= high if high <= info.max else False)
    if where is not None:
        bad = bad & (np.asarray(where) if concrete(where) else where)
    if concrete(bad):
        if bad.any():
            at = [tuple(i) for i in np.argwhere(bad)[:5].tolist()]
            raise ValueError(f"{name}: {rule}, got {values[bad][:5].tolist()} at {at}")
    else:
        first = jnp.argmax(bad.ravel())
        checkify.debug_check(~bad.any(), f"{name}: {rule}, got {{value}} at {{at}}", value=jnp.ravel(values)[first],
                             at=jnp.stack(jnp.unravel_index(first, shape)) if shape else first)
    return jnp.asarray(x, jnp.int32)


def check_state(state, name: str = "state", *, stacked_ok: bool = False) -> None:
    """Raises TypeError unless `state` is a `CacheState`, ValueError unless its arrays agree: one layer (k, v
    [B, Hkv, capacity, D], or one layer's view of a stack: `CacheState.layer`), or, with `stacked_ok`, L layers
    stacked on a leading axis (`init_cache(num_layers=L)`). Shapes only: free under jit."""
    if not isinstance(state, CacheState):
        raise TypeError(f"{name} must be a jcascade CacheState (from jc.init_cache), got {type(state).__name__}")
    pos = state.pos.shape
    if len(pos) not in (3, 4) or state.layer is not None and len(pos) != 3:
        raise ValueError(f"{name}.pos must have shape [batch, num_kv_heads, capacity] (or a leading layer axis), got "
                         f"{list(pos)}")
    if len(pos) == 4 and not stacked_ok:
        raise ValueError(f"{name} is a stacked cache of {pos[0]} layers (pos {list(pos)}), this function takes one "
                         f"layer, pos [batch, num_kv_heads, capacity]: pass one layer "
                         "(jax.tree.map(lambda x: x[i], state)) or jax.vmap over the layers")
    lead = pos[:-3] if state.layer is None else state.k.shape[:1]  # () or (L,)
    expected = {"k": (*lead, *pos[-3:], state.k.shape[-1]), "v": (*lead, *pos[-3:], state.k.shape[-1]),
                "score": pos, "seen": pos[:-2]}
    for field, shape in expected.items():
        if getattr(state, field).shape != shape:
            raise ValueError(f"{name}.{field} must have shape {list(shape)} (pos {list(pos)}), got "
                             f"{list(getattr(state, field).shape)}")
    for field in ("pos", "seen"):
        if getattr(state, field).dtype != jnp.int32:
            raise TypeError(f"{name}.{field} must be int32, got {getattr(state, field).dtype}")


def check_chunk(state: CacheState, q, k, v) -> tuple[int, int]:
    """Checks a chunk against a one-layer `state` (`check_state`): k, v [B, T, Hkv, D] with the state's batch,
    num_kv_heads and head_dim, q [B, T, Hq, D] with Hq a multiple of Hkv (None: a chunk without queries), all
    floating arrays. Returns (B, T)."""
    check_state(state)
    B, H, _, D = state.k.shape[-4:]
    for name, x in (("k", k), ("v", v), ("q", q)):
        if x is None and name == "q":
            continue
        if not hasattr(x, "shape") or not jnp.issubdtype(x.dtype, jnp.floating):
            got = f"{x.dtype}{list(x.shape)}" if hasattr(x, "shape") else type(x).__name__
            raise TypeError(f"{name} must be a floating-point array [batch, T, heads, head_dim], got {got}")
    if k.ndim != 4 or k.shape[0] != B or k.shape[2:] != (H, D):
        raise ValueError(f"k must have shape [batch={B}, T, num_kv_heads={H}, head_dim={D}] (the state's), got "
                         f"{list(k.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"v must have the shape of k, {list(k.shape)}, got {list(v.shape)}")
    T = k.shape[1]
    if q is not None and (q.ndim != 4 or q.shape[:2] != (B, T) or q.shape[3] != D or q.shape[2] % H):
        raise ValueError(f"q must have shape [batch={B}, T={T}, Hq, head_dim={D}] with Hq a multiple of "
                         f"num_kv_heads={H}, got {list(q.shape)}")
    return B, T


def check_lengths(lengths, batch: int, chunk_len: int) -> jax.Array:
    """int32 [B] valid-token counts (a prefix of each chunk row), checked by `int_array`; None means the whole
    chunk."""
    if lengths is None:
        return jnp.full((batch,), chunk_len, jnp.int32)
    return int_array(lengths, "lengths", (batch,), 0, chunk_len + 1, f"each must lie in [0, {chunk_len}] (the "
                     "chunk's length)")


def check_rope(rope) -> None:
    """Raises TypeError unless rope is None or a callable (x, positions) -> rotated x."""
    if rope is not None and not callable(rope):
        raise TypeError(f"rope must be None or a callable (x, positions) -> rotated x, such as jc.RoPE(theta), got "
                        f"{type(rope).__name__}")


def insert(layout: RingLayout, state: CacheState, k: jax.Array, v: jax.Array, score: jax.Array,
           chunk_score: jax.Array, placed: jax.Array, n: jax.Array, implementation: str | None = None,
           place_evicted: PlaceEvicted | None = None) -> CacheState:
    """Inserts a chunk into a ring cache (docs/semantics.md §3, step 2). k, v [B, T, H, D] un-rotated; score f32
    [B, H, cap] the residents' scores after step 1; chunk_score f32 [B, H, T]; placed int32 [B] the row's
    slot clock (tokens placed so far: `seen`, or `append_fill` for append caches); n int32 [B] valid
    tokens. A single-token chunk on Triton runs the in-place insertion kernel (layouts without heavy
    slots); everything else runs the vectorised XLA formulation."""
    B, T, H, _ = k.shape
    backend, interpret = pallas_kernels.resolve(implementation)
    if T == 1 and backend in pallas_kernels.GPU_BACKENDS and not layout.heavy:
        score, pos, new_k, new_v = insert_one(layout, score, state.pos, state.k, state.v, chunk_score, k, v,
                                              placed, n, state.seen, layer=state.layer, interpret=interpret)
        return dataclasses.replace(state, k=new_k, v=new_v, score=score, pos=pos, seen=state.seen + n)
    dest, src, mu = _insertions(layout, score, state.pos >= 0, chunk_score, placed, n, place_evicted)
    ck, cv = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # [B, H, T, D]
    chunk_pos = state.seen[:, None, None] + jnp.arange(T, dtype=jnp.int32)
    index = (jnp.arange(B)[:, None, None], jnp.arange(H)[None, :, None], dest)
    write = lambda x, val: x.at[index].set(val.astype(x.dtype), mode="drop")
    old_k, old_v = cached_kv(state)
    state = write_kv(state, index, _gather_items(old_k, ck.astype(old_k.dtype), src),
                     _gather_items(old_v, cv.astype(old_v.dtype), src))
    return dataclasses.replace(
        state,
        score=write(score, mu),
        pos=write(state.pos, _gather_items(state.pos, jnp.broadcast_to(chunk_pos, (B, H, T)), src)),
        seen=state.seen + n,
    )
