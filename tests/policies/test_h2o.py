"""H2O's cache update against its token-by-token oracle (tests/oracle.py). Its attention weights (every valid
query counts 1): tests/test_attention.py."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from oracle import HEAD_DIM, H2OOracle, random_scores, tagged_chunk

import jcascade as jc

UPDATE = jax.jit(jc.update, static_argnums=0)


@given(st.data())
def test_h2o_chunk_updates_equal_oracle(data):
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
        pos, score, kk = np.asarray(state.pos), np.asarray(state.score), np.asarray(state.k.data)
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
