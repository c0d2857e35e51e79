"""Every weight of every model family, declared once (`declarations`): its shape from the config, a logical
axis per dimension, and its Hugging Face and GGUF tensor names with how their layout differs from ours. The
decoder's weight shapes (`weight_shapes`), the sharding rules (`models.sharding`, which maps logical axes to
mesh axes) and both loaders (`models.loading`) derive from these declarations: adding a weight is one entry
here and its use in the decoder.

Our layout: x @ W (W is [in, out], the transpose of a PyTorch Linear weight); layer weights are stacked on a
leading layer axis (not part of a declaration's shape or axes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from jcascade.models.config import ModelConfig

# Logical axes: "vocab" (vocabulary), "embed" (hidden size), "q" (query heads x head_dim), "kv" (KV heads x
# head_dim), "mlp" (intermediate size), "head_dim" (one head's features).


@dataclasses.dataclass(frozen=True)
class Weight:
    """One weight. shape(config) and axes are one layer's for layer weights (`layer`); hf / gguf: tensor names
    ("{i}" is the layer); transposed: stored [out, in] as a PyTorch Linear weight; gguf_interleaved: llama.cpp
    interleaves the rotary halves of each head's rows ("q" or "kv" heads) in llama GGUF files; needed: whether a
    config has this weight."""

    shape: Callable[[ModelConfig], tuple[int, ...]]
    axes: tuple[str | None, ...]
    hf: str
    gguf: str
    layer: bool = True
    transposed: bool = False
    gguf_interleaved: str | None = None
    needed: Callable[[ModelConfig], bool] = lambda cfg: True


def _q(cfg: ModelConfig) -> int:
    return cfg.num_heads * cfg.head_dim


def _kv(cfg: ModelConfig) -> int:
    return cfg.num_kv_heads * cfg.head_dim


_ATTN, _MLP = "model.layers.{i}.self_attn.", "model.layers.{i}.mlp."
WEIGHTS: dict[str, Weight] = {
    "embed": Weight(lambda c: (c.vocab_size, c.hidden_size), ("vocab", "embed"), "model.embed_tokens.weight",
                    "token_embd.weight", layer=False),
    "final_norm": Weight(lambda c: (c.hidden_size,), (None,), "model.norm.weight", "output_norm.weight", layer=False),
    "lm_head": Weight(lambda c: (c.hidden_size, c.vocab_size), ("embed", "vocab"), "lm_head.weight", "output.weight",
                      layer=False, transposed=True, needed=lambda c: not c.tie_word_embeddings),
    "attn_norm": Weight(lambda c: (c.hidden_size,), (None,), "model.layers.{i}.input_layernorm.weight",
                        "blk.{i}.attn_norm.weight"),
    "wq": Weight(lambda c: (c.hidden_size, _q(c)), ("embed", "q"), _ATTN + "q_proj.weight", "blk.{i}.attn_q.weight",
                 transposed=True, gguf_interleaved="q"),
    "wk": Weight(lambda c: (c.hidden_size, _kv(c)), ("embed", "kv"), _ATTN + "k_proj.weight", "blk.{i}.attn_k.weight",
                 transposed=True, gguf_interleaved="kv"),
    "wv": Weight(lambda c: (c.hidden_size, _kv(c)), ("embed", "kv"), _ATTN + "v_proj.weight", "blk.{i}.attn_v.weight",
                 transposed=True),
    "bq": Weight(lambda c: (_q(c),), ("q",), _ATTN + "q_proj.bias", "blk.{i}.attn_q.bias",
                 needed=lambda c: c.qkv_bias),
    "bk": Weight(lambda c: (_kv(c),), ("kv",), _ATTN + "k_proj.bias", "blk.{i}.attn_k.bias",
                 needed=lambda c: c.qkv_bias),
    "bv": Weight(lambda c: (_kv(c),), ("kv",), _ATTN + "v_proj.bias", "blk.{i}.attn_v.bias",
                 needed=lambda c: c.qkv_bias),
    "q_norm": Weight(lambda c: (c.head_dim,), ("head_dim",), _ATTN + "q_norm.weight", "blk.{i}.attn_q_norm.weight",
                     needed=lambda c: c.qk_norm),
    "k_norm": Weight(lambda c: (c.head_dim,), ("head_dim",), _ATTN + "k_norm.weight", "blk.{i}.attn_k_norm.weight",
                     needed=lambda c: c.qk_norm),
    "wo": Weight(lambda c: (_q(c), c.hidden_size), ("q", "embed"), _ATTN + "o_proj.weight",
                 "blk.{i}.attn_output.weight", transposed=True),
    "bo": Weight(lambda c: (c.hidden_size,), ("embed",), _ATTN + "o_proj.bias", "blk.{i}.attn_output.bias",
                 needed=lambda c: c.o_bias),
    "mlp_norm": Weight(lambda c: (c.hidden_size,), (None,), "model.layers.{i}.post_attention_layernorm.weight",
                       "blk.{i}.ffn_norm.weight"),
    "w_gate": Weight(lambda c: (c.hidden_size, c.intermediate_size), ("embed", "mlp"), _MLP + "gate_proj.weight",
                     "blk.{i}.ffn_gate.weight", transposed=True),
    "w_up": Weight(lambda c: (c.hidden_size, c.intermediate_size), ("embed", "mlp"), _MLP + "up_proj.weight",
                   "blk.{i}.ffn_up.weight", transposed=True),
    "w_down": Weight(lambda c: (c.intermediate_size, c.hidden_size), ("mlp", "embed"), _MLP + "down_proj.weight",
                     "blk.{i}.ffn_down.weight", transposed=True),
}


# Gemma 3: its MLP norm is "pre_feedforward_layernorm" (Llama's "post_attention_layernorm" is its norm after the
# attention), and norms after the attention and the MLP.
GEMMA3: dict[str, Weight] = {
    "mlp_norm": dataclasses.replace(WEIGHTS["mlp_norm"], hf="model.layers.{i}.pre_feedforward_layernorm.weight"),
    "post_attn_norm": Weight(lambda c: (c.hidden_size,), (None,), "model.layers.{i}.post_attention_layernorm.weight",
                             "blk.{i}.post_attention_norm.weight"),
    "post_mlp_norm": Weight(lambda c: (c.hidden_size,), (None,), "model.layers.{i}.post_feedforward_layernorm.weight",
                            "blk.{i}.post_ffw_norm.weight"),
}


def declarations(cfg: ModelConfig) -> dict[str, Weight]:
    """The weights a config has, by our name, in a fixed order."""
    table = WEIGHTS | (GEMMA3 if cfg.gemma else {})
    return {name: w for name, w in table.items() if w.needed(cfg)}


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every weight the config has (layer weights with their leading layer axis)."""
    return {name: ((cfg.num_layers,) if w.layer else ()) + w.shape(cfg) for name, w in declarations(cfg).items()}


def logical_axes(cfg: ModelConfig) -> dict[str, tuple[str | None, ...]]:
    """The logical axes of every weight the config has, the layer axis (None) included."""
    return {name: ((None,) if w.layer else ()) + w.axes for name, w in declarations(cfg).items()}
