"""The low-level cache API every policy shares (docs/semantics.md §2-4): `init_cache`, `attend` (a chunk's queries
against the cache and the chunk itself, with EMA-score increments), `update`, `compress` and `cache_occupancy`.

Each checks its arguments, then calls the policy's hooks (`jcascade.policies.base.Policy`); the state lives in
`jcascade.cache_state`, and runs on its kernels (`CacheState.kernels`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jcascade import cache_state, checks
from jcascade.cache_state import CacheState, Scores
from jcascade.pallas_kernels import Kernels
from jcascade.pallas_kernels.storage import Stored
from jcascade.policies import Policy, check_policy


def init_cache(
    policy: Policy,
    batch: int,
    num_kv_heads: int,
    head_dim: int,
    dtype=jnp.float32,
    *,
    max_tokens: int | None = None,
    num_layers: int | None = None,
    kernels: Kernels | None = None,
    rope=None,
) -> CacheState:
    """An empty cache. `kernels`: the `jc.Kernels` its attention and insertion run (None: `Kernels.default()`, the
    platform's), carried by the state as static data. `max_tokens` is the number of tokens a cache of a policy that is
    not `bounded` (not `bounded`) can receive (required there, unused by the bounded policies); a policy that compresses
    after its prompt (an `observation_window`) needs only the prompt's (`jcascade.compress` makes room for decoding).

    With `num_layers`, every array gets a leading layer axis (scan over it to run a model). `dtype` is the model's
    (that of the keys and values attend and update take); the cache stores them in it, or quantized when the
    policy's `kv_dtype` says so (`jcascade.pallas_kernels.storage`: codes plus a float32 scale per slot).

    `rope`: None, or the RoPE that `attend` will be given: a policy that `stores_rotated` then stores its keys rotated
    by it at their original positions (`CacheState.rope`), so that the attention reads them without rotating each
    key, and `attend` must be given that rope. Otherwise keys are stored un-rotated (rotated as they are read, by
    whatever rope `attend` gets).
    """
    check_policy(policy)
    sizes = (
        ("batch", batch),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
        ("max_tokens", max_tokens),
        ("num_layers", num_layers),
    )
    for name, value in sizes:
        if value is None and name in ("max_tokens", "num_layers"):
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"init_cache: {name} must be a positive int, got {type(value).__name__} {value!r}")
        if not 1 <= value <= checks.CLOCK_LIMIT:
            raise ValueError(f"init_cache: {name} must be a positive int (at most {checks.CLOCK_LIMIT}), got {value!r}")
    if not policy.bounded and max_tokens is None:
        raise ValueError(f"init_cache: a {type(policy).__name__} cache needs max_tokens, a positive int; got None")
    if kernels is None:
        kernels = Kernels.default()
    elif not isinstance(kernels, Kernels):
        raise TypeError(f"init_cache: kernels must be a jc.Kernels or None, got {type(kernels).__name__} {kernels!r}")
    checks.check_rope(rope)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"init_cache: dtype must be a floating-point dtype (e.g. jnp.bfloat16), got {dtype!r}")
    capacity = policy.cache_slots(max_tokens)
    if capacity > checks.CLOCK_LIMIT:
        raise ValueError(
            f"init_cache: {policy} with max_tokens={max_tokens} needs {capacity} slots, more than the "
            f"{checks.CLOCK_LIMIT} that int32 slot indices address"
        )
    lead = () if num_layers is None else (num_layers,)
    shape = (*lead, batch, num_kv_heads, capacity)
    # two buffers (a cache is donated, and one buffer cannot be donated twice)
    k, v = (Stored.empty((*shape, head_dim), policy.kv_dtype, dtype) for _ in range(2))
    return CacheState(
        k=k,
        v=v,
        score=jnp.zeros(shape, jnp.float32),
        pos=jnp.full(shape, -1, jnp.int32),
        seen=jnp.zeros((*lead, batch), jnp.int32),
        kernels=kernels,
        rope=rope if policy.stores_rotated else None,
    )


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
    B, T = cache_state.check_chunk(state, q, k, v)
    checks.check_rope(rope)
    cache_state.check_stored_rope(state, rope)
    n = checks.check_lengths(lengths, B, T)
    return policy.attend(state, q, k, v, n, rope)


def update(
    policy: Policy,
    state: CacheState,
    k: jax.Array,
    v: jax.Array,
    scores: Scores | None,
    lengths: jax.Array | None = None,
) -> CacheState:
    """Decays and accumulates the residents' scores, then inserts the chunk (docs/semantics.md §3).

    k, v: [B, T, Hkv, D] un-rotated chunk keys/values (the chunk `attend` just saw); scores: what
    `attend` returned (None for policies that keep no scores); lengths: int32 [B] valid tokens per row
    (a prefix of the chunk; padding leaves the state untouched). Pure and jit-able. The insertion runs on the
    state's kernels (`Kernels.insert`).
    """
    check_policy(policy)
    B, T = cache_state.check_chunk(state, None, k, v)
    H = k.shape[2]
    n = checks.check_lengths(lengths, B, T)
    checks.check_clock(state.seen, n)
    cap = state.capacity
    if policy.keeps_scores:
        if not isinstance(scores, Scores):
            raise ValueError(f"{type(policy).__name__} selects by score: pass the Scores that attend returned")
        if scores.cache.shape != (B, H, cap) or scores.chunk.shape != (B, H, T):
            raise ValueError(
                f"scores must be Scores(cache=[{B}, {H}, {cap}], chunk=[{B}, {H}, {T}]), got "
                f"cache={list(scores.cache.shape)}, chunk={list(scores.chunk.shape)}"
            )
    elif scores is not None:
        raise ValueError(f"{type(policy).__name__} keeps no scores: pass scores=None")
    return policy.update(state, k, v, scores, n)


def compress(policy: Policy, state: CacheState, room: int) -> CacheState:
    """The post-prompt compression of a policy with an observation window (`Policy.compress`).

    state: the append cache after the prompt (its last chunk being the observation window), one layer
    or L layers stacked on a leading axis. room: slots to leave for the tokens decoded afterwards.
    Returns a cache holding, per (row, KV head), the kept tokens in position order followed by empty slots.
    """
    check_policy(policy)
    cache_state.check_state(state, stacked_ok=True)
    if not policy.observation_window:
        raise TypeError(
            "compress applies to policies with an observation window (those that compress after their "
            f"prompt), got {type(policy).__name__}"
        )
    if isinstance(room, bool) or not isinstance(room, int) or room < 0:
        raise ValueError(f"room must be an int >= 0, got {room!r}")
    return policy.compress(state, room)


def cache_occupancy(state) -> tuple[int, int]:
    """(resident, allocated): the slots holding a token and all slots, summed over every row, KV head and
    layer of `state` (a `CacheState`, or a model's pair of them). Policies whose heads keep different counts
    (`jc.AdaKV`) allocate more than they hold."""
    states = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, CacheState))
    return (sum(int(jnp.sum(s.pos >= 0)) for s in states), sum(int(s.pos.size) for s in states))
