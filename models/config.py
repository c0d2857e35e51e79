"""Model configuration: one frozen dataclass for the Llama, Mistral, Qwen2, Qwen3, Qwen3.5, Gemma 3, Gemma 4,
SmolLM3 and OLMo 3 decoders, read from Hugging Face `config.json` files or GGUF metadata."""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import Any

from jcascade.rope import Llama3Scaling, RoPE

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
    "Gemma4ForCausalLM": "gemma4",
    "Gemma4ForConditionalGeneration": "gemma4",
    "SmolLM3ForCausalLM": "smollm3",
    "Olmo3ForCausalLM": "olmo3",
}
# Layer types: GLOBAL layers hold the user's policy's KV cache, SLIDING ones a window cache of their own (Gemma 3
# and 4), LINEAR ones (Qwen3.5's Gated DeltaNet) a fixed-size recurrent state.
GLOBAL, SLIDING, LINEAR = "global", "sliding", "linear"


INT32_MAX = 2**31 - 1  # sizes and counts are int32 inside


@dataclasses.dataclass(frozen=True)
class Norms:
    """The RMSNorms of a block: where they sit and how they scale (the defaults are Llama's)."""

    pre: bool = True  # before the attention and before the MLP
    post: bool = False  # after the attention and after the MLP, before each residual add
    plus_one: bool = False  # scale by (1 + w), not w
    scale_f32: bool = False  # multiply by the weight in float32, then cast back
    qk: str | None = None  # RMSNorm of q and k before the rotation: None, over each head's features ("head") or over
    # all heads' at once ("all")
    values: bool = False  # values RMS-normed (no weight)

    def __post_init__(self):
        if self.qk not in (None, "head", "all"):
            raise ValueError(f"Norms.qk must be None, 'head' or 'all', got {self.qk!r}")


@dataclasses.dataclass(frozen=True)
class Rotary:
    """The rotary positions: the global layers' base and scaling, the sliding layers' base, and the share of a global
    layer's head dims that rotate (`ModelConfig.rope`)."""

    theta: float = 10000.0
    scaling: Llama3Scaling | None = None
    local_theta: float | None = None  # the sliding layers' base
    fraction: float = 1.0  # the share of a global layer's head dims that rotate
    proportional: bool = False  # that share of the frequencies of a RoPE of the whole head (else the first dims turn
    # as a RoPE of their width)

    def __post_init__(self):
        if not 0 < self.fraction <= 1:
            raise ValueError(f"Rotary.fraction must lie in (0, 1], got {self.fraction}")


@dataclasses.dataclass(frozen=True)
class Attention:
    """The attention layers' projections and scale; the global layers' own sizes and weights (Gemma 4)."""

    qkv_bias: bool = False
    o_bias: bool = False
    query_scale: float | None = None  # None: head_dim ** -0.5
    output_gate: bool = False  # a sigmoid gate on the attention output (Qwen3.5)
    global_head_dim: int | None = None  # the global layers' head_dim (None: `ModelConfig.head_dim`)
    global_kv_heads: int | None = None  # the global layers' KV heads (None: `ModelConfig.num_kv_heads`)
    global_weights: bool = False  # the global layers' attention weights apart from the sliding ones'; k and v only
    # on the layers that keep a cache
    k_eq_v: bool = False  # the global layers' keys serve as their values


@dataclasses.dataclass(frozen=True)
class LinearAttention:
    """The Gated DeltaNet layers' heads, head dims and convolution kernel (Qwen3.5)."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LinearAttention.{f.name} must be a positive int, got {value!r}")
        if self.value_heads % self.key_heads:
            raise ValueError(
                f"LinearAttention.value_heads ({self.value_heads}) must be a multiple of key_heads ({self.key_heads})"
            )


# What each family fixes in every model of it (its translation sets these fields; the others vary by checkpoint)
FAMILY_FEATURES = {
    "llama": {},
    "mistral": {},
    "qwen2": {},
    "qwen3": dict(norms=Norms(qk="head")),
    "smollm3": {},
    "gemma3": dict(
        norms=Norms(post=True, plus_one=True, scale_f32=True, qk="head"), activation="gelu_tanh", embed_scaled=True
    ),
    "gemma4": dict(
        norms=Norms(post=True, scale_f32=True, qk="head", values=True),
        activation="gelu_tanh",
        embed_scaled=True,
        layer_scalar=True,
    ),
    "qwen3_5": dict(norms=Norms(plus_one=True, qk="head")),
    "olmo3": dict(norms=Norms(pre=False, post=True, scale_f32=True, qk="all")),
}


def required(fields: dict[str, Any], name: str, source, kind: type = int):
    """fields[name] as `kind`: an int > 0 (int), a finite number (float) or a str; a ValueError naming the field
    and `source` (the file) when it is missing, null or of another kind."""
    value = fields.get(name)
    if value is None:
        raise ValueError(f"{source}: the required field {name!r} is missing")
    if kind is int:
        ok = isinstance(value, numbers.Integral) and not isinstance(value, bool) and 0 < value <= INT32_MAX
    elif kind is float:
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    else:
        ok = isinstance(value, kind)
    if not ok:
        wanted = {int: f"a positive int (at most {INT32_MAX})", float: "a finite number"}.get(kind, kind.__name__)
        raise ValueError(f"{source}: field {name!r} must be {wanted}, got {value!r}")
    return kind(value)


def optional(fields: dict[str, Any], name: str, source, default, kind: type = int, least: int = 1):
    """fields[name] checked as `required` checks it (an int >= `least` for int), or `default` when it is missing
    or null."""
    value = fields.get(name)
    if value is None:
        return default
    if kind is int and not (
        isinstance(value, numbers.Integral) and not isinstance(value, bool) and least <= value <= INT32_MAX
    ):
        raise ValueError(f"{source}: field {name!r} must be an int in [{least}, {INT32_MAX}], got {value!r}")
    return required(fields, name, source, kind) if kind is not int else int(value)


def _layer_names(config: dict[str, Any], source, default: list[str]) -> list[str]:
    names = config.get("layer_types")
    if names is None or names == []:
        return default
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"{source}: field 'layer_types' must be a list of layer type names, got {names!r}")
    return names


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder: its sizes, then its features in groups (norms, rotary positions, attention, the MLP's activation,
    the linear layers) and per layer kind (`layer_types`, the window, NoPE and shared-KV layers). The translations
    (`from_hf`, the GGUF reader) set every field; nothing outside them reads `architecture`, the family's name."""

    architecture: str  # the family (a value of ARCHITECTURES), for messages
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    rms_norm_eps: float = 1e-6
    norms: Norms = Norms()
    rotary: Rotary = Rotary()
    attention: Attention = Attention()
    activation: str = "silu"  # the MLP's gate activation: "silu" or "gelu_tanh"
    linear: LinearAttention | None = None  # the Gated DeltaNet layers' sizes (with LINEAR layers)
    layer_types: tuple[str, ...] = ()  # GLOBAL, SLIDING or LINEAR per layer; () for all global
    sliding_window: int | None = None  # the tokens a sliding layer's query sees, itself included
    nope_layers: tuple[int, ...] = ()  # global layers whose attention rotates neither q nor k (SmolLM3)
    kv_shared_layers: int = 0  # the last layers, each reading the cache of the last earlier layer of its type
    embed_scaled: bool = False  # embeddings scaled by sqrt(hidden_size)
    per_layer_input_size: int = 0  # per-layer input embeddings of this width (Gemma 4), from a table of
    per_layer_vocab_size: int = 0  # this many tokens
    layer_scalar: bool = False  # each layer's output scaled by a learned scalar
    final_logit_softcapping: float | None = None  # logits soft-capped: cap * tanh(x / cap)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES.values():
            raise ValueError(f"architecture must be one of {sorted(ARCHITECTURES.values())}, got {self.architecture!r}")
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        for name, kind in (("norms", Norms), ("rotary", Rotary), ("attention", Attention)):
            if not isinstance(getattr(self, name), kind):
                raise TypeError(f"ModelConfig.{name} must be a {kind.__name__}, got {getattr(self, name)!r}")
        if self.activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"ModelConfig.activation must be 'silu' or 'gelu_tanh', got {self.activation!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.layer_types and (
            len(self.layer_types) != self.num_layers or set(self.layer_types) - {SLIDING, GLOBAL, LINEAR}
        ):
            raise ValueError(
                f"ModelConfig.layer_types must name {GLOBAL!r}, {SLIDING!r} or {LINEAR!r} for each of the "
                f"{self.num_layers} layers, got {self.layer_types!r}"
            )
        if self.layer_types and GLOBAL not in self.layer_types:
            raise ValueError(
                f"ModelConfig.layer_types must name at least one {GLOBAL!r} layer (the layers the cache "
                f"policy serves), got {self.layer_types!r}"
            )
        if (LINEAR in self.layer_types) != isinstance(self.linear, LinearAttention):
            raise ValueError(
                "ModelConfig.linear (a LinearAttention) must be given exactly when layer_types has linear layers, "
                f"got {self.linear!r}"
            )
        if any(
            isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.num_layers or self.types[i] != GLOBAL
            for i in self.nope_layers
        ) or list(self.nope_layers) != sorted(set(self.nope_layers)):
            raise ValueError(
                f"ModelConfig.nope_layers must be increasing indices of global layers (of {self.num_layers}), got "
                f"{self.nope_layers!r}"
            )
        if not 0 <= self.kv_shared_layers < self.num_layers:
            raise ValueError(
                f"ModelConfig.kv_shared_layers must lie in [0, {self.num_layers}), got {self.kv_shared_layers}"
            )
        owners = set(self.layer_types[: self.num_layers - self.kv_shared_layers] or [GLOBAL])
        if self.kv_shared_layers and set(self.layer_types[-self.kv_shared_layers :] or [GLOBAL]) - owners:
            raise ValueError(
                "every layer type among the last kv_shared_layers needs an earlier layer of its type "
                "whose cache it reads"
            )
        if SLIDING in self.layer_types and not (
            isinstance(self.sliding_window, int) and self.sliding_window >= 2 and self.rotary.local_theta
        ):
            raise ValueError(
                "sliding layers need ModelConfig.sliding_window (an int >= 2) and rotary.local_theta, got "
                f"{self.sliding_window!r} and {self.rotary.local_theta!r}"
            )

    @property
    def types(self) -> tuple[str, ...]:
        """Every layer's type (GLOBAL for all when `layer_types` is empty)."""
        return self.layer_types or (GLOBAL,) * self.num_layers

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.types) if t == SLIDING)

    def reads_from(self, layer: int) -> int:
        """The layer whose cache `layer` attends to: itself, or for one of the last `kv_shared_layers` the last
        earlier layer of its type that keeps a cache."""
        first_shared = self.num_layers - self.kv_shared_layers
        if layer < first_shared:
            return layer
        return max(i for i in range(first_shared) if self.types[i] == self.types[layer])

    def layers_with_state(self, layer_type: str) -> tuple[int, ...]:
        """The layers of `layer_type` that keep a state of their own (in the order of its stack)."""
        return tuple(i for i, t in enumerate(self.types) if t == layer_type and self.reads_from(i) == i)

    def kv_heads(self, layer_type: str) -> int:
        return self.attention.global_kv_heads or self.num_kv_heads if layer_type == GLOBAL else self.num_kv_heads

    def head_size(self, layer_type: str) -> int:
        return self.attention.global_head_dim or self.head_dim if layer_type == GLOBAL else self.head_dim

    @property
    def local_rope(self) -> RoPE:
        return RoPE(self.rotary.local_theta)

    @property
    def rope(self) -> RoPE:
        """The global layers' RoPE (`nope_layers` rotate nothing). Partial: the first `rotary.fraction` of the head
        dims rotate as a RoPE of that width (the attention layers move them into rotate-half pairs,
        `layers.projections.rotary_order`); with `rotary.proportional`, that share of the head's frequencies, the
        rest 0."""
        r = self.rotary
        if r.fraction == 1:
            return RoPE(r.theta, r.scaling)
        head_dim = self.head_size(GLOBAL)
        if r.proportional:
            return RoPE(r.theta, r.scaling, rotary_dim=2 * int(r.fraction * head_dim // 2), proportional=True)
        return RoPE(r.theta, r.scaling, rotary_dim=int(head_dim * r.fraction))

    @classmethod
    def from_hf(cls, config: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """From a Hugging Face config.json dictionary (transformers 4 or 5 layout); every ValueError (a required
        field missing or of the wrong kind, a value the config refuses) starts with `source`, the file."""
        try:
            return cls._translate(config, source)
        except ValueError as e:
            if str(e).startswith(str(source)):
                raise
            raise ValueError(f"{source}: {e}") from None

    @classmethod
    def _translate(cls, config: dict[str, Any], source: str) -> ModelConfig:
        names = config.get("architectures") or []
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ValueError(f"{source}: field 'architectures' must be a list of class names, got {names!r}")
        known = [ARCHITECTURES[n] for n in names if n in ARCHITECTURES]
        if not known:
            raise ValueError(
                f"unsupported architecture {names or config.get('model_type')!r} in config.json; "
                f"jcascade supports {sorted(ARCHITECTURES)}"
            )
        arch = known[0]
        if names[0].endswith("ForConditionalGeneration"):  # the text model of a multimodal checkpoint
            if not isinstance(config.get("text_config"), dict):
                raise ValueError(f"{source}: the required field 'text_config' is missing")
            config, source = config["text_config"], f"{source} (text_config)"
        family = {"gemma3": cls._gemma3, "gemma4": cls._gemma4, "qwen3_5": cls._qwen3_5, "olmo3": cls._olmo3}
        return family.get(arch, functools.partial(cls._llama, arch))(config, source)

    @classmethod
    def _of(
        cls,
        arch: str,
        config: dict[str, Any],
        source: str,
        *,
        head_dim=None,
        positions=2048,
        tied=False,
        eps=1e-6,
        **fields,
    ) -> ModelConfig:
        """A config of family `arch`: the fields every family reads alike from `config` (sizes, norm epsilon,
        positions, tied embeddings, bos and eos; `head_dim`, `positions`, `tied` and `eps`: the family's defaults), the
        family's `FAMILY_FEATURES`, and `fields`, the family's own."""
        field = lambda name, kind=int: required(config, name, source, kind)
        get = lambda name, default, kind=int: optional(config, name, source, default, kind)
        heads = field("num_attention_heads")
        return cls(
            architecture=arch,
            vocab_size=field("vocab_size"),
            hidden_size=field("hidden_size"),
            intermediate_size=field("intermediate_size"),
            num_layers=field("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=get("num_key_value_heads", heads),
            head_dim=get("head_dim", head_dim or field("hidden_size") // heads),
            max_position_embeddings=get("max_position_embeddings", positions),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", tied)),
            rms_norm_eps=get("rms_norm_eps", eps, float),
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=_eos(config),
            **FAMILY_FEATURES[arch] | fields,
        )

    @classmethod
    def _llama(cls, arch: str, config: dict[str, Any], source: str) -> ModelConfig:
        """Llama, Mistral, Qwen2, Qwen3 and SmolLM3 (Llama's layers, some without rotary positions: `_nope_layers`)."""
        smollm3 = arch == "smollm3"
        rope_params = dict(config.get("rope_parameters") or {})
        theta = config.get("rope_theta", rope_params.get("rope_theta", 2e6 if smollm3 else 10000.0))
        scaling = config.get("rope_scaling") or rope_params or None
        scaling = _rope_scaling(
            scaling, f"{source} ({'rope_scaling' if config.get('rope_scaling') else 'rope_parameters'})"
        )
        if config.get("mlp_bias"):
            raise ValueError("unsupported config.json: mlp_bias=true")
        if config.get("use_sliding_window"):
            raise ValueError("unsupported config.json: use_sliding_window=true")
        window = config.get("sliding_window")
        positions = config.get("max_position_embeddings", 32768 if smollm3 else 2048)
        if arch == "mistral" and window is not None and window < positions:
            raise ValueError(
                f"unsupported config.json: sliding_window={window} < max_position_embeddings={positions} "
                "(Mistral's sliding-window attention is not implemented; models with "
                "sliding_window null, such as Mistral-7B v0.2 and later, load)"
            )
        bias = bool(config.get("attention_bias", False))
        return cls._of(
            arch,
            config,
            source,
            positions=32768 if smollm3 else 2048,
            tied=smollm3,
            rotary=Rotary(float(theta), scaling),
            attention=Attention(qkv_bias=arch == "qwen2" or bias, o_bias=arch != "qwen2" and bias),
            nope_layers=_nope_layers(config, source, required(config, "num_hidden_layers", source)) if smollm3 else (),
        )

    @classmethod
    def _gemma3(cls, config: dict[str, Any], source: str) -> ModelConfig:
        """Gemma 3's text config (model_type gemma3_text): sliding and global layers by `layer_types`."""
        per_type = config.get("rope_parameters") or {}  # transformers 5: one entry per layer type
        full = per_type.get("full_attention") or {
            "rope_theta": config.get("rope_theta", 1e6),
            **(config.get("rope_scaling") or {}),
        }
        local = per_type.get("sliding_attention") or {"rope_theta": config.get("rope_local_base_freq", 1e4)}
        for kind, params in (("full_attention", full), ("sliding_attention", local)):
            if params.get("rope_type", params.get("type", "default")) != "default":
                raise ValueError(
                    f"unsupported rope scaling {params.get('rope_type', params.get('type'))!r} of the "
                    f"{kind} layers in config.json (supported for Gemma 3: default)"
                )
        for name in ("final_logit_softcapping", "attn_logit_softcapping"):
            if config.get(name) is not None:
                raise ValueError(f"unsupported config.json: {name}={config[name]} (Gemma 3 has none)")
        if config.get("use_bidirectional_attention"):
            raise ValueError("unsupported config.json: use_bidirectional_attention=true")
        _check_gelu_tanh(config, source)
        layers = required(config, "num_hidden_layers", source)
        pattern = config.get("sliding_window_pattern", 6)
        names = config.get("layer_types") or [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)
        ]
        _check_layer_types(names, {"sliding_attention": SLIDING, "full_attention": GLOBAL}, "config.json")
        bias = bool(config.get("attention_bias", False))
        return cls._of(
            "gemma3",
            config,
            source,
            positions=131072,
            tied=True,
            rotary=Rotary(
                required(full, "rope_theta", f"{source} (rope_parameters.full_attention)", float),
                local_theta=required(local, "rope_theta", f"{source} (rope_parameters.sliding_attention)", float),
            ),
            attention=Attention(
                qkv_bias=bias, o_bias=bias, query_scale=float(config.get("query_pre_attn_scalar", 256)) ** -0.5
            ),
            layer_types=tuple(SLIDING if n == "sliding_attention" else GLOBAL for n in names),
            sliding_window=config.get("sliding_window", 4096),
        )

    @classmethod
    def _qwen3_5(cls, config: dict[str, Any], source: str) -> ModelConfig:
        """Qwen3.5's text config (model_type qwen3_5_text): Gated DeltaNet layers and gated full-attention ones by
        `layer_types` (default: every `full_attention_interval`-th layer full)."""
        rope = {
            "rope_theta": config.get("rope_theta", 1e7),
            "partial_rotary_factor": config.get("partial_rotary_factor", 0.25),
            **(config.get("rope_parameters") or {}),
        }
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError(
                f"unsupported rope scaling {rope.get('rope_type', rope.get('type'))!r} in {source} "
                "(supported for Qwen3.5: default)"
            )
        for name, supported in (("attention_bias", False), ("hidden_act", "silu")):
            if config.get(name, supported) != supported:
                raise ValueError(f"unsupported {source}: {name}={config[name]!r} (supported: {supported!r})")
        layers = required(config, "num_hidden_layers", source)
        get = lambda name, default: optional(config, name, source, default)
        interval = get("full_attention_interval", 4)
        names = _layer_names(
            config, source, ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
        )
        _check_layer_types(names, {"full_attention": GLOBAL, "linear_attention": LINEAR}, source)
        return cls._of(
            "qwen3_5",
            config,
            source,
            head_dim=256,
            positions=32768,
            rotary=Rotary(
                required(rope, "rope_theta", f"{source} (rope_parameters)", float),
                fraction=required(rope, "partial_rotary_factor", f"{source} (rope_parameters)", float),
            ),
            attention=Attention(output_gate=True),
            layer_types=tuple(GLOBAL if n == "full_attention" else LINEAR for n in names),
            linear=LinearAttention(
                key_heads=get("linear_num_key_heads", 16),
                value_heads=get("linear_num_value_heads", 32),
                key_dim=get("linear_key_head_dim", 128),
                value_dim=get("linear_value_head_dim", 128),
                conv_kernel=get("linear_conv_kernel_dim", 4),
            ),
        )

    @classmethod
    def _gemma4(cls, config: dict[str, Any], source: str) -> ModelConfig:
        """Gemma 4's text config (model_type gemma4_text), dense: sliding and full layers by `layer_types` (the
        last always full), the full layers' own head_dim and KV heads, k = v, KV sharing, per-layer inputs."""
        for name in ("enable_moe_block", "use_double_wide_mlp", "use_bidirectional_attention", "attention_bias"):
            if config.get(name):
                raise ValueError(
                    f"unsupported {source}: {name}={config[name]!r} (jcascade runs Gemma 4's dense text "
                    "model: no MoE block, no double-wide MLP, causal attention, no attention bias)"
                )
        _check_gelu_tanh(config, source)
        layers = required(config, "num_hidden_layers", source)
        get = lambda name, default, kind=int, least=1: optional(config, name, source, default, kind, least)
        names = list(
            _layer_names(
                config, source, ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]
            )
        )
        names[-1] = "full_attention"  # as transformers forces it
        _check_layer_types(names, {"full_attention": GLOBAL, "sliding_attention": SLIDING}, source)
        per_type = config.get("rope_parameters") or {}
        full = per_type.get("full_attention") or {
            "rope_type": "proportional",
            "partial_rotary_factor": 0.25,
            "rope_theta": 1e6,
        }
        local = per_type.get("sliding_attention") or {"rope_type": "default", "rope_theta": 1e4}
        for kind, params, supported in (
            ("full_attention", full, ("proportional", "default")),
            ("sliding_attention", local, ("default",)),
        ):
            if params.get("rope_type", "default") not in supported or params.get("factor", 1.0) != 1.0:
                raise ValueError(f"unsupported rope parameters {params!r} of the {kind} layers in {source}")
        full_overrides = [
            o for i, o in (config.get("per_layer_config") or {}).items() if names[int(i)] == "full_attention"
        ]
        global_head_dim = (full_overrides[0] if full_overrides else {}).get("head_dim", get("global_head_dim", 512))
        global_kv = (full_overrides[0] if full_overrides else {}).get(
            "num_key_value_heads", get("num_global_key_value_heads", None) if config.get("attention_k_eq_v") else None
        )
        per_layer = get("hidden_size_per_layer_input", 0, least=0)
        return cls._of(
            "gemma4",
            config,
            source,
            head_dim=256,
            positions=131072,
            tied=True,
            rotary=Rotary(
                required(full, "rope_theta", f"{source} (rope_parameters.full_attention)", float),
                local_theta=required(local, "rope_theta", f"{source} (rope_parameters.sliding_attention)", float),
                fraction=float(full.get("partial_rotary_factor", 1.0))
                if full.get("rope_type") == "proportional"
                else 1.0,
                proportional=True,
            ),
            attention=Attention(
                query_scale=1.0,
                global_head_dim=global_head_dim,
                global_kv_heads=global_kv,
                global_weights=True,
                k_eq_v=bool(config.get("attention_k_eq_v", False)),
            ),
            layer_types=tuple(SLIDING if n == "sliding_attention" else GLOBAL for n in names),
            sliding_window=get("sliding_window", 512),
            kv_shared_layers=get("num_kv_shared_layers", 0, least=0),
            per_layer_input_size=per_layer,
            per_layer_vocab_size=get("vocab_size_per_layer_input", required(config, "vocab_size", source))
            if per_layer
            else 0,
            final_logit_softcapping=get("final_logit_softcapping", None, float),
        )

    @classmethod
    def _olmo3(cls, config: dict[str, Any], source: str) -> ModelConfig:
        """OLMo 3's config (model_type olmo3): sliding and full layers by `layer_types` (default: every 4th full),
        a RoPE per layer type (llama3 scaling on the full ones), and the features of `FAMILY_FEATURES["olmo3"]`."""
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported {source}: hidden_act={config['hidden_act']!r} (supported: 'silu')")
        layers = required(config, "num_hidden_layers", source)
        names = _layer_names(
            config, source, ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(layers)]
        )
        _check_layer_types(names, {"full_attention": GLOBAL, "sliding_attention": SLIDING}, source)
        per_type = config.get("rope_parameters") or {}  # transformers 5: one entry per layer type
        theta = config.get("rope_theta", 500000.0)
        full = per_type.get("full_attention") or {"rope_theta": theta, **(config.get("rope_scaling") or {})}
        local = per_type.get("sliding_attention") or {"rope_theta": theta}
        where = f"{source} (rope_parameters.sliding_attention)"
        if local.get("rope_type", local.get("type", "default")) != "default":
            raise ValueError(
                f"unsupported rope scaling {local.get('rope_type', local.get('type'))!r} of the sliding layers in "
                f"{where} (supported: default)"
            )
        bias = bool(config.get("attention_bias", False))
        return cls._of(
            "olmo3",
            config,
            source,
            rotary=Rotary(
                required(full, "rope_theta", f"{source} (rope_parameters.full_attention)", float),
                _rope_scaling(full, f"{source} (rope_parameters.full_attention)"),
                local_theta=required(local, "rope_theta", where, float),
            ),
            attention=Attention(qkv_bias=bias, o_bias=bias),
            layer_types=tuple(SLIDING if n == "sliding_attention" else GLOBAL for n in names),
            sliding_window=optional(config, "sliding_window", source, 4096),
            eps=1e-5,
        )


def _check_gelu_tanh(config: dict[str, Any], source: str) -> None:
    if config.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ValueError(
            f"unsupported {source}: hidden_activation={config['hidden_activation']!r} (supported: gelu_pytorch_tanh)"
        )


def _rope_scaling(params: dict[str, Any] | None, where: str) -> Llama3Scaling | None:
    """The `Llama3Scaling` of rope parameters of `rope_type` "llama3", None for "default"; a ValueError for others
    (`where` names them)."""
    rope_type = (params or {}).get("rope_type", (params or {}).get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope scaling {rope_type!r} in config.json (supported: llama3)")
    return Llama3Scaling(
        **{
            name: required(params, name, where, kind)
            for name, kind in (
                ("factor", float),
                ("low_freq_factor", float),
                ("high_freq_factor", float),
                ("original_max_position_embeddings", int),
            )
        }
    )


def _nope_layers(config: dict[str, Any], source, layers: int) -> tuple[int, ...]:
    """SmolLM3's layers without rotary positions: those whose `no_rope_layers` flag is 0 (1: the layer rotates),
    else every `no_rope_layer_interval`-th (default 4)."""
    flags = config.get("no_rope_layers")
    if flags is None:
        interval = optional(config, "no_rope_layer_interval", source, 4)
        return tuple(i for i in range(layers) if (i + 1) % interval == 0)
    if (
        not isinstance(flags, list)
        or len(flags) < layers
        or any(f not in (0, 1) or isinstance(f, float) for f in flags)
    ):
        raise ValueError(
            f"{source}: field 'no_rope_layers' must be a list of a flag per layer ({layers}; 1: the layer uses "
            f"RoPE, 0: it does not), got {flags!r}"
        )
    return tuple(i for i in range(layers) if not flags[i])


def _eos(config: dict[str, Any]) -> tuple[int, ...]:
    eos = config.get("eos_token_id")
    return tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])


def _check_layer_types(names: list[str], known: dict[str, str], source: str) -> None:
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise ValueError(f"unsupported layer types {unknown} in {source} (supported: {', '.join(known)})")
