"""`attend`: a chunk's queries against the cache and the chunk itself, with EMA-score increments."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jcascade import cache as C
from jcascade import policies as P
from jcascade import pallas_kernels, selection
from jcascade.rope import rotate_chunk


def query_weights(policy: P.Policy, lengths: jax.Array, chunk_len: int) -> jax.Array | None:
    """f32 [B, T] weight of each query in the score increments, or None for policies without scores.

    Cascade: w_q = (1 - gamma) * gamma**(n - 1 - q) for q < n (DESIGN §3), 0 for padding queries, so that
    a chunk of n tokens moves the EMA exactly as n single-token steps would. H2O: 1 for every valid query.
    SnapKV / PyramidKV: 1 for the last `window` valid queries (the observation window). Recycled: 1 for
    the last valid query.
    """
    if not P.uses_scores(policy):
        return None
    q = jnp.arange(chunk_len, dtype=jnp.int32)[None, :]
    valid = q < lengths[:, None]
    if isinstance(policy, P.H2O):  # accumulated attention: every query counts once
        return valid.astype(jnp.float32)
    if isinstance(policy, (P.SnapKV, P.PyramidKV, P.Recycled)):
        window = 1 if isinstance(policy, P.Recycled) else policy.window
        return (valid & (q >= lengths[:, None] - window)).astype(jnp.float32)
    age = (lengths[:, None] - 1 - q).astype(jnp.float32)
    w = jnp.float32(1.0 - policy.gamma) * jnp.power(jnp.float32(policy.gamma), age)
    return jnp.where(valid, w, 0.0)


def chunk_positions(policy: P.Policy, state: C.CacheState) -> tuple[jax.Array, jax.Array]:
    """RoPE positions (DESIGN §4): keys int32 [B, 1 or Hkv, capacity] and first chunk position int32 [B]."""
    layout = C.layout_of(policy, state)
    if P.position_mode(policy) != "cache":
        return state.pos, state.seen
    if isinstance(policy, P.APPEND_POLICIES):  # held slots come first, in position order
        slot = jnp.arange(state.capacity, dtype=jnp.int32)[None, None, :]
        return jnp.where(state.pos >= 0, slot, -1), C.append_fill(state)
    if layout.heavy:  # heavy slots are not in age order: rank each head's tokens by position
        return selection.rank_by_position(state.pos), C.tokens_held(layout, state.seen)
    return C.slot_ranks(layout, state.seen)[:, None, :], C.tokens_held(layout, state.seen)


def attend(
    policy: P.Policy,
    state: C.CacheState,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lengths: jax.Array | None = None,
    rope=None,
    *,
    implementation: str | None = None,
) -> tuple[jax.Array, C.Scores | None]:
    """Attention of a chunk's queries to every held token and causally to the chunk (DESIGN §2-4).

    q: [B, T, Hq, D]; k, v: [B, T, Hkv, D] un-rotated chunk keys/values (Hq a multiple of Hkv);
    lengths: int32 [B] valid tokens per row (a prefix; padding queries return zeros);
    rope: callable (x, positions) -> rotated x, e.g. `jcascade.RoPE(theta)`; None for no rotation.
    implementation: "xla", "pallas" (Triton on GPU, Mosaic on TPU), "triton" or "mosaic_tpu" (interpret
    mode on the CPU); None picks Pallas on GPU/TPU and XLA on the CPU.
    Returns out [B, T, Hq, D] (q.dtype) and `Scores` (None for policies that keep no scores).
    Under `Full`, rows that overflowed max_tokens return NaN.
    """
    P.check_policy(policy)
    C.check_chunk("k", k, state)
    C.check_chunk("v", v, state)
    B, T, Hkv, D = k.shape
    if q.ndim != 4 or q.shape[:2] != (B, T) or q.shape[3] != D or q.shape[2] % Hkv:
        raise ValueError(
            f"q must have shape [batch={B}, T={T}, Hq, head_dim={D}] with Hq a multiple of "
            f"num_kv_heads={Hkv}, got {q.shape}"
        )
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {k.shape} and {v.shape}")
    n = C.check_lengths(lengths, B, T)
    weights = query_weights(policy, n, T)
    if isinstance(policy, P.Recycled):
        out, inc_cache, inc_chunk = selection.recycled_attend(policy, state, q, k, v, n, rope, implementation, weights)
        return out, C.Scores(cache=inc_cache, chunk=inc_chunk)
    key_pos, start = chunk_positions(policy, state)
    q, k = rotate_chunk(rope, q, k, start)
    out, _, inc_cache, inc_chunk = pallas_kernels.chunk_attention(
        q, k, v, state.k, state.v, state.pos >= 0, key_pos, n,
        weights, getattr(policy, "head_reduction", "max"), rope,
        implementation=implementation,
    )
    if isinstance(policy, P.Full):
        out = jnp.where((state.seen > state.capacity)[:, None, None, None], jnp.nan, out)
    scores = C.Scores(cache=inc_cache, chunk=inc_chunk) if inc_cache is not None else None
    return out, scores
