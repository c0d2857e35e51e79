"""Qwen3.5, Gemma 4 and SmolLM3 (a layer without rotary positions) under every policy (tiny random models): a policy
whose budget holds the whole text gives Full's log-probabilities through a prompt and decode steps, on ragged rows
(their parity with transformers under Full, Cascade and SnapKV, greedy generation included: test_loading.py;
sharded: test_sharding.py)."""

import numpy as np
import pytest
import tiny

import jcascade as jc

QWEN3_5 = dict(
    architecture="qwen3_5",
    num_layers=3,
    qk_norm=True,
    head_dim=16,
    layer_types=("linear", "global", "linear"),
    attention_output_gate=True,
    partial_rotary_factor=0.25,
    linear_key_heads=2,
    linear_value_heads=4,
    linear_key_dim=8,
    linear_value_dim=8,
    linear_conv_kernel=4,
)
GEMMA4 = dict(
    architecture="gemma4",
    num_layers=4,
    qk_norm=True,
    layer_types=("sliding", "global") * 2,
    sliding_window=8,
    rope_local_theta=10000.0,
    query_scale=1.0,
    global_head_dim=16,
    k_eq_v=True,
    kv_shared_layers=2,
    per_layer_input_size=4,
    per_layer_vocab_size=96,
    final_logit_softcapping=30.0,
    partial_rotary_factor=0.25,
)
SMOLLM3 = dict(architecture="smollm3", num_layers=3, nope_layers=(1,))
FAMILIES = {"qwen3_5": QWEN3_5, "gemma4": GEMMA4, "smollm3": SMOLLM3}
# every policy at a budget that holds the whole text (40 tokens)
KEEP_ALL = [
    jc.SlidingWindow(window=64, stride=16),
    jc.Sink(window=64, stride=16),
    jc.Cascade(cache_size=64, sinks=2, num_cascades=2, stride=16),
    jc.H2O(heavy=32, recent=32, stride=16),
    jc.TOVA(cache_size=64, stride=16),
    jc.SnapKV(budget=64, window=4, stride=16),
    jc.PyramidKV(budget=64, window=4, stride=16),
    jc.AdaKV(jc.SnapKV(budget=64, window=4, stride=16)),
    jc.KNorm(budget=64, stride=16),
    jc.ExpectedAttention(budget=64, window=4, future=16, sinks=2, stride=16),
    jc.KVzip(budget=64, instruction=(1, 2, 3), continuation=(4,), turn=(5,), chunk=16, stride=16),
    jc.Recycled(top_k=64, refresh_every=3, stride=16),
]


def family_model(name: str) -> jc.CausalLM:
    return tiny.model(96, seed=1, hidden_size=64, intermediate_size=128, num_heads=8, num_kv_heads=4, **FAMILIES[name])


def prompt_then_steps(model, policy, tokens, lengths):
    """Log-probs of tokens [B, 40] after a 24-token prompt: the prompt is prefilled (and compressed, for a policy
    that acts after it) in 16-token chunks, then each token runs as one decode step, teacher-forced: the path
    `generate` takes (tests/test_generation.py: score with a prefix replays generate, under every policy)."""
    return np.asarray(jc.score(model, tokens, policy, lengths=lengths, prefix=24))


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    model = family_model(request.param)
    tokens = np.random.default_rng(0).integers(0, 96, (2, 40)).astype(np.int32)
    lengths = np.array([40, 31], np.int32)
    return model, tokens, lengths, prompt_then_steps(model, jc.Full(stride=16), tokens, lengths)


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
