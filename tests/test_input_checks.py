"""Checks at the boundaries: token ids, lengths and sampling arguments are refused by name, checked before any
narrowing (under a user's jit: unchecked, or a checkify error); damaged or truncated weight and tokenizer files
are named with what is wrong; a book or word list that is not text is refused."""

import dataclasses
import importlib.util
import json
import re
import shutil
import typing

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny
from hypothesis import given
from hypothesis import strategies as st
from jax.experimental import checkify
from jcascade.models import loading

import jcascade as jc
from jcascade.eval import texts
from jcascade.policies import policy_classes

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
        "prefill": lambda t, lengths=None, **kw: jc.prefill(
            model, POLICY, cache, t, np.array([3]) if lengths is None else lengths, **kw
        ),
    }
    for name, run in entry_points.items():
        # as int32 these would be 5, 0 and 3: valid ids and lengths
        with pytest.raises(
            ValueError,
            match=r"tokens: token ids must lie in \[0, vocab_size=50\), got "
            r"\[4294967301\] at \[\(0, 2\)\]",
        ):
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
    for ids in (
        tokens.astype(np.uint32),
        tokens.astype(np.int8),
        tokens.astype(np.uint64),
        jnp.asarray(tokens, jnp.uint8),
        np.where(np.arange(6) < lengths[:, None], tokens, 2**40 + 999),
        tokens.tolist(),
    ):
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
    with pytest.raises(
        checkify.JaxRuntimeError,
        match=r"tokens: token ids must lie in \[0, vocab_size=50\), got 60 "
        r"at \[1 2\]",
    ):
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
    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps,
        "tie_word_embeddings": True,
        "max_position_embeddings": 4096,
    }
    tensors = {}
    for ours, w in tiny.unfused(c, model.weights()).items():
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
        (
            "model.safetensors",
            lambda b: b[:-10],
            rf"model.safetensors: truncated: the header says {size - header} bytes of tensor data, the file has "
            rf"{size - header - 10}",
        ),
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
    save_file(
        {**tensors, "model.layers.1.mlp.up_proj.weight": np.zeros((64, 31), np.float32)},
        misshaped / "model.safetensors",
    )
    with pytest.raises(
        ValueError,
        match=r"model.safetensors: tensor 'model.layers.1.mlp.up_proj.weight' has shape "
        r"\(64, 31\), the config needs \(64, 32\)",
    ):
        jc.load_pretrained(misshaped)
    sharded = shutil.copytree(good, tmp_path / "sharded")
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-00002.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="model.safetensors.index.json lists model-00002.safetensors, which"):
        jc.load_pretrained(sharded)


GGUF_REQUIRED = (
    "block_count",
    "embedding_length",
    "feed_forward_length",
    "attention.head_count",
    "attention.layer_norm_rms_epsilon",
    "vocab_size",
)  # without a tokenizer: the vocabulary's size


def write_gguf(path, model, intermediate_size=None, omit=None):
    """The tiny model as a float32 llama GGUF file (no tokenizer), without the metadata field `omit`."""
    from gguf import GGUFWriter

    c = model.config
    writer = GGUFWriter(str(path), "llama")
    for name, add, value in [
        ("block_count", writer.add_block_count, c.num_layers),
        ("embedding_length", writer.add_embedding_length, c.hidden_size),
        ("feed_forward_length", writer.add_feed_forward_length, intermediate_size or c.intermediate_size),
        ("attention.head_count", writer.add_head_count, c.num_heads),
        ("attention.head_count_kv", writer.add_head_count_kv, c.num_kv_heads),
        ("attention.layer_norm_rms_epsilon", writer.add_layer_norm_rms_eps, c.rms_norm_eps),
        ("vocab_size", writer.add_vocab_size, c.vocab_size),
    ]:
        if name != omit:
            add(value)
    # GGUF's (llama.cpp's) row permutation of Q/K does not matter here
    tiny.write_gguf(
        writer,
        {
            name: tensor
            for ours, w in tiny.unfused(c, model.weights()).items()
            for name, tensor in tiny.source_tensors(ours, w, "gguf", c.num_layers).items()
        },
    )
    return path


def test_damaged_gguf_files_name_the_file_and_the_fault(model, tmp_path):
    good = write_gguf(tmp_path / "model.gguf", model)
    assert jc.load_pretrained(good).config.hidden_size == model.config.hidden_size
    data = good.read_bytes()
    for cut in (len(data) - 10, 1000, 2):  # in the tensor data, the metadata, the magic number
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(
            ValueError,
            match=rf"cut.gguf: truncated: the GGUF file has {cut} bytes, its header and "
            r"tensor table need at least \d+",
        ):
            jc.load_pretrained(tmp_path / "cut.gguf")
    (tmp_path / "other.gguf").write_bytes(b"PK\x03\x04" + data[4:])
    with pytest.raises(ValueError, match=r"other.gguf: not readable as a GGUF file \(\d+ bytes\): GGUF magic invalid"):
        jc.read_config(tmp_path / "other.gguf")
    write_gguf(tmp_path / "misshaped.gguf", model, intermediate_size=model.config.intermediate_size + 1)
    with pytest.raises(
        ValueError,
        match=r"misshaped.gguf: tensor 'blk.0.ffn_gate.weight' has shape \(64, 32\), the "
        r"config needs \(65, 32\)",
    ):
        jc.load_pretrained(tmp_path / "misshaped.gguf")
    if importlib.util.find_spec("torch") is not None:  # transformers reads GGUF tokenizers through torch
        with pytest.raises(ValueError, match="cut.gguf: truncated"):
            jc.load_tokenizer(tmp_path / "cut.gguf")


@pytest.mark.parametrize("field", GGUF_REQUIRED)
def test_a_gguf_file_lacking_a_required_field_names_it_and_the_file(model, tmp_path, field):
    write_gguf(tmp_path / "lacking.gguf", model, omit=field)
    with pytest.raises(ValueError, match=rf"lacking.gguf: the required field 'llama.{field}' is missing"):
        jc.read_config(tmp_path / "lacking.gguf")


def test_a_sharded_checkpoint_reads_each_tensor_from_the_shard_its_index_names(model, tmp_path):
    """Two shards, each tensor where the index says; a stale copy of a tensor in the other shard is refused
    (it was read instead of the named one when its file came later), as is a tensor missing from its shard."""
    from safetensors.numpy import load_file, save_file

    good = hf_directory(tmp_path / "single", model)
    tensors = load_file(good / "model.safetensors")
    names = sorted(tensors)
    first, second = names[: len(names) // 2], names[len(names) // 2 :]

    def sharded(folder, shard_a, shard_b, weight_map):
        folder.mkdir()
        shutil.copy(good / "config.json", folder / "config.json")
        save_file(shard_a, folder / "model-00001-of-00002.safetensors")
        save_file(shard_b, folder / "model-00002-of-00002.safetensors")
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        return folder

    files = {
        name: "model-00001-of-00002.safetensors" if name in first else "model-00002-of-00002.safetensors"
        for name in names
    }
    loaded = jc.load_pretrained(
        sharded(tmp_path / "two", {n: tensors[n] for n in first}, {n: tensors[n] for n in second}, files)
    )
    for ours, w in model.weights().items():
        np.testing.assert_array_equal(np.asarray(loaded.weights()[ours]), np.asarray(w), err_msg=ours)
    stale = names[0]  # named in the first shard; a zeroed copy in the second, which is read last
    twice = sharded(
        tmp_path / "twice",
        {n: tensors[n] for n in first},
        {**{n: tensors[n] for n in second}, stale: np.zeros_like(tensors[stale])},
        files,
    )
    with pytest.raises(
        ValueError,
        match=rf"model.safetensors.index.json: tensor '{re.escape(stale)}' is in two "
        r"shards, model-00001-of-00002.safetensors and "
        r"model-00002-of-00002.safetensors \(the index names "
        r"model-00001-of-00002.safetensors\)",
    ):
        jc.load_pretrained(twice)
    lacking = sharded(tmp_path / "lacking", {n: tensors[n] for n in first[1:]}, {n: tensors[n] for n in second}, files)
    with pytest.raises(
        ValueError,
        match=rf"index.json names model-00001-of-00002.safetensors for tensor "
        rf"'{re.escape(stale)}', which model-00001-of-00002.safetensors does not "
        "hold",
    ):
        jc.load_pretrained(lacking)
    moved = sharded(
        tmp_path / "moved", {n: tensors[n] for n in first[1:]}, {n: tensors[n] for n in [stale, *second]}, files
    )  # the tensor is in the other shard only: the index is wrong, and said so
    with pytest.raises(ValueError, match=rf"names model-00001-of-00002.safetensors for tensor '{re.escape(stale)}'"):
        jc.load_pretrained(moved)


def test_damaged_converted_checkpoints_name_the_folder_and_the_fault(model, tmp_path):
    good = tmp_path / "good"
    jc.save_converted(model, good)
    largest = max((p for p in (good / "weights").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    truncated = damaged_copy(good, tmp_path / "truncated", largest.relative_to(good), lambda b: b[: len(b) // 2])
    with pytest.raises(
        ValueError,
        match=r"truncated/weights: cannot restore the orbax checkpoint: .*; if it is "
        r"damaged, delete ",
    ):
        jc.load_pretrained(truncated)
    metadata = damaged_copy(good, tmp_path / "metadata", "weights/_METADATA", lambda b: b[:50])
    with pytest.raises(ValueError, match=r"metadata/weights: not readable as an orbax checkpoint"):
        jc.load_pretrained(metadata)
    config = damaged_copy(good, tmp_path / "config", loading.CONVERTED_CONFIG, lambda b: b[:40])
    with pytest.raises(ValueError, match=r"jcascade-config.json: damaged or truncated: not valid JSON"):
        jc.load_pretrained(config)
    other = json.dumps({**json.loads((good / loading.CONVERTED_CONFIG).read_text()), "vocab_size": VOCAB + 1})
    mismatch = damaged_copy(good, tmp_path / "mismatch", loading.CONVERTED_CONFIG, lambda b: other.encode())
    with pytest.raises(
        ValueError,
        match=r"mismatch/weights: tensor 'embed' has shape \(50, 32\), jcascade-config.json "
        r"needs \(51, 32\)",
    ):
        jc.load_pretrained(mismatch)
    older = json.dumps(
        {k: v for k, v in json.loads((good / loading.CONVERTED_CONFIG).read_text()).items() if k != "layout"}
    )  # as jcascade wrote it before q/k/v and gate/up were stored joined
    old = damaged_copy(good, tmp_path / "old", loading.CONVERTED_CONFIG, lambda b: older.encode())
    (old / "tokenizer_config.json").write_text("{}")
    with pytest.raises(
        ValueError,
        match=r"old: converted by another jcascade \(weights layout 1, this one reads 3\); "
        r"delete it and convert \(or fetch\) it again",
    ):
        jc.load_pretrained(old)
    (good / "tokenizer_config.json").write_text("{}")
    assert jc.models.packaged.converted(good) and not jc.models.packaged.converted(old)  # fetch converts it again


def test_damaged_tokenizer_files_name_the_file_and_the_fault(tmp_path):
    good = tmp_path / "good"
    tiny.tokenizer().save_pretrained(good)
    assert len(jc.load_tokenizer(good)) > 4
    for name, change, match in [
        (
            "tokenizer.json",
            lambda b: b[: len(b) // 2],
            r"tokenizer.json: damaged or truncated: not valid JSON \(.* at line",
        ),
        ("tokenizer.json", lambda b: b"\xff\xfe\x00\x01" * 64, r"tokenizer.json: damaged: not UTF-8 text \(byte 0\)"),
        ("tokenizer_config.json", lambda b: b[:30], "tokenizer_config.json: damaged or truncated: not valid JSON"),
    ]:
        broken = damaged_copy(good, tmp_path / f"broken-{len(list(tmp_path.iterdir()))}", name, change)
        with pytest.raises(ValueError, match=match):
            jc.load_tokenizer(broken)


# ---- books and word lists ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content, match",
    [
        ("Ein Buch über Bäume\n".encode("latin-1"), r"not UTF-8 text \(byte 0xfc at offset 9: invalid start byte\)"),
        (b"\x1f\x8b\x08\x00" + bytes(range(256)), r"not UTF-8 text \(byte 0x8b at offset 1"),
        (b"words\x00\x00\x00\x05binary", r"not text \(a NUL character at offset 5"),
    ],
    ids=["latin-1", "gzip", "nul"],
)
def test_a_book_or_word_list_that_is_not_utf8_text_is_refused(tmp_path, content, match):
    path = tmp_path / "input.txt"
    path.write_bytes(content)
    for load in (texts.load_book, texts.word_list):
        with pytest.raises(ValueError, match=rf"input.txt: {match}"):
            load(path)


# ---- the cache API ----------------------------------------------------------------------------------------

SINK = jc.Sink(window=4, sinks=1, stride=4)  # bounded, keeps no scores
CASCADE = jc.Cascade(cache_size=4, sinks=1, num_cascades=2, stride=4)  # keeps scores


def test_attend_and_update_check_lengths_in_their_own_dtype():
    """The cache-level API too: an int64 length of 2**32 + 1 is refused, not narrowed to 1."""
    state = jc.init_cache(SINK, batch=1, num_kv_heads=1, head_dim=4)
    q = k = v = jnp.ones((1, 4, 1, 4))
    for call in (
        lambda n: jc.attend(SINK, state, q, k, v, lengths=n),
        lambda n: jc.update(SINK, state, k, v, None, lengths=n),
    ):
        with pytest.raises(
            ValueError,
            match=r"lengths: each must lie in \[0, 4\] .*, got \[4294967297\] at "
            r"\[\(0,\)\]",
        ):
            call(np.array([2**32 + 1], np.int64))
        with pytest.raises(ValueError, match=r"lengths: .*, got \[-1\]"):
            call(np.array([-1], np.int8))
        with pytest.raises(TypeError, match=r"lengths must be an integer array of shape \[1\], got float64\[1\]"):
            call(np.array([2.0]))
        with pytest.raises(ValueError, match=r"lengths must be an integer array of shape \[1\], got int64\[1, 1\]"):
            call(np.array([[2]]))


def test_states_of_the_wrong_kind_or_layering_are_refused_by_name():
    """A stacked cache (init_cache(num_layers=)) where one layer is expected, something that is no CacheState,
    a policy that is no Policy, a state whose arrays disagree: each a clear error, before any computation."""
    stacked = jc.init_cache(SINK, 2, 1, 4, num_layers=3)
    one = jax.tree.map(lambda x: x[0], stacked)
    x = jnp.ones((2, 3, 1, 4))
    layered = r"state is a stacked cache of 3 layers \(pos \[3, 2, 1, 5\]\), .* pass one layer"
    for call in (
        lambda s: jc.attend(SINK, s, x, x, x),
        lambda s: jc.update(SINK, s, x, x, None),
        lambda s: jc.share_prefix(SINK, s),
        lambda s: jc.attend_shared(SINK, s, x, x, x, []),
        lambda s: jc.write_kv(s, (), x[:, 0, :, None], x[:, 0, :, None]),
    ):
        with pytest.raises(ValueError, match=layered):
            call(stacked)
        with pytest.raises(TypeError, match="state must be a jcascade CacheState .*, got tuple"):
            call((one, one))
        with pytest.raises(ValueError, match=r"state.seen must have shape \[2\] \(pos \[2, 1, 5\]\), got \[3\]"):
            call(dataclasses.replace(one, seen=jnp.zeros(3, jnp.int32)))
        jax.eval_shape(call, one)
    # the readers and compress take one layer or a stack
    assert jc.cached_positions(stacked).shape == (3, 2, 1, 5) and jc.cached_kv(one)[0].shape == (2, 1, 5, 4)
    for read in (jc.cached_positions, jc.cached_scores, jc.cached_kv):
        with pytest.raises(TypeError, match="state must be a jcascade CacheState .*, got dict"):
            read({"pos": one.pos})
    with pytest.raises(TypeError, match="policy must be one of jcascade's policies .*, got str"):
        jc.attend("sink", one, x, x, x)
    with pytest.raises(TypeError, match="index must be a tuple of indices"):
        jc.write_kv(one, 0, x[:, 0], x[:, 0])
    with pytest.raises(TypeError, match="state.pos must be int32, got float32"):
        jc.attend(SINK, dataclasses.replace(one, pos=one.pos.astype(jnp.float32)), x, x, x)


def test_chunks_that_do_not_fit_the_state_are_refused_with_the_expected_shape():
    state = jc.init_cache(CASCADE, 2, 2, 4)
    q, k = jnp.ones((2, 3, 4, 4)), jnp.ones((2, 3, 2, 4))
    for wrong, error, match in [
        (
            dict(k=jnp.ones((2, 3, 4, 4))),
            ValueError,
            r"k must have shape \[batch=2, T, num_kv_heads=2, head_dim=4\] \(the state's\), got \[2, 3, 4, 4\]",
        ),
        (dict(k=jnp.ones((2, 3, 2, 8))), ValueError, r"k must have shape .*head_dim=4.*got \[2, 3, 2, 8\]"),
        (dict(k=jnp.ones((1, 3, 2, 4))), ValueError, r"k must have shape \[batch=2,"),
        (dict(v=jnp.ones((2, 2, 2, 4))), ValueError, r"v must have the shape of k, \[2, 3, 2, 4\], got \[2, 2, 2, 4\]"),
        (
            dict(q=jnp.ones((2, 3, 3, 4))),
            ValueError,
            r"q must have shape \[batch=2, T=3, Hq, head_dim=4\] with Hq a "
            r"multiple of num_kv_heads=2, got \[2, 3, 3, 4\]",
        ),
        (dict(q=jnp.ones((2, 3, 4, 8))), ValueError, r"q must have shape .*got \[2, 3, 4, 8\]"),
        (dict(q=jnp.ones((2, 3, 4, 4), jnp.int32)), TypeError, r"q must be a floating-point array .*, got int32"),
        (dict(k=np.ones((2, 3, 2, 4), bool)), TypeError, r"k must be a floating-point array .*, got bool"),
        (dict(v=[[1.0]]), TypeError, r"v must be a floating-point array .*, got list"),
    ]:
        args = dict(q=q, k=k, v=k) | wrong
        with pytest.raises(error, match=match):
            jc.attend(CASCADE, state, args["q"], args["k"], args["v"])
        if "q" not in wrong:
            with pytest.raises(error, match=match):
                jc.update(CASCADE, state, args["k"], args["v"], None)
    with pytest.raises(TypeError, match=r"rope must be None or a callable .*, got float"):
        jc.attend(CASCADE, state, q, k, k, rope=10000.0)
    with pytest.raises(ValueError, match=r"v_b must have shape \[3, 4\] .*got \[3, 5\]"):
        jc.merge_attention(jnp.zeros((3, 4)), jnp.zeros(3), jnp.zeros((3, 5)), jnp.zeros(3))
    with pytest.raises(ValueError, match=r"lse_b must have shape \[3\] .*got \[4\]"):
        jc.merge_attention(jnp.zeros((3, 4)), jnp.zeros(3), jnp.zeros((3, 4)), jnp.zeros(4))
    # the shapes are checked under jit too (they are static)
    with pytest.raises(ValueError, match="k must have shape"):
        jax.jit(lambda k: jc.attend(CASCADE, state, q, k, k))(jnp.ones((2, 3, 4, 4)))


def test_init_cache_refuses_sizes_and_dtypes_by_name():
    for kwargs, error, match in [
        (dict(batch=2.0), TypeError, "init_cache: batch must be a positive int, got float 2.0"),
        (dict(num_kv_heads=True), TypeError, "init_cache: num_kv_heads must be a positive int, got bool"),
        (dict(head_dim=0), ValueError, r"init_cache: head_dim must be a positive int \(at most 2147483647\), got 0"),
        (dict(num_layers=np.int64(2)), TypeError, "init_cache: num_layers must be a positive int, got int64"),
        (dict(num_layers=0), ValueError, "init_cache: num_layers must be a positive int"),
        (dict(max_tokens=-1), ValueError, "init_cache: max_tokens must be a positive int"),
        (dict(dtype=jnp.int32), TypeError, "init_cache: dtype must be a floating-point dtype"),
        (dict(policy=jc.Full()), ValueError, "init_cache: a Full cache needs max_tokens"),
        (
            dict(policy=jc.Recycled(top_k=4, refresh_every=2), max_tokens=2**31 - 4),
            ValueError,
            "needs 2147483650 slots, more than the 2147483647 that int32 slot indices address",
        ),
        (dict(policy=vars(SINK)), TypeError, "policy must be one of jcascade's policies"),
    ]:
        args = dict(policy=SINK, batch=1, num_kv_heads=1, head_dim=4) | kwargs
        with pytest.raises(error, match=match):
            jax.eval_shape(lambda: jc.init_cache(**args))


def test_traced_lengths_and_offsets_are_unchecked_or_a_checkify_error():
    state = jc.init_cache(SINK, 2, 1, 4)
    x = jnp.ones((2, 3, 1, 4))
    attend = checkify.checkify(jax.jit(lambda n: jc.attend(SINK, state, x, x, x, lengths=n)[0]))
    error, _ = attend(jnp.array([3, 4]))
    with pytest.raises(checkify.JaxRuntimeError, match=r"lengths: each must lie in \[0, 3\] .*got 4 at \[1\]"):
        error.throw()
    attend(jnp.array([3, 0]))[0].throw()
    share = checkify.checkify(jax.jit(lambda offset: jc.share_prefix(SINK, state, offset).length))
    error, _ = share(jnp.array([0, -5]))
    with pytest.raises(checkify.JaxRuntimeError, match=r"offset: each must lie in \[0, 2147483647\] .*got -5 at \[1\]"):
        error.throw()
    share(jnp.array([0, 5]))[0].throw()


# ---- property-based: shapes and lengths of the cache API, policy fields -------------------------------------
# Valid inputs are traced (jax.eval_shape: every check and the whole computation, no compilation), so that each
# example costs milliseconds.

SIZES = st.integers(1, 3)


@st.composite
def chunk_calls(draw):
    """(B, H, D, T, Hq, lengths, fault): a valid chunk for a [B, H, ., D] cache, and at most one fault in it."""
    B, H, T = draw(SIZES), draw(SIZES), draw(SIZES)
    D = draw(st.sampled_from([2, 4]))
    lengths = np.array(draw(st.lists(st.integers(0, T), min_size=B, max_size=B)))
    fault = draw(
        st.sampled_from(
            [
                None,
                "k_heads",
                "k_head_dim",
                "k_batch",
                "v_len",
                "q_heads",
                "q_len",
                "q_dtype",
                "lengths_value",
                "lengths_shape",
                "lengths_dtype",
                "stacked",
            ]
        )
    )
    return B, H, D, T, H * draw(SIZES), lengths, fault


@given(chunk_calls(), st.sampled_from([SINK, CASCADE, jc.Full(stride=4)]))
def test_chunks_of_any_shape_run_or_are_refused_by_argument(call, policy):
    B, H, D, T, Hq, lengths, fault = call
    state = jc.init_cache(policy, B, H, D, max_tokens=T, num_layers=2 if fault == "stacked" else None)
    q, k, v = (jax.ShapeDtypeStruct(shape, jnp.float32) for shape in ((B, T, Hq, D), (B, T, H, D), (B, T, H, D)))
    change = {
        "k_heads": ("k", (B, T, H + 1, D)),
        "k_head_dim": ("k", (B, T, H, D + 1)),
        "k_batch": ("k", (B + 1, T, H, D)),
        "v_len": ("v", (B, T + 1, H, D)),
        "q_heads": ("q", (B, T, Hq + 1, D) if H > 1 else (B, T, Hq, 2 * D)),  # (any Hq is a multiple of 1)
        "q_len": ("q", (B, T + 1, Hq, D)),
    }
    if fault in change:
        name, shape = change[fault]
        q, k, v = (jax.ShapeDtypeStruct(shape, jnp.float32) if n == name else x for n, x in zip("qkv", (q, k, v)))
    if fault == "q_dtype":
        q = jax.ShapeDtypeStruct(q.shape, jnp.int32)
    lengths = {"lengths_value": lengths + T + 1, "lengths_shape": lengths[None], "lengths_dtype": lengths * 1.0}.get(
        fault, lengths
    )

    def attend_and_update(q, k, v):
        out, scores = jc.attend(policy, state, q, k, v, lengths)
        return out, scores, jc.update(policy, state, k, v, scores, lengths)

    if fault is None:
        out, scores, after = jax.eval_shape(attend_and_update, q, k, v)
        assert out.shape == (B, T, Hq, D) and out.dtype == jnp.float32
        cap = state.capacity
        assert (
            scores is None
            if not policy.keeps_scores
            else (scores.cache.shape, scores.chunk.shape) == ((B, H, cap), (B, H, T))
        )
        assert jax.tree.map(lambda x: (x.shape, x.dtype), after) == jax.tree.map(lambda x: (x.shape, x.dtype), state)
        return
    named = {"stacked": "state"}.get(fault, fault.split("_")[0])
    with pytest.raises((ValueError, TypeError), match=rf"^{named}\b"):
        jax.eval_shape(attend_and_update, q, k, v)


ODD_VALUES = st.one_of(
    st.integers(-2, 6),
    st.sampled_from([2**31 - 1, 2**31, 2**63]),
    st.booleans(),
    st.none(),
    st.floats(allow_nan=True),
    st.text(max_size=3),
    st.just(np.int64(3)),
)


@given(
    st.fixed_dictionaries(
        {name: ODD_VALUES for name in ("batch", "num_kv_heads", "head_dim", "max_tokens", "num_layers")}
    )
)
def test_init_cache_sizes_give_the_shapes_asked_or_are_refused_by_name(sizes):
    policy = jc.Full(stride=4)
    try:
        state = jax.eval_shape(lambda: jc.init_cache(policy, **sizes))
    except (ValueError, TypeError) as e:
        bad = [
            name
            for name, x in sizes.items()
            if not (type(x) is int and 1 <= x < 2**31 or x is None and name == "num_layers")
        ]
        assert bad and re.match(rf"init_cache: ({'|'.join(bad)}) must be", str(e)), (sizes, e)
        return
    lead = () if sizes["num_layers"] is None else (sizes["num_layers"],)
    shape = (*lead, sizes["batch"], sizes["num_kv_heads"], sizes["max_tokens"])
    assert state.k.shape == (*shape, sizes["head_dim"]) and state.pos.shape == shape and state.seen.shape == shape[:-2]


# a valid instance of every policy class (its required fields), and a value of the kind each field wants
VALID_POLICIES = {
    "full": dict(),
    "slidingwindow": dict(window=4),
    "sink": dict(window=4),
    "cascade": dict(cache_size=8),
    "h2o": dict(heavy=2, recent=2),
    "tova": dict(cache_size=4),
    "snapkv": dict(budget=40),
    "pyramidkv": dict(budget=16, window=4),
    "adakv": dict(scorer=jc.SnapKV(budget=8, window=2, positions="original")),
    "knorm": dict(budget=4),
    "expectedattention": dict(budget=8),
    "kvzip": dict(budget=4),
    "recycled": dict(top_k=2, refresh_every=2),
}
SCORERS = st.sampled_from(
    [jc.SnapKV(budget=8, window=2), jc.PyramidKV(budget=8, window=2, positions="original"), jc.Full()]
)


def field_values(hint) -> st.SearchStrategy:
    """Values of the kind a field's type hint names (about half the draws), or of any odd kind."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    kind = (
        st.sampled_from(args)
        if origin is typing.Literal
        else st.integers(0, 40)
        if hint is int
        else st.floats(0, 1)
        if hint is float
        else st.booleans()
        if hint is bool
        else st.tuples(st.integers(-1, 5))
        if origin is tuple
        else SCORERS
    )
    odd = st.one_of(ODD_VALUES, st.sampled_from(["max", "cache", "avg", "global"]), st.lists(st.integers(0, 5)))
    return st.one_of(kind, odd)


def test_every_policy_class_has_a_valid_instance_here():
    assert set(VALID_POLICIES) == set(policy_classes())
    for name, cls in policy_classes().items():
        cls(**VALID_POLICIES[name])


def test_policy_int_fields_stop_at_the_int32_limit():
    """Token counts, slots and strides are int32 inside: a field past 2**31 - 1 is refused where it is given."""
    for make, name in [
        (lambda: jc.Cascade(cache_size=8, stride=2**31), "Cascade.stride"),
        (lambda: jc.Sink(window=2**31), "Sink.window"),
        (lambda: jc.SnapKV(budget=2**40), "SnapKV.budget"),
    ]:
        with pytest.raises(ValueError, match=rf"{name} must be >= \d \(and at most 2147483647\), got"):
            make()
    assert jc.Sink(window=2**31 - 1).window == 2**31 - 1


@given(st.sampled_from(sorted(VALID_POLICIES)), st.data())
def test_policy_fields_are_accepted_and_work_or_are_refused_by_name(name, data):
    """Random values for one or two fields of each policy: the policy either refuses them, naming a field it was
    given, or is hashable (static under jit) and runs: a cache (whose slots int32 can index, or init_cache says
    why not), a chunk attended and inserted (traced; or refused naming the field if its indices pass int32's)."""
    cls = policy_classes()[name]
    hints = typing.get_type_hints(cls)
    fields = [f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")]
    changed = {
        field: data.draw(field_values(hints[field]), label=field)
        for field in data.draw(st.sets(st.sampled_from(fields), min_size=1, max_size=2))
    }
    try:
        policy = cls(**VALID_POLICIES[name] | changed)
    except (ValueError, TypeError) as e:
        assert any(field in str(e) for field in changed), (changed, e)
        return
    hash(policy)
    slots = policy.cache_slots(8)
    assert isinstance(slots, int) and slots >= 1, (policy, slots)
    make = lambda: jc.init_cache(policy, 1, 1, 2, max_tokens=8)
    if slots > 2**31 - 1:
        with pytest.raises(ValueError, match="int32 slot indices"):
            jax.eval_shape(make)
        return

    def step(x):
        state = make()
        out, scores = jc.attend(policy, state, x, x, x)
        return out, jc.update(policy, state, x, x, scores)

    try:
        out, state = jax.eval_shape(step, jax.ShapeDtypeStruct((1, 2, 1, 2), jnp.float32))
    except ValueError as e:  # H2O's and TOVA's heavy slots that int32 indexes, but not with a chunk's tokens besides
        assert re.match(
            r"(H2O\.heavy|TOVA\.cache_size)=\d+: its heavy slots and the \d+ tokens a chunk brings them are "
            r"more than the 2147483647 that int32 indices address",
            str(e),
        ), (changed, e)
        return
    assert out.shape == (1, 2, 1, 2) and state.pos.shape == (1, 1, slots)
