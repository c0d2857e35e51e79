"""The cache state every policy keeps (docs/semantics.md §2-4), its accessors and its shape checks.

A `CacheState` holds K, V, an EMA score and the original position per slot, plus one token counter per row, and
the `jc.Kernels` that run its attention and insertion (static). Which token a slot holds follows the policy's
layout (ring caches: `jcascade.slot_order`); K/V stay where they were written.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jcascade.pallas_kernels import Kernels, quantization


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CacheState:
    """KV cache of one layer (or of L layers stacked on a leading axis).

    k, v:  [B, Hkv, capacity, D] un-rotated keys/values, in the library's slot order: in the model's dtype, or
           8-bit codes (int8, float8_e4m3fn: `jcascade.pallas_kernels.quantization`, the policy's `kv_dtype`).
    score: f32 [B, Hkv, capacity] EMA attention score per slot (0 for policies that keep none).
    pos:   int32 [B, Hkv, capacity] original token index per slot, -1 for an empty slot.
    seen:  int32 [B] number of tokens each row has received.
    kernels: (static) the `jc.Kernels` that attend to and insert into this cache (`init_cache`'s `kernels`).
    layer: None, or an int32 scalar when this is one layer of a model's stacked cache as its layer loop
           sees it: k and v are then the whole stack [L, B, Hkv, capacity, D], read and written in place
           at `layer` (`cached_kv`, `write_kv`, the kernels' `layer` argument), and the other fields are
           the layer's own. Nothing is copied out of the stack or back.
    k_scale, v_scale: f32 [B, Hkv, capacity] the scale of each slot's codes (None for a cache in the model's
           dtype), per slot like `score` and `pos`: they move with their token.
    """

    k: jax.Array
    v: jax.Array
    score: jax.Array
    pos: jax.Array
    seen: jax.Array
    kernels: Kernels = dataclasses.field(metadata=dict(static=True))
    layer: jax.Array | None = None
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None

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


def quantize_kv(state: CacheState, k: jax.Array, v: jax.Array):
    """(k codes, v codes, k scales, v scales) of keys and values [..., D] in a quantized `state`'s format."""
    (k, k_scale), (v, v_scale) = (quantization.quantize(x, state.k.dtype) for x in (k, v))
    return k, v, k_scale, v_scale


def layer_fields(state: CacheState) -> tuple[str, ...]:
    """The fields that each layer of a stacked cache holds as its own (`CacheState.layer`): all but K and V, which
    a layer reads and writes in place in the stack."""
    return ("score", "pos", "seen") + (() if state.k_scale is None else ("k_scale", "v_scale"))


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
    dequantized to float32 (code * scale)."""
    check_state(state, stacked_ok=True)
    k, v = stored_kv(state)
    if state.k_scale is None:
        return k, v
    return quantization.dequantize(k, state.k_scale), quantization.dequantize(v, state.v_scale)


def stored_kv(state: CacheState) -> tuple[jax.Array, jax.Array]:
    """(k, v) as the cache stores them (a quantized cache's codes), of the state's layer when `state.layer` is set."""
    return (state.k, state.v) if state.layer is None else (state.k[state.layer], state.v[state.layer])


def write_kv(state: CacheState, index: tuple, k: jax.Array, v: jax.Array) -> CacheState:
    """The state with its (layer's) k and v set to `k`, `v` at `index` (a NumPy-style index tuple into
    [B, Hkv, capacity, D], `()` for all of it; out-of-range scatter indices are dropped). With `state.layer`
    set this is one scatter into the stack: only the written rows move. A quantized cache stores k and v
    quantized, their scales at the same slots. state: one layer (`check_state`)."""
    check_state(state)
    if not isinstance(index, tuple):
        raise TypeError(
            f"index must be a tuple of indices into [batch, num_kv_heads, capacity, head_dim] (() for "
            f"all of it), got {type(index).__name__}"
        )
    if state.k_scale is not None and len(index) > 3:
        raise ValueError(
            f"index must address whole slots of a quantized cache (at most 3 indices into [batch, "
            f"num_kv_heads, capacity, head_dim]: a slot's scale covers its head_dim), got {len(index)}"
        )
    slot_index = index
    index = index if state.layer is None else (state.layer, *index)
    put = lambda x, val, at=index: x.at[at].set(val.astype(x.dtype), mode="drop")
    if state.k_scale is None:
        return dataclasses.replace(state, k=put(state.k, k), v=put(state.v, v))
    k, v, k_scale, v_scale = quantize_kv(state, k, v)
    return dataclasses.replace(
        state,
        k=put(state.k, k),
        v=put(state.v, v),
        k_scale=put(state.k_scale, k_scale, slot_index),
        v_scale=put(state.v_scale, v_scale, slot_index),
    )


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
    quantized = quantization.is_quantized(state.k.dtype)
    if (
        state.v.dtype != state.k.dtype
        or quantized != (state.k_scale is not None)
        or (state.k_scale is None) != (state.v_scale is None)
    ):
        raise ValueError(
            f"{name} must hold k and v of one dtype, with k_scale and v_scale exactly when that is a "
            f"quantized format (int8, float8_e4m3fn); got k {state.k.dtype}, v {state.v.dtype}, "
            f"k_scale {'None' if state.k_scale is None else 'set'}, v_scale "
            f"{'None' if state.v_scale is None else 'set'}"
        )
    if quantized:
        expected |= {"k_scale": pos, "v_scale": pos}
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
