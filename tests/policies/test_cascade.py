"""Cascade's cache update against the token-by-token oracle of docs/semantics.md §3, and its consequences."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from oracle import HEAD_DIM, CascadeOracle, random_scores, tagged_chunk

import jcascade as jc
from jcascade import slot_order

UPDATE = jax.jit(jc.update, static_argnums=0)


def assert_matches_oracle(state, oracles, layout):
    pos, score = np.asarray(state.pos), np.asarray(state.score)
    k, v = (np.asarray(x) for x in jc.cached_kv(state))
    ranks = np.asarray(slot_order.slot_ranks(layout, state.seen))
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
                np.testing.assert_allclose(
                    score[b, h, slots], [m for _, m in ring], rtol=1e-6, err_msg=f"ring {i} scores, {where}"
                )
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
    """docs/semantics.md §3: a T-token chunk equals T single-token updates given the same scores.

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
            single = UPDATE(
                policy, single, k[:, j : j + 1], v[:, j : j + 1], jc.Scores(zeros, jnp.asarray(raw[..., j : j + 1]))
            )
    np.testing.assert_array_equal(chunked.pos, single.pos)
    np.testing.assert_array_equal(chunked.k.data, single.k.data)
    # Sink scores are never decayed nor used (docs/semantics.md §3): compare the rings'.
    np.testing.assert_allclose(chunked.score[..., 2:], single.score[..., 2:], rtol=1e-5)


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
