"""KV storage formats (a policy's `kv_dtype`): the model's dtype, or 8-bit codes with a float32 scale per slot.

    "model"          keys and values as the model computes them (bfloat16, float32, ...)
    "int8"           symmetric: codes round(x / s) in [-127, 127], s = max |x| / 127 over the token's head_dim
    "float8_e4m3fn"  codes (x / s) rounded to float8_e4m3fn, s = max |x| / 448 (its largest finite value)

One scale per (token, KV head), stored in the slot beside the codes and moved with them (`CacheState.k_scale`,
`v_scale`). Dequantized, x' = code * s, with |x - x'| <= s / 2 = max |x| / 254 per element for int8, and
<= max(2**-4 |x|, 2**-10 s) for float8_e4m3fn (3 mantissa bits; 2**-9 is its smallest subnormal). A row of zeros
has s = 0 and dequantizes to zeros; a non-finite element makes its token's head non-finite.
"""

from __future__ import annotations

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
