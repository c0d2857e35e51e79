"""The "Writing a policy" example of docs/policies.md, executed as written (the one test that runs it): a policy
defined outside the package runs through init_cache / attend / update, jc.score and jc.generate, and keeps what it
says it keeps."""

import doc_blocks
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny
from hypothesis import given
from hypothesis import strategies as st

import jcascade as jc


def the_example() -> type:
    """The class the block of docs/policies.md that names this file defines."""
    (block,) = [
        b
        for b in doc_blocks.python_blocks(doc_blocks.ROOT / "docs/policies.md")
        if doc_blocks.run_elsewhere(b) == doc_blocks.ROOT / "tests/policies/test_policy_example.py"
    ]
    assert len(block.code.splitlines()) < 60
    namespace = {"__name__": "policy_example"}
    block.run(namespace)
    return namespace["RecentAndEveryNth"]


RecentAndEveryNth = the_example()


def expected_positions(seen: int, recent: int, landmarks: int, every: int) -> set[int]:
    """The newest `recent` positions plus the newest multiples of `every` before them, `landmarks` of them
    (fewer while the row is young)."""
    kept = set(range(max(0, seen - recent), seen))
    older = [p for p in range(max(0, seen - recent) - 1, -1, -1) if p % every == 0]
    return kept | set(older[: recent + landmarks - len(kept)])


@given(
    st.lists(st.tuples(st.integers(1, 9), st.integers(0, 9)), min_size=1, max_size=12),
    st.integers(1, 6),
    st.integers(1, 4),
    st.integers(2, 5),
)
def test_the_example_keeps_the_recent_tokens_and_the_newest_landmarks(chunks, recent, landmarks, every):
    policy = RecentAndEveryNth(recent=recent, landmarks=landmarks, every=every)
    state = jc.init_cache(policy, 2, 2, 4)
    rng = np.random.default_rng(0)
    for T, pad in chunks:
        lengths = jnp.asarray([T, max(T - pad, 0)], jnp.int32)
        k = rng.normal(size=(2, T, 2, 4)).astype(np.float32)
        k[..., 0] = np.asarray(state.seen)[:, None, None] + np.arange(T)[None, :, None]  # its position
        k = jnp.asarray(k)
        before = state
        state = jc.update(policy, state, k, 2 * k, None, lengths)
        if lengths[1] == 0:  # padding leaves the row untouched
            for old, new in zip(jax.tree.leaves(before), jax.tree.leaves(state)):
                np.testing.assert_array_equal(np.asarray(old)[1], np.asarray(new)[1])
    pos, keys, values = np.asarray(state.pos), np.asarray(state.k.data), np.asarray(state.v.data)
    for row in range(2):
        seen = int(state.seen[row])
        for head in range(2):
            held = [int(p) for p in pos[row, head] if p >= 0]
            assert set(held) == expected_positions(seen, recent, landmarks, every)
            assert len(held) == len(set(held))
            held_slots = pos[row, head] >= 0
            # each slot holds the key and value fed at its position (k[..., 0] is the position, v = 2k)
            np.testing.assert_array_equal(keys[row, head, held_slots, 0], pos[row, head][held_slots])
            np.testing.assert_array_equal(values[row, head][held_slots], 2 * keys[row, head][held_slots])


@pytest.fixture(scope="module")
def model():
    return tiny.model(97, seed=2)


def test_the_example_runs_through_score_and_generate(model):
    tokens = np.random.default_rng(4).integers(0, 97, (2, 60))
    lengths = np.array([60, 45])
    roomy = RecentAndEveryNth(recent=96, landmarks=4, every=10, stride=16)  # everything fits: equals Full
    full = jc.score(model, tokens, jc.Full(stride=16), lengths=lengths)
    np.testing.assert_allclose(jc.score(model, tokens, roomy, lengths=lengths), full, atol=2e-5)
    np.testing.assert_array_equal(
        jc.generate(model, tokens[:, :40], roomy, max_new_tokens=8),
        jc.generate(model, tokens[:, :40], jc.Full(stride=16), max_new_tokens=8),
    )

    tight = RecentAndEveryNth(recent=8, landmarks=4, every=10, stride=16)
    logps = np.asarray(jc.score(model, tokens, tight, lengths=lengths))
    assert np.isfinite(logps).all()
    assert np.abs(logps - np.asarray(full)).max() > 1e-3  # it really evicts
    out = jc.generate(model, tokens[:, :40], tight, max_new_tokens=8, lengths=np.array([40, 33]))
    assert out.shape == (2, 8) and (np.asarray(out) >= 0).all()


def test_the_example_is_validated_and_hashable():
    with pytest.raises(ValueError, match="RecentAndEveryNth.every must be >= 1"):
        RecentAndEveryNth(recent=4, landmarks=2, every=0)
    assert hash(RecentAndEveryNth(4, 2)) == hash(RecentAndEveryNth(4, 2))
    with pytest.raises(ValueError, match="keeps no scores"):
        state = jc.init_cache(RecentAndEveryNth(4, 2), 1, 1, 2)
        jc.update(
            RecentAndEveryNth(4, 2),
            state,
            jnp.zeros((1, 1, 1, 2)),
            jnp.zeros((1, 1, 1, 2)),
            jc.Scores(cache=jnp.zeros((1, 1, 6)), chunk=jnp.zeros((1, 1, 1))),
        )
