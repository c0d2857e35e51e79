"""Weights without torch: Hugging Face directories (config.json + single or sharded safetensors), GGUF
files (dequantised with the `gguf` package), and converted models saved with orbax-checkpoint."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from jcascade.models.config import GLOBAL, SLIDING, ModelConfig, required
from jcascade.models.decoder import CausalLM, on_mesh
from jcascade.models.weights import WEIGHTS, Weight, declarations, weight_shapes
from jcascade.rope import Llama3Scaling

CONVERTED_CONFIG = "jcascade-config.json"

def _collect(cfg: ModelConfig, files: dict[str, str], read, source: str) -> dict[str, np.ndarray]:
    """Our weights (`models.weights`), read by their `source` ("hf" or "gguf") names, checking presence and
    shape of every tensor; `files` maps each source name to the file holding it (for the errors)."""

    def get(name: str, w: Weight, ours: str) -> np.ndarray:
        if name not in files:
            raise ValueError(f"missing tensor {name!r} (needed for {ours}) in {', '.join(sorted(set(files.values())))}")
        array = read(name)
        want = w.shape(cfg)[::-1] if w.transposed else w.shape(cfg)
        if source == "hf" and w.hf_half is not None:  # rows [heads, 2, rows per head, ...]: one half of each head
            want = (2 * want[0], *want[1:]) if w.transposed else (*want[:-1], 2 * want[-1])
        if w.squeezed and array.size == np.prod(want) and tuple(d for d in array.shape if d != 1) == want:
            array = array.reshape(want)
        if array.shape != want:
            raise ValueError(f"{files[name]}: tensor {name!r} has shape {array.shape}, the config needs {want}")
        if source == "hf" and w.hf_half is not None:
            array = array.reshape(cfg.num_heads, 2, -1, array.shape[-1])[:, w.hf_half].reshape(-1, array.shape[-1])
        return array.T if w.transposed else array

    weights = {}
    for ours, w in declarations(cfg).items():
        name = getattr(w, source)
        if w.layer:
            weights[ours] = np.stack([get(name.format(i=i), w, ours) for i in w.layer_indices(cfg)])
        else:
            weights[ours] = get(name, w, ours)
    return weights


def _json(path: pathlib.Path):
    """The JSON in `path`; a ValueError naming the file when it is not UTF-8 JSON (damaged or truncated)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: damaged: not UTF-8 text (byte {e.start}), so not JSON") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: damaged or truncated: not valid JSON ({e.msg} at line {e.lineno}, "
                         f"column {e.colno})") from None


def _hf_config(path: pathlib.Path) -> ModelConfig:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"no config.json in {path}")
    return ModelConfig.from_hf(_json(config_file), source=str(config_file))


def _safetensors_problem(path: pathlib.Path) -> str | None:
    """What is wrong with a file that safetensors refused, found from its layout: an 8-byte header length,
    that many bytes of JSON (each tensor's data_offsets), then exactly the tensor data."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if size < 8 or 8 + n > size:
            return f"truncated or not a safetensors file: {size} bytes, too few for the header it announces"
        try:
            header = json.loads(f.read(n))
            need = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return "damaged: its header is not the JSON table of tensors that safetensors writes"
    have = size - 8 - n
    if have != need:
        fault = "truncated" if have < need else "damaged"
        return f"{fault}: the header says {need} bytes of tensor data, the file has {have}"
    return None


def read_hf_directory(path: pathlib.Path) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """config.json and model.safetensors, or the shards named by model.safetensors.index.json."""
    from safetensors import SafetensorError, safe_open

    cfg = _hf_config(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: damaged: no \"weight_map\" object")
        files = sorted(set(weight_map.values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")
    tensors, where = {}, {}
    for name in files:
        if not (path / name).is_file():
            raise FileNotFoundError(f"{index} lists {name}, which is not in {path}")
        try:
            with safe_open(path / name, framework="numpy") as f:
                for key in f.keys():
                    if key in where:
                        raise ValueError(f"{index}: tensor {key!r} is in two shards, {where[key]} and {name} "
                                         f"(the index names {weight_map.get(key)})")
                    where[key] = name
                    if index.is_file() and weight_map.get(key) != name:
                        continue  # a tensor the index does not name here: not read
                    tensors[key] = f.get_tensor(key)
        except SafetensorError as e:  # its messages name no file
            raise ValueError(f"{path / name}: {_safetensors_problem(path / name) or e}") from e
    if index.is_file():
        for key, name in weight_map.items():
            if key not in tensors:
                raise ValueError(f"{index} names {name} for tensor {key!r}, which {name} does not hold")
    # the text model of a multimodal checkpoint: model.language_model.* (its towers' tensors are not read)
    text = {key.replace("model.language_model.", "model.", 1): key for key in tensors}
    return cfg, _collect(cfg, {ours: where[key] for ours, key in text.items()},
                         lambda name: np.asarray(tensors[text[name]]), "hf")


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter interleaves the rotary halves of Q/K rows; back to Hugging Face's layout."""
    out = w.shape[0]
    return w.reshape(heads, out // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf(path: pathlib.Path) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """A llama, qwen2, qwen3 or gemma3 GGUF file, dequantised to float32 (gemma3's norm weights: llama.cpp's
    converter stores 1 + w, the scale it multiplies by; ours are w)."""
    from gguf.quants import dequantize

    reader = _gguf_reader(path)
    cfg = _gguf_config(reader, path)
    tensors = {t.name: t for t in reader.tensors}
    interleaved = {w.gguf.split(".")[-2]: w.gguf_interleaved for w in WEIGHTS.values() if w.gguf_interleaved}

    def read(name: str) -> np.ndarray:
        t = tensors[name]
        w = dequantize(t.data, t.tensor_type).astype(np.float32)
        heads = interleaved.get(name.split(".")[-2]) if cfg.architecture == "llama" else None
        if cfg.norm_plus_one and name.endswith("norm.weight"):
            w = w - 1.0
        return w if heads is None else _unpermute(w, cfg.num_heads if heads == "q" else cfg.num_kv_heads)

    return cfg, _collect(cfg, dict.fromkeys(tensors, path.name), read, "gguf")


class _PastTheEnd(Exception):
    pass


def _gguf_reader(path: pathlib.Path):
    """gguf's GGUFReader of `path`, or a ValueError naming the file and what is wrong: truncated (a read
    past its end) or not readable as GGUF."""
    from gguf import GGUFReader

    class Checked(GGUFReader):  # gguf slices its memory map unchecked (a truncated file fails in a reshape); were
        # its private `_get` renamed, truncation would get the general message below
        def _get(self, offset, dtype, count=1, *args, **kwargs):
            end = int(offset) + np.dtype(dtype).itemsize * int(count)
            if end > self.data.size:
                raise _PastTheEnd(end)
            return super()._get(offset, dtype, count, *args, **kwargs)

    size = path.stat().st_size
    try:
        return Checked(path)
    except _PastTheEnd as e:
        raise ValueError(f"{path}: truncated: the GGUF file has {size} bytes, its header and tensor table need at "
                         f"least {e.args[0]}") from None
    except Exception as e:
        raise ValueError(f"{path}: not readable as a GGUF file ({size} bytes): {e}") from e


def _gguf_config(reader, path: pathlib.Path) -> ModelConfig:
    meta = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("tokenizer.ggml.")}
    arch = required(meta, "general.architecture", path, str)
    if arch not in ("llama", "qwen2", "qwen3", "gemma3"):
        raise ValueError(f"unsupported GGUF architecture {arch!r} in {path} (supported: llama, qwen2, qwen3, gemma3)")
    field = lambda key, kind=int: required(meta, f"{arch}.{key}", path, kind)  # noqa: E731
    tensors = {t.name: t for t in reader.tensors}
    if "rope_freqs.weight" in tensors:
        raise ValueError(f"{path}: GGUF rope frequency factors (llama3 scaling) are not supported")
    heads = field("attention.head_count")
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
    hidden = field("embedding_length")
    vocab_tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = int(meta.get(f"{arch}.vocab_size") or (field("vocab_size") if vocab_tokens is None else
                                                     len(vocab_tokens.data)))
    eos = reader.fields.get("tokenizer.ggml.eos_token_id")
    bos = reader.fields.get("tokenizer.ggml.bos_token_id")
    layers = field("block_count")
    gemma = {}
    if arch == "gemma3":  # as llama.cpp runs it: every 6th layer global, RoPE base 10K on the sliding ones
        gemma = dict(layer_types=tuple(GLOBAL if (i + 1) % 6 == 0 else SLIDING for i in range(layers)),
                     sliding_window=field("attention.sliding_window"), rope_local_theta=10000.0)
    return ModelConfig(**gemma,
        architecture=arch, vocab_size=vocab, hidden_size=hidden,
        intermediate_size=field("feed_forward_length"), num_layers=layers,
        num_heads=heads, num_kv_heads=kv_heads,
        head_dim=int(meta.get(f"{arch}.attention.key_length") or meta.get(f"{arch}.rope.dimension_count")
                     or hidden // heads),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)), rope_scaling=None,
        rms_norm_eps=field("attention.layer_norm_rms_epsilon", float),
        tie_word_embeddings="output.weight" not in tensors, qkv_bias="blk.0.attn_q.bias" in tensors,
        o_bias="blk.0.attn_output.bias" in tensors, qk_norm="blk.0.attn_q_norm.weight" in tensors,
        max_position_embeddings=int(meta.get(f"{arch}.context_length", 2048)),
        bos_token_id=None if bos is None else int(bos.contents()),
        eos_token_ids=() if eos is None else (int(eos.contents()),),
    )


def _default_dtype():
    return jnp.bfloat16 if jax.default_backend() in ("gpu", "tpu") else jnp.float32


def save_converted(model: CausalLM, directory: str | pathlib.Path) -> None:
    """Saves a model as jcascade-config.json + an orbax checkpoint, for a fast `load_pretrained` later."""
    import orbax.checkpoint as ocp

    directory = pathlib.Path(directory).absolute()
    directory.mkdir(parents=True, exist_ok=True)
    cfg = dataclasses.asdict(model.config)
    (directory / CONVERTED_CONFIG).write_text(json.dumps(cfg, indent=2))
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(directory / "weights", model.weights(), force=True)
    checkpointer.wait_until_finished()


def _converted_config(directory: pathlib.Path) -> ModelConfig:
    raw = _json(directory / CONVERTED_CONFIG)
    raw["rope_scaling"] = None if raw["rope_scaling"] is None else Llama3Scaling(**raw["rope_scaling"])
    raw["eos_token_ids"] = tuple(raw["eos_token_ids"])
    raw["layer_types"] = tuple(raw.get("layer_types", ()))  # (absent from checkpoints converted before Gemma 3)
    return ModelConfig(**raw)


def read_config(path: str | pathlib.Path) -> ModelConfig:
    """The ModelConfig of what `load_pretrained(path)` loads, without reading the weights (e.g. to choose a
    mesh that divides the heads before loading onto it)."""
    path = pathlib.Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return _gguf_config(_gguf_reader(path), path)
    if (path / CONVERTED_CONFIG).is_file():
        return _converted_config(path)
    if path.is_dir():
        return _hf_config(path)
    raise FileNotFoundError(f"{path} is neither a .gguf file nor a model directory")


def load_pretrained(path: str | pathlib.Path, dtype=None, mesh=None, rules: dict[str, tuple] | None = None) -> CausalLM:
    """A model from a Hugging Face directory, a .gguf file, or a directory written by `save_converted`.

    dtype: parameter and activation dtype; None gives bfloat16 on GPU/TPU and float32 on the CPU.
    mesh: a mesh with axes ("data", "model"): weights are placed as `jcascade.models.shard(..., rules)`
    places them; a converted checkpoint restores each device's shard straight from disk (every process of
    a multi-controller run reads only its own), the other formats go from host memory to the shards, never
    whole onto one device. Without a mesh, everything goes to the default device, whatever mesh a converted
    checkpoint was saved from.
    A damaged or truncated file, or a tensor whose shape differs from the config's, raises a ValueError
    naming the file (and tensor) and what is wrong.
    """
    path = pathlib.Path(path)
    cfg = read_config(path)
    dtype = dtype or _default_dtype()
    if (path / CONVERTED_CONFIG).is_file():
        restore = _converted_restore(path, cfg, dtype)
        if mesh is None:
            device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
            return CausalLM(cfg, restore({name: device for name in weight_shapes(cfg)}))
        return on_mesh(cfg, restore, mesh, rules)
    _, weights = read_gguf(path) if path.is_file() else read_hf_directory(path)
    if mesh is None:
        return CausalLM(cfg, {name: jnp.asarray(w, dtype) for name, w in weights.items()})
    return on_mesh(cfg, {name: np.asarray(w).astype(dtype) for name, w in weights.items()}, mesh, rules)


def _converted_restore(path: pathlib.Path, cfg: ModelConfig, dtype):
    """`restore(shardings)` of the orbax checkpoint in path/weights, once the names and shapes it stores are
    checked against the config; a ValueError names the folder and what is wrong."""
    import orbax.checkpoint as ocp

    weights, remedy = path.absolute() / "weights", f"if it is damaged, delete {path} and convert (or fetch) it again"
    try:
        stored = ocp.StandardCheckpointer().metadata(weights).item_metadata
    except Exception as e:
        raise ValueError(f"{weights}: not readable as an orbax checkpoint ({e}); {remedy}") from e
    if stored is None:  # orbax logs why (e.g. a damaged _METADATA file)
        raise ValueError(f"{weights}: not readable as an orbax checkpoint (no metadata of its tensors); {remedy}")
    for name, shape in weight_shapes(cfg).items():
        if name not in stored:
            raise ValueError(f"{weights}: missing tensor {name!r} (needed by {CONVERTED_CONFIG}); {remedy}")
        if tuple(stored[name].shape) != shape:
            raise ValueError(f"{weights}: tensor {name!r} has shape {tuple(stored[name].shape)}, {CONVERTED_CONFIG} "
                             f"needs {shape}")

    def restore(shardings):
        try:
            return ocp.StandardCheckpointer().restore(weights, {
                name: jax.ShapeDtypeStruct(shape, dtype, sharding=shardings[name])
                for name, shape in weight_shapes(cfg).items()})
        except Exception as e:  # orbax wraps tensorstore's error (e.g. a byte range past a file's end)
            cause = str(e.__cause__ or e).split("\n")[0]
            raise ValueError(f"{weights}: cannot restore the orbax checkpoint: {cause}; {remedy}") from e

    return restore


def load_tokenizer(path: str | pathlib.Path):
    """The Hugging Face tokenizer of a model directory (no torch needed) or of a .gguf file (transformers
    needs torch for that: install jcascade[gguf]). When transformers fails on a damaged JSON file of the
    directory, or on a damaged .gguf, a ValueError names the file and what is wrong."""
    import importlib.util

    from transformers import AutoTokenizer

    path = pathlib.Path(path)
    if path.is_file() and path.suffix == ".gguf":
        if importlib.util.find_spec("torch") is None:
            raise ModuleNotFoundError(f"building the tokenizer of {path.name} needs torch (transformers reads GGUF "
                                      "tokenizers through it): pip install 'jcascade[gguf]'")
        try:
            return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        except Exception:
            _gguf_reader(path)  # a damaged file: raises naming it
            raise
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception:
        for file in sorted(path.glob("*.json")):  # a damaged tokenizer.json etc.: named, not a bare parser error
            _json(file)
        raise
