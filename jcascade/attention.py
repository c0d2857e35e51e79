"""`attend`: a chunk's queries against the cache and the chunk itself, with EMA-score increments."""

from __future__ import annotations

import jax

from jcascade import slots
from jcascade.policies import Policy, check_policy
from jcascade.slots import CacheState, Scores


def attend(
    policy: Policy,
    state: CacheState,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lengths: jax.Array | None = None,
    rope=None,
) -> tuple[jax.Array, Scores | None]:
    """Attention of a chunk's queries to every held token and causally to the chunk (docs/semantics.md §2-4).

    state: one layer's cache (a stacked one is refused: index a layer or vmap over them);
    q: [B, T, Hq, D]; k, v: [B, T, Hkv, D] un-rotated chunk keys/values (Hq a multiple of Hkv; B, Hkv, D the
    state's); lengths: integer [B] valid tokens per row, in [0, T] (a prefix; padding queries return zeros);
    rope: callable (x, positions) -> rotated x, e.g. `jcascade.RoPE(theta)`; None for no rotation.
    The attention runs on the state's kernels (`CacheState.kernels`, chosen by `init_cache`).
    Returns out [B, T, Hq, D] (q.dtype) and `Scores` (None for policies that keep no scores), as the
    policy's `attend` computes them. Under `Full`, rows that overflowed max_tokens return NaN.
    """
    check_policy(policy)
    B, T = slots.check_chunk(state, q, k, v)
    slots.check_rope(rope)
    n = slots.check_lengths(lengths, B, T)
    return policy.attend(state, q, k, v, n, rope)
