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
    *,
    implementation: str | None = None,
) -> tuple[jax.Array, Scores | None]:
    """Attention of a chunk's queries to every held token and causally to the chunk (DESIGN §2-4).

    q: [B, T, Hq, D]; k, v: [B, T, Hkv, D] un-rotated chunk keys/values (Hq a multiple of Hkv);
    lengths: int32 [B] valid tokens per row (a prefix; padding queries return zeros);
    rope: callable (x, positions) -> rotated x, e.g. `jcascade.RoPE(theta)`; None for no rotation.
    implementation: "xla", "pallas" (on GPU Mosaic GPU for bf16/f16 chunks on Hopper, else Triton; Mosaic on
    TPU), "triton", "mosaic_gpu" or "mosaic_tpu" (interpret mode on the CPU); None picks Pallas on GPU/TPU and
    XLA on the CPU (`jcascade.pallas_kernels` says which kernel runs what).
    Returns out [B, T, Hq, D] (q.dtype) and `Scores` (None for policies that keep no scores), as the
    policy's `attend` computes them. Under `Full`, rows that overflowed max_tokens return NaN.
    """
    check_policy(policy)
    slots.check_chunk("k", k, state)
    slots.check_chunk("v", v, state)
    B, T, Hkv, D = k.shape
    if q.ndim != 4 or q.shape[:2] != (B, T) or q.shape[3] != D or q.shape[2] % Hkv:
        raise ValueError(
            f"q must have shape [batch={B}, T={T}, Hq, head_dim={D}] with Hq a multiple of "
            f"num_kv_heads={Hkv}, got {q.shape}"
        )
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {k.shape} and {v.shape}")
    n = slots.check_lengths(lengths, B, T)
    return policy.attend(state, q, k, v, n, rope, implementation)
