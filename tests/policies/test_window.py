"""Full, Sink and SlidingWindow: what each keeps."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from oracle import HEAD_DIM, random_scores, sink_window_positions, tagged_chunk

import jcascade as jc

UPDATE = jax.jit(jc.update, static_argnums=0)


@pytest.mark.parametrize("sinks,window", [(0, 1), (3, 4), (4, 5)])
def test_sink_is_streaming_llm_and_cascade_with_one_ring(sinks, window):
    rng = np.random.default_rng(sinks)
    B, H, T = 2, 2, 5
    sink = jc.Sink(window=window, sinks=sinks)
    cascade = jc.Cascade(cache_size=window, sinks=sinks, num_cascades=1, gamma=0.9)
    s1, s2 = jc.init_cache(sink, B, H, HEAD_DIM), jc.init_cache(cascade, B, H, HEAD_DIM)
    for _ in range(9):
        lengths = jnp.asarray(rng.integers(0, T + 1, size=B), jnp.int32)
        k, v = tagged_chunk(np.asarray(s1.seen), T, H)
        s1 = UPDATE(sink, s1, k, v, None, lengths)
        s2 = UPDATE(cascade, s2, k, v, random_scores(rng, B, H, sinks + window, T, False), lengths)
        np.testing.assert_array_equal(s1.pos, s2.pos)
        np.testing.assert_array_equal(s1.k.data, s2.k.data)
        for b in range(B):
            held = np.sort(np.asarray(s1.pos[b, 0])[np.asarray(s1.pos[b, 0]) >= 0])
            np.testing.assert_array_equal(held, sink_window_positions(int(s1.seen[b]), sinks, window))


def test_sliding_window_keeps_last_tokens():
    policy = jc.SlidingWindow(window=6)
    state = jc.init_cache(policy, 1, 1, HEAD_DIM)
    for _ in range(5):
        k, v = tagged_chunk(np.asarray(state.seen), 4, 1)
        state = UPDATE(policy, state, k, v, None)
    np.testing.assert_array_equal(np.sort(state.pos[0, 0]), np.arange(14, 20))


def test_full_keeps_everything_in_order_and_refuses_overflow():
    policy = jc.Full()
    state = jc.init_cache(policy, 2, 1, HEAD_DIM, max_tokens=12)
    for lengths in ([4, 0], [4, 3], [4, 4]):
        k, v = tagged_chunk(np.asarray(state.seen), 4, 1)
        state = jc.update(policy, state, k, v, None, jnp.asarray(lengths))
    np.testing.assert_array_equal(state.pos[0, 0], np.arange(12))
    np.testing.assert_array_equal(state.pos[1, 0], [*range(7), -1, -1, -1, -1, -1])
    k, v = tagged_chunk(np.asarray(state.seen), 4, 1)
    with pytest.raises(ValueError, match="12 slots overflows"):
        jc.update(policy, state, k, v, None, jnp.asarray([1, 4]))
    # Under jit the overflow cannot raise: the overflowed row's attention becomes NaN instead.
    state = UPDATE(policy, state, k, v, None, jnp.asarray([1, 4]))
    q = jnp.ones((2, 4, 1, HEAD_DIM))
    out, _ = jax.jit(jc.attend, static_argnums=0)(policy, state, q, k, v)
    assert np.isnan(out[0]).all() and not np.isnan(out[1]).any()
