"""`init_cache` and `update` (jcascade/cache_api.py) for every policy: argument checks, the stacked multi-layer
cache and its layer views. What each policy keeps: tests/policies/."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from oracle import HEAD_DIM

import jcascade as jc


def test_multi_layer_state_has_a_leading_layer_axis():
    state = jc.init_cache(jc.Sink(window=8, sinks=2), 3, 2, 16, jnp.bfloat16, num_layers=5)
    assert state.k.shape == (5, 3, 2, 10, 16) and state.k.dtype == jnp.bfloat16
    assert state.seen.shape == (5, 3)
    layer = jax.tree.map(lambda x: x[0], state)
    assert jc.cached_positions(layer).shape == (3, 2, 10)


@pytest.mark.parametrize("backend", ["xla", "triton"])
@pytest.mark.parametrize(
    "policy",
    [
        jc.Cascade(cache_size=12, sinks=2, num_cascades=3, gamma=0.5),
        jc.H2O(heavy=6, recent=4),
        jc.Recycled(top_k=4, refresh_every=3),
    ],
    ids=["cascade", "h2o", "recycled"],
)
def test_updates_write_only_their_layer_of_a_stack(backend, policy):
    """`update` on a layer view of a stacked cache (`CacheState.layer`) writes that layer of the K/V stack
    as the layer alone would be written, in decode steps and chunks, and leaves the other layers alone."""
    rng = np.random.default_rng(4)
    B, H, D, L = 2, 2, 16, 3
    alone = jc.init_cache(policy, B, H, D, max_tokens=64, kernels=jc.Kernels(backend))
    others = lambda: jnp.asarray(rng.normal(size=(L, *alone.k.shape)), jnp.float32)
    stack_k, stack_v = others(), others()
    view = jc.CacheState(
        k=jc.Stored(stack_k.at[1].set(alone.k.data)),
        v=jc.Stored(stack_v.at[1].set(alone.v.data)),
        score=alone.score,
        pos=alone.pos,
        seen=alone.seen,
        kernels=alone.kernels,
        layer=jnp.int32(1),
    )
    update = jax.jit(jc.update, static_argnums=0)
    for T in [3, 1, 1, 3, 1, 1, 1, 3, 1, 1, 1, 3, 1, 1]:
        k = jnp.asarray(rng.normal(size=(B, T, H, D)), jnp.float32)
        lengths = jnp.asarray([T, rng.integers(0, T + 1)], jnp.int32)
        scores = jc.Scores(
            jnp.asarray(rng.choice([0.0, 0.25, 0.5], (B, H, alone.capacity)), jnp.float32),
            jnp.asarray(rng.choice([0.0, 0.5, 1.0], (B, H, T)), jnp.float32),
        )
        alone = update(policy, alone, k, -k, scores, lengths)
        view = update(policy, view, k, -k, scores, lengths)
        for name in ("score", "pos", "seen"):
            np.testing.assert_array_equal(np.asarray(getattr(view, name)), np.asarray(getattr(alone, name)))
        for got, want, before in ((view.k.data, alone.k.data, stack_k), (view.v.data, alone.v.data, stack_v)):
            np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want))
            np.testing.assert_array_equal(np.asarray(got[::2]), np.asarray(before[::2]))
    assert int(view.layer) == 1 and int(alone.seen[0]) == 22  # past the ring caches' capacities


def test_bad_update_inputs_raise_clear_errors():
    policy = jc.Cascade(cache_size=4, sinks=1, num_cascades=2)
    state = jc.init_cache(policy, 2, 2, HEAD_DIM)
    k = jnp.zeros((2, 3, 2, HEAD_DIM))
    scores = jc.Scores(jnp.zeros((2, 2, 5)), jnp.zeros((2, 2, 3)))
    with pytest.raises(ValueError, match="k must have shape"):
        jc.update(policy, state, k[:, :, :1], k, scores)
    with pytest.raises(ValueError, match=r"lengths: each must lie in \[0, 3\]"):
        jc.update(policy, state, k, k, scores, jnp.asarray([4, 1]))
    with pytest.raises(TypeError, match="lengths must be an integer array"):
        jc.update(policy, state, k, k, scores, jnp.asarray([1.0, 2.0]))
    with pytest.raises(ValueError, match="pass the Scores"):
        jc.update(policy, state, k, k, None)
    with pytest.raises(ValueError, match=r"scores must be Scores\(cache=\[2, 2, 5\]"):
        jc.update(policy, state, k, k, jc.Scores(jnp.zeros((2, 2, 4)), jnp.zeros((2, 2, 3))))
    with pytest.raises(ValueError, match="keeps no scores"):
        jc.update(jc.Sink(window=4, sinks=1), state, k, k, scores)
    with pytest.raises(ValueError, match="capacity 5"):
        jc.update(jc.Sink(window=8, sinks=1), state, k, k, None)
    with pytest.raises(ValueError, match="max_tokens"):
        jc.init_cache(jc.Full(), 1, 1, 4)
    with pytest.raises(ValueError, match="num_kv_heads"):
        jc.init_cache(policy, 1, 0, 4)


def test_non_policy_is_refused():
    state = jc.init_cache(jc.Sink(window=2, sinks=0), 1, 1, 2)
    with pytest.raises(TypeError, match="policy must be one of"):
        jc.update("cascade", state, jnp.zeros((1, 1, 1, 2)), jnp.zeros((1, 1, 1, 2)), None)
