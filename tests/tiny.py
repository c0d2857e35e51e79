"""A tiny random model and a tiny byte-level BPE tokenizer, built offline, for the evaluation and CLI tests."""

from __future__ import annotations

import dataclasses
import pathlib

import jax
import numpy as np
from jcascade.models.config import Rotary
from jcascade.models.weights import WEIGHTS, declarations

import jcascade as jc
from jcascade.eval.passkey import INTRO, NEEDLE, PRIME, QUESTION
from jcascade.eval.texts import REPEAT_SENTENCES

CHAT_TEMPLATE = (
    "{% for m in messages %}<|user|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TEXT = " ".join(
    [
        INTRO,
        *REPEAT_SENTENCES,
        NEEDLE.format(key="0123456789"),
        QUESTION,
        PRIME,
        "the quick brown fox jumps over the lazy dog",
    ]
)


def tokenizer(chat: bool = True, text: str = TEXT, byte_level: bool = True):
    """A BPE tokenizer (at most 512 tokens) trained on `text` (the passkey texts), with an <eos> token and,
    if `chat`, a chat template: byte-level (it encodes any text), or without `byte_level` split at white space
    and silently dropping the characters `text` lacks (a BPE without an unknown token)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<eos>", "<|user|>", "<|end|>", "<|assistant|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False) if byte_level else pre_tokenizers.Whitespace()
    if byte_level:
        bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet() if byte_level else [],
    )
    bpe.train_from_iterator([text] * 4, trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>", additional_special_tokens=specials[1:])
    if chat:
        wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def model(vocab_size: int, seed: int = 0, scale: float = 0.5, **config_fields) -> jc.CausalLM:
    """A random tiny Llama; `config_fields` override the ModelConfig's fields."""
    config = jc.ModelConfig(
        architecture="llama",
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rotary=Rotary(theta=10000.0),
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
    )
    return jc.CausalLM.random(dataclasses.replace(config, **config_fields), jax.random.key(seed), scale=scale)


def save(directory: pathlib.Path) -> pathlib.Path:
    """A model directory that jc.load_pretrained and jc.load_tokenizer read: the tiny model + tokenizer."""
    tok = tokenizer()
    jc.save_converted(model(len(tok)), directory)
    tok.save_pretrained(directory)
    return directory


def _split(declared, w: np.ndarray, source: str, layers) -> dict[str, np.ndarray]:
    parts = (
        [(getattr(declared, source).format(i=i), part) for i, part in zip(layers, w)]
        if declared.layer
        else [(getattr(declared, source), w)]
    )
    return {key: part.T if declared.transposed else part for key, part in parts}


def unfused(config: jc.ModelConfig, weights: dict) -> dict[str, np.ndarray]:
    """A model's weights with each fused one (`models.weights.FUSED`) split into its parts, by their names."""
    out, declared = {}, declarations(config)
    for name, w in weights.items():
        out.update(declared[name].split(config, np.asarray(w)) if declared[name].parts else {name: np.asarray(w)})
    return out


def source_tensors(name: str, weight, source: str, num_layers: int) -> dict[str, np.ndarray]:
    """Our unfused weight `name` (layers stacked; `unfused`) as the tensors of a Hugging Face ("hf") or GGUF
    ("gguf") file, by their names there (`models.weights`; without llama.cpp's Q/K row interleaving)."""
    return _split(WEIGHTS[name], np.asarray(weight), source, range(num_layers))


def file_tensors(config: jc.ModelConfig, weights: dict, source: str) -> dict[str, np.ndarray]:
    """All the weights of a model of any family as the tensors of a Hugging Face ("hf") or GGUF ("gguf") file
    (`models.weights`: fused weights split into their parts, each stack split over the layers it holds, the two
    halves of each head's rows of a Qwen3.5 q_proj in one tensor; without llama.cpp's converter's changes of values
    and order)."""
    tensors, halves = {}, {}
    declared = {n: w for name, d in declarations(config).items() for n, w in (d.parts or ((name, d),))}
    for ours, array in unfused(config, weights).items():
        for name, tensor in _split(declared[ours], array, source, declared[ours].layer_indices(config)).items():
            if declared[ours].hf_half is None:
                tensors[name] = tensor
            else:
                halves.setdefault(name, {})[declared[ours].hf_half] = tensor.reshape(
                    config.num_heads, -1, tensor.shape[-1]
                )
    for name, half in halves.items():  # [heads, 2, rows per head, in]
        tensors[name] = np.stack([half[0], half[1]], 1).reshape(-1, half[0].shape[-1])
    return tensors


def write_gguf(writer, tensors: dict) -> None:
    """Adds `tensors` ({GGUF name: array}) to a gguf GGUFWriter whose metadata is set, then writes and closes it."""
    for name, tensor in tensors.items():
        writer.add_tensor(name, np.ascontiguousarray(tensor))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
