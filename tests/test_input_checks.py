"""Checks at the boundaries: token ids, lengths and sampling arguments are refused by name, checked before any
narrowing (under a user's jit: unchecked, or a checkify error); damaged or truncated weight and tokenizer files
are named with what is wrong; a book or word list that is not text is refused."""

import importlib.util
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import jcascade as jc
import tiny
from jcascade.eval import texts
from jcascade.models import loading

VOCAB = 50
POLICY = jc.Full(stride=8)  # the default stride (4096) would pad each prompt to 4096 tokens


@pytest.fixture(scope="module")
def model():
    return tiny.model(VOCAB)


# ---- token ids, lengths, sampling arguments ----------------------------------------------------------------


def test_ids_and_lengths_are_checked_in_their_own_dtype_before_narrowing(model):
    ok = np.array([[1, 2, 3]])
    cache = model.init_cache(POLICY, 1, max_tokens=3)
    entry_points = {
        "generate": lambda t, **kw: jc.generate(model, t, POLICY, max_new_tokens=2, **kw),
        "score": lambda t, **kw: jc.score(model, t, POLICY, **kw),
        "prefill": lambda t, lengths=np.array([3]), **kw: jc.prefill(model, POLICY, cache, t, lengths, **kw),
    }
    for name, run in entry_points.items():
        # as int32 these would be 5, 0 and 3: valid ids and lengths
        with pytest.raises(ValueError, match=r"tokens: token ids must lie in \[0, vocab_size=50\), got "
                                             r"\[4294967301\] at \[\(0, 2\)\]"):
            run(np.array([[1, 2, 2**32 + 5]], np.int64))
        with pytest.raises(ValueError, match=r"tokens: .* got \[18446744073709551615\]"):
            run(np.array([[2**64 - 1, 2, 3]], np.uint64))
        with pytest.raises(ValueError, match=r"tokens: .* got \[-3\]"):
            run(np.array([[1, -3, 3]], np.int8))
        least = 0 if name == "prefill" else 1
        with pytest.raises(ValueError, match=rf"lengths: each must lie in \[{least}, 3\].* got \[4294967299\]"):
            run(ok, lengths=np.array([2**32 + 3], np.int64))
        for wrong in (ok.astype(np.float32), ok > 1, [[1.0, 2.0, 3.0]]):
            with pytest.raises(TypeError, match="tokens must be an integer array"):
                run(wrong)
        with pytest.raises(TypeError, match=r"lengths must be an integer array of shape \[1\], got float64\[1\]"):
            run(ok, lengths=np.array([3.0]))
        with pytest.raises(ValueError, match=r"lengths must be an integer array of shape \[1\], got int64\[2\]"):
            run(ok, lengths=np.array([3, 3]))
    with pytest.raises(ValueError, match=r"lengths: each must lie in \[1, 3\] \(a prompt needs at least one token\)"):
        jc.score(model, ok, POLICY, lengths=np.array([0], np.uint64))
    with pytest.raises(ValueError, match=r"lengths: each must lie in \[0, 3\], got \[4\]"):
        jc.prefill(model, POLICY, cache, ok, np.array([4], np.uint8))
    with pytest.raises(ValueError, match=r"targets: token ids must lie in \[0, vocab_size=50\), got \[50\]"):
        jc.prefill(model, POLICY, cache, ok, np.array([3]), targets=np.array([[1, 50, 3]], np.int16))


def test_ids_of_every_integer_dtype_score_alike_and_padding_ids_are_ignored(model):
    """One compilation: the ids become int32 after their check. Padding may hold any id (it becomes 0: an id
    outside the vocabulary there would embed as NaN and turn its row NaN)."""
    tokens = np.array([[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 0, 0]])
    lengths = np.array([6, 4])
    want = np.asarray(jc.score(model, tokens, POLICY, lengths=lengths))
    assert np.isfinite(want).all()
    for ids in (tokens.astype(np.uint32), tokens.astype(np.int8), tokens.astype(np.uint64),
                jnp.asarray(tokens, jnp.uint8), np.where(np.arange(6) < lengths[:, None], tokens, 2**40 + 999),
                tokens.tolist()):
        np.testing.assert_array_equal(jc.score(model, ids, POLICY, lengths=lengths.astype(np.uint16)), want)
    np.testing.assert_array_equal(jc.score(model, np.where(tokens > 0, tokens, 999), POLICY, lengths=lengths), want)


def test_sampling_arguments_of_the_wrong_type_or_range_are_refused_by_name(model):
    tokens = np.array([[1, 2, 3]])
    key = jax.random.key(0)
    for kwargs, error, match in [
        (dict(max_new_tokens=2.0), TypeError, "max_new_tokens must be a positive int, got float 2.0"),
        (dict(max_new_tokens=True), TypeError, "max_new_tokens must be a positive int, got bool"),
        (dict(max_new_tokens=0), ValueError, "max_new_tokens must be a positive int, got 0"),
        (dict(temperature="0.5"), TypeError, r"temperature must be a finite float >= 0 .*, got str '0.5'"),
        (dict(temperature=-0.5), ValueError, r"temperature must be a finite float >= 0 .*, got -0.5"),
        (dict(temperature=float("nan"), rng=key), ValueError, r"temperature must be .*, got nan"),
        (dict(temperature=float("inf"), rng=key), ValueError, r"temperature must be .*, got inf"),
        (dict(top_p=1.5), ValueError, r"top_p must be a float in \(0, 1\], got 1.5"),
        (dict(top_p=0), ValueError, r"top_p must be a float in \(0, 1\], got 0"),
        (dict(top_p="1"), TypeError, r"top_p must be a float in \(0, 1\], got str"),
        (dict(eos_id=VOCAB), ValueError, r"eos_id must be None or an int in \[0, vocab_size=50\), got 50"),
        (dict(eos_id=-1), ValueError, r"eos_id must be None or an int in \[0, vocab_size=50\), got -1"),
        (dict(eos_id=1.0), TypeError, "eos_id must be None or an int .*, got float 1.0"),
        (dict(num_samples=2.0), TypeError, "num_samples must be a positive int or None, got float"),
        (dict(temperature=1.0), ValueError, r"rng \(a jax.random key\) is required"),
        (dict(temperature=1.0, rng=0), TypeError, "rng must be one key from jax.random.key .*, got int"),
        (dict(temperature=1.0, rng=np.random.default_rng(0)), TypeError, "rng must be one key .*, got Generator"),
        (dict(temperature=1.0, rng=jax.random.split(key)), TypeError, r"rng must be one key .*, got key<fry>\[2\]"),
    ]:
        kwargs.setdefault("max_new_tokens", 2)
        with pytest.raises(error, match=match):
            jc.generate(model, tokens, POLICY, **kwargs)
    with pytest.raises(TypeError, match=r"prefix must be None or an int in \[1, 3\], got float 2.0"):
        jc.score(model, tokens, jc.SnapKV(budget=64), prefix=2.0)


def test_out_of_range_ids_under_jit_are_unchecked_or_a_checkify_error(model):
    """Traced values cannot be checked: an id >= vocab_size embeds as NaN (its row's log-likelihoods are NaN),
    a negative one wraps around the vocabulary; under checkify the same program reports the argument, the
    value and where it is."""
    run = jax.jit(lambda tokens, lengths: jc.score(model, tokens, POLICY, lengths=lengths))
    tokens, lengths = jnp.array([[1, 2, 3, 4], [1, 2, 3, 4]]), jnp.array([4, 4])
    out = np.asarray(run(tokens.at[1, 2].set(VOCAB + 10), lengths))
    assert np.isfinite(out[0]).all() and np.isnan(out[1]).all()
    np.testing.assert_array_equal(run(tokens.at[1, 2].set(-1), lengths), run(tokens.at[1, 2].set(VOCAB - 1), lengths))
    checked = checkify.checkify(run)
    error, _ = checked(tokens.at[1, 2].set(VOCAB + 10), lengths)
    with pytest.raises(checkify.JaxRuntimeError, match=r"tokens: token ids must lie in \[0, vocab_size=50\), got 60 "
                                                       r"at \[1 2\]"):
        error.throw()
    error, _ = checked(tokens, jnp.array([4, 5]))
    with pytest.raises(checkify.JaxRuntimeError, match=r"lengths: each must lie in \[1, 4\] .*got 5 at \[1\]"):
        error.throw()
    error, _ = checked(tokens.at[1, 3].set(VOCAB + 10), jnp.array([4, 3]))  # a bad id in padding: fine
    error.throw()


# ---- weight and tokenizer files ----------------------------------------------------------------------------


def hf_directory(directory, model):
    """The tiny model as a Hugging Face directory: config.json + model.safetensors."""
    from safetensors.numpy import save_file

    c = model.config
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
              "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
              "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
              "rms_norm_eps": c.rms_norm_eps, "tie_word_embeddings": True, "max_position_embeddings": 4096}
    tensors = {}
    for ours, w in model.weights().items():
        tensors.update(tiny.source_tensors(ours, w, "hf", c.num_layers))
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, directory / "model.safetensors")
    return directory


def damaged_copy(source, target, name, change):
    shutil.copytree(source, target)
    (target / name).write_bytes(change((target / name).read_bytes()))
    return target


def test_damaged_safetensors_directories_name_the_file_and_the_fault(model, tmp_path):
    from safetensors.numpy import load_file, save_file

    good = hf_directory(tmp_path / "good", model)
    assert jc.load_pretrained(good).config == model.config
    size = (good / "model.safetensors").stat().st_size
    header = 8 + int.from_bytes((good / "model.safetensors").read_bytes()[:8], "little")
    for name, change, match in [
        ("model.safetensors", lambda b: b[:-10],
         rf"model.safetensors: truncated: the header says {size - header} bytes of tensor data, the file has "
         rf"{size - header - 10}"),
        ("model.safetensors", lambda b: b + b"0000", "model.safetensors: damaged: the header says"),
        ("model.safetensors", lambda b: b[:100], r"model.safetensors: truncated or not a safetensors file: 100 bytes"),
        ("model.safetensors", lambda b: b[:8] + b"#" + b[9:], "model.safetensors: damaged: its header is not the JSON"),
        ("config.json", lambda b: b[:-20], r"config.json: damaged or truncated: not valid JSON \(.* at line 1, column"),
        ("config.json", lambda b: b"\x89PNG\r\n\x1a\n" + b, r"config.json: damaged: not UTF-8 text \(byte 0\)"),
    ]:
        broken = damaged_copy(good, tmp_path / f"broken-{len(list(tmp_path.iterdir()))}", name, change)
        with pytest.raises(ValueError, match=match):
            jc.load_pretrained(broken)
    # a tensor whose shape does not match the config: the tensor, its file, both shapes
    tensors = load_file(good / "model.safetensors")
    misshaped = shutil.copytree(good, tmp_path / "misshaped")
    save_file({**tensors, "model.layers.1.mlp.up_proj.weight": np.zeros((64, 31), np.float32)},
              misshaped / "model.safetensors")
    with pytest.raises(ValueError, match=r"model.safetensors: tensor 'model.layers.1.mlp.up_proj.weight' has shape "
                                         r"\(64, 31\), the config needs \(64, 32\)"):
        jc.load_pretrained(misshaped)
    sharded = shutil.copytree(good, tmp_path / "sharded")
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-00002.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="model.safetensors.index.json lists model-00002.safetensors, which"):
        jc.load_pretrained(sharded)


def write_gguf(path, model, intermediate_size=None):
    """The tiny model as a float32 llama GGUF file (no tokenizer)."""
    from gguf import GGUFWriter

    c = model.config
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(c.num_layers)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(intermediate_size or c.intermediate_size)
    writer.add_head_count(c.num_heads)
    writer.add_head_count_kv(c.num_kv_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    for ours, w in model.weights().items():  # GGUF's (llama.cpp's) row permutation of Q/K does not matter here
        for name, tensor in tiny.source_tensors(ours, w, "gguf", c.num_layers).items():
            writer.add_tensor(name, np.ascontiguousarray(tensor))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_damaged_gguf_files_name_the_file_and_the_fault(model, tmp_path):
    good = write_gguf(tmp_path / "model.gguf", model)
    assert jc.load_pretrained(good).config.hidden_size == model.config.hidden_size
    data = good.read_bytes()
    for cut in (len(data) - 10, 1000, 2):  # in the tensor data, the metadata, the magic number
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(ValueError, match=rf"cut.gguf: truncated: the GGUF file has {cut} bytes, its header and "
                                             r"tensor table need at least \d+"):
            jc.load_pretrained(tmp_path / "cut.gguf")
    (tmp_path / "other.gguf").write_bytes(b"PK\x03\x04" + data[4:])
    with pytest.raises(ValueError, match=r"other.gguf: not readable as a GGUF file \(\d+ bytes\): GGUF magic invalid"):
        jc.read_config(tmp_path / "other.gguf")
    write_gguf(tmp_path / "misshaped.gguf", model, intermediate_size=model.config.intermediate_size + 1)
    with pytest.raises(ValueError, match=r"misshaped.gguf: tensor 'blk.0.ffn_gate.weight' has shape \(64, 32\), the "
                                         r"config needs \(65, 32\)"):
        jc.load_pretrained(tmp_path / "misshaped.gguf")
    if importlib.util.find_spec("torch") is not None:  # transformers reads GGUF tokenizers through torch
        with pytest.raises(ValueError, match="cut.gguf: truncated"):
            jc.load_tokenizer(tmp_path / "cut.gguf")


def test_damaged_converted_checkpoints_name_the_folder_and_the_fault(model, tmp_path):
    good = tmp_path / "good"
    jc.save_converted(model, good)
    largest = max((p for p in (good / "weights").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    truncated = damaged_copy(good, tmp_path / "truncated", largest.relative_to(good), lambda b: b[: len(b) // 2])
    with pytest.raises(ValueError, match=r"truncated/weights: cannot restore the orbax checkpoint: .*; if it is "
                                         r"damaged, delete "):
        jc.load_pretrained(truncated)
    metadata = damaged_copy(good, tmp_path / "metadata", "weights/_METADATA", lambda b: b[:50])
    with pytest.raises(ValueError, match=r"metadata/weights: not readable as an orbax checkpoint"):
        jc.load_pretrained(metadata)
    config = damaged_copy(good, tmp_path / "config", loading.CONVERTED_CONFIG, lambda b: b[:40])
    with pytest.raises(ValueError, match=r"jcascade-config.json: damaged or truncated: not valid JSON"):
        jc.load_pretrained(config)
    other = json.dumps({**json.loads((good / loading.CONVERTED_CONFIG).read_text()), "vocab_size": VOCAB + 1})
    mismatch = damaged_copy(good, tmp_path / "mismatch", loading.CONVERTED_CONFIG, lambda b: other.encode())
    with pytest.raises(ValueError, match=r"mismatch/weights: tensor 'embed' has shape \(50, 32\), jcascade-config.json "
                                         r"needs \(51, 32\)"):
        jc.load_pretrained(mismatch)


def test_damaged_tokenizer_files_name_the_file_and_the_fault(tmp_path):
    good = tmp_path / "good"
    tiny.tokenizer().save_pretrained(good)
    assert len(jc.load_tokenizer(good)) > 4
    for name, change, match in [
        ("tokenizer.json", lambda b: b[: len(b) // 2],
         r"tokenizer.json: damaged or truncated: not valid JSON \(.* at line"),
        ("tokenizer.json", lambda b: b"\xff\xfe\x00\x01" * 64, r"tokenizer.json: damaged: not UTF-8 text \(byte 0\)"),
        ("tokenizer_config.json", lambda b: b[:30], "tokenizer_config.json: damaged or truncated: not valid JSON"),
    ]:
        broken = damaged_copy(good, tmp_path / f"broken-{len(list(tmp_path.iterdir()))}", name, change)
        with pytest.raises(ValueError, match=match):
            jc.load_tokenizer(broken)


# ---- books and word lists ----------------------------------------------------------------------------------


@pytest.mark.parametrize("content, match", [
    ("Ein Buch über Bäume\n".encode("latin-1"), r"not UTF-8 text \(byte 0xfc at offset 9: invalid start byte\)"),
    (b"\x1f\x8b\x08\x00" + bytes(range(256)), r"not UTF-8 text \(byte 0x8b at offset 1"),
    (b"words\x00\x00\x00\x05binary", r"not text \(a NUL character at offset 5"),
], ids=["latin-1", "gzip", "nul"])
def test_a_book_or_word_list_that_is_not_utf8_text_is_refused(tmp_path, content, match):
    path = tmp_path / "input.txt"
    path.write_bytes(content)
    for load in (texts.load_book, texts.word_list):
        with pytest.raises(ValueError, match=rf"input.txt: {match}"):
            load(path)


def test_attend_and_update_check_lengths_in_their_own_dtype():
    """The cache-level API too: an int64 length of 2**32 + 1 is refused, not narrowed to 1."""
    policy = jc.Sink(window=8, sinks=2, stride=4)
    state = jc.init_cache(policy, batch=1, num_kv_heads=1, head_dim=4)
    q = k = v = jnp.ones((1, 4, 1, 4))
    for call in (lambda n: jc.attend(policy, state, q, k, v, lengths=n),
                 lambda n: jc.update(policy, state, k, v, None, lengths=n)):
        with pytest.raises(ValueError, match=r"lengths must lie in \[0, chunk length 4\], got \[4294967297\]"):
            call(np.array([2**32 + 1], np.int64))
        with pytest.raises(ValueError, match="lengths must be an int array"):
            call(np.array([2.0]))
