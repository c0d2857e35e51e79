"""Shared-prefix attention (jcascade/shared.py): the merge operator's properties, shared == flat attention
(one and two levels), and `num_samples`. The multi-query prefix kernel against its reference:
tests/pallas_kernels/test_triton.py."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny
from hypothesis import given
from hypothesis import strategies as st

import jcascade as jc

ROPE = jc.RoPE(100.0)


def state_strategy():
    """(v [3, 4], lse [3]) with some empty sets (lse = -inf, v = 0)."""
    return st.tuples(
        st.lists(st.floats(-3, 3), min_size=12, max_size=12),
        st.lists(st.one_of(st.floats(-30, 30), st.just(-np.inf)), min_size=3, max_size=3),
    )


def as_state(raw):
    v, lse = np.array(raw[0], np.float32).reshape(3, 4), np.array(raw[1], np.float32)
    return jnp.asarray(np.where(np.isfinite(lse)[:, None], v, 0.0)), jnp.asarray(lse)


@given(state_strategy(), state_strategy(), state_strategy())
def test_merge_is_associative_commutative_with_identity_and_never_nan(a, b, c):
    a, b, c = as_state(a), as_state(b), as_state(c)
    left = jc.merge_attention(*jc.merge_attention(*a, *b), *c)
    right = jc.merge_attention(*a, *jc.merge_attention(*b, *c))
    for x, y in zip(left, right):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)
    for x, y in zip(jc.merge_attention(*a, *b), jc.merge_attention(*b, *a)):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6)
    identity = (jnp.zeros((3, 4)), jnp.full((3,), -jnp.inf))
    for x, y in zip(jc.merge_attention(*a, *identity), a):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6)
    v, lse = jc.merge_attention(*identity, *identity)
    assert not np.isnan(np.asarray(v)).any() and np.all(np.asarray(lse) == -np.inf)
    assert not np.isnan(np.asarray(left[0])).any()


def test_merging_two_key_sets_is_attention_over_their_union():
    rng = np.random.default_rng(0)
    q, keys, vals = rng.normal(size=8), rng.normal(size=(30, 8)), rng.normal(size=(30, 8))
    logits = keys @ q

    def state(sl):
        e = np.exp(logits[sl] - logits[sl].max())
        return jnp.asarray(e @ vals[sl] / e.sum()), jnp.asarray(np.log(e.sum()) + logits[sl].max())

    v, lse = jc.merge_attention(*state(slice(0, 11)), *state(slice(11, 30)))
    v_all, lse_all = state(slice(0, 30))
    np.testing.assert_allclose(v, v_all, rtol=1e-6)
    np.testing.assert_allclose(lse, lse_all, rtol=1e-6)


def full_state(k, v, lengths=None):
    B, T, H, D = k.shape
    state = jc.init_cache(jc.Full(), B, H, D, max_tokens=T + 8)
    return jc.update(jc.Full(), state, k, v, None, lengths)


@pytest.mark.parametrize("rotated", [False, True], ids=["keys-rotated-per-step", "keys-stored-rotated"])
@pytest.mark.parametrize("backend", ["xla", "triton"])
def test_two_level_shared_prefixes_equal_flat_attention(backend, rotated):
    """A system prompt shared by 4 requests, two histories shared by 2 each, then each request's own
    tokens (ragged) and a 3-token chunk: the same as one flat cache per request, whether the prefixes hold
    un-rotated keys or keys stored rotated (share_prefix's rope)."""
    Hq, H, D = 4, 2, 16
    L0, L1, Ls, T = 9, 6, 5, 3
    ks = jax.random.split(jax.random.key(7), 8)
    k0, v0 = jax.random.normal(ks[0], (1, L0, H, D)), jax.random.normal(ks[1], (1, L0, H, D))
    k1, v1 = jax.random.normal(ks[2], (2, L1, H, D)), jax.random.normal(ks[3], (2, L1, H, D))
    k2, v2 = jax.random.normal(ks[4], (4, Ls, H, D)), jax.random.normal(ks[5], (4, Ls, H, D))
    q, kc = jax.random.normal(ks[6], (4, T, Hq, D)), jax.random.normal(ks[7], (4, T, H, D))
    own = jnp.array([5, 3, 0, 4], jnp.int32)

    @jax.jit
    def shared_and_flat(k0, v0, k1, v1, k2, v2, q, kc):
        stored = ROPE if rotated else None
        level0 = jc.share_prefix(jc.Full(), full_state(k0, v0), rope=stored)
        level1 = jc.share_prefix(jc.Full(), full_state(k1, v1), offset=L0, rope=stored)
        suffix = dataclasses.replace(full_state(k2, v2, own), kernels=jc.Kernels(backend))  # every level runs on them
        got = jc.attend_shared(jc.Full(), suffix, q, kc, kc, [level0, level1], jnp.array([3, 3, 2, 3]), ROPE)
        rep = lambda x, n: jnp.repeat(x, n, axis=0)
        flat = full_state(jnp.concatenate([rep(k0, 4), rep(k1, 2)], 1), jnp.concatenate([rep(v0, 4), rep(v1, 2)], 1))
        flat = jc.update(jc.Full(), flat, k2, v2, None, own)
        want, _ = jc.attend(jc.Full(), flat, q, kc, kc, jnp.array([3, 3, 2, 3]), ROPE)
        return got, want

    got, want = shared_and_flat(k0, v0, k1, v1, k2, v2, q, kc)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)


@pytest.fixture(scope="module")
def model():
    return tiny.model(
        97,
        seed=1,
        scale=0.2,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        head_dim=16,
        max_position_embeddings=512,
    )


def test_decode_logits_over_a_shared_prefix_equal_unshared(model):
    prompt = jnp.asarray(np.random.default_rng(2).integers(0, 97, (1, 40)))
    policy = jc.Full(stride=16)
    prompt_state, _, _ = jc.prefill(model, policy, model.init_cache(policy, 1, max_tokens=40), prompt, jnp.array([40]))
    prefix = jax.vmap(lambda s: jc.share_prefix(policy, s))(prompt_state.cache)
    step = jnp.array([[5], [17], [60]])
    hidden, _ = model(policy, model.init_cache(policy, 3, max_tokens=4), step, jnp.ones(3, jnp.int32), (prefix,))
    unshared, _, _ = jc.prefill(
        model, policy, model.init_cache(policy, 3, max_tokens=44), jnp.repeat(prompt, 3, 0), jnp.full(3, 40)
    )
    want, _ = model(policy, unshared, step, jnp.ones(3, jnp.int32))
    np.testing.assert_allclose(model.logits(hidden), model.logits(want), atol=1e-5)


@pytest.mark.parametrize(
    "policy",
    [jc.Full(stride=16), jc.Cascade(cache_size=96, sinks=4, stride=16), jc.SnapKV(budget=24, window=4, stride=16)],
    ids=lambda p: type(p).__name__,
)
def test_num_samples_equals_generating_from_copies(model, policy):
    prompt = np.random.default_rng(3).integers(0, 97, (1, 50))
    key = jax.random.key(4)
    shared = jc.generate(model, prompt, policy, max_new_tokens=12, temperature=1.0, rng=key, num_samples=5)
    copies = jc.generate(model, np.repeat(prompt, 5, 0), policy, max_new_tokens=12, temperature=1.0, rng=key)
    np.testing.assert_array_equal(shared, copies)
    assert len({tuple(row) for row in np.asarray(shared).tolist()}) > 1  # the samples differ
    if isinstance(policy, jc.Cascade):  # greedy decoding of the samples (the same path for every policy)
        greedy = jc.generate(model, prompt, policy, max_new_tokens=12, num_samples=2)
        np.testing.assert_array_equal(greedy, jc.generate(model, np.repeat(prompt, 2, 0), policy, max_new_tokens=12))


def test_shared_prefix_errors(model):
    prompt = np.zeros((2, 8), int)
    with pytest.raises(ValueError, match="tokens must have batch 1"):
        jc.generate(model, prompt, jc.Full(), max_new_tokens=2, num_samples=3)
    with pytest.raises(ValueError, match="num_samples does not support Recycled"):
        jc.generate(model, prompt[:1], jc.Recycled(top_k=4, refresh_every=2), max_new_tokens=2, num_samples=3)
    with pytest.raises(ValueError, match="num_samples must be a positive int"):
        jc.generate(model, prompt[:1], jc.Full(), max_new_tokens=2, num_samples=0)
    k = jnp.zeros((3, 2, 2, 8))
    prefix = jc.share_prefix(jc.Full(), full_state(k[:2], k[:2]))
    with pytest.raises(ValueError, match="2 rows cannot serve a batch of 3"):
        jc.attend_shared(jc.Full(), full_state(k, k), jnp.zeros((3, 2, 2, 8)), k, k, [prefix])
    rotated = jc.share_prefix(jc.Full(), full_state(k[:1], k[:1]), rope=ROPE)
    with pytest.raises(ValueError, match=r"prefixes\[0\] holds keys rotated by RoPE.*same rope, got None"):
        jc.attend_shared(jc.Full(), full_state(k, k), jnp.zeros((3, 2, 2, 8)), k, k, [rotated])
    cascade = jc.Cascade(cache_size=8, sinks=0, num_cascades=2)
    with pytest.raises(ValueError, match="must keep no scores"):
        jc.attend_shared(cascade, jc.init_cache(cascade, 3, 2, 8), jnp.zeros((3, 2, 2, 8)), k, k, [prefix])


def test_prefixes_that_do_not_fit_the_requests_are_refused_by_name():
    """A prefix with other KV heads or head_dim than the requests (it was attended silently, or failed inside an
    einsum), a negative or misshaped offset, a stacked state or prefix, a bare SharedPrefix for the list."""
    k = jnp.ones((2, 3, 2, 8))
    empty = lambda rows, H, D: jc.init_cache(jc.Full(), rows, H, D, max_tokens=11)  # shapes matter here
    requests = empty(2, 2, 8)
    q = jnp.ones((2, 3, 4, 8))
    for H, D, match in [
        (
            4,
            8,
            r"prefixes\[0\] has num_kv_heads=4, head_dim=8 \(k \[1, 4, 11, 8\]\), the requests' "
            r"state and k have num_kv_heads=2, head_dim=8",
        ),
        (1, 8, "prefixes\\[0\\] has num_kv_heads=1"),
        (2, 4, "prefixes\\[0\\] has .*head_dim=4"),
    ]:
        with pytest.raises(ValueError, match=match):
            jc.attend_shared(jc.Full(), requests, q, k, k, [jc.share_prefix(jc.Full(), empty(1, H, D))])
    prefix = jc.share_prefix(jc.Full(), empty(1, 2, 8))
    stacked = jax.tree.map(lambda x: jnp.stack([x, x]), prefix)
    with pytest.raises(
        ValueError,
        match=r"prefixes\[1\].k must have shape \[P, num_kv_heads, S, head_dim\], got "
        r"\[2, 1, 2, 11, 8\] \(a stacked prefix of several layers",
    ):
        jc.attend_shared(jc.Full(), requests, q, k, k, [prefix, stacked])
    with pytest.raises(TypeError, match=r"prefixes must be a list of SharedPrefix levels .*: wrap it, \[prefix\]"):
        jc.attend_shared(jc.Full(), requests, q, k, k, prefix)
    with pytest.raises(TypeError, match=r"prefixes\[0\] must be a SharedPrefix .*, got CacheState"):
        jc.attend_shared(jc.Full(), requests, q, k, k, [requests])
    with pytest.raises(ValueError, match=r"prefixes\[0\].key_pos must have shape \[1, 1, 11\] or \[1, 2, 11\]"):
        jc.attend_shared(jc.Full(), requests, q, k, k, [dataclasses.replace(prefix, key_pos=prefix.key_pos[:, :, :3])])
    with pytest.raises(ValueError, match=r"q must have shape \[batch=2, T=3, Hq, head_dim=8\]"):
        jc.attend_shared(jc.Full(), requests, q[..., :4], k, k, [prefix])
    for offset, error, match in [
        (
            -1,
            ValueError,
            r"offset: each must lie in \[0, 2147483647\] \(the positions of the levels before it\), got "
            r"\[-1\]",
        ),
        (np.array([4, -2]), ValueError, r"offset: .*got \[-2\] at \[\(1,\)\]"),
        (np.array([2**31, 0]), ValueError, r"offset: .*got \[2147483648\]"),
        (np.array([1, 2, 3]), ValueError, r"offset must be an integer array of shape \[2\], got int64\[3\]"),
        (2.0, TypeError, r"offset must be an integer array of shape \[\], got float64\[\]"),
    ]:
        with pytest.raises(error, match=match):
            jc.share_prefix(jc.Full(), requests, offset)
    with pytest.raises(ValueError, match="state is a stacked cache of 2 layers"):
        jc.share_prefix(jc.Full(), jax.tree.map(lambda x: jnp.stack([x, x]), requests))


def test_share_prefix_reads_one_layer_of_a_stacked_cache_through_its_view():
    """A state that is one layer's view of a stack (CacheState.layer) shares that layer's keys, not the stack."""
    ks = jax.random.split(jax.random.key(0), 2)
    k, v = jax.random.normal(ks[0], (1, 4, 2, 8)), jax.random.normal(ks[1], (1, 4, 2, 8))
    layers = [full_state(k, v), full_state(-k, 2 * v)]
    stack = jax.tree.map(lambda *x: jnp.stack(x), *layers)
    view = dataclasses.replace(jax.tree.map(lambda x: x[1], stack), k=stack.k, v=stack.v, layer=jnp.int32(1))
    for rope in (None, ROPE):
        got, want = jc.share_prefix(jc.Full(), view, 3, rope), jc.share_prefix(jc.Full(), layers[1], 3, rope)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
