"""Qwen3.5, Gemma 3 and 4, SmolLM3 (a layer without rotary positions) and OLMo 3 (norms after attention and MLP
only, sliding layers) under every policy (tiny random models): a policy whose budget holds the whole text gives
Full's log-probabilities through a prompt and decode steps, on ragged rows; a policy that evicts generates each
padded row as beside a copy of itself (their parity with transformers under Full, Cascade and SnapKV, greedy
generation included: test_loading.py; sharded: test_sharding.py)."""

import functools

import numpy as np
import pytest
import tiny
from jcascade.models.config import FAMILY_FEATURES, Attention, LinearAttention, Rotary

import jcascade as jc

QWEN3_5 = dict(
    architecture="qwen3_5",
    **FAMILY_FEATURES["qwen3_5"],
    num_layers=3,
    head_dim=16,
    layer_types=("linear", "global", "linear"),
    rotary=Rotary(theta=10000.0, fraction=0.25),
    attention=Attention(output_gate=True),
    linear=LinearAttention(key_heads=2, value_heads=4, key_dim=8, value_dim=8, conv_kernel=4),
)
GEMMA4 = dict(
    architecture="gemma4",
    **FAMILY_FEATURES["gemma4"],
    num_layers=4,
    layer_types=("sliding", "global") * 2,
    sliding_window=8,
    rotary=Rotary(theta=10000.0, local_theta=10000.0, fraction=0.25, proportional=True),
    attention=Attention(query_scale=1.0, global_head_dim=16, global_weights=True, k_eq_v=True),
    kv_shared_layers=2,
    per_layer_input_size=4,
    per_layer_vocab_size=96,
    final_logit_softcapping=30.0,
)
SMOLLM3 = dict(architecture="smollm3", **FAMILY_FEATURES["smollm3"], num_layers=3, nope_layers=(1,))
OLMO3 = dict(
    architecture="olmo3",
    **FAMILY_FEATURES["olmo3"],
    num_layers=4,
    layer_types=("sliding", "global") * 2,
    sliding_window=8,
    rotary=Rotary(theta=10000.0, local_theta=10000.0),
)
GEMMA3 = dict(
    architecture="gemma3",
    **FAMILY_FEATURES["gemma3"],
    num_layers=3,
    layer_types=("sliding", "global", "sliding"),
    sliding_window=8,
    rotary=Rotary(theta=10000.0, local_theta=10000.0),
    attention=Attention(query_scale=0.3),
)
FAMILIES = {
    "qwen3_5": QWEN3_5,
    "gemma4": GEMMA4,
    "smollm3": SMOLLM3,
    "olmo3": OLMO3,
    "gemma3": GEMMA3,
}


def every_policy(budget: int, stride: int) -> list:
    """Every policy but Full, at `budget` tokens, acting in `stride`-token chunks."""
    return [
        jc.SlidingWindow(window=budget, stride=stride),
        jc.Sink(window=budget - 2, sinks=2, stride=stride),
        jc.Cascade(cache_size=budget, sinks=2, num_cascades=2, stride=stride),
        jc.H2O(heavy=budget // 2, recent=budget // 2, stride=stride),
        jc.TOVA(cache_size=budget, stride=stride),
        jc.SnapKV(budget=budget, window=4, stride=stride),
        jc.PyramidKV(budget=budget, window=4, stride=stride),
        jc.AdaKV(jc.SnapKV(budget=budget, window=4, stride=stride)),
        jc.KNorm(budget=budget, stride=stride),
        jc.ExpectedAttention(budget=budget, window=4, future=16, sinks=2, stride=stride),
        jc.KVzip(budget=budget, instruction=(1, 2, 3), continuation=(4,), turn=(5,), chunk=stride, stride=stride),
        jc.Recycled(top_k=budget, refresh_every=3, stride=stride),
    ]


KEEP_ALL = every_policy(64, 16)  # a budget that holds the whole text (40 tokens)
EVICTING = every_policy(12, 8)  # each evicts from prompts of 24 and 17 tokens and 8 (or 16) new ones


@functools.cache
def family_model(name: str) -> jc.CausalLM:
    return tiny.model(96, seed=1, hidden_size=64, intermediate_size=128, num_heads=8, num_kv_heads=4, **FAMILIES[name])


TOKENS = np.random.default_rng(0).integers(0, 96, (2, 40)).astype(np.int32)
LENGTHS = np.array([40, 31], np.int32)


def prompt_then_steps(model, policy, tokens, lengths):
    """Log-probs of tokens [B, 40] after a 24-token prompt: the prompt is prefilled (and compressed, for a policy
    that acts after it) in 16-token chunks, then each token runs as one decode step, teacher-forced: the path
    `generate` takes (tests/test_generation.py: score with a prefix replays generate, under every policy)."""
    return np.asarray(jc.score(model, tokens, policy, lengths=lengths, prefix=24))


@functools.cache
def full_scores(name: str) -> np.ndarray:
    return prompt_then_steps(family_model(name), jc.Full(stride=16), TOKENS, LENGTHS)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    return family_model(request.param), TOKENS, LENGTHS, full_scores(request.param)


@pytest.mark.parametrize("policy", KEEP_ALL, ids=lambda p: type(p).__name__)
def test_every_policy_that_keeps_the_whole_text_scores_as_full(family, policy):
    model, tokens, lengths, want = family
    np.testing.assert_allclose(prompt_then_steps(model, policy, tokens, lengths), want, rtol=1e-5, atol=1e-4)


def test_a_padded_row_scores_as_alone(family):
    """Row 1 (31 of 40 tokens) beside a full row gives what it gives alone: padding reaches no layer's state (the
    Gated DeltaNet's recurrent state and convolution tail, the window caches, the caches later layers read)."""
    model, tokens, lengths, want = family
    alone = prompt_then_steps(model, jc.Full(stride=16), tokens[1:, :31], lengths[1:])
    np.testing.assert_allclose(alone[0], want[1, :30], rtol=1e-5, atol=1e-4)


NEW_FAMILIES = ("qwen3_5", "gemma4", "smollm3", "olmo3")


# Each policy on one of the new families in turn (each family under 3 policies): the suite's cost. Every pair passed
# on 2026-11-29 (48 instances, 43 s each on 2 cores); the keep-all test above runs every pair.
@pytest.mark.parametrize(
    "name, policy", [(NEW_FAMILIES[i % 4], p) for i, p in enumerate(EVICTING)], ids=lambda x: getattr(x, "label", x)
)
def test_every_policy_that_evicts_generates_each_padded_row_as_beside_itself(name, policy):
    """A new family generates under each policy while it evicts: the padded row (17 of 24 prompt tokens) generates
    the same tokens beside a full row as beside a copy of itself (padding and the other row reach none of its
    layers' states), and the same steps teacher-forced (`prompt_then_steps`) differ from Full's (the policy acted;
    greedy tokens of these tiny models often do not change)."""
    model, prompts, lengths = family_model(name), TOKENS[:, :24], np.array([24, 17], np.int32)
    generate = lambda rows: np.asarray(
        jc.generate(model, prompts[rows], policy, max_new_tokens=8, lengths=lengths[rows])
    )
    np.testing.assert_array_equal(generate([0, 1])[1], generate([1, 1])[0])
    scored = prompt_then_steps(model, policy, TOKENS, LENGTHS)
    assert np.isfinite(scored).all() and np.abs(scored - full_scores(name)).max() > 1e-3
