"""jc.score, jc.generate and the strided prefill (jcascade/generation.py) on a tiny random model: every policy
equals Full while the sequence fits, score(prefix=) replays generate, strides, ragged rows, eos, sampling,
nesting in a user's jit, input checks."""

import dataclasses
import warnings

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
import tiny
from hypothesis import given
from hypothesis import strategies as st

import jcascade as jc
from jcascade import generation

VOCAB = 97


@pytest.fixture(scope="module")
def model():
    return tiny.model(
        VOCAB,
        seed=0,
        scale=0.2,
        hidden_size=64,
        intermediate_size=96,
        num_layers=3,
        head_dim=16,
        max_position_embeddings=512,
    )


FITTING = [
    jc.Cascade(cache_size=96, sinks=4, num_cascades=4, stride=16),
    jc.SnapKV(budget=128, window=8, stride=16),
    jc.PyramidKV(budget=128, window=4, stride=16),
    jc.Recycled(top_k=128, refresh_every=5, stride=16),
    jc.SnapKV(budget=128, positions="cache", stride=16),
    jc.Recycled(top_k=128, refresh_every=3, positions="cache", stride=16),
]


@pytest.mark.parametrize("policy", FITTING, ids=lambda p: f"{type(p).__name__}-{p.positions}")
def test_policies_equal_full_while_the_sequence_fits(model, policy):
    tokens = np.random.default_rng(5).integers(0, VOCAB, (2, 70))
    lengths = np.array([70, 52])
    full = jc.score(model, tokens, jc.Full(stride=16), lengths=lengths)
    prefix = 40 if policy.needs_prompt else None
    np.testing.assert_allclose(jc.score(model, tokens, policy, lengths=lengths, prefix=prefix), full, atol=2e-5)
    want = jc.generate(model, tokens[:, :40], jc.Full(stride=16), max_new_tokens=12)
    np.testing.assert_array_equal(jc.generate(model, tokens[:, :40], policy, max_new_tokens=12), want)


@pytest.mark.parametrize(
    "policy",
    [
        jc.SnapKV(budget=24, window=4, stride=16),
        jc.PyramidKV(budget=24, window=4, beta=4, stride=16),
        jc.Recycled(top_k=12, refresh_every=4, stride=16, kernel=3),
    ],
    ids=lambda p: type(p).__name__,
)
def test_score_with_a_prefix_replays_generate(model, policy):
    """Teacher-forced scoring after a prompt sees what decoding saw: every greedy token is at least as
    likely under score(prefix=) as any substitute at its step, and the policy differs from Full."""
    rng = np.random.default_rng(6)
    prompt = rng.integers(0, VOCAB, (1, 60))
    new = np.asarray(jc.generate(model, prompt, policy, max_new_tokens=8))[0]
    seq = np.concatenate([prompt[0], new])
    rows, where = [seq], []
    for i in range(8):
        for token in rng.integers(0, VOCAB, 4):
            row = seq.copy()
            row[60 + i] = token
            rows.append(row)
            where.append(i)
    logp = np.asarray(jc.score(model, np.stack(rows), policy, prefix=60))
    chosen = logp[0, 59:]
    for r, i in enumerate(where, start=1):
        assert logp[r, 59 + i] <= chosen[i] + 1e-6
    full = np.asarray(jc.score(model, seq[None], jc.Full(stride=16)))[0, 59:]
    assert not np.allclose(chosen, full, atol=1e-4)  # the policy really dropped something


def test_strided_prefill_equals_one_shot_under_full(model):
    tokens = np.random.default_rng(5).integers(0, VOCAB, (1, 70))
    one_shot = jc.score(model, tokens, jc.Full(stride=70))
    for stride in (1, 13, 64):
        np.testing.assert_allclose(jc.score(model, tokens, jc.Full(stride=stride)), one_shot, atol=1e-5)


def test_ragged_rows_equal_the_same_rows_alone(model):
    rng = np.random.default_rng(6)
    policy = jc.Cascade(cache_size=24, sinks=2, num_cascades=3, stride=8)
    rows = [rng.integers(0, VOCAB, n) for n in (30, 11, 19)]
    batch = np.zeros((3, 30), np.int64)
    for i, r in enumerate(rows):
        batch[i, : len(r)] = r
    lengths = jnp.array([len(r) for r in rows])
    scores = np.asarray(jc.score(model, batch, policy, lengths=lengths))
    generated = np.asarray(jc.generate(model, batch, policy, max_new_tokens=10, lengths=lengths))
    for i, r in enumerate(rows):
        assert not scores[i, len(r) - 1 :].any()
        if i == 2:  # padded like row 1 (rows 0 and 1 test the longest row and a padded one alone)
            continue
        alone = np.asarray(jc.score(model, r[None], policy))[0]
        np.testing.assert_allclose(scores[i, : len(r) - 1], alone, atol=1e-5)
        np.testing.assert_array_equal(
            generated[i], np.asarray(jc.generate(model, r[None], policy, max_new_tokens=10))[0]
        )


def test_generate_stops_at_eos_and_samples_with_a_key(model):
    prompt = np.random.default_rng(7).integers(0, VOCAB, (2, 12))
    full = jc.Full(stride=16)
    greedy = np.asarray(jc.generate(model, prompt, full, max_new_tokens=8))
    eos = int(greedy[0, 2])
    stopped = np.asarray(jc.generate(model, prompt, full, max_new_tokens=8, eos_id=eos))
    first = list(greedy[0]).index(eos)
    np.testing.assert_array_equal(stopped[0, : first + 1], greedy[0, : first + 1])
    assert (stopped[0, first + 1 :] == eos).all()
    a = jc.generate(model, prompt, full, max_new_tokens=8, temperature=1.0, top_p=0.9, rng=jax.random.key(1))
    b = jc.generate(model, prompt, full, max_new_tokens=8, temperature=1.0, top_p=0.9, rng=jax.random.key(1))
    np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="rng"):
        jc.generate(model, prompt, full, max_new_tokens=8, temperature=0.7)


def test_generate_and_score_nest_inside_a_users_jit(model):
    prompt = jnp.asarray(np.random.default_rng(8).integers(0, VOCAB, (1, 16)), jnp.int32)
    policy = jc.Sink(window=8, sinks=2, stride=4)

    @jax.jit
    def pipeline(model, prompt):
        out = jc.generate(model, prompt, policy, max_new_tokens=6)
        return out, jc.score(model, jnp.concatenate([prompt, out], axis=1), policy)

    out, logp = pipeline(model, prompt)
    np.testing.assert_array_equal(out, jc.generate(model, prompt, policy, max_new_tokens=6))
    assert logp.shape == (1, 21) and np.isfinite(np.asarray(logp)).all()


def test_the_model_may_be_its_nnx_split_pair_or_a_weights_dict_with_its_config(model):
    """The design card's call jc.generate(params, tokens, policy): params as the model, the pair nnx.split
    returns, or the weights with config=; also as arguments of a user's jit. Anything else: a TypeError."""
    from flax import nnx

    prompt = jnp.asarray(np.random.default_rng(9).integers(0, VOCAB, (2, 12)), jnp.int32)
    policy = jc.Cascade(cache_size=8, sinks=2, num_cascades=2, stride=4)
    want = np.asarray(jc.generate(model, prompt, policy, max_new_tokens=5))
    graphdef, state = nnx.split(model)
    weights, config = model.weights(), model.config
    np.testing.assert_array_equal(jc.generate((graphdef, state), prompt, policy, max_new_tokens=5), want)
    np.testing.assert_array_equal(jc.generate(weights, prompt, policy, max_new_tokens=5, config=config), want)
    jitted = jax.jit(
        lambda state, weights, prompt: (
            jc.generate((graphdef, state), prompt, policy, max_new_tokens=5),
            jc.generate(weights, prompt, policy, max_new_tokens=5, config=config),
            jc.score(weights, prompt, policy, config=config),
        )
    )
    from_pair, from_weights, logps = jitted(state, weights, prompt)
    np.testing.assert_array_equal(from_pair, want)
    np.testing.assert_array_equal(from_weights, want)
    np.testing.assert_allclose(logps, jc.score(model, prompt, policy), atol=1e-5)
    for params, given_config, match in [
        (state, None, "nnx.State alone lacks its graph"),
        (weights, None, "also needs config="),
        (model, config, "config= goes only with a dict"),
        ([1, 2], None, "got list"),
    ]:
        with pytest.raises(TypeError, match=match):
            jc.generate(params, prompt, policy, max_new_tokens=5, config=given_config)


def test_bad_inputs_raise_clear_errors(model):
    with pytest.raises(ValueError, match=rf"token ids must lie in \[0, vocab_size={VOCAB}\)"):
        jc.generate(model, np.array([[1, 2, VOCAB]]), jc.Full(), max_new_tokens=2)
    with pytest.raises(ValueError, match="tokens is empty"):
        jc.score(model, np.zeros((1, 0), np.int32), jc.Full())
    with pytest.raises(ValueError, match="at least one token"):
        jc.generate(model, np.ones((2, 4), np.int32), jc.Full(), max_new_tokens=2, lengths=np.array([4, 0]))
    with pytest.warns(UserWarning, match="exceed the model's 512 trained positions"):
        jc.generate(model, np.ones((1, 500), np.int32), jc.Full(stride=256), max_new_tokens=20)
    jc.generate(
        model, np.ones((1, 500), np.int32), jc.Sink(window=32, sinks=4, stride=256), max_new_tokens=20
    )  # bounded: fine
    with warnings.catch_warnings():  # right-padded rows: the positions used are the longest row's, not the padding's
        warnings.simplefilter("error")
        jc.generate(
            model, np.ones((2, 500), np.int32), jc.Full(stride=256), max_new_tokens=20, lengths=np.array([490, 300])
        )


@given(stride=st.integers(1, 5000), width=st.integers(1, 9000))
def test_the_prefill_chunk_is_cut_to_the_prompt_within_the_stride(stride, width):
    """chunk_size: at most the stride; a prompt within the stride is one chunk (the chunking is the stride's),
    one wider is fed in stride chunks; a cut chunk is a power of two >= 16 (few compiled widths)."""
    chunk = generation.chunk_size(jc.Sink(window=8, stride=stride), width)
    assert chunk <= stride
    assert width <= chunk < 2 * max(width, generation.SMALLEST_CHUNK) if width <= stride else chunk == stride
    if chunk < stride:
        assert chunk >= generation.SMALLEST_CHUNK and chunk & (chunk - 1) == 0


@pytest.mark.parametrize(
    "policy", [jc.Sink(window=16, sinks=4), jc.KVzip(budget=16, instruction=(5, 6, 7))], ids=lambda p: type(p).__name__
)
def test_a_short_prompt_under_the_default_stride_compiles_a_short_chunk(model, policy):
    """A 37-token prompt under a stride-4096 policy: no array of the generate program is 2048 or more wide (the
    prompt was padded to a whole stride chunk before the cut, and KVzip's reconstruction rows to its 2048-token
    chunk)."""
    tokens = np.random.default_rng(3).integers(0, VOCAB, (1, 37))
    jaxpr = jax.make_jaxpr(lambda t: jc.generate(model, t, policy, max_new_tokens=2))(tokens)
    widths = {d for eqn in _equations(jaxpr.jaxpr) for v in eqn.outvars for d in getattr(v.aval, "shape", ())}
    assert 64 in widths and max(widths) < 2048, sorted(widths)


def _equations(jaxpr):
    """Every equation of a jaxpr, those of its sub-jaxprs (scan, while, pjit bodies) included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _equations(sub)


@pytest.mark.parametrize(
    "policy",
    [
        jc.Cascade(cache_size=16, sinks=4, num_cascades=2),
        jc.Sink(window=16, sinks=4),
        jc.H2O(heavy=8, recent=8),
        jc.SnapKV(budget=16, window=4),
        jc.KVzip(budget=16, instruction=(5, 6, 7), continuation=(8, 9), turn=(10,), chunk=24, overlap=4),
    ],
    ids=lambda p: type(p).__name__,
)
def test_the_cut_chunk_changes_no_result(model, policy):
    """Under the default stride (4096: a chunk cut to 64, 27 of it padding) the log-probs of a 37-token prompt
    then 6 tokens fed one by one (as generate feeds them) are those of a stride of exactly the prompt's width
    (one unpadded chunk), bit for bit."""
    tokens = np.random.default_rng(4).integers(0, VOCAB, (2, 43))
    lengths, exact = np.array([43, 30]), dataclasses.replace(policy, stride=37)
    np.testing.assert_array_equal(
        jc.score(model, tokens, policy, lengths=lengths, prefix=37),
        jc.score(model, tokens, exact, lengths=lengths, prefix=37),
    )


def test_prompt_cache_is_the_cache_generate_decodes_from(model):
    """`generation.prompt_cache` (how the benchmarks reach the cache after a prompt): SnapKV's cache compressed
    to its budget, from which the decode loop continues exactly as generate does; a negative room is refused."""
    policy = jc.SnapKV(budget=24, window=8, stride=16)
    tokens, lengths = np.random.default_rng(7).integers(0, VOCAB, (2, 60)), np.array([60, 45])
    state, last = jax.jit(lambda t: generation.prompt_cache(model, policy, t, lengths, room=6))(tokens)
    assert int((np.asarray(jc.cached_positions(state.cache)) >= 0).sum(-1).max()) == 24
    run = jax.jit(
        lambda s, h: generation.decode(
            model, policy, s, h, jax.random.key(0), max_new_tokens=6, temperature=0.0, top_p=1.0, eos_id=None
        )
    )
    np.testing.assert_array_equal(
        run(state, last), jc.generate(model, tokens, policy, max_new_tokens=6, lengths=lengths)
    )
    with pytest.raises(ValueError, match="room must be an int >= 0, got -1"):
        generation.prompt_cache(model, policy, tokens, room=-1)
