"""Rotary position embeddings (rotate-half layout, as Hugging Face Llama/Qwen2), with Llama-3 scaling and
partial rotation (Qwen3.5's partial, Gemma 4's proportional)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Llama3Scaling:
    """The `rope_scaling` of Llama 3.1+ configs (`rope_type: "llama3"`)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if not self.factor > 0:
            raise ValueError(f"Llama3Scaling.factor must be > 0, got {self.factor}")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                "Llama3Scaling needs 0 < low_freq_factor < high_freq_factor, got "
                f"{self.low_freq_factor} and {self.high_freq_factor}"
            )
        if self.original_max_position_embeddings < 1:
            raise ValueError(
                "Llama3Scaling.original_max_position_embeddings must be >= 1, got "
                f"{self.original_max_position_embeddings}"
            )


@dataclasses.dataclass(frozen=True)
class RoPE:
    """`rope(x, positions)` rotates x [..., D] by integer positions of shape x.shape[:-1] (broadcastable).

    Frequencies theta**(-2i/D) as in Hugging Face, optionally rescaled by `Llama3Scaling`. With `rotary_dim`
    (< D), only the first rotary_dim / 2 frequencies are nonzero (the other pairs pass unrotated): those of a
    RoPE of width rotary_dim (theta**(-2i/rotary_dim)), or with `proportional` (Gemma 4) the first ones of
    width D. Pairs are always (i, i + D/2). The rotation is computed in float32 and cast back to x.dtype.
    """

    theta: float = 10000.0
    scaling: Llama3Scaling | None = None
    rotary_dim: int | None = None
    proportional: bool = False

    def __post_init__(self):
        if not self.theta > 1:
            raise ValueError(f"RoPE.theta must be > 1, got {self.theta}")
        if self.rotary_dim is not None and (self.rotary_dim < 2 or self.rotary_dim % 2):
            raise ValueError(f"RoPE.rotary_dim must be an even int >= 2 or None, got {self.rotary_dim}")

    def inv_freq(self, head_dim: int) -> np.ndarray:
        """float32 [head_dim // 2] inverse frequencies."""
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
        rotary = head_dim if self.rotary_dim is None else self.rotary_dim
        if rotary > head_dim:
            raise ValueError(f"RoPE.rotary_dim ({rotary}) exceeds the head_dim ({head_dim})")
        width = head_dim if self.proportional else rotary
        # float32 throughout, as Hugging Face computes it (parity of positions up to ~1M).
        exponent = np.arange(0, rotary, 2, dtype=np.float32) / np.float32(width)
        inv = np.float32(1.0) / np.float32(self.theta) ** exponent
        if self.scaling is not None:
            s = self.scaling
            wavelen = np.float32(2 * math.pi) / inv
            low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
            high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
            smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
                s.high_freq_factor - s.low_freq_factor
            )
            mid = (1 - smooth) * inv / s.factor + smooth * inv
            inv = np.where(wavelen > low_wavelen, inv / s.factor, np.where(wavelen < high_wavelen, inv, mid))
        return np.concatenate([inv, np.zeros((head_dim - rotary) // 2)]).astype(np.float32)

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        inv = jnp.asarray(self.inv_freq(x.shape[-1]))
        angles = positions.astype(jnp.float32)[..., None] * inv
        cos, sin = jnp.cos(angles), jnp.sin(angles)
        x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
        rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
        return rotated.astype(x.dtype)


def rotate_chunk(rope, q: jax.Array, k: jax.Array | None, start: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    """A chunk's q [B, T, Hq, D] and k [B, T, Hkv, D] (None: the queries alone) rotated by `rope` at positions
    start[b] + 0..T-1 (start int32 [B]); unchanged when rope is None."""
    if rope is None:
        return q, k
    pos = (start[:, None] + jnp.arange(q.shape[1], dtype=jnp.int32)[None, :])[:, :, None]
    return rope(q, pos), None if k is None else rope(k, pos)
