"""Cache state and slot machinery (docs/semantics.md §2-4): the arrays every policy keeps and the slot order of
ring caches (the ring insertion is the kernel package's: `Kernels.insert`).

Slot layout of every ring cache: [sinks | ring 0 | ... | ring N-1 | heavy] (`RingLayout`). K/V stay
where they were written: rings are circular buffers, nothing is concatenated, shifted or sorted.

Where a token goes never depends on scores, only on the row's clock t (non-sink tokens seen): the ring
metadata (fill counts, ring heads) is a closed-form function of t (`pallas_kernels.schedule`). Scores only
decide *which* token sits in a ring's newest slot. So the state stores K, V, score and original position
per slot plus one token counter per row.

"""

from __future__ import annotations

import dataclasses
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from jcascade.pallas_kernels import Kernels
from jcascade.pallas_kernels.schedule import RingLayout, ring_schedules


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CacheState:
    """KV cache of one layer (or of L layers stacked on a leading axis).

    k, v:  [B, Hkv, capacity, D] un-rotated keys/values, in the library's slot order.
    score: f32 [B, Hkv, capacity] EMA attention score per slot (0 for policies that keep none).
    pos:   int32 [B, Hkv, capacity] original token index per slot, -1 for an empty slot.
    seen:  int32 [B] number of tokens each row has received.
    kernels: (static) the `jc.Kernels` that attend to and insert into this cache (`init_cache`'s `kernels`).
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
    kernels: Kernels = dataclasses.field(metadata=dict(static=True))
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
    if not isinstance(state.kernels, Kernels):
        raise TypeError(f"{name}.kernels must be a jc.Kernels (init_cache sets it), got {type(state.kernels).__name__}")
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
