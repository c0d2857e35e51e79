"""Shared-prefix (cascade) attention (FlashInfer's "Cascade Inference"; docs/semantics.md §6).

Requests that share a prefix attend to its cache once, as one multi-query pass, and to their own suffix
cache separately; the two attention states (v, lse) merge exactly. A prefix can be any policy's cache
after its prompt (a Full cache, or a compressed one: Cascade, SnapKV, ...); it is frozen while the
requests decode. Levels nest: a tree of prefixes (one system prompt, then per-user histories) is a list
of levels, level i holding P_i rows, each row serving B / P_i consecutive requests.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jcascade import cache_state, checks
from jcascade.pallas_kernels.attention_state import merge
from jcascade.pallas_kernels.storage import Stored
from jcascade.policies import Policy, check_policy, policy_names
from jcascade.rope import rotate_chunk


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SharedPrefix:
    """One level of shared prefixes (one layer, or L layers stacked on a leading axis).

    k, v:    `Stored` [P, Hkv, S, D] keys/values of the P prefix rows (zeros in empty slots); the keys un-rotated,
             or rotated at key_pos when `rope` is set; in a format of `jcascade.pallas_kernels.storage` (8-bit
             codes with a scale per slot, or floats);
    valid:   bool [P, Hkv, S] slots that hold a token;
    key_pos: int32 [P, 1 or Hkv, S] RoPE position of each slot;
    length:  int32 [P] the first position after the prefix (including the levels before it): where the
             next level, or its requests' own tokens, start;
    rope:    (static) None, or the RoPE that k was rotated with (`share_prefix(..., rope=)`): the requests must
             decode with the same one, and no step rotates the prefix's keys again.
    """

    k: Stored
    v: Stored
    valid: jax.Array
    key_pos: jax.Array
    length: jax.Array
    rope: object = dataclasses.field(default=None, metadata=dict(static=True))


def share_prefix(
    policy: Policy, state: cache_state.CacheState, offset: jax.Array | int = 0, rope=None, dtype=None
) -> SharedPrefix:
    """The cache `state` (one layer; its batch rows become the prefix rows), as `policy` positions it,
    shifted by `offset` (an int, or an integer array [P]: positions of the levels before it, >= 0). rope: the
    RoPE the requests decode with, or None; when given, the keys are stored rotated at their positions (which a
    frozen prefix never changes), so that decoding reads them without rotating them in every step (and, on a
    Hopper GPU, many requests' queries run on the tensor-core kernel, `Kernels.prefix_attention`). dtype: None
    stores the keys and values as the cache does: a quantized cache's prefix holds its codes and scales as they are
    where it can: un-rotated from a cache storing them so (whatever `rope` says: rotating would round them a second
    time; the requests' steps rotate them as they read, in the GPU kernel's registers), rotated from a cache storing
    them rotated at the tokens' own positions when those are the prefix's (no offset, "original" positions) and
    `rope` is given; otherwise the keys are rotated to the prefix's positions (or back, rope None) and encoded
    anew. A floating dtype stores them dequantized in it."""
    check_policy(policy)
    if not policy.shareable:
        raise ValueError(f"{type(policy).__name__} cannot be a shared prefix (its cache is chosen per request)")
    cache_state.check_state(state)
    checks.check_rope(rope)
    if state.rope is not None and rope is not None and rope != state.rope:
        raise ValueError(
            f"rope must be None or the RoPE the cache stores its keys rotated by ({state.rope!r}), got {rope!r}"
        )
    unshifted = isinstance(offset, int) and offset == 0
    shape = () if np.ndim(offset) == 0 else state.seen.shape  # an int, or one per prefix row
    offset = checks.int_array(
        offset,
        "offset",
        shape,
        0,
        checks.CLOCK_LIMIT + 1,
        f"each must lie in [0, {checks.CLOCK_LIMIT}] (the positions of the levels before it)",
    )
    key_pos, start = policy.key_positions(state)
    offset = jnp.broadcast_to(offset, start.shape)
    key_pos = jnp.where(key_pos >= 0, key_pos + offset[:, None, None], -1)
    valid = state.pos >= 0
    if dtype is not None and not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"dtype must be None (the cache's storage) or a floating dtype, got {dtype}")
    stored_k, stored_v = cache_state.stored_kv(state)
    empty = lambda x: jnp.where(valid.reshape(valid.shape + (1,) * (x.ndim - 3)), x, jnp.zeros((), x.dtype))
    keys = lambda: cache_state.cached_kv(state)[0] if rope is None else cache_state.held_keys(state, rope, key_pos)
    if stored_k.quantized and dtype is None:  # codes and scales, zero in empty slots
        if state.rope is None:  # as they are, un-rotated: the requests' steps rotate them as they read
            rotated = None
        elif rope is not None and unshifted and policy.positions != "cache":  # as they are, rotated where needed
            rotated = rope
        else:  # rotated to the prefix's positions (or back), and encoded anew
            stored_k, rotated = stored_k.encode(keys()), rope
        k, v = stored_k.map(empty), stored_v.map(empty)
        return SharedPrefix(k=k, v=v, valid=valid, key_pos=key_pos, length=start + offset, rope=rotated)
    target = dtype or stored_k.dtype
    k, v = (Stored(empty(x).astype(target)) for x in (keys(), stored_v.decode()))
    return SharedPrefix(k=k, v=v, valid=valid, key_pos=key_pos, length=start + offset, rope=rope)


def merge_attention(v_a: jax.Array, lse_a: jax.Array, v_b: jax.Array, lse_b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Exact merge of two attention states over disjoint key sets: v [..., D], lse f32 [...] (natural
    log). lse = logaddexp(lse_a, lse_b), v = sigmoid(lse_a - lse_b) v_a + sigmoid(lse_b - lse_a) v_b.
    Associative and commutative; (0, -inf) is the identity; never NaN for empty sets. v is float32."""
    shape = np.shape(v_a)
    for name, x, want in (("v_b", v_b, shape), ("lse_a", lse_a, shape[:-1]), ("lse_b", lse_b, shape[:-1])):
        if np.shape(x) != want:
            raise ValueError(
                f"{name} must have shape {list(want)} (v_a {list(shape)}: v [..., D], lse [...]), got "
                f"{list(np.shape(x))}"
            )
    return merge(v_a, lse_a, v_b, lse_b)


def _check_prefixes(prefixes, batch: int, num_kv_heads: int, head_dim: int, rope) -> list[int]:
    """Checks each level against the requests (k, v [P, Hkv, S, D] with the requests' Hkv and D, valid
    [P, Hkv, S], key_pos [P, 1 or Hkv, S], length [P], P dividing the batch, the same rope); returns the
    requests each level's row serves."""
    if isinstance(prefixes, SharedPrefix) or not isinstance(prefixes, Sequence):
        hint = ": wrap it, [prefix]" if isinstance(prefixes, SharedPrefix) else ""
        raise TypeError(
            f"prefixes must be a list of SharedPrefix levels (outermost first), got {type(prefixes).__name__}{hint}"
        )
    fan_out = []
    for i, prefix in enumerate(prefixes):
        name = f"prefixes[{i}]"
        if not isinstance(prefix, SharedPrefix):
            raise TypeError(f"{name} must be a SharedPrefix (from jc.share_prefix), got {type(prefix).__name__}")
        for field in ("k", "v"):
            if not isinstance(getattr(prefix, field), Stored):
                raise TypeError(
                    f"{name}.{field} must be a jc.Stored value (jc.share_prefix makes it), got "
                    f"{type(getattr(prefix, field)).__name__}"
                )
        if prefix.k.ndim != 4:
            raise ValueError(
                f"{name}.k must have shape [P, num_kv_heads, S, head_dim], got {list(prefix.k.shape)}"
                + (" (a stacked prefix of several layers: pass one layer's levels)" if prefix.k.ndim == 5 else "")
            )
        P, H, S, D = prefix.k.shape
        if (H, D) != (num_kv_heads, head_dim):
            raise ValueError(
                f"{name} has num_kv_heads={H}, head_dim={D} (k {list(prefix.k.shape)}), the requests' "
                f"state and k have num_kv_heads={num_kv_heads}, head_dim={head_dim}"
            )
        for field, want in (
            ("v", [(P, H, S, D)]),
            ("valid", [(P, H, S)]),
            ("key_pos", [(P, 1, S), (P, H, S)]),
            ("length", [(P,)]),
        ):
            if getattr(prefix, field).shape not in want:
                raise ValueError(
                    f"{name}.{field} must have shape {' or '.join(str(list(w)) for w in want)} "
                    f"(k {list(prefix.k.shape)}), got {list(getattr(prefix, field).shape)}"
                )
        if prefix.v.dtype != prefix.k.dtype:
            raise ValueError(f"{name}: k and v must be stored in one format, got {prefix.k.dtype} and {prefix.v.dtype}")
        for field in ("k", "v"):
            getattr(prefix, field).check_scales(f"{name}.{field}", (P, H, S))
        if batch % P:
            raise ValueError(
                f"{name}: a shared-prefix level with {P} rows cannot serve a batch of {batch} requests "
                "(each row serves batch / rows consecutive requests)"
            )
        if prefix.rope is not None and prefix.rope != rope:
            raise ValueError(
                f"{name} holds keys rotated by {prefix.rope!r} (share_prefix's rope); "
                f"attend_shared must be given the same rope, got {rope!r}"
            )
        fan_out.append(batch // P)
    return fan_out


def attend_shared(
    policy: Policy,
    state: cache_state.CacheState,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    prefixes: Sequence[SharedPrefix],
    lengths: jax.Array | None = None,
    rope=None,
) -> jax.Array:
    """`attend` for requests whose history begins with shared prefixes, then continues in `state`.

    state: the requests' own caches [B, ...] under `policy`, which must keep no scores (not `keeps_scores`:
    score increments would need the merged normaliser); q [B, T, Hq, D], k, v
    [B, T, Hkv, D] un-rotated, lengths as for `attend`. prefixes: a list of levels, outermost first (each made by
    `share_prefix` with the offset of the levels before it), with the requests' num_kv_heads and head_dim.
    Returns out [B, T, Hq, D] (q.dtype). Every level runs on the state's kernels (`CacheState.kernels`).
    """
    check_policy(policy)
    if policy.keeps_scores:
        raise ValueError(
            f"the per-request cache under a shared prefix must keep no scores "
            f"({', '.join(policy_names(keeps_scores=False))}), got {type(policy).__name__}"
        )
    B, T = cache_state.check_chunk(state, q, k, v)
    checks.check_rope(rope)
    cache_state.check_stored_rope(state, rope)
    D = k.shape[3]
    fan_out = _check_prefixes(prefixes, B, k.shape[2], D, rope)
    n = checks.check_lengths(lengths, B, T)
    # the innermost level's end is where the requests' own tokens start
    offset = jnp.repeat(prefixes[-1].length, fan_out[-1]) if prefixes else jnp.zeros((B,), jnp.int32)
    key_pos, start = policy.key_positions(state)
    # keys stored rotated at the tokens' own positions are read there: the own cache and the chunk unshifted (their
    # distances are the same), the prefixes with the queries shifted past them
    own = state.rope is not None and policy.positions != "cache"
    if not own:
        key_pos = jnp.where(key_pos >= 0, key_pos + offset[:, None, None], -1)
    q_prefix, _ = rotate_chunk(rope, q, None, start + offset)
    q, k = rotate_chunk(rope, q, k, start if own else start + offset)
    cache_rope, cache_pos = cache_state.read_rotation(state, rope, key_pos, own)
    out, lse, _, _ = state.kernels.chunk_attention(
        q,
        k,
        v,
        state.k,
        state.v,
        state.pos >= 0,
        cache_pos,
        n,
        None,
        "max",
        cache_rope,
        layer=state.layer,
    )
    out, lse = out.astype(jnp.float32), jnp.swapaxes(lse, 1, 2)  # lse [B, T, Hq]
    Hq = q.shape[2]
    for prefix, per_row in zip(prefixes, fan_out):
        grouped = q_prefix.reshape(B // per_row, per_row * T, Hq, D)
        p_out, p_lse = state.kernels.prefix_attention(
            grouped,
            prefix.k,
            prefix.v,
            prefix.valid,
            prefix.key_pos,
            rope if prefix.rope is None else None,
        )
        out, lse = merge(out, lse, p_out.reshape(B, T, Hq, D), p_lse.reshape(B, T, Hq))
    valid = (jnp.arange(T)[None, :] < n[:, None])[:, :, None, None]
    return jnp.where(valid, out, 0.0).astype(q.dtype)
