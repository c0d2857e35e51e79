"""NaN in q/k/v or in the weights: it never leaks into other batch rows or KV heads; a layer's cache
recovers once the token is evicted; through a model a row that saw it stays non-finite and jc.score
reports the positions."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny

import jcascade as jc

ATTEND = jax.jit(jc.attend, static_argnums=(0, 6))
UPDATE = jax.jit(jc.update, static_argnums=0)
ROPE = jc.RoPE(100.0)
B, HKV, HQ, D = 2, 2, 4, 8
NAN_AT = 8  # position of the poisoned token: row 0, KV head 0 (query heads 0 and 1)
BOUNDED = [
    jc.SlidingWindow(window=6),
    jc.Sink(window=6, sinks=2),
    jc.Cascade(cache_size=8, sinks=2, num_cascades=2),
    jc.H2O(heavy=3, recent=4),
]


def run(policy, poison: str | None, backend="xla", steps=40):
    """Feeds a chunk of 6, a chunk of 5 (token NAN_AT poisoned in `poison` for row 0 / KV head 0), then
    single tokens; returns the outputs [steps, B, Hq, D] of the single-token steps and the states."""
    rng = np.random.default_rng(0)
    state = jc.init_cache(policy, B, HKV, D, max_tokens=64, kernels=jc.Kernels(backend))
    outs, states = [], []
    for T in [6, 5] + [1] * steps:
        q, k, v = (rng.normal(size=(B, T, h, D)).astype(np.float32) for h in (HQ, HKV, HKV))
        first = int(state.seen[0])
        if poison is not None and first <= NAN_AT < first + T:
            x = {"q": q, "k": k, "v": v}[poison]
            x[0, NAN_AT - first, 0 if poison != "q" else slice(0, 2)] = np.nan
        out, scores = ATTEND(policy, state, q, k, v, None, ROPE)
        state = UPDATE(policy, state, k, v, scores)
        if T == 1:
            outs.append(np.asarray(out[:, 0]))
            states.append(state)
    return np.stack(outs), states


@pytest.mark.parametrize("poison", ["q", "k", "v"])
@pytest.mark.parametrize("policy", BOUNDED + [jc.Full()], ids=lambda p: type(p).__name__)
def test_a_nan_stays_in_its_row_and_kv_head(policy, poison):
    clean, clean_states = run(policy, None)
    dirty, dirty_states = run(policy, poison)
    np.testing.assert_array_equal(dirty[:, 1], clean[:, 1])  # the other row
    np.testing.assert_array_equal(dirty[:, 0, 2:], clean[:, 0, 2:])  # the other KV head's query heads
    for got, want in zip(dirty_states, clean_states):
        for name in ("k", "v", "pos", "score"):
            a, b = (np.asarray(getattr(s, name).data if name in ("k", "v") else getattr(s, name)) for s in (got, want))
            np.testing.assert_array_equal(a[1], b[1])
            np.testing.assert_array_equal(a[0, 1], b[0, 1])


@pytest.mark.parametrize("policy", BOUNDED, ids=lambda p: type(p).__name__)
def test_a_layer_recovers_once_the_poisoned_token_is_evicted(policy):
    outs, states = run(policy, "k")
    held = np.array([NAN_AT in np.asarray(s.pos[0, 0]) for s in states])
    assert held[0] and not held[-1]  # held after the chunk, evicted later
    finite = np.isfinite(outs[:, 0, :2]).all(axis=(1, 2))
    # NaN exactly while the token is held (the step's output reads the cache before its update)
    np.testing.assert_array_equal(finite[1:], ~held[:-1])


def test_full_holds_a_poisoned_token_for_good():
    outs, _ = run(jc.Full(), "k", steps=10)
    assert np.isnan(outs[:, 0, :2]).all() and np.isfinite(outs[:, 0, 2:]).all()


def test_the_pallas_kernels_keep_a_nan_in_its_row_and_head():
    policy = jc.Cascade(cache_size=8, sinks=2, num_cascades=2)
    clean, _ = run(policy, None, "triton", steps=6)
    dirty, _ = run(policy, "k", "triton", steps=6)
    np.testing.assert_array_equal(dirty[:, 1], clean[:, 1])
    np.testing.assert_array_equal(dirty[:, 0, 2:], clean[:, 0, 2:])
    assert np.isnan(dirty[:, 0, :2]).all()


def test_score_reports_where_a_row_turned_non_finite():
    healthy = tiny.model(97, seed=1, tie_word_embeddings=False)  # an untied head: logits stay finite
    weights = {
        "embed": healthy.embed[...].at[13].set(jnp.nan),
        "final_norm": healthy.final_norm[...],
        "lm_head": healthy.lm_head[...],
        **{k: p[...] for k, p in healthy.layers.items()},
    }
    model = jc.CausalLM(healthy.config, weights)  # a corrupt embedding row: only rows that feed token 13 see it
    tokens = np.random.default_rng(2).integers(14, 97, (2, 40))
    tokens[0, 10] = 13
    policy = jc.Sink(window=8, sinks=2, stride=8)
    clean = np.asarray(jc.score(healthy, tokens, policy))
    with pytest.warns(
        RuntimeWarning,
        match=r"non-finite log-probabilities .*row 0: 24 from position 8 "
        r"\(8, 9, 10, 11, 12, \.\.\.\)$",
    ):
        dirty = np.asarray(jc.score(model, tokens, policy))
    np.testing.assert_array_equal(dirty[1], clean[1])  # no leak into the other row
    # from the start of the bad token's chunk (the chunk's earlier queries multiply its value by a zero
    # weight: 0 * NaN), until the tokens it reached have left both layers' caches
    np.testing.assert_array_equal(dirty[0, :8], clean[0, :8])
    assert np.isnan(dirty[0, 8:32]).all()
    np.testing.assert_allclose(dirty[0, 32:], clean[0, 32:], rtol=1e-4)  # recovered: the cache forgot
    with pytest.warns(RuntimeWarning, match=r"row 0: 31 from position 8"):
        full = np.asarray(jc.score(model, tokens, jc.Full(stride=8)))  # Full never forgets
    assert np.isnan(full[0, 8:]).all() and np.isfinite(full[1]).all()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jc.score(healthy, tokens, policy)  # finite: no warning
