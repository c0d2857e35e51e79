"""The cache state every policy keeps (docs/semantics.md §2-4), its accessors and its shape checks.

A `CacheState` holds K, V, an EMA score and the original position per slot, plus one token counter per row, and
the `jc.Kernels` that run its attention and insertion (static). Which token a slot holds follows the policy's
layout (ring caches: `jcascade.slot_order`); K/V stay where they were written.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jcascade.pallas_kernels import Kernels
from jcascade.pallas_kernels.storage import Stored


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CacheState:
    """KV cache of one layer (or of L layers stacked on a leading axis).

    k, v:  `Stored` [B, Hkv, capacity, D] keys/values in the library's slot order: in the model's dtype, or
           8-bit codes with a scale per slot (int8, float8_e4m3fn: `jcascade.pallas_kernels.storage`, the policy's
           `kv_dtype`); a slot's scale moves with its token. The keys are un-rotated, or rotated by `rope` at their
           original positions (`pos`).
    score: f32 [B, Hkv, capacity] EMA attention score per slot (0 for policies that keep none).
    pos:   int32 [B, Hkv, capacity] original token index per slot, -1 for an empty slot.
    seen:  int32 [B] number of tokens each row has received.
    kernels: (static) the `jc.Kernels` that attend to and insert into this cache (`init_cache`'s `kernels`).
    layer: None, or an int32 scalar when this is one layer of a model's stacked cache as its layer loop
           sees it: k and v are then the whole stack [L, B, Hkv, capacity, D], read and written in place
           at `layer` (`cached_kv`, `write_kv`, the kernels' `layer` argument), and the other fields (the
           codes' scales among them: `map_layer_fields`) are the layer's own. Nothing is copied out of the stack
           or back.
    rope:  (static) None: the keys are stored as computed (un-rotated), and the attention rotates them at the
           policy's key positions as it reads them; or the RoPE (`init_cache`'s `rope`) the keys are stored rotated
           by, at their original positions, once on their way in (`update`, `write_kv`): the attention reads them as
           they are where positions are the tokens' own (docs/semantics.md §4).
    """

    k: Stored
    v: Stored
    score: jax.Array
    pos: jax.Array
    seen: jax.Array
    kernels: Kernels = dataclasses.field(metadata=dict(static=True))
    layer: jax.Array | None = None
    rope: object = dataclasses.field(default=None, metadata=dict(static=True))

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


def encode_kv(state: CacheState, k: jax.Array, v: jax.Array, positions: jax.Array) -> tuple[Stored, Stored]:
    """Un-rotated keys and values [..., D] of the tokens at original `positions` (int32, broadcastable to [...]) as
    `state` stores them: the keys rotated there by `state.rope` (if any), both in its format (`Stored.encode`)."""
    if state.rope is not None:
        k = state.rope(k, positions)
    return state.k.encode(k), state.v.encode(v)


def encode_chunk(state: CacheState, k: jax.Array, v: jax.Array) -> tuple[Stored, Stored]:
    """`encode_kv` of a chunk k, v [B, T, Hkv, D] that follows the row's tokens (positions seen + 0..T-1)."""
    positions = state.seen[:, None, None] + jnp.arange(k.shape[1], dtype=jnp.int32)[None, :, None]
    return encode_kv(state, k, v, positions)


def key_rotation(state: CacheState, key_pos: jax.Array) -> jax.Array:
    """int32 (key_pos's shape, broadcast with `state.pos`): the positions by which to rotate the stored keys so that
    they sit at `key_pos`: key_pos itself for un-rotated keys, key_pos - pos for keys stored rotated at `pos`."""
    return key_pos if state.rope is None else jnp.where(state.pos >= 0, key_pos - state.pos, 0)


def read_rotation(state: CacheState, rope, key_pos: jax.Array, own_positions: bool) -> tuple[object, jax.Array]:
    """(rope, positions) with which an attention kernel rotates the held keys so that they sit at `key_pos`
    (`Kernels.chunk_attention`'s rope and cache_positions): `rope` at key_pos for un-rotated keys; nothing for keys
    stored rotated where key_pos are the tokens' own positions (`own_positions`); else `rope` at `key_rotation`."""
    if state.rope is None:
        return rope, key_pos
    return (None, key_pos) if own_positions else (rope, key_rotation(state, key_pos))


def check_stored_rope(state: CacheState, rope) -> None:
    """Raises ValueError unless a cache storing keys rotated (`CacheState.rope`) is attended with that rope."""
    if state.rope is not None and rope != state.rope:
        raise ValueError(
            f"rope must be the RoPE this cache stores its keys rotated by ({state.rope!r}, init_cache's rope), "
            f"got {rope!r}"
        )


def held_keys(state: CacheState, rope, key_pos: jax.Array) -> jax.Array:
    """f32 [B, Hkv, capacity, D] (or the layer's, `state.layer`): the held keys rotated by `rope` at `key_pos`
    (from un-rotated keys, or from keys stored rotated at their own positions: `key_rotation`), dequantized;
    as stored when rope is None. An XLA computation: the kernels rotate in their registers."""
    keys = stored_kv(state)[0].decode()
    return keys if rope is None else rope(keys, key_rotation(state, key_pos))


def map_layer_fields(f, state: CacheState, *others: CacheState, **changes) -> CacheState:
    """`state` with each array that a layer of a stacked cache holds as its own (`CacheState.layer`: score, pos,
    seen and the codes' scales; not the K/V data, which a layer reads and writes in place in the stack) replaced by
    f(that array, the same array of each of `others`), and the fields in `changes` set."""
    new = {name: f(getattr(state, name), *(getattr(o, name) for o in others)) for name in ("score", "pos", "seen")}
    for name in ("k", "v"):
        scales = [getattr(o, name).scale for o in others]
        new[name] = getattr(state, name).map_scale(lambda x: f(x, *scales))
    return dataclasses.replace(state, **new, **changes)


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
    `cached_positions` (the state's layer of a stacked cache when `state.layer` is set); a quantized cache's
    dequantized to float32 (code * scale); keys stored rotated (`CacheState.rope`) rotated back, in float32."""
    check_state(state, stacked_ok=True)
    k, v = stored_kv(state)
    if state.rope is not None:
        return state.rope(k.decode(), -state.pos), v.decode() if v.quantized else v.data
    return (k.decode(), v.decode()) if k.quantized else (k.data, v.data)


def stored_kv(state: CacheState) -> tuple[Stored, Stored]:
    """(k, v) as the cache stores them, of the state's layer when `state.layer` is set."""
    return state.k.of_layer(state.layer), state.v.of_layer(state.layer)


def write_kv(state: CacheState, index: tuple, k: jax.Array, v: jax.Array, positions=None) -> CacheState:
    """The state with its (layer's) k and v set to `k`, `v` (un-rotated) at `index` (a NumPy-style index tuple into
    [B, Hkv, capacity, D], `()` for all of it; out-of-range scatter indices are dropped). With `state.layer`
    set this is one scatter into the stack: only the written rows move. A quantized cache stores k and v
    quantized, their scales at the same slots. positions: int32, broadcastable to the written keys' [...] (without
    head_dim): the tokens' original positions, at which a cache storing keys rotated (`CacheState.rope`) rotates
    them (required there; the state's `pos` is the caller's to set). state: one layer (`check_state`)."""
    check_state(state)
    if state.rope is not None and positions is None:
        raise ValueError(
            "positions must be given: this cache stores keys rotated at their original positions "
            f"(CacheState.rope = {state.rope!r}); pass the written tokens' positions"
        )
    if not isinstance(index, tuple):
        raise TypeError(
            f"index must be a tuple of indices into [batch, num_kv_heads, capacity, head_dim] (() for "
            f"all of it), got {type(index).__name__}"
        )
    if state.k.quantized and len(index) > 3:
        raise ValueError(
            f"index must address whole slots of a quantized cache (at most 3 indices into [batch, "
            f"num_kv_heads, capacity, head_dim]: a slot's scale covers its head_dim), got {len(index)}"
        )
    k, v = encode_kv(state, k, v, positions)
    if state.layer is None:
        return dataclasses.replace(state, k=state.k.set(index, k), v=state.v.set(index, v))
    # the layer's codes in the stack, its own scales
    put = lambda old, new: old.at[(state.layer, *index)].set(new.data.astype(old.dtype), mode="drop")
    k_new, v_new = (
        Stored(put(old.data, new), old.map_scale(lambda s, new=new: s.at[index].set(new.scale, mode="drop")).scale)
        for old, new in ((state.k, k), (state.v, v))
    )
    return dataclasses.replace(state, k=k_new, v=v_new)


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
        raise ValueError(
            f"{name}.pos must have shape [batch, num_kv_heads, capacity] (or a leading layer axis), got {list(pos)}"
        )
    if len(pos) == 4 and not stacked_ok:
        raise ValueError(
            f"{name} is a stacked cache of {pos[0]} layers (pos {list(pos)}), this function takes one "
            f"layer, pos [batch, num_kv_heads, capacity]: pass one layer "
            "(jax.tree.map(lambda x: x[i], state)) or jax.vmap over the layers"
        )
    lead = pos[:-3] if state.layer is None else state.k.shape[:1]  # () or (L,)
    expected = {
        "k": (*lead, *pos[-3:], state.k.shape[-1]),
        "v": (*lead, *pos[-3:], state.k.shape[-1]),
        "score": pos,
        "seen": pos[:-2],
    }
    if not (isinstance(state.k, Stored) and isinstance(state.v, Stored)) or state.v.dtype != state.k.dtype:
        raise ValueError(
            f"{name} must hold k and v as Stored values of one format, got k {type(state.k).__name__} "
            f"{getattr(state.k, 'dtype', '')}, v {type(state.v).__name__} {getattr(state.v, 'dtype', '')}"
        )
    for field in ("k", "v"):
        getattr(state, field).check_scales(f"{name}.{field}", pos)
    for field, shape in expected.items():
        if getattr(state, field).shape != shape:
            raise ValueError(
                f"{name}.{field} must have shape {list(shape)} (pos {list(pos)}), got "
                f"{list(getattr(state, field).shape)}"
            )
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
        raise ValueError(
            f"k must have shape [batch={B}, T, num_kv_heads={H}, head_dim={D}] (the state's), got {list(k.shape)}"
        )
    if v.shape != k.shape:
        raise ValueError(f"v must have the shape of k, {list(k.shape)}, got {list(v.shape)}")
    T = k.shape[1]
    if q is not None and (q.ndim != 4 or q.shape[:2] != (B, T) or q.shape[3] != D or q.shape[2] % H):
        raise ValueError(
            f"q must have shape [batch={B}, T={T}, Hq, head_dim={D}] with Hq a multiple of "
            f"num_kv_heads={H}, got {list(q.shape)}"
        )
    return B, T
