"""What a cache stores: keys or values as one `Stored` value (data and, for 8-bit codes, their scales), in one of
the KV storage formats (a policy's `kv_dtype`): the model's dtype, or 8-bit codes with a float32 scale per slot.

    "model"          keys and values as the model computes them (bfloat16, float32, ...)
    "int8"           symmetric: codes round(x / s) in [-127, 127], s = max |x| / 127 over the token's head_dim
    "float8_e4m3fn"  codes (x / s) rounded to float8_e4m3fn, s = max |x| / 448 (its largest finite value)

One scale per (token, KV head), stored in the slot beside the codes and moved with them (`Stored.scale`).
Dequantized, x' = code * s, with |x - x'| <= s / 2 = max |x| / 254 per element for int8, and
<= max(2**-4 |x|, 2**-10 s) for float8_e4m3fn (3 mantissa bits; 2**-9 is its smallest subnormal). A row of zeros
has s = 0 and dequantizes to zeros; a non-finite element makes its token's head non-finite.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

KV_DTYPES = ("model", "int8", "float8_e4m3fn")
# the storage dtype and its largest code of each quantized format
FORMATS = {"int8": (jnp.dtype(jnp.int8), 127.0), "float8_e4m3fn": (jnp.dtype(jnp.float8_e4m3fn), 448.0)}


def storage_dtype(kv_dtype: str, model_dtype) -> jnp.dtype:
    """The dtype a cache stores keys and values in: `model_dtype` for "model", else the format's codes."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
    return jnp.dtype(model_dtype) if kv_dtype == "model" else FORMATS[kv_dtype][0]


def is_quantized(dtype) -> bool:
    """Whether a cache of this storage dtype holds codes (and so scales)."""
    return any(jnp.dtype(dtype) == d for d, _ in FORMATS.values())


def quantize(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """x [..., D] floating -> (codes [..., D] of the storage `dtype` (int8 or float8_e4m3fn), scale f32 [...])."""
    name = next((n for n, (d, _) in FORMATS.items() if d == jnp.dtype(dtype)), None)
    if name is None:
        raise ValueError(f"quantize: dtype must be one of {[str(d) for d, _ in FORMATS.values()]}, got {dtype}")
    top = FORMATS[name][1]
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1) / top
    scale = jnp.where(jnp.any(jnp.isnan(x), axis=-1), jnp.nan, scale)  # XLA's max may drop a NaN
    y = x / jnp.where(scale > 0, scale, 1.0)[..., None]
    codes = jnp.clip(jnp.round(y), -top, top) if name == "int8" else y
    return codes.astype(dtype), scale


def dequantize(codes: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
    """codes [..., D], scale f32 [...] -> codes * scale [..., D] in `dtype`."""
    return (codes.astype(jnp.float32) * scale[..., None]).astype(dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Stored:
    """Keys or values as a cache stores them: data [..., D] in the model's dtype, or 8-bit codes with their scales
    f32 [...] (one per slot, per token and KV head); scale is None exactly when data are not codes. The leading axes
    are the caller's ([B, Hkv, capacity], a stack [L, B, Hkv, capacity], a chunk [B, T, Hkv]): `map` applies an
    index operation over them to data and scales alike, so that a token's scale moves with its codes. One layer's
    view of a stacked cache (`CacheState.layer`) holds the whole stack's data and the layer's own scales."""

    data: jax.Array
    scale: jax.Array | None = None

    def __post_init__(self):
        # jax's tree operations build instances of other leaves (shapes, PartitionSpecs, placeholders): check arrays
        if not (hasattr(self.data, "dtype") and hasattr(self.data, "shape")):
            return
        if is_quantized(self.data.dtype) != (self.scale is not None):
            raise ValueError(
                f"Stored holds 8-bit codes with their scales, or data in a floating dtype without: got data "
                f"{self.data.dtype} and scale {'None' if self.scale is None else 'set'}"
            )
        slots = self.data.shape[:-1]
        scale = tuple(getattr(self.scale, "shape", slots))
        if len(scale) > len(slots) or slots[len(slots) - len(scale) :] != scale:
            raise ValueError(
                f"Stored.scale must have shape {list(slots)} (data {list(self.data.shape)}), or its trailing axes "
                f"(a stack read in place at a layer, with the layer's own scales), got {list(self.scale.shape)}"
            )

    @classmethod
    def empty(cls, shape: tuple[int, ...], kv_dtype: str, model_dtype) -> Stored:
        """Zeros of `shape` [..., D] in the format `kv_dtype` ("model": `model_dtype`)."""
        data = jnp.zeros(shape, storage_dtype(kv_dtype, model_dtype))
        return cls(data, jnp.zeros(shape[:-1], jnp.float32) if is_quantized(data.dtype) else None)

    @property
    def quantized(self) -> bool:
        """Whether data are 8-bit codes (with scales)."""
        return self.scale is not None

    @property
    def dtype(self) -> jnp.dtype:
        """The dtype of the stored data (the codes' for a quantized format)."""
        return self.data.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    @property
    def ndim(self) -> int:
        return self.data.ndim

    def encode(self, x: jax.Array) -> Stored:
        """x [..., D] floating in this value's format: quantized to codes and scales, or cast to its dtype."""
        if not self.quantized:
            return Stored(x.astype(self.dtype))
        return Stored(*quantize(x, self.dtype))

    def decode(self, dtype=jnp.float32) -> jax.Array:
        """The data in `dtype`: codes * scale for a quantized format."""
        return dequantize(self.data, self.scale, dtype) if self.quantized else self.data.astype(dtype)

    def map(self, f) -> Stored:
        """f applied to data and scales alike (an index operation over the leading axes, which both share)."""
        return Stored(f(self.data), None if self.scale is None else f(self.scale))

    def map_scale(self, f) -> Stored:
        """f applied to the scales alone (None stays None): the per-layer arrays of a stacked cache."""
        return Stored(self.data, None if self.scale is None else f(self.scale))

    def check_scales(self, name: str, shape: tuple[int, ...]) -> None:
        """Raises ValueError naming `name` unless a quantized value's scales have `shape` (one per slot)."""
        if self.quantized and tuple(self.scale.shape) != tuple(shape):
            raise ValueError(f"{name}.scale must have shape {list(shape)}, got {list(self.scale.shape)}")

    def of_layer(self, layer) -> Stored:
        """Layer `layer`'s value of a stack read in place (from the stack's data, with the layer's own scales:
        `CacheState.layer`); this value when layer is None."""
        return self if layer is None else Stored(self.data[layer], self.scale)

    def slots_from(self, first: int) -> Stored:
        """Slots [first, capacity) of a cache's [..., capacity, D]."""
        return Stored(self.data[..., first:, :], None if self.scale is None else self.scale[..., first:])

    def set(self, index: tuple, x: Stored) -> Stored:
        """This value with `x` (of the same format) written at `index` into the leading axes (NumPy-style; out-of-
        range scatter indices dropped)."""
        if x.quantized != self.quantized:
            raise ValueError(f"Stored.set: x must be in this value's format ({self.dtype}), got {x.dtype}")
        put = lambda old, new: old.at[index].set(new.astype(old.dtype), mode="drop")
        return Stored(put(self.data, x.data), None if self.scale is None else put(self.scale, x.scale))
