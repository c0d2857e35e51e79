"""Every weight of every model family, declared once (`declarations`): its shape from the config, a logical
axis per dimension, and its Hugging Face and GGUF tensor names with how their layout differs from ours. The
decoder's weight shapes (`weight_shapes`), the sharding rules (`models.sharding`, which maps logical axes to
mesh axes) and both loaders (`models.loading`) derive from these declarations: adding a weight is one entry
here and its use in the decoder.

Our layout: x @ W (W is [in, out], the transpose of a PyTorch Linear weight; a fused weight of `FUSED` splits its
out axis further); layer weights are stacked on a leading axis over the layers that have them (`Weight.layers`;
not part of a declaration's shape or axes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
from jcascade.models.config import GLOBAL, LINEAR, SLIDING, ModelConfig

# Logical axes: "vocab" (vocabulary), "embed" (hidden size), "q" (query heads x head_dim), "kv" (KV heads x
# head_dim), "kv_heads" (KV heads), "mlp" (intermediate size), "head_dim" (one head's features); None: replicated.


@dataclasses.dataclass(frozen=True)
class Weight:
    """One weight. shape(config) and axes are one layer's for layer weights (`layer`); layers: which layers have
    it ("all", a layer type, or "<type> kv": the layers of that type keeping a cache of their own); hf / gguf:
    tensor names ("{i}" is the layer); transposed: stored [out, in] as a PyTorch Linear weight; hf_half: the
    first (0) or second (1) half of each head's rows of the stored tensor (Qwen3.5's q_proj and llama.cpp's attn_q
    hold each head's query then its gate); squeezed: the stored tensor has singleton dims ours drops;
    gguf_interleaved: llama.cpp interleaves the rotary halves of each head's rows ("q" or "kv" heads) in llama GGUF
    files; needed: whether a config has this weight; parts: a weight stored as the join of other declarations'
    tensors (`FUSED`; its hf and gguf names are unused): ((name, Weight), ...), each part [in, out] reshaped to
    this shape with its own extent along `join_axis`, then concatenated along it (`join`, `split`)."""

    shape: Callable[[ModelConfig], tuple[int, ...]]
    axes: tuple[str | None, ...]
    hf: str
    gguf: str
    layer: bool = True
    layers: str = "all"
    transposed: bool = False
    hf_half: int | None = None
    squeezed: bool = False
    gguf_interleaved: str | None = None
    needed: Callable[[ModelConfig], bool] = lambda cfg: True
    parts: tuple[tuple[str, Weight], ...] = ()
    join_axis: int | None = None

    def layer_indices(self, cfg: ModelConfig) -> tuple[int, ...]:
        """The model layers this weight's stack holds, in order."""
        if self.layers == "all":
            return tuple(range(cfg.num_layers))
        if self.layers.endswith(" kv"):
            return cfg.layers_with_state(self.layers.removesuffix(" kv"))
        return tuple(i for i, t in enumerate(cfg.types) if t == self.layers)

    def join(self, cfg: ModelConfig, arrays: list, xp=np):
        """A fused weight [..., *shape(cfg)] from its parts' arrays (each [..., in, out], in the order of `parts`;
        leading axes, such as the layers', kept), concatenated with `xp` (numpy, or jax.numpy)."""
        shape, axis = self.shape(cfg), self.join_axis
        return xp.concatenate(
            [a.reshape(*a.shape[:-2], *shape[:axis], -1, *shape[axis + 1 :]) for a in arrays], axis=axis - len(shape)
        )

    def split(self, cfg: ModelConfig, array: np.ndarray) -> dict[str, np.ndarray]:
        """The inverse of `join` for `array` [..., *shape(cfg)]: {part name: [..., in, out]}."""
        shape, axis = self.shape(cfg), self.join_axis
        lead, beside = array.ndim - len(shape), int(np.prod(shape[1:axis] + shape[axis + 1 :]))
        extents = [w.shape(cfg)[-1] // beside for _, w in self.parts]  # each part's extent along join_axis
        pieces = np.split(array, np.cumsum(extents)[:-1], axis=lead + axis)
        return {name: p.reshape(*p.shape[:lead], *w.shape(cfg)) for (name, w), p in zip(self.parts, pieces)}


def _q(cfg: ModelConfig) -> int:
    return cfg.num_heads * cfg.head_dim


def _kv(cfg: ModelConfig) -> int:
    return cfg.num_kv_heads * cfg.head_dim


_ATTN, _MLP = "model.layers.{i}.self_attn.", "model.layers.{i}.mlp."
WEIGHTS: dict[str, Weight] = {
    "embed": Weight(
        lambda c: (c.vocab_size, c.hidden_size),
        ("vocab", "embed"),
        "model.embed_tokens.weight",
        "token_embd.weight",
        layer=False,
    ),
    "final_norm": Weight(lambda c: (c.hidden_size,), (None,), "model.norm.weight", "output_norm.weight", layer=False),
    "lm_head": Weight(
        lambda c: (c.hidden_size, c.vocab_size),
        ("embed", "vocab"),
        "lm_head.weight",
        "output.weight",
        layer=False,
        transposed=True,
        needed=lambda c: not c.tie_word_embeddings,
    ),
    "attn_norm": Weight(
        lambda c: (c.hidden_size,),
        (None,),
        "model.layers.{i}.input_layernorm.weight",
        "blk.{i}.attn_norm.weight",
        needed=lambda c: c.norms.pre,
    ),
    "wq": Weight(
        lambda c: (c.hidden_size, _q(c)),
        ("embed", "q"),
        _ATTN + "q_proj.weight",
        "blk.{i}.attn_q.weight",
        transposed=True,
        gguf_interleaved="q",
    ),
    "wk": Weight(
        lambda c: (c.hidden_size, _kv(c)),
        ("embed", "kv"),
        _ATTN + "k_proj.weight",
        "blk.{i}.attn_k.weight",
        transposed=True,
        gguf_interleaved="kv",
    ),
    "wv": Weight(
        lambda c: (c.hidden_size, _kv(c)),
        ("embed", "kv"),
        _ATTN + "v_proj.weight",
        "blk.{i}.attn_v.weight",
        transposed=True,
    ),
    "bq": Weight(
        lambda c: (_q(c),), ("q",), _ATTN + "q_proj.bias", "blk.{i}.attn_q.bias", needed=lambda c: c.attention.qkv_bias
    ),
    "bk": Weight(
        lambda c: (_kv(c),),
        ("kv",),
        _ATTN + "k_proj.bias",
        "blk.{i}.attn_k.bias",
        needed=lambda c: c.attention.qkv_bias,
    ),
    "bv": Weight(
        lambda c: (_kv(c),),
        ("kv",),
        _ATTN + "v_proj.bias",
        "blk.{i}.attn_v.bias",
        needed=lambda c: c.attention.qkv_bias,
    ),
    "q_norm": Weight(
        lambda c: (c.head_dim,),
        ("head_dim",),
        _ATTN + "q_norm.weight",
        "blk.{i}.attn_q_norm.weight",
        needed=lambda c: c.norms.qk is not None,
    ),
    "k_norm": Weight(
        lambda c: (c.head_dim,),
        ("head_dim",),
        _ATTN + "k_norm.weight",
        "blk.{i}.attn_k_norm.weight",
        needed=lambda c: c.norms.qk is not None,
    ),
    "wo": Weight(
        lambda c: (_q(c), c.hidden_size),
        ("q", "embed"),
        _ATTN + "o_proj.weight",
        "blk.{i}.attn_output.weight",
        transposed=True,
    ),
    "bo": Weight(
        lambda c: (c.hidden_size,),
        ("embed",),
        _ATTN + "o_proj.bias",
        "blk.{i}.attn_output.bias",
        needed=lambda c: c.attention.o_bias,
    ),
    "mlp_norm": Weight(
        lambda c: (c.hidden_size,),
        (None,),
        "model.layers.{i}.post_attention_layernorm.weight",
        "blk.{i}.ffn_norm.weight",
        needed=lambda c: c.norms.pre,
    ),
    "w_gate": Weight(
        lambda c: (c.hidden_size, c.intermediate_size),
        ("embed", "mlp"),
        _MLP + "gate_proj.weight",
        "blk.{i}.ffn_gate.weight",
        transposed=True,
    ),
    "w_up": Weight(
        lambda c: (c.hidden_size, c.intermediate_size),
        ("embed", "mlp"),
        _MLP + "up_proj.weight",
        "blk.{i}.ffn_up.weight",
        transposed=True,
    ),
    "w_down": Weight(
        lambda c: (c.intermediate_size, c.hidden_size),
        ("mlp", "embed"),
        _MLP + "down_proj.weight",
        "blk.{i}.ffn_down.weight",
        transposed=True,
    ),
}


# Norms after the attention and the MLP (`FamilyFeatures.post_norms`: Gemma 3 and 4, OLMo 3): "post_attention_layernorm"
# is then the norm after the attention, and the MLP's norm before it (where there is one) "pre_feedforward_layernorm".
POST_NORMS: dict[str, Weight] = {
    "mlp_norm": dataclasses.replace(WEIGHTS["mlp_norm"], hf="model.layers.{i}.pre_feedforward_layernorm.weight"),
    "post_attn_norm": Weight(
        lambda c: (c.hidden_size,),
        (None,),
        "model.layers.{i}.post_attention_layernorm.weight",
        "blk.{i}.post_attention_norm.weight",
    ),
    "post_mlp_norm": Weight(
        lambda c: (c.hidden_size,),
        (None,),
        "model.layers.{i}.post_feedforward_layernorm.weight",
        "blk.{i}.post_ffw_norm.weight",
    ),
}
# q and k norms over all heads' features at once (`Norms.qk` "all": OLMo 3).
QK_NORM_FULL: dict[str, Weight] = {
    "q_norm": dataclasses.replace(WEIGHTS["q_norm"], shape=lambda c: (_q(c),), axes=(None,)),
    "k_norm": dataclasses.replace(WEIGHTS["k_norm"], shape=lambda c: (_kv(c),), axes=(None,)),
}
# A sigmoid gate on the attention output (`Attention.output_gate`: Qwen3.5): q_proj holds each head's
# query, then its gate.
OUTPUT_GATE: dict[str, Weight] = {
    "wq": dataclasses.replace(WEIGHTS["wq"], hf_half=0, gguf_interleaved=None),
    "w_attn_gate": Weight(
        lambda c: (c.hidden_size, _q(c)),
        ("embed", "q"),
        _ATTN + "q_proj.weight",
        "blk.{i}.attn_q.weight",
        transposed=True,
        hf_half=1,
    ),
}
# The attention weights, which a model with LINEAR layers has on its GLOBAL layers alone.
ATTENTION = ("wq", "wk", "wv", "bq", "bk", "bv", "q_norm", "k_norm", "wo", "bo", "w_attn_gate")


def _on(layers: str, names: tuple[str, ...], table=WEIGHTS) -> dict[str, Weight]:
    return {name: dataclasses.replace(table[name], layers=layers) for name in names}


_LINEAR = "model.layers.{i}.linear_attn."


def _lin(c: ModelConfig) -> int:
    """The Gated DeltaNet's q | k | v channels."""
    return 2 * c.linear.key_heads * c.linear.key_dim + c.linear.value_heads * c.linear.value_dim


# Gated DeltaNet on the LINEAR layers (Qwen3.5; llama.cpp's qwen35 names); every layer's norms and MLP as Llama's
# (llama.cpp names the MLP's norm post_attention_norm there, as Hugging Face does).
LINEAR_LAYERS: dict[str, Weight] = {
    "mlp_norm": dataclasses.replace(WEIGHTS["mlp_norm"], gguf="blk.{i}.post_attention_norm.weight"),
    "lin_qkv": Weight(
        lambda c: (c.hidden_size, _lin(c)),
        ("embed", None),
        _LINEAR + "in_proj_qkv.weight",
        "blk.{i}.attn_qkv.weight",
        layers=LINEAR,
        transposed=True,
    ),
    "lin_z": Weight(
        lambda c: (c.hidden_size, c.linear.value_heads * c.linear.value_dim),
        ("embed", None),
        _LINEAR + "in_proj_z.weight",
        "blk.{i}.attn_gate.weight",
        layers=LINEAR,
        transposed=True,
    ),
    "lin_b": Weight(
        lambda c: (c.hidden_size, c.linear.value_heads),
        ("embed", None),
        _LINEAR + "in_proj_b.weight",
        "blk.{i}.ssm_beta.weight",
        layers=LINEAR,
        transposed=True,
    ),
    "lin_a": Weight(
        lambda c: (c.hidden_size, c.linear.value_heads),
        ("embed", None),
        _LINEAR + "in_proj_a.weight",
        "blk.{i}.ssm_alpha.weight",
        layers=LINEAR,
        transposed=True,
    ),
    "lin_conv": Weight(
        lambda c: (_lin(c), c.linear.conv_kernel),
        (None, None),
        _LINEAR + "conv1d.weight",
        "blk.{i}.ssm_conv1d.weight",
        layers=LINEAR,
        squeezed=True,
    ),
    "lin_dt_bias": Weight(
        lambda c: (c.linear.value_heads,), (None,), _LINEAR + "dt_bias", "blk.{i}.ssm_dt.bias", layers=LINEAR
    ),
    "lin_a_log": Weight(lambda c: (c.linear.value_heads,), (None,), _LINEAR + "A_log", "blk.{i}.ssm_a", layers=LINEAR),
    "lin_norm": Weight(
        lambda c: (c.linear.value_dim,), (None,), _LINEAR + "norm.weight", "blk.{i}.ssm_norm.weight", layers=LINEAR
    ),
    "lin_out": Weight(
        lambda c: (c.linear.value_heads * c.linear.value_dim, c.hidden_size),
        (None, "embed"),
        _LINEAR + "out_proj.weight",
        "blk.{i}.ssm_out.weight",
        layers=LINEAR,
        transposed=True,
    ),
}


def _global_q(c: ModelConfig) -> int:
    return c.num_heads * c.head_size(GLOBAL)


def _global_kv(c: ModelConfig) -> int:
    return c.kv_heads(GLOBAL) * c.head_size(GLOBAL)


# The GLOBAL layers' attention weights apart from the SLIDING ones' (`FamilyFeatures.global_attention_weights`: Gemma
# 4), of their own head_dim and KV heads; no k/v weights on the layers that read an earlier layer's cache (nor v on
# global layers with k = v).
GLOBAL_ATTENTION: dict[str, Weight] = {
    **_on(SLIDING, ("wq", "wo", "q_norm")),
    **_on("sliding kv", ("wk", "wv", "k_norm")),
    "wq_global": dataclasses.replace(WEIGHTS["wq"], shape=lambda c: (c.hidden_size, _global_q(c)), layers=GLOBAL),
    "wk_global": dataclasses.replace(WEIGHTS["wk"], shape=lambda c: (c.hidden_size, _global_kv(c)), layers="global kv"),
    "wv_global": dataclasses.replace(
        WEIGHTS["wv"],
        shape=lambda c: (c.hidden_size, _global_kv(c)),
        layers="global kv",
        needed=lambda c: not c.attention.k_eq_v,
    ),
    "wo_global": dataclasses.replace(WEIGHTS["wo"], shape=lambda c: (_global_q(c), c.hidden_size), layers=GLOBAL),
    "q_norm_global": dataclasses.replace(WEIGHTS["q_norm"], shape=lambda c: (c.head_size(GLOBAL),), layers=GLOBAL),
    "k_norm_global": dataclasses.replace(WEIGHTS["k_norm"], shape=lambda c: (c.head_size(GLOBAL),), layers="global kv"),
}
_PLE = "model.layers.{i}."
# Per-layer inputs (`ModelConfig.per_layer_input_size`: a gate and projection per layer from a table and a projection
# of the embeddings) and a scalar per layer (`FamilyFeatures.layer_scalar`): Gemma 4.
PER_LAYER: dict[str, Weight] = {
    "embed_per_layer": Weight(
        lambda c: (c.per_layer_vocab_size, c.num_layers * c.per_layer_input_size),
        ("vocab", None),
        "model.embed_tokens_per_layer.weight",
        "per_layer_token_embd.weight",
        layer=False,
        needed=lambda c: c.per_layer_input_size > 0,
    ),
    "per_layer_projection": Weight(
        lambda c: (c.hidden_size, c.num_layers * c.per_layer_input_size),
        ("embed", None),
        "model.per_layer_model_projection.weight",
        "per_layer_model_proj.weight",
        layer=False,
        transposed=True,
        needed=lambda c: c.per_layer_input_size > 0,
    ),
    "per_layer_projection_norm": Weight(
        lambda c: (c.per_layer_input_size,),
        (None,),
        "model.per_layer_projection_norm.weight",
        "per_layer_proj_norm.weight",
        layer=False,
        needed=lambda c: c.per_layer_input_size > 0,
    ),
    "ple_gate": Weight(
        lambda c: (c.hidden_size, c.per_layer_input_size),
        ("embed", None),
        _PLE + "per_layer_input_gate.weight",
        "blk.{i}.inp_gate.weight",
        transposed=True,
        needed=lambda c: c.per_layer_input_size > 0,
    ),
    "ple_proj": Weight(
        lambda c: (c.per_layer_input_size, c.hidden_size),
        (None, "embed"),
        _PLE + "per_layer_projection.weight",
        "blk.{i}.proj.weight",
        transposed=True,
        needed=lambda c: c.per_layer_input_size > 0,
    ),
    "ple_norm": Weight(
        lambda c: (c.hidden_size,),
        (None,),
        _PLE + "post_per_layer_input_norm.weight",
        "blk.{i}.post_norm.weight",
        needed=lambda c: c.per_layer_input_size > 0,
    ),
    "layer_scalar": Weight(
        lambda c: (1,),
        (None,),
        _PLE + "layer_scalar",
        "blk.{i}.layer_output_scale.weight",
        needed=lambda c: c.layer_scalar,
    ),
}


# Products that read the same input, stored joined so that a decode step runs one product for each: a one-row
# product costs at least about 8 us on an H200 however small its weight (k and v at 0.27-1.05 TB/s), so joining q, k
# and v saves 0.36-0.50 ms of an 8B batch-1 step's kernels at TP = 1, 2 and 4, gate and up 0.07-0.17 ms
# (benchmarks/results/joined-products/h200x2/products.json). wqkv holds each KV head's query heads, then its key and its
# value head ([in, KV heads, queries per KV head + 2, head_dim]: a device of a tensor-parallel mesh holds whole
# groups); w_gate_up [in, 2, intermediate]. Joined where every part is on the same set of layers (not Gemma 4's
# attention, whose q is on every sliding layer, its k and v only on those keeping a cache of their own).
FUSED: dict[str, tuple[tuple[str, ...], Weight]] = {  # name: (its parts' names, its declaration without the parts)
    "wqkv": (
        ("wq", "wk", "wv"),
        Weight(
            lambda c: (c.hidden_size, c.num_kv_heads, c.num_heads // c.num_kv_heads + 2, c.head_dim),
            ("embed", "kv_heads", None, None),
            "",
            "",
            join_axis=2,
        ),
    ),
    "w_gate_up": (
        ("w_gate", "w_up"),
        Weight(lambda c: (c.hidden_size, 2, c.intermediate_size), ("embed", None, "mlp"), "", "", join_axis=1),
    ),
}


def declarations(cfg: ModelConfig) -> dict[str, Weight]:
    """The weights a config has, by our name, in a fixed order (each fused weight of `FUSED` in its first part's
    place, where all its parts are on the same layers)."""
    table = dict(WEIGHTS)
    if cfg.norms.post:
        table |= POST_NORMS
    if cfg.norms.qk == "all":
        table |= QK_NORM_FULL
    if cfg.attention.output_gate:
        table |= OUTPUT_GATE
    if LINEAR in cfg.types:
        table |= _on(GLOBAL, tuple(name for name in ATTENTION if name in table), table) | LINEAR_LAYERS
    if cfg.attention.global_weights:
        table |= GLOBAL_ATTENTION
    table = {name: w for name, w in (table | PER_LAYER).items() if w.needed(cfg)}
    for name, (part_names, fused) in FUSED.items():
        parts = tuple((part, table.get(part)) for part in part_names)
        if any(w is None for _, w in parts) or len({w.layers for _, w in parts}) > 1:
            continue
        joined, out = dataclasses.replace(fused, layers=parts[0][1].layers, parts=parts), {}
        for n, w in table.items():
            if n == part_names[0]:
                out[name] = joined
            elif n not in part_names:
                out[n] = w
        table = out
    return table


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every weight the config has (layer weights with their leading axis over `Weight.layer_indices`)."""
    return {
        name: ((len(w.layer_indices(cfg)),) if w.layer else ()) + w.shape(cfg) for name, w in declarations(cfg).items()
    }


def logical_axes(cfg: ModelConfig) -> dict[str, tuple[str | None, ...]]:
    """The logical axes of every weight the config has, the layer axis (None) included."""
    return {name: ((None,) if w.layer else ()) + w.axes for name, w in declarations(cfg).items()}
