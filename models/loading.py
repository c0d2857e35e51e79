"""Weights without torch: Hugging Face directories (config.json + single or sharded safetensors), GGUF
files (dequantised with the `gguf` package), and converted models saved with orbax-checkpoint."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from jcascade.models.config import (
    FAMILY_FEATURES,
    GLOBAL,
    LINEAR,
    SLIDING,
    Attention,
    LinearAttention,
    ModelConfig,
    Norms,
    Rotary,
    required,
)
from jcascade.models.decoder import CausalLM, on_mesh
from jcascade.models.weights import Weight, declarations, weight_shapes

from jcascade.rope import Llama3Scaling

CONVERTED_CONFIG = "jcascade-config.json"
# How `save_converted` stores the model: 2 since q/k/v and gate/up are stored joined (`models.weights.FUSED`), 3
# since the config's features are grouped (`ModelConfig.norms`, `rotary`, `attention`, `linear`).
CONVERTED_LAYOUT = 3


def _collect(cfg: ModelConfig, files: dict[str, str], read, source: str) -> dict[str, np.ndarray]:
    """Our weights (`models.weights`; a fused one joined from its parts), read by their `source` ("hf" or "gguf")
    names (`read(name, ours, weight)`: `ours` and `weight` name and declare the tensor, a fused weight's part),
    checking presence and shape of every tensor; `files` maps each source name to the file holding it (for the
    errors)."""

    def get(name: str, w: Weight, ours: str) -> np.ndarray:
        if name not in files:
            raise ValueError(f"missing tensor {name!r} (needed for {ours}) in {', '.join(sorted(set(files.values())))}")
        array = read(name, ours, w)
        want = w.shape(cfg)[::-1] if w.transposed else w.shape(cfg)
        if w.hf_half is not None:  # rows [heads, 2, rows per head, ...]: one half of each head
            want = (2 * want[0], *want[1:]) if w.transposed else (*want[:-1], 2 * want[-1])
        if w.squeezed and array.size == np.prod(want) and tuple(d for d in array.shape if d != 1) == want:
            array = array.reshape(want)
        if array.shape != want:
            raise ValueError(f"{files[name]}: tensor {name!r} has shape {array.shape}, the config needs {want}")
        if w.hf_half is not None:
            array = array.reshape(cfg.num_heads, 2, -1, array.shape[-1])[:, w.hf_half].reshape(-1, array.shape[-1])
        return array.T if w.transposed else array

    def layer(ours: str, w: Weight, i: int | None) -> np.ndarray:  # one layer's (i) or a model-wide weight
        if w.parts:
            return w.join(cfg, [layer(name, part, i) for name, part in w.parts])
        name = getattr(w, source)
        return get(name if i is None else name.format(i=i), w, ours)

    return {
        ours: np.stack([layer(ours, w, i) for i in w.layer_indices(cfg)]) if w.layer else layer(ours, w, None)
        for ours, w in declarations(cfg).items()
    }


def _json(path: pathlib.Path):
    """The JSON in `path`; a ValueError naming the file when it is not UTF-8 JSON (damaged or truncated)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: damaged: not UTF-8 text (byte {e.start}), so not JSON") from None
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{path}: damaged or truncated: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})"
        ) from None


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
            raise ValueError(f'{index}: damaged: no "weight_map" object')
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
                        raise ValueError(
                            f"{index}: tensor {key!r} is in two shards, {where[key]} and {name} "
                            f"(the index names {weight_map.get(key)})"
                        )
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
    return cfg, _collect(
        cfg,
        {ours: where[key] for ours, key in text.items()},
        lambda name, ours, w: np.asarray(tensors[text[name]]),
        "hf",
    )


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter interleaves the rotary halves of Q/K rows; back to Hugging Face's layout."""
    out = w.shape[0]
    return w.reshape(heads, out // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# Qwen3.5's Gated DeltaNet weights whose value heads llama.cpp's converter reorders (when there are fewer key heads
# than value heads): the axis of the heads in the stored [out, in] tensor, and whether the q and k channels
# (2 * key heads * key dim, not reordered) come first on it
_QWEN35_VALUE_HEADS = {
    "lin_qkv": (0, True),
    "lin_conv": (0, True),
    "lin_z": (0, False),
    "lin_b": (0, False),
    "lin_a": (0, False),
    "lin_a_log": (0, False),
    "lin_dt_bias": (0, False),
    "lin_out": (1, False),
}


def _untile_value_heads(w: np.ndarray, cfg: ModelConfig, axis: int, after_qk: bool) -> np.ndarray:
    """llama.cpp stores the value heads tiled (head j * Hk + g of the file is Hugging Face's head g * r + j, r value
    heads per key head g); back to Hugging Face's grouped order."""
    w = np.moveaxis(w, axis, 0)
    sizes = cfg.linear
    start = 2 * sizes.key_heads * sizes.key_dim if after_qk else 0
    v = w[start:]
    v = v.reshape(sizes.value_heads // sizes.key_heads, sizes.key_heads, -1, *v.shape[1:])
    return np.moveaxis(np.concatenate([w[:start], v.swapaxes(0, 1).reshape(w[start:].shape)]), 0, axis)


def read_gguf(path: pathlib.Path) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """A llama, qwen2, qwen3, gemma3, qwen35 or gemma4 GGUF file, dequantised to float32, with llama.cpp's
    converter's changes undone: llama's Q/K rows interleaved, gemma3's and qwen35's norm weights stored as 1 + w
    (but Qwen3.5's Gated DeltaNet norm), qwen35's A_log stored as -exp(A_log) and its value heads reordered."""
    from gguf.quants import dequantize

    reader = _gguf_reader(path)
    cfg = _gguf_config(reader, path)
    tensors = {t.name: t for t in reader.tensors}
    interleaved = reader.fields["general.architecture"].contents() in _GGUF_INTERLEAVED

    def read(name: str, ours: str, declared: Weight) -> np.ndarray:
        t = tensors[name]
        w = dequantize(t.data, t.tensor_type).astype(np.float32)
        if cfg.norms.plus_one and name.endswith("norm.weight") and ours != "lin_norm":
            w = w - 1.0
        if ours == "lin_a_log":
            w = np.log(-w)
        if ours in _QWEN35_VALUE_HEADS and cfg.linear.key_heads != cfg.linear.value_heads:
            w = _untile_value_heads(w, cfg, *_QWEN35_VALUE_HEADS[ours])
        heads = declared.gguf_interleaved if interleaved else None
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
        raise ValueError(
            f"{path}: truncated: the GGUF file has {size} bytes, its header and tensor table need at least {e.args[0]}"
        ) from None
    except Exception as e:
        raise ValueError(f"{path}: not readable as a GGUF file ({size} bytes): {e}") from e


_GGUF_ARCHITECTURES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3": "gemma3",
    "qwen35": "qwen3_5",
    "gemma4": "gemma4",
    "smollm3": "smollm3",
    "olmo2": "olmo3",
}  # GGUF's name -> ours
_GGUF_INTERLEAVED = ("llama", "smollm3")  # where llama.cpp's converter interleaves the rotary halves of Q/K rows


def _gguf_config(reader, path: pathlib.Path) -> ModelConfig:
    meta = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("tokenizer.ggml.")}
    arch = required(meta, "general.architecture", path, str)
    if arch not in _GGUF_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r} in {path} (supported: {', '.join(_GGUF_ARCHITECTURES)})"
        )
    field = lambda key, kind=int: required(meta, f"{arch}.{key}", path, kind)
    get = lambda key, default=None: meta.get(f"{arch}.{key}", default)
    tensors = {t.name: t for t in reader.tensors}
    experts = sorted(name for name in tensors if "_exps" in name or "ffn_gate_inp" in name)
    if experts:
        raise ValueError(f"{path}: mixture-of-experts layers ({experts[0]}, ...) are not supported")
    if "rope_freqs.weight" in tensors and arch != "gemma4":
        raise ValueError(f"{path}: GGUF rope frequency factors (llama3 scaling) are not supported")
    family = {
        "gemma3": _gemma3_fields,
        "qwen35": _qwen35_fields,
        "gemma4": _gemma4_fields,
        "smollm3": _smollm3_fields,
        "olmo2": _olmo2_fields,
    }.get(arch)
    fields = family(field, get, tensors, path) if family else {}
    groups = {  # the groups' fields common to every family, then the family's own (`fields`' dicts of them)
        "rotary": Rotary(float(get("rope.freq_base", 10000.0))),
        "attention": Attention(qkv_bias="blk.0.attn_q.bias" in tensors, o_bias="blk.0.attn_output.bias" in tensors),
    }
    groups = {name: dataclasses.replace(group, **fields.pop(name, {})) for name, group in groups.items()}
    heads = field("attention.head_count")
    hidden = field("embedding_length")
    vocab_tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = int(get("vocab_size") or (field("vocab_size") if vocab_tokens is None else len(vocab_tokens.data)))
    eos = reader.fields.get("tokenizer.ggml.eos_token_id")
    bos = reader.fields.get("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        **{
            "architecture": _GGUF_ARCHITECTURES[arch],
            "vocab_size": vocab,
            "hidden_size": hidden,
            "intermediate_size": field("feed_forward_length"),
            "num_layers": field("block_count"),
            "num_heads": heads,
            "num_kv_heads": get("attention.head_count_kv", heads),
            "head_dim": int(get("attention.key_length") or get("rope.dimension_count") or hidden // heads),
            "rms_norm_eps": field("attention.layer_norm_rms_epsilon", float),
            "tie_word_embeddings": "output.weight" not in tensors,
            "max_position_embeddings": int(get("context_length", 2048)),
            "bos_token_id": None if bos is None else int(bos.contents()),
            "eos_token_ids": () if eos is None else (int(eos.contents()),),
            **FAMILY_FEATURES[_GGUF_ARCHITECTURES[arch]],
            **groups,
            **fields,
        }
    )


def _gemma3_fields(field, get, tensors, path) -> dict:
    """As llama.cpp runs Gemma 3: every 6th layer global, RoPE base 10K on the sliding ones."""
    layers = field("block_count")
    return dict(
        layer_types=tuple(GLOBAL if (i + 1) % 6 == 0 else SLIDING for i in range(layers)),
        sliding_window=field("attention.sliding_window"),
        rotary=dict(local_theta=10000.0),
    )


def _smollm3_fields(field, get, tensors, path) -> dict:
    """As llama.cpp runs SmolLM3: every 4th layer without rotary positions (its files do not record the interval)."""
    return dict(nope_layers=tuple(i for i in range(field("block_count")) if (i + 1) % 4 == 0))


def _olmo2_fields(field, get, tensors, path) -> dict:
    """OLMo 3 (llama.cpp's olmo2 with a sliding window), as llama.cpp runs it: every 4th layer full, one RoPE base
    for both layer types. An olmo2 file without a sliding window (OLMo 2) is refused."""
    window = get("attention.sliding_window")
    if not window:
        raise ValueError(
            f"{path}: an olmo2 file without olmo2.attention.sliding_window (OLMo 2) is not supported; OLMo 3 loads"
        )
    layers = field("block_count")
    return dict(
        layer_types=tuple(GLOBAL if (i + 1) % 4 == 0 else SLIDING for i in range(layers)),
        sliding_window=int(window),
        rotary=dict(local_theta=float(get("rope.freq_base", 10000.0))),
    )


def _qwen35_fields(field, get, tensors, path) -> dict:
    """Qwen3.5: the layers without the multi-token-prediction ones llama.cpp counts in block_count, Gated DeltaNet
    layers by attention.recurrent_layers (else all but every full_attention_interval-th), the rotating share of
    the head dims as rope.dimension_count, the Gated DeltaNet's dims as ssm.*."""
    layers = field("block_count") - int(get("nextn_predict_layers", 0))
    recurrent = get("attention.recurrent_layers") or [
        (i + 1) % field("full_attention_interval") != 0 for i in range(layers)
    ]
    head_dim, value_heads = field("attention.key_length"), field("ssm.time_step_rank")
    return dict(
        num_layers=layers,
        layer_types=tuple(LINEAR if r else GLOBAL for r in recurrent[:layers]),
        head_dim=head_dim,
        rotary=dict(fraction=field("rope.dimension_count") / head_dim),
        attention=dict(output_gate=True),
        linear=LinearAttention(
            key_heads=field("ssm.group_count"),
            value_heads=value_heads,
            key_dim=field("ssm.state_size"),
            value_dim=field("ssm.inner_size") // value_heads,
            conv_kernel=field("ssm.conv_kernel"),
        ),
    )


def _gemma4_fields(field, get, tensors, path) -> dict:
    """Gemma 4 (dense): layer types by attention.sliding_window_pattern, each type's head_dim and KV heads (the
    global layers' own only with k = v, as transformers reads them), k = v where the first global layer has no
    attn_v, the rotating share of the global head dims from rope_freqs (llama.cpp's form of the proportional RoPE:
    1 for each rotating frequency, 1e30 for the others)."""
    if isinstance(get("feed_forward_length"), list):
        raise ValueError(
            f"{path}: gemma4.feed_forward_length per layer ({get('feed_forward_length')}) is not "
            "supported (a double-wide MLP on the shared layers)"
        )
    types = [SLIDING if s else GLOBAL for s in field("attention.sliding_window_pattern", list)]
    kv = get("attention.head_count_kv", field("attention.head_count"))
    kv = kv if isinstance(kv, list) else [kv] * len(types)
    first_global, global_dim = types.index(GLOBAL) if GLOBAL in types else None, field("attention.key_length")
    k_eq_v = first_global is not None and f"blk.{first_global}.attn_v.weight" not in tensors
    freqs = tensors.get("rope_freqs.weight")
    rotating = global_dim // 2
    if freqs is not None:
        from gguf.quants import dequantize

        factors = dequantize(freqs.data, freqs.tensor_type).reshape(-1)
        rotating = int(np.sum(factors == 1.0))
        if factors.shape != (global_dim // 2,) or np.any(factors[rotating:] != np.float32(1e30)):
            raise ValueError(
                f"{path}: unsupported rope_freqs.weight (gemma4: {global_dim // 2} factors, 1.0 "
                f"then 1e30), got {factors.size} factors valued {np.unique(factors).tolist()}"
            )
    ple = int(get("embedding_length_per_layer_input", 0))
    table = tensors.get("per_layer_token_embd.weight")
    softcap = get("final_logit_softcapping")
    return dict(
        layer_types=tuple(types),
        head_dim=field("attention.key_length_swa"),
        num_kv_heads=kv[types.index(SLIDING) if SLIDING in types else 0],
        attention=dict(
            query_scale=1.0,
            global_head_dim=global_dim,
            global_kv_heads=kv[first_global] if k_eq_v else None,
            global_weights=True,
            k_eq_v=k_eq_v,
        ),
        rotary=dict(
            fraction=2 * rotating / global_dim,
            proportional=True,
            local_theta=field("rope.freq_base_swa", float),
        ),
        sliding_window=field("attention.sliding_window"),
        kv_shared_layers=int(get("attention.shared_kv_layers", 0)),
        per_layer_input_size=ple,
        per_layer_vocab_size=int(table.shape[-1]) if ple and table is not None else 0,
        final_logit_softcapping=None if softcap is None else float(softcap),
    )


def _default_dtype():
    return jnp.bfloat16 if jax.default_backend() in ("gpu", "tpu") else jnp.float32


def save_converted(model: CausalLM, directory: str | pathlib.Path) -> None:
    """Saves a model as jcascade-config.json + an orbax checkpoint, for a fast `load_pretrained` later."""
    import orbax.checkpoint as ocp

    directory = pathlib.Path(directory).absolute()
    directory.mkdir(parents=True, exist_ok=True)
    cfg = dataclasses.asdict(model.config) | {"layout": CONVERTED_LAYOUT}
    (directory / CONVERTED_CONFIG).write_text(json.dumps(cfg, indent=2))
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(directory / "weights", model.weights(), force=True)
    checkpointer.wait_until_finished()


def converted_layout(directory: pathlib.Path) -> int:
    """The `CONVERTED_LAYOUT` of a directory written by `save_converted` (1: before the layout was recorded)."""
    return _json(directory / CONVERTED_CONFIG).get("layout", 1)


def _converted_config(directory: pathlib.Path) -> ModelConfig:
    raw = _json(directory / CONVERTED_CONFIG)
    layout = raw.pop("layout", 1)  # as `converted_layout` reads it
    if layout != CONVERTED_LAYOUT:
        raise ValueError(
            f"{directory}: converted by another jcascade (weights layout {layout}, this one reads "
            f"{CONVERTED_LAYOUT}); delete it and convert (or fetch) it again"
        )
    scaling = raw["rotary"]["scaling"]
    raw["rotary"] = Rotary(**raw["rotary"] | {"scaling": None if scaling is None else Llama3Scaling(**scaling)})
    raw["norms"], raw["attention"] = Norms(**raw["norms"]), Attention(**raw["attention"])
    raw["linear"] = None if raw["linear"] is None else LinearAttention(**raw["linear"])
    for name in ("eos_token_ids", "layer_types", "nope_layers"):
        raw[name] = tuple(raw[name])
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
            raise ValueError(
                f"{weights}: tensor {name!r} has shape {tuple(stored[name].shape)}, {CONVERTED_CONFIG} needs {shape}"
            )

    def restore(shardings):
        try:
            return ocp.StandardCheckpointer().restore(
                weights,
                {
                    name: jax.ShapeDtypeStruct(shape, dtype, sharding=shardings[name])
                    for name, shape in weight_shapes(cfg).items()
                },
            )
        except Exception as e:  # orbax wraps tensorstore's error (e.g. a byte range past a file's end)
            cause = str(e.__cause__ or e).split("\n")[0]
            raise ValueError(f"{weights}: cannot restore the orbax checkpoint: {cause}; {remedy}") from e

    return restore


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")  # any one


def load_tokenizer(path: str | pathlib.Path):
    """The Hugging Face tokenizer of a model directory (no torch needed) or of a .gguf file (transformers
    needs torch for that: install jcascade[gguf]). A directory without any of `TOKENIZER_FILES`, a damaged JSON
    file of the directory, or a damaged .gguf: a ValueError naming the path and what is wrong."""
    import importlib.util

    from transformers import AutoTokenizer

    path = pathlib.Path(path)
    if path.is_file() and path.suffix == ".gguf":
        if importlib.util.find_spec("torch") is None:
            raise ModuleNotFoundError(
                f"building the tokenizer of {path.name} needs torch (transformers reads GGUF "
                "tokenizers through it): pip install 'jcascade[gguf]'"
            )
        try:
            return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        except Exception:
            _gguf_reader(path)  # a damaged file: raises naming it
            raise
    if path.is_dir() and not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(
            f"{path}: the model directory holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
            "save one there with tokenizer.save_pretrained(directory)"
        )
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception:
        for file in sorted(path.glob("*.json")):  # a damaged tokenizer.json etc.: named, not a bare parser error
            _json(file)
        raise
