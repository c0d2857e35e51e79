"""A context and its questions (generate / score with context=): the context is compressed under the policy alone,
then frozen as a shared prefix that each row's question and new tokens read from a cache of their own. Under a
policy that keeps every token both forms equal the concatenated prompt; a shared [1, S] context equals it repeated;
score(context=) equals score(prefix=) over the concatenation for the policies that evict nothing after their prompt;
the kept context tokens do not depend on the question; ragged rows, a user's jit, the refusals."""

import dataclasses

import jax
import numpy as np
import pytest
import tiny
from jcascade.models.config import FAMILY_FEATURES, Rotary

import jcascade as jc

VOCAB = 61
S, T = 24, 6  # context and question widths; 24 + 6 + 4 new tokens exceed the model's 32 trained positions
RNG = np.random.default_rng(0)
CONTEXT = RNG.integers(0, VOCAB, (1, S))  # one context for every row
CONTEXTS = RNG.integers(0, VOCAB, (3, S))  # one per row, ragged
CONTEXT_LENGTHS = np.array([24, 17, 9])
QUESTIONS = RNG.integers(0, VOCAB, (3, T))
LENGTHS = np.array([6, 3, 1])
SNAPKV = jc.SnapKV(budget=10, window=4, stride=8)  # keeps 10 of the 24 context tokens


@pytest.fixture(scope="module")
def model():
    return tiny.model(VOCAB, seed=0, scale=0.3, max_position_embeddings=32)


def concatenated(contexts, context_lengths):
    """Each row's context then its question, right-padded to [3, S + T], and their lengths."""
    rows = [np.concatenate([c[:n], q[:m]]) for c, n, q, m in zip(contexts, context_lengths, QUESTIONS, LENGTHS)]
    return np.stack([np.pad(r, (0, S + T - len(r))) for r in rows]), np.array([len(r) for r in rows])


def scored_part(logps, context_lengths):
    """[3, T] of score(concatenation) [3, S + T - 1]: log p of each question token, the first one included."""
    return np.stack([row[n - 1 : n - 1 + T] for row, n in zip(np.asarray(logps), context_lengths)])


FORMS = {"shared": (CONTEXT, None, [S] * 3), "per-row": (CONTEXTS, CONTEXT_LENGTHS, CONTEXT_LENGTHS)}


@pytest.mark.parametrize(
    "policy, form",
    [
        (jc.Full(stride=8), "shared"),
        (jc.Full(stride=8), "per-row"),
        (jc.SnapKV(budget=32, window=4, stride=8), "shared"),
    ],
    ids=["Full-shared", "Full-per-row", "SnapKV-shared"],
)  # SnapKV per row: the ragged test below
def test_a_policy_that_keeps_every_token_equals_the_concatenated_prompt(model, policy, form):
    """Ragged questions after a shared context, or after ragged contexts of their own: log-probs (the first
    question token given the context included) and greedy tokens equal the concatenated prompt's under Full; the
    positions warning counts the context."""
    context, context_lengths, used = FORMS[form]
    prompt, prompt_lengths = concatenated(np.broadcast_to(context, (3, S)), used)
    full = jc.Full(stride=8)
    got = np.asarray(
        jc.score(model, QUESTIONS, policy, lengths=LENGTHS, context=context, context_lengths=context_lengths)
    )
    want = scored_part(jc.score(model, prompt, full, lengths=prompt_lengths), used)
    np.testing.assert_allclose(got, np.where(np.arange(T) < LENGTHS[:, None], want, 0.0), atol=1e-5)
    with pytest.warns(UserWarning, match="34 tokens exceed the model's 32 trained positions"):
        generated = jc.generate(
            model,
            QUESTIONS,
            policy,
            lengths=LENGTHS,
            context=context,
            context_lengths=context_lengths,
            max_new_tokens=4,
        )
    with pytest.warns(UserWarning, match="34 tokens exceed"):
        np.testing.assert_array_equal(
            generated, jc.generate(model, prompt, full, lengths=prompt_lengths, max_new_tokens=4)
        )


def test_a_shared_context_equals_it_repeated_per_row(model):
    """Under compression (SnapKV keeps 10 of 24): one [1, S] prefix read by every row, or B identical rows (the
    same log-probs up to the order of the sums, the same greedy tokens)."""
    repeated = np.repeat(CONTEXT, 3, axis=0)
    np.testing.assert_allclose(
        jc.score(model, QUESTIONS, SNAPKV, lengths=LENGTHS, context=CONTEXT),
        jc.score(model, QUESTIONS, SNAPKV, lengths=LENGTHS, context=repeated),
        atol=1e-5,
    )
    np.testing.assert_array_equal(
        jc.generate(model, QUESTIONS, SNAPKV, lengths=LENGTHS, context=CONTEXT, max_new_tokens=2),
        jc.generate(model, QUESTIONS, SNAPKV, lengths=LENGTHS, context=repeated, max_new_tokens=2),
    )


@pytest.mark.parametrize("fmt", ["int8", "float8_e4m3fn"])
def test_a_quantized_context_reads_as_the_concatenated_prompt(model, fmt):
    """Under a quantized Full cache (the context shared as its codes: tests/pallas_kernels/test_quantization.py),
    the log-probs after a context equal the concatenated prompt's under the same policy, as Full's do."""
    policy = jc.Full(stride=8, kv_dtype=fmt)
    prompt, prompt_lengths = concatenated(np.repeat(CONTEXT, 3, axis=0), [S] * 3)
    got = np.asarray(jc.score(model, QUESTIONS, policy, lengths=LENGTHS, context=CONTEXT))
    want = scored_part(jc.score(model, prompt, policy, lengths=prompt_lengths), [S] * 3)
    np.testing.assert_allclose(got, np.where(np.arange(T) < LENGTHS[:, None], want, 0.0), atol=1e-5)


def kvzip(budget):
    return jc.KVzip(budget=budget, instruction=(1, 2, 3), continuation=(4,), turn=(5,), chunk=16, stride=8)


COMPRESSING = [
    SNAPKV,
    jc.PyramidKV(budget=10, window=4, beta=4, stride=8),
    jc.AdaKV(SNAPKV),
    jc.KNorm(budget=8, stride=8),
    jc.ExpectedAttention(budget=10, window=4, future=16, sinks=2, stride=8),
    kvzip(10),
]


@pytest.mark.parametrize("policy", COMPRESSING, ids=lambda p: type(p).__name__)
def test_score_after_a_context_equals_score_with_the_context_as_prompt(model, policy):
    """For a policy that evicts nothing after its prompt, score(q, context=C) is score(C + q, prefix=S) on q, and
    differs from Full's (the context really was compressed)."""
    prompt, prompt_lengths = concatenated(np.repeat(CONTEXT, 3, axis=0), [S] * 3)
    got = np.asarray(jc.score(model, QUESTIONS, policy, lengths=LENGTHS, context=CONTEXT))
    want = np.asarray(jc.score(model, prompt, policy, lengths=prompt_lengths, prefix=S))[:, S - 1 :]
    np.testing.assert_allclose(got, want, atol=1e-5)
    full = np.asarray(jc.score(model, QUESTIONS, jc.Full(stride=8), lengths=LENGTHS, context=CONTEXT))
    assert not np.allclose(got, full, atol=1e-3)


def test_a_ragged_row_under_compression_equals_it_alone(model):
    """Row 1 (a 17-token context, compressed to 10, and a 3-token question) of a ragged batch equals its
    concatenation scored alone with the context as prompt; entries past a question's length are 0."""
    got = np.asarray(
        jc.score(model, QUESTIONS, SNAPKV, lengths=LENGTHS, context=CONTEXTS, context_lengths=CONTEXT_LENGTHS)
    )
    n, m = CONTEXT_LENGTHS[1], LENGTHS[1]
    alone = np.concatenate([CONTEXTS[1, :n], QUESTIONS[1, :m]])[None]
    np.testing.assert_allclose(
        got[1, :m], np.asarray(jc.score(model, alone, SNAPKV, prefix=int(n)))[0, n - 1 :], atol=1e-5
    )
    assert not (got * (np.arange(T) >= LENGTHS[:, None])).any()


KEPT = []  # the positions each compression of WatchedSnapKV kept: int32 [layers, B, KV heads, slots]


@dataclasses.dataclass(frozen=True)
class WatchedSnapKV(jc.SnapKV):
    """SnapKV that reports the positions its compression keeps (from inside the compiled program)."""

    def compress(self, state, room):
        state = super().compress(state, room)
        jax.debug.callback(lambda pos: KEPT.append(np.asarray(pos)), state.pos)
        return state


def kept_context(pos, row):
    """The context positions each layer and KV head of `row` kept."""
    return [[frozenset(p[p >= 0].tolist()) & set(range(S)) for p in layer[row]] for layer in pos]


def test_snapkv_keeps_the_same_context_tokens_whatever_the_question(model):
    """Two rows, one context, two different questions: their compressions keep the same context tokens. With each
    question in the prompt (query-aware: score(C + q, prefix=len)) the kept context tokens differ between them."""
    policy = WatchedSnapKV(budget=10, window=4, stride=8)
    KEPT.clear()
    jc.score(model, QUESTIONS[:2], policy, context=np.repeat(CONTEXT, 2, axis=0))
    jc.score(model, np.concatenate([np.repeat(CONTEXT, 2, axis=0), QUESTIONS[:2]], axis=1), policy, prefix=S + T)
    assert len(KEPT) == 2
    agnostic, aware = KEPT
    assert len(kept_context(agnostic, 0)[0][0]) < S  # it compressed the context
    assert kept_context(agnostic, 0) == kept_context(agnostic, 1)
    assert kept_context(aware, 0) != kept_context(aware, 1)


def test_context_inside_a_users_jit(model):
    policy = SNAPKV

    @jax.jit
    def pipeline(model, questions, lengths, contexts, context_lengths):
        kwargs = dict(lengths=lengths, context=contexts, context_lengths=context_lengths)
        return jc.generate(model, questions, policy, max_new_tokens=2, **kwargs), jc.score(
            model, questions, policy, **kwargs
        )

    generated, logps = pipeline(model, QUESTIONS, LENGTHS, CONTEXTS, CONTEXT_LENGTHS)
    kwargs = dict(lengths=LENGTHS, context=CONTEXTS, context_lengths=CONTEXT_LENGTHS)
    np.testing.assert_array_equal(generated, jc.generate(model, QUESTIONS, policy, max_new_tokens=2, **kwargs))
    np.testing.assert_allclose(logps, jc.score(model, QUESTIONS, policy, **kwargs), atol=1e-6)


def test_refusals_name_the_argument(model):
    generate = lambda **kw: jc.generate(model, QUESTIONS, jc.Full(stride=8), max_new_tokens=2, **kw)
    for kwargs, error, match in [
        (
            dict(context=CONTEXT[0]),
            ValueError,
            r"context must be an integer array of shape \[1, length\] .* or "
            r"\[3, length\] .*, got shape \[24\]",
        ),
        (dict(context=CONTEXTS[:2]), ValueError, r"context must be .*, got shape \[2, 24\]"),
        (dict(context=CONTEXT[:, :0]), ValueError, "context is empty"),
        (dict(context=CONTEXT.astype(np.float32)), TypeError, r"context must be an integer array of shape \[1, 24\]"),
        (dict(context=CONTEXT + VOCAB), ValueError, rf"context: token ids must lie in \[0, vocab_size={VOCAB}\)"),
        (dict(context_lengths=CONTEXT_LENGTHS), ValueError, "context_lengths goes only with context="),
        (
            dict(context=CONTEXTS, context_lengths=CONTEXT_LENGTHS[:1]),
            ValueError,
            r"context_lengths must be an integer array of shape \[3\]",
        ),
        (
            dict(context=CONTEXTS, context_lengths=np.array([24, 0, 25])),
            ValueError,
            r"context_lengths: each must lie in \[1, 24\] .*got \[0, 25\]",
        ),
        (dict(context=CONTEXT, num_samples=2), ValueError, "num_samples and context= do not combine"),
    ]:
        with pytest.raises(error, match=match):
            generate(**kwargs)
    with pytest.raises(ValueError, match="context= does not support Recycled"):
        jc.score(model, QUESTIONS, jc.Recycled(top_k=4, refresh_every=2), context=CONTEXT)
    with pytest.raises(ValueError, match="prefix= and context= do not combine"):
        jc.score(model, QUESTIONS, SNAPKV, context=CONTEXT, prefix=2)
    gemma = tiny.model(
        VOCAB,
        architecture="gemma3",
        **FAMILY_FEATURES["gemma3"],
        num_layers=2,
        sliding_window=8,
        layer_types=("sliding", "global"),
        rotary=Rotary(theta=10000.0, local_theta=10000.0),
    )
    with pytest.raises(ValueError, match="context= is not supported yet for models with sliding or linear layers"):
        jc.generate(gemma, QUESTIONS, jc.Full(stride=8), max_new_tokens=2, context=CONTEXT)
