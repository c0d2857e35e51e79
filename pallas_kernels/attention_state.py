"""Attention states (v, lse) and their exact merge (docs/semantics.md §6).

An attention state over a key set is the softmax-normalised output v [..., D] and the log-sum-exp lse
[...] of its logits (natural log). States over disjoint key sets merge exactly; the empty set is the
identity (0, -inf), and merging with it never produces NaN; a NaN state (a non-finite key or query) stays
NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def merge(v_a: jax.Array, lse_a: jax.Array, v_b: jax.Array, lse_b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(v, lse) of the union of two disjoint key sets. v_* [..., D] (any float dtype), lse_* f32 [...]."""
    lse = jnp.logaddexp(lse_a, lse_b)
    empty = jnp.isneginf(lse)
    safe = jnp.where(empty, 0.0, lse)
    w_a = jnp.where(empty, 0.0, jnp.exp(lse_a - safe))[..., None]
    w_b = jnp.where(empty, 0.0, jnp.exp(lse_b - safe))[..., None]
    v = w_a * v_a.astype(jnp.float32) + w_b * v_b.astype(jnp.float32)
    return v, lse


def merge_all(v: jax.Array, lse: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
    """Merges the states stacked along `axis` of lse (and the same axis of v, which has D last)."""
    total = jax.nn.logsumexp(lse, axis=axis, keepdims=True)
    empty = jnp.isneginf(total)
    weights = jnp.where(empty, 0.0, jnp.exp(lse - jnp.where(empty, 0.0, total)))
    out = jnp.sum(weights[..., None] * v.astype(jnp.float32), axis=axis)
    return out, jnp.squeeze(total, axis)
