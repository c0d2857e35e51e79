"""Qwen3.5 and Gemma 4 under every policy (tiny random models): a policy whose budget holds the whole text scores
and generates exactly as Full does, on ragged rows (their parity with transformers: test_loading.py; sharded:
test_sharding.py); the layer types' states (a Gated DeltaNet's recurrent state, a window cache, the caches
that later layers read) behave as the decoder documents."""

import numpy as np
import pytest

import jcascade as jc
import tiny

QWEN3_5 = dict(architecture="qwen3_5", num_layers=3, qk_norm=True, layer_types=("linear", "global", "linear"),
               attention_output_gate=True, partial_rotary_factor=0.25, linear_key_heads=2, linear_value_heads=4,
               linear_key_dim=8, linear_value_dim=8, linear_conv_kernel=4)
GEMMA4 = dict(architecture="gemma4", num_layers=4, qk_norm=True, layer_types=("sliding", "global") * 2,
              sliding_window=8, rope_local_theta=10000.0, query_scale=1.0, global_head_dim=16, k_eq_v=True,
              kv_shared_layers=2, per_layer_input_size=4, per_layer_vocab_size=96, final_logit_softcapping=30.0,
              partial_rotary_factor=0.25)
FAMILIES = {"qwen3_5": QWEN3_5, "gemma4": GEMMA4}
# every policy at a budget that holds the whole text (40 prompt tokens + 6 generated)
KEEP_ALL = [jc.SlidingWindow(window=64, stride=16), jc.Sink(window=64, stride=16),
            jc.Cascade(cache_size=64, sinks=2, num_cascades=2, stride=16), jc.H2O(heavy=32, recent=32, stride=16),
            jc.TOVA(cache_size=64, stride=16), jc.SnapKV(budget=64, window=4, stride=16),
            jc.PyramidKV(budget=64, window=4, stride=16), jc.AdaKV(jc.SnapKV(budget=64, window=4, stride=16)),
            jc.KNorm(budget=64, stride=16), jc.ExpectedAttention(budget=64, window=4, future=16, sinks=2, stride=16),
            jc.KVzip(budget=64, instruction=(1, 2, 3), continuation=(4,), turn=(5,), chunk=16, stride=16),
            jc.Recycled(top_k=64, refresh_every=3, stride=16)]


def family_model(name: str) -> jc.CausalLM:
    return tiny.model(96, seed=1, hidden_size=64, intermediate_size=128, num_heads=8, num_kv_heads=4,
                      **FAMILIES[name])




def score_and_generate(model, policy, tokens, lengths):
    prefix = 24 if policy.needs_prompt else None
    score = jc.score(model, tokens, policy, lengths=lengths, prefix=prefix)
    generated = jc.generate(model, tokens[:, :24], policy, max_new_tokens=6, lengths=np.minimum(lengths, 24))
    return np.asarray(score), np.asarray(generated)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    model = family_model(request.param)
    tokens = np.random.default_rng(0).integers(0, 96, (2, 40)).astype(np.int32)
    lengths = np.array([40, 23], np.int32)
    want = {prompt: score_and_generate(model, jc.Full(stride=16) if not prompt else jc.SnapKV(budget=4096, stride=16),
                                       tokens, lengths) for prompt in (False, True)}
    return model, tokens, lengths, want


@pytest.mark.parametrize("policy", KEEP_ALL, ids=lambda p: type(p).__name__)
def test_every_policy_that_keeps_the_whole_text_scores_and_generates_as_full(family, policy):
    model, tokens, lengths, want = family
    score, generated = score_and_generate(model, policy, tokens, lengths)
    want_score, want_generated = want[policy.needs_prompt]
    np.testing.assert_allclose(score, want_score, rtol=1e-5, atol=1e-4)  # log-probs up to about 30
    np.testing.assert_array_equal(generated, want_generated)
