"""The cache update against the token-by-token oracle of DESIGN §3, and its consequences."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import jcascade as jc
from jcascade import slots as C
from oracle import CascadeOracle, sink_window_positions

UPDATE = jax.jit(jc.update, static_argnums=0)
HEAD_DIM = 4


def tagged_chunk(seen: np.ndarray, T: int, H: int):
    """K/V whose rows name their token: k = (position, head, row, 1), v = -k."""
    B = seen.shape[0]
    pos = seen[:, None] + np.arange(T)[None]  # [B, T]
    k = np.zeros((B, T, H, HEAD_DIM), np.float32)
    k[..., 0] = pos[:, :, None]
    k[..., 1] = np.arange(H)[None, None, :]
    k[..., 2] = np.arange(B)[:, None, None]
    k[..., 3] = 1.0
    return jnp.asarray(k), jnp.asarray(-k)


def random_scores(rng, B, H, cap, T, tied: bool) -> jc.Scores:
    if tied:  # few distinct values, exact in float32, so that ties really happen
        values = np.array([0.0, 0.25, 0.5, 1.0], np.float32)
        return jc.Scores(
            cache=jnp.asarray(rng.choice(values[:2], size=(B, H, cap))),
            chunk=jnp.asarray(rng.choice(values, size=(B, H, T))),
        )
    return jc.Scores(
        cache=jnp.asarray(rng.random((B, H, cap), np.float32) * 0.1),
        chunk=jnp.asarray(rng.random((B, H, T), np.float32)),
    )


def assert_matches_oracle(state, oracles, layout):
    pos, score = np.asarray(state.pos), np.asarray(state.score)
    k, v = (np.asarray(x) for x in jc.cached_kv(state))
    ranks = np.asarray(C.slot_ranks(layout, state.seen))
    S0, W = layout.sinks, layout.ring_size
    for b, row in enumerate(oracles):
        for h, orc in enumerate(row):
            where = f"row {b} head {h}"
            held = [p for p, _ in orc.sinks]
            np.testing.assert_array_equal(pos[b, h, : len(held)], held, err_msg=f"sinks, {where}")
            np.testing.assert_array_equal(pos[b, h, len(held) : S0], -1, err_msg=f"empty sinks, {where}")
            for i, ring in enumerate(orc.rings):
                slots = np.arange(S0 + i * W, S0 + (i + 1) * W)
                slots = slots[pos[b, h, slots] >= 0]
                slots = slots[np.argsort(ranks[b, slots])]  # age order, oldest first
                np.testing.assert_array_equal(pos[b, h, slots], [p for p, _ in ring], err_msg=f"ring {i}, {where}")
                np.testing.assert_allclose(score[b, h, slots], [m for _, m in ring], rtol=1e-6, err_msg=f"ring {i} scores, {where}")
            valid = pos[b, h] >= 0
            # K/V travel with their tokens.
            np.testing.assert_array_equal(k[b, h, valid, 0], pos[b, h, valid], err_msg=f"k, {where}")
            np.testing.assert_array_equal(k[b, h, valid, 1:3], np.broadcast_to([h, b], (valid.sum(), 2)))
            np.testing.assert_array_equal(v[b, h, valid, 0], -pos[b, h, valid], err_msg=f"v, {where}")
            # Cache-index positions are the age ranks: sinks first, then older rings, all distinct.
            np.testing.assert_array_equal(np.argsort(ranks[b, valid]), np.argsort(pos[b, h, valid]))
            np.testing.assert_array_equal(np.sort(ranks[b, valid]), np.arange(valid.sum()))


def stream(policy, oracles, B, H, T, lengths_per_chunk, rng, tied):
    layout = policy.layout()
    state = jc.init_cache(policy, B, H, HEAD_DIM)
    for lengths in lengths_per_chunk:
        lengths = np.asarray(lengths, np.int32)
        k, v = tagged_chunk(np.asarray(state.seen), T, H)
        scores = random_scores(rng, B, H, layout.capacity, T, tied)
        before = np.asarray(state.pos)
        state = UPDATE(policy, state, k, v, scores, jnp.asarray(lengths))
        sc_cache, sc_chunk = np.asarray(scores.cache), np.asarray(scores.chunk)
        for b in range(B):
            for h in range(H):
                inc = {int(p): sc_cache[b, h, s] for s, p in enumerate(before[b, h]) if p >= 0}
                oracles[b][h].update(sc_chunk[b, h], inc, int(lengths[b]))
        assert_matches_oracle(state, oracles, layout)
    return state


@st.composite
def streams(draw):
    T = draw(st.sampled_from([1, 3, 7]))
    B = draw(st.sampled_from([1, 3]))
    num_chunks = draw(st.integers(1, 40 // T + 4))
    lengths = [[draw(st.sampled_from([0, T]) | st.integers(0, T)) for _ in range(B)] for _ in range(num_chunks)]
    return dict(
        N=draw(st.integers(1, 8)),
        W=draw(st.integers(1, 3)),
        sinks=draw(st.sampled_from([0, 1, 3])),
        gamma=draw(st.sampled_from([0.5, 0.9])),
        H=draw(st.sampled_from([1, 2])),
        B=B,
        T=T,
        lengths=lengths,
        tied=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@given(streams())
def test_chunk_updates_equal_token_by_token_oracle(case):
    policy = jc.Cascade(
        cache_size=case["N"] * case["W"], sinks=case["sinks"], num_cascades=case["N"], gamma=case["gamma"]
    )
    layout = policy.layout()
    oracles = [
        [CascadeOracle(layout.sinks, layout.ring_size, layout.num_rings, policy.gamma) for _ in range(case["H"])]
        for _ in range(case["B"])
    ]
    rng = np.random.default_rng(case["seed"])
    stream(policy, oracles, case["B"], case["H"], case["T"], case["lengths"], rng, case["tied"])


@pytest.mark.parametrize("tied", [True, False])
def test_long_stream_with_eight_cascades_and_chunks_longer_than_rings(tied):
    """Deep into the steady phase: ring 7 accepts every 128 clocks, chunks span several rings."""
    policy = jc.Cascade(cache_size=16, sinks=2, num_cascades=8, gamma=0.5)
    oracles = [[CascadeOracle(2, 2, 8, 0.5) for _ in range(2)] for _ in range(2)]
    rng = np.random.default_rng(7 + tied)
    lengths = [[rng.integers(0, 12), 11] for _ in range(70)]
    state = stream(policy, oracles, 2, 2, 11, lengths, rng, tied)
    assert np.asarray(state.seen)[1] == 770


def test_chunk_equals_single_token_updates():
    """DESIGN §3: a T-token chunk equals T single-token updates given the same scores.

    With cache increments 0, single-token updates see chunk token j's score decayed by the n-1-j
    tokens after it, which is what attend's query weights build into a chunk's scores.
    """
    policy = jc.Cascade(cache_size=12, sinks=2, num_cascades=3, gamma=0.8)
    rng = np.random.default_rng(3)
    B, H, T = 2, 3, 9
    chunked = single = jc.init_cache(policy, B, H, HEAD_DIM)
    for _ in range(8):
        k, v = tagged_chunk(np.asarray(chunked.seen), T, H)
        raw = rng.random((B, H, T), np.float32)
        decayed = raw * np.float32(0.8) ** (T - 1 - np.arange(T)).astype(np.float32)
        zeros = jnp.zeros((B, H, chunked.capacity))
        chunked = UPDATE(policy, chunked, k, v, jc.Scores(zeros, jnp.asarray(decayed)))
        for j in range(T):
            single = UPDATE(policy, single, k[:, j : j + 1], v[:, j : j + 1], jc.Scores(zeros, jnp.asarray(raw[..., j : j + 1])))
    np.testing.assert_array_equal(chunked.pos, single.pos)
    np.testing.assert_array_equal(chunked.k, single.k)
    # Sink scores are never decayed nor used (DESIGN §3): compare the rings'.
    np.testing.assert_allclose(chunked.score[..., 2:], single.score[..., 2:], rtol=1e-5)


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
        np.testing.assert_array_equal(s1.k, s2.k)
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


def test_padding_leaves_state_untouched():
    policy = jc.Cascade(cache_size=6, sinks=1, num_cascades=2, gamma=0.9)
    rng = np.random.default_rng(0)
    state = jc.init_cache(policy, 2, 2, HEAD_DIM)
    for _ in range(4):
        k, v = tagged_chunk(np.asarray(state.seen), 3, 2)
        state = UPDATE(policy, state, k, v, random_scores(rng, 2, 2, 7, 3, False))
    k, v = tagged_chunk(np.asarray(state.seen), 3, 2)
    after = UPDATE(policy, state, k * 7, v * 7, random_scores(rng, 2, 2, 7, 3, False), jnp.asarray([0, 2]))
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(a)[0], np.asarray(b)[0])
    assert int(after.seen[1]) == int(state.seen[1]) + 2


def test_update_is_one_jitted_call_for_a_4096_chunk_into_16k():
    policy = jc.Cascade(cache_size=16384, sinks=64, num_cascades=4)
    state = jc.init_cache(policy, 1, 1, 8, jnp.bfloat16)
    k = jnp.ones((1, 4096, 1, 8), jnp.bfloat16)
    scores = jc.Scores(jnp.zeros((1, 1, state.capacity)), jnp.ones((1, 1, 4096)))
    for _ in range(6):  # 24K tokens: through the fill phase into the steady phase
        state = UPDATE(policy, state, k, k, scores)
    held = np.asarray(state.pos[0, 0])
    assert (held >= 0).all() and len(set(held.tolist())) == state.capacity


def test_multi_layer_state_has_a_leading_layer_axis():
    state = jc.init_cache(jc.Sink(window=8, sinks=2), 3, 2, 16, jnp.bfloat16, num_layers=5)
    assert state.k.shape == (5, 3, 2, 10, 16) and state.k.dtype == jnp.bfloat16
    assert state.seen.shape == (5, 3)
    layer = jax.tree.map(lambda x: x[0], state)
    assert jc.cached_positions(layer).shape == (3, 2, 10)


def test_bad_update_inputs_raise_clear_errors():
    policy = jc.Cascade(cache_size=4, sinks=1, num_cascades=2)
    state = jc.init_cache(policy, 2, 2, HEAD_DIM)
    k = jnp.zeros((2, 3, 2, HEAD_DIM))
    scores = jc.Scores(jnp.zeros((2, 2, 5)), jnp.zeros((2, 2, 3)))
    with pytest.raises(ValueError, match="k must have shape"):
        jc.update(policy, state, k[:, :, :1], k, scores)
    with pytest.raises(ValueError, match="lengths must lie in"):
        jc.update(policy, state, k, k, scores, jnp.asarray([4, 1]))
    with pytest.raises(ValueError, match="lengths must be an int array"):
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


@given(st.data())
def test_h2o_chunk_updates_equal_oracle(data):
    from oracle import H2OOracle

    heavy, recent = data.draw(st.integers(1, 5)), data.draw(st.integers(1, 4))
    T, B, H = data.draw(st.sampled_from([1, 3, 7])), 2, 2
    policy = jc.H2O(heavy=heavy, recent=recent)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31 - 1)))
    oracles = [[H2OOracle(heavy, recent) for _ in range(H)] for _ in range(B)]
    state = jc.init_cache(policy, B, H, HEAD_DIM)
    for _ in range(data.draw(st.integers(1, 30 // T + 3))):
        lengths = np.array([data.draw(st.integers(0, T)) for _ in range(B)], np.int32)
        k, v = tagged_chunk(np.asarray(state.seen), T, H)
        scores = random_scores(rng, B, H, heavy + recent, T, tied=False)
        before = np.asarray(state.pos)
        state = UPDATE(policy, state, k, v, scores, jnp.asarray(lengths))
        pos, score, kk = np.asarray(state.pos), np.asarray(state.score), np.asarray(state.k)
        for b in range(B):
            for h in range(H):
                inc = {int(p): np.asarray(scores.cache)[b, h, s] for s, p in enumerate(before[b, h]) if p >= 0}
                orc = oracles[b][h]
                orc.update(np.asarray(scores.chunk)[b, h], inc, int(lengths[b]))
                ring, heavy_slots = pos[b, h, :recent], pos[b, h, recent:]
                np.testing.assert_array_equal(np.sort(ring[ring >= 0]), [p for p, _ in orc.recent])
                got = sorted(zip(heavy_slots[heavy_slots >= 0], score[b, h, recent:][heavy_slots >= 0]))
                want = sorted((p, m) for p, m in orc.heavy)
                np.testing.assert_array_equal([p for p, _ in got], [p for p, _ in want])
                np.testing.assert_allclose([m for _, m in got], [m for _, m in want], rtol=1e-6)
                held = pos[b, h] >= 0
                np.testing.assert_array_equal(kk[b, h, held, 0], pos[b, h, held])  # K travels with its token


def test_h2o_keeps_residents_on_ties():
    policy = jc.H2O(heavy=2, recent=1)
    state = jc.init_cache(policy, 1, 1, HEAD_DIM)
    zeros = jc.Scores(jnp.zeros((1, 1, 3)), jnp.zeros((1, 1, 1)))
    for _ in range(6):  # every token scores 0: the first two pushed out of the window stay heavy
        k, v = tagged_chunk(np.asarray(state.seen), 1, 1)
        state = UPDATE(policy, state, k, v, zeros)
    np.testing.assert_array_equal(np.sort(state.pos[0, 0]), [0, 1, 5])
