"""Shared-prefix (cascade) attention, papers/003 and DESIGN §6.

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

from jcascade import pallas_kernels, slots
from jcascade.pallas_kernels.states import merge
from jcascade.policies import Policy, check_policy
from jcascade.rope import rotate_chunk


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SharedPrefix:
    """One level of shared prefixes (one layer, or L layers stacked on a leading axis).

    k, v:    [P, Hkv, S, D] keys/values of the P prefix rows (zeros in empty slots); the keys un-rotated, or
             rotated at key_pos when `rope` is set;
    valid:   bool [P, Hkv, S] slots that hold a token;
    key_pos: int32 [P, 1 or Hkv, S] RoPE position of each slot;
    length:  int32 [P] the first position after the prefix (including the levels before it): where the
             next level, or its requests' own tokens, start;
    rope:    (static) None, or the RoPE that k was rotated with (`share_prefix(..., rope=)`): the requests must
             decode with the same one, and no step rotates the prefix's keys again.
    """

    k: jax.Array
    v: jax.Array
    valid: jax.Array
    key_pos: jax.Array
    length: jax.Array
    rope: object = dataclasses.field(default=None, metadata=dict(static=True))


def share_prefix(policy: Policy, state: slots.CacheState, offset: jax.Array | int = 0, rope=None) -> SharedPrefix:
    """The cache `state` (one layer; its batch rows become the prefix rows), as `policy` positions it,
    shifted by `offset` (int32 [P] or int: positions of the levels before it). rope: the RoPE the requests
    decode with, or None; when given, the keys are stored rotated at their positions (which a frozen prefix
    never changes), so that decoding reads them without rotating them in every step (and, on a Hopper GPU,
    many requests' queries run on the tensor-core kernel, `pallas_kernels.prefix_attention`)."""
    check_policy(policy)
    if not policy.shareable:
        raise ValueError(f"{type(policy).__name__} cannot be a shared prefix (its cache is chosen per request)")
    key_pos, start = policy.key_positions(state)
    offset = jnp.broadcast_to(jnp.asarray(offset, jnp.int32), start.shape)
    key_pos = jnp.where(key_pos >= 0, key_pos + offset[:, None, None], -1)
    valid = state.pos >= 0
    k = state.k if rope is None else rope(state.k, key_pos)
    k, v = (jnp.where(valid[..., None], x, 0) for x in (k, state.v))
    return SharedPrefix(k=k, v=v, valid=valid, key_pos=key_pos, length=start + offset, rope=rope)


def merge_attention(v_a: jax.Array, lse_a: jax.Array, v_b: jax.Array, lse_b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Exact merge of two attention states over disjoint key sets: v [..., D], lse f32 [...] (natural
    log). lse = logaddexp(lse_a, lse_b), v = sigmoid(lse_a - lse_b) v_a + sigmoid(lse_b - lse_a) v_b.
    Associative and commutative; (0, -inf) is the identity; never NaN for empty sets. v is float32."""
    return merge(v_a, lse_a, v_b, lse_b)


def _rows_per_prefix(prefix: SharedPrefix, batch: int) -> int:
    rows = prefix.length.shape[0]
    if batch % rows:
        raise ValueError(f"a shared-prefix level with {rows} rows cannot serve a batch of {batch} requests "
                         "(each row serves batch / rows consecutive requests)")
    return batch // rows


def attend_shared(
    policy: Policy,
    state: slots.CacheState,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    prefixes: Sequence[SharedPrefix],
    lengths: jax.Array | None = None,
    rope=None,
    *,
    implementation: str | None = None,
) -> jax.Array:
    """`attend` for requests whose history begins with shared prefixes, then continues in `state`.

    state: the requests' own caches [B, ...] under `policy`, which must keep no scores (Full,
    SlidingWindow, Sink: score increments would need the merged normaliser); q [B, T, Hq, D], k, v
    [B, T, Hkv, D] un-rotated, lengths as for `attend`. prefixes: levels, outermost first (each made by
    `share_prefix` with the offset of the levels before it). Returns out [B, T, Hq, D] (q.dtype).
    """
    check_policy(policy)
    if policy.keeps_scores:
        raise ValueError(f"the per-request cache under a shared prefix must keep no scores (Full, SlidingWindow, "
                         f"Sink), got {type(policy).__name__}")
    slots.check_chunk("k", k, state)
    slots.check_chunk("v", v, state)
    B, T, Hkv, D = k.shape
    n = slots.check_lengths(lengths, B, T)
    fan_out = [_rows_per_prefix(prefix, B) for prefix in prefixes]
    for i, prefix in enumerate(prefixes):
        if prefix.rope is not None and prefix.rope != rope:
            raise ValueError(f"prefixes[{i}] holds keys rotated by {prefix.rope!r} (share_prefix's rope); "
                             f"attend_shared must be given the same rope, got {rope!r}")
    # the innermost level's end is where the requests' own tokens start
    offset = jnp.repeat(prefixes[-1].length, fan_out[-1]) if prefixes else jnp.zeros((B,), jnp.int32)
    key_pos, start = policy.key_positions(state)
    key_pos = jnp.where(key_pos >= 0, key_pos + offset[:, None, None], -1)
    start = start + offset
    q, k = rotate_chunk(rope, q, k, start)
    out, lse, _, _ = pallas_kernels.chunk_attention(q, k, v, state.k, state.v, state.pos >= 0, key_pos, n, None,
                                                    "max", rope, layer=state.layer, implementation=implementation)
    out, lse = out.astype(jnp.float32), jnp.swapaxes(lse, 1, 2)  # lse [B, T, Hq]
    Hq = q.shape[2]
    for prefix, per_row in zip(prefixes, fan_out):
        grouped = q.reshape(B // per_row, per_row * T, Hq, D)
        p_out, p_lse = pallas_kernels.prefix_attention(grouped, prefix.k, prefix.v, prefix.valid, prefix.key_pos,
                                                       rope if prefix.rope is None else None,
                                                       implementation=implementation)
        out, lse = merge(out, lse, p_out.reshape(B, T, Hq, D), p_lse.reshape(B, T, Hq))
    valid = (jnp.arange(T)[None, :] < n[:, None])[:, :, None, None]
    return jnp.where(valid, out, 0.0).astype(q.dtype)
