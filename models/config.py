"""Model configuration: one frozen dataclass for the Llama, Mistral, Qwen2, Qwen3, Qwen3.5, Gemma 3, Gemma 4,
SmolLM3 and OLMo 3 decoders, read from Hugging Face `config.json` files or GGUF metadata."""

from __future__ import annotations

import dataclasses
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
class FamilyFeatures:
    """What a family fixes in every model of it (`ModelConfig.features`; the decoder and the weight declarations test
    these, never a name). The defaults are Llama's."""

    pre_norms: bool = True  # an RMSNorm before the attention and before the MLP
    post_norms: bool = False  # an RMSNorm after the attention and after the MLP, before each residual add
    norm_plus_one: bool = False  # norms scale by (1 + w), not w
    norm_scale_f32: bool = False  # norms multiply by their weight in float32, then cast back
    embed_scaled: bool = False  # embeddings scaled by sqrt(hidden_size)
    activation: str = "silu"  # the MLP's gate activation: "silu" or "gelu_tanh"
    qk_norm_full: bool = False  # q and k norms (`ModelConfig.qk_norm`) over all heads' features, not each head's
    value_norm: bool = False  # values RMS-normed (no weight)
    rope_proportional: bool = False  # a partial RoPE turns the first frequencies of a RoPE of the whole head (else
    # the first dims turn as a RoPE of their width; `ModelConfig.rope`)
    global_attention_weights: bool = False  # the global layers' attention weights apart from the sliding ones' (of
    # their own head_dim and KV heads); k and v only on the layers that keep a cache
    layer_scalar: bool = False  # each layer's output scaled by a learned scalar


# Each family's features (`FamilyFeatures`), where they are not Llama's.
FAMILY_FEATURES = {
    "gemma3": FamilyFeatures(
        post_norms=True, norm_plus_one=True, norm_scale_f32=True, embed_scaled=True, activation="gelu_tanh"
    ),
    "gemma4": FamilyFeatures(
        post_norms=True,
        norm_scale_f32=True,
        embed_scaled=True,
        activation="gelu_tanh",
        value_norm=True,
        rope_proportional=True,
        global_attention_weights=True,
        layer_scalar=True,
    ),
    "qwen3_5": FamilyFeatures(norm_plus_one=True),
    "olmo3": FamilyFeatures(pre_norms=False, post_norms=True, norm_scale_f32=True, qk_norm_full=True),
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
    architecture: str  # the family (a value of ARCHITECTURES): its `features`
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rope_scaling: Llama3Scaling | None
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2 always; Llama and Qwen3 with attention_bias
    o_bias: bool  # Llama and Qwen3 with attention_bias
    max_position_embeddings: int
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each head's features of q and k, before the rotation
    layer_types: tuple[str, ...] = ()  # GLOBAL, SLIDING or LINEAR per layer; () for all global
    sliding_window: int | None = None  # the tokens a sliding layer's query sees, itself included
    rope_local_theta: float | None = None  # RoPE base of the sliding layers
    query_scale: float | None = None  # attention scale (Gemma 3: query_pre_attn_scalar ** -0.5); None: head_dim ** -0.5
    partial_rotary_factor: float = 1.0  # the share of a global layer's head dims that rotate (Qwen3.5, Gemma 4)
    nope_layers: tuple[int, ...] = ()  # global layers whose attention rotates neither q nor k (SmolLM3)
    # Qwen3.5: a sigmoid gate on the attention output; its Gated DeltaNet layers' heads, head dims and kernel
    attention_output_gate: bool = False
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    linear_conv_kernel: int = 0
    # Gemma 4: the global layers' head_dim and KV heads (None: as the sliding ones), keys reused as values on the
    # global layers, the last layers reading the caches of earlier ones, per-layer input embeddings of this width
    global_head_dim: int | None = None
    global_kv_heads: int | None = None
    k_eq_v: bool = False
    kv_shared_layers: int = 0
    per_layer_input_size: int = 0
    per_layer_vocab_size: int = 0
    final_logit_softcapping: float | None = None
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
        if (
            LINEAR in self.layer_types
            and min(
                self.linear_key_heads,
                self.linear_value_heads,
                self.linear_key_dim,
                self.linear_value_dim,
                self.linear_conv_kernel,
            )
            < 1
        ):
            raise ValueError(
                "linear layers need positive ModelConfig.linear_key_heads, linear_value_heads, "
                "linear_key_dim, linear_value_dim and linear_conv_kernel"
            )
        if any(
            isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.num_layers or self.types[i] != GLOBAL
            for i in self.nope_layers
        ) or list(self.nope_layers) != sorted(set(self.nope_layers)):
            raise ValueError(
                f"ModelConfig.nope_layers must be increasing indices of global layers (of {self.num_layers}), got "
                f"{self.nope_layers!r}"
            )
        if LINEAR in self.layer_types and self.linear_value_heads % self.linear_key_heads:
            raise ValueError(
                f"linear_value_heads ({self.linear_value_heads}) must be a multiple of linear_key_heads "
                f"({self.linear_key_heads})"
            )
        if not 0 < self.partial_rotary_factor <= 1:
            raise ValueError(f"ModelConfig.partial_rotary_factor must lie in (0, 1], got {self.partial_rotary_factor}")
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
            isinstance(self.sliding_window, int) and self.sliding_window >= 2 and self.rope_local_theta
        ):
            raise ValueError(
                "sliding layers need ModelConfig.sliding_window (an int >= 2) and rope_local_theta, got "
                f"{self.sliding_window!r} and {self.rope_local_theta!r}"
            )

    @property
    def features(self) -> FamilyFeatures:
        """What the family fixes (`FAMILY_FEATURES`; Llama's where it names none)."""
        return FAMILY_FEATURES.get(self.architecture, FamilyFeatures())

    @property
    def types(self) -> tuple[str, ...]:
        """Every layer's type (GLOBAL for all when `layer_types` is empty)."""
        return self.layer_types or (GLOBAL,) * self.num_layers

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.types) if t == SLIDING)

    @property
    def state_types(self) -> tuple[str, ...]:
        """The layer types with a state, in the order of a model's cache tuple: GLOBAL (the policy's KV cache)
        first, then SLIDING (a window cache), then LINEAR (recurrent states)."""
        return tuple(t for t in (GLOBAL, SLIDING, LINEAR) if t in self.types)

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
        return self.global_kv_heads or self.num_kv_heads if layer_type == GLOBAL else self.num_kv_heads

    def head_size(self, layer_type: str) -> int:
        return self.global_head_dim or self.head_dim if layer_type == GLOBAL else self.head_dim

    @property
    def local_rope(self) -> RoPE:
        return RoPE(self.rope_local_theta)

    @property
    def rope(self) -> RoPE:
        """The global layers' RoPE (`nope_layers` rotate nothing). Partial: the first `partial_rotary_factor` of the
        head dims rotate as a RoPE of that width (the decoder moves them into rotate-half pairs, `_rotary_order`);
        with `features.rope_proportional`, that share of the head's frequencies, the rest 0."""
        if self.partial_rotary_factor == 1:
            return RoPE(self.rope_theta, self.rope_scaling)
        head_dim = self.head_size(GLOBAL)
        if self.features.rope_proportional:
            return RoPE(
                self.rope_theta,
                self.rope_scaling,
                rotary_dim=2 * int(self.partial_rotary_factor * head_dim // 2),
                proportional=True,
            )
        return RoPE(self.rope_theta, self.rope_scaling, rotary_dim=int(head_dim * self.partial_rotary_factor))

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
        field = lambda name, kind=int: required(config, name, source, kind)
        if arch == "gemma3":
            return cls._gemma3(config, field, source)
        if arch == "gemma4":
            return cls._gemma4(config, field, source)
        if arch == "qwen3_5":
            return cls._qwen3_5(config, field, source)
        if arch == "olmo3":
            return cls._olmo3(config, field, source)
        smollm3 = arch == "smollm3"  # Llama's layers, some without rotary positions (`_nope_layers`)
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
        layers, heads = field("num_hidden_layers"), field("num_attention_heads")
        attention_bias = bool(config.get("attention_bias", False))
        eos = config.get("eos_token_id")
        return cls(
            architecture=arch,
            vocab_size=field("vocab_size"),
            hidden_size=field("hidden_size"),
            intermediate_size=field("intermediate_size"),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or field("hidden_size") // heads,
            rope_theta=float(theta),
            rope_scaling=scaling,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", smollm3)),
            qkv_bias=arch == "qwen2" or attention_bias,
            o_bias=arch != "qwen2" and attention_bias,
            max_position_embeddings=positions,
            qk_norm=arch == "qwen3",
            nope_layers=_nope_layers(config, source, layers) if smollm3 else (),
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
        )

    @classmethod
    def _gemma3(cls, config: dict[str, Any], field, source: str) -> ModelConfig:
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
        if config.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise ValueError(
                f"unsupported config.json: hidden_activation={config['hidden_activation']!r} "
                "(supported: gelu_pytorch_tanh)"
            )
        layers, heads = field("num_hidden_layers"), field("num_attention_heads")
        pattern = config.get("sliding_window_pattern", 6)
        names = config.get("layer_types") or [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)
        ]
        unknown = sorted(set(names) - {"sliding_attention", "full_attention"})
        if unknown:
            raise ValueError(
                f"unsupported layer types {unknown} in config.json (supported: sliding_attention, full_attention)"
            )
        eos = config.get("eos_token_id")
        return cls(
            architecture="gemma3",
            vocab_size=field("vocab_size"),
            hidden_size=field("hidden_size"),
            intermediate_size=field("intermediate_size"),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or field("hidden_size") // heads,
            rope_theta=required(full, "rope_theta", f"{source} (rope_parameters.full_attention)", float),
            rope_scaling=None,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
            qkv_bias=bool(config.get("attention_bias", False)),
            o_bias=bool(config.get("attention_bias", False)),
            max_position_embeddings=config.get("max_position_embeddings", 131072),
            qk_norm=True,
            layer_types=tuple(SLIDING if n == "sliding_attention" else GLOBAL for n in names),
            sliding_window=config.get("sliding_window", 4096),
            rope_local_theta=required(local, "rope_theta", f"{source} (rope_parameters.sliding_attention)", float),
            query_scale=float(config.get("query_pre_attn_scalar", 256)) ** -0.5,
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
        )

    @classmethod
    def _qwen3_5(cls, config: dict[str, Any], field, source: str) -> ModelConfig:
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
        layers, heads = field("num_hidden_layers"), field("num_attention_heads")
        get = lambda name, default, kind=int, least=1: optional(config, name, source, default, kind, least)
        interval = get("full_attention_interval", 4)
        names = _layer_names(
            config, source, ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
        )
        _check_layer_types(names, {"full_attention": GLOBAL, "linear_attention": LINEAR}, source)
        return cls(
            architecture="qwen3_5",
            vocab_size=field("vocab_size"),
            hidden_size=field("hidden_size"),
            intermediate_size=field("intermediate_size"),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=get("num_key_value_heads", heads),
            head_dim=get("head_dim", 256),
            rope_theta=required(rope, "rope_theta", f"{source} (rope_parameters)", float),
            rope_scaling=None,
            partial_rotary_factor=required(rope, "partial_rotary_factor", f"{source} (rope_parameters)", float),
            rms_norm_eps=get("rms_norm_eps", 1e-6, float),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=False,
            o_bias=False,
            max_position_embeddings=get("max_position_embeddings", 32768),
            qk_norm=True,
            layer_types=tuple(GLOBAL if n == "full_attention" else LINEAR for n in names),
            attention_output_gate=True,
            linear_key_heads=get("linear_num_key_heads", 16),
            linear_value_heads=get("linear_num_value_heads", 32),
            linear_key_dim=get("linear_key_head_dim", 128),
            linear_value_dim=get("linear_value_head_dim", 128),
            linear_conv_kernel=get("linear_conv_kernel_dim", 4),
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=_eos(config),
        )

    @classmethod
    def _gemma4(cls, config: dict[str, Any], field, source: str) -> ModelConfig:
        """Gemma 4's text config (model_type gemma4_text), dense: sliding and full layers by `layer_types` (the
        last always full), the full layers' own head_dim and KV heads, k = v, KV sharing, per-layer inputs."""
        for name in ("enable_moe_block", "use_double_wide_mlp", "use_bidirectional_attention", "attention_bias"):
            if config.get(name):
                raise ValueError(
                    f"unsupported {source}: {name}={config[name]!r} (jcascade runs Gemma 4's dense text "
                    "model: no MoE block, no double-wide MLP, causal attention, no attention bias)"
                )
        if config.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise ValueError(
                f"unsupported {source}: hidden_activation={config['hidden_activation']!r} "
                "(supported: gelu_pytorch_tanh)"
            )
        layers, heads = field("num_hidden_layers"), field("num_attention_heads")
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
        return cls(
            architecture="gemma4",
            vocab_size=field("vocab_size"),
            hidden_size=field("hidden_size"),
            intermediate_size=field("intermediate_size"),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=get("num_key_value_heads", heads),
            head_dim=get("head_dim", 256),
            rope_theta=required(full, "rope_theta", f"{source} (rope_parameters.full_attention)", float),
            rope_scaling=None,
            partial_rotary_factor=float(full.get("partial_rotary_factor", 1.0))
            if full.get("rope_type") == "proportional"
            else 1.0,
            rms_norm_eps=get("rms_norm_eps", 1e-6, float),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
            qkv_bias=False,
            o_bias=False,
            max_position_embeddings=get("max_position_embeddings", 131072),
            qk_norm=True,
            layer_types=tuple(SLIDING if n == "sliding_attention" else GLOBAL for n in names),
            sliding_window=get("sliding_window", 512),
            rope_local_theta=required(local, "rope_theta", f"{source} (rope_parameters.sliding_attention)", float),
            query_scale=1.0,
            global_head_dim=global_head_dim,
            global_kv_heads=global_kv,
            k_eq_v=bool(config.get("attention_k_eq_v", False)),
            kv_shared_layers=get("num_kv_shared_layers", 0, least=0),
            per_layer_input_size=per_layer,
            per_layer_vocab_size=get("vocab_size_per_layer_input", field("vocab_size")) if per_layer else 0,
            final_logit_softcapping=get("final_logit_softcapping", None, float),
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=_eos(config),
        )

    @classmethod
    def _olmo3(cls, config: dict[str, Any], field, source: str) -> ModelConfig:
        """OLMo 3's config (model_type olmo3): sliding and full layers by `layer_types` (default: every 4th full),
        a RoPE per layer type (llama3 scaling on the full ones), and the features of `FAMILY_FEATURES["olmo3"]`."""
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported {source}: hidden_act={config['hidden_act']!r} (supported: 'silu')")
        layers, heads = field("num_hidden_layers"), field("num_attention_heads")
        get = lambda name, default, kind=int, least=1: optional(config, name, source, default, kind, least)
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
        attention_bias = bool(config.get("attention_bias", False))
        return cls(
            architecture="olmo3",
            vocab_size=field("vocab_size"),
            hidden_size=field("hidden_size"),
            intermediate_size=field("intermediate_size"),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=get("num_key_value_heads", heads),
            head_dim=get("head_dim", field("hidden_size") // heads),
            rope_theta=required(full, "rope_theta", f"{source} (rope_parameters.full_attention)", float),
            rope_scaling=_rope_scaling(full, f"{source} (rope_parameters.full_attention)"),
            rms_norm_eps=get("rms_norm_eps", 1e-5, float),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            max_position_embeddings=get("max_position_embeddings", 2048),
            qk_norm=True,
            layer_types=tuple(SLIDING if n == "sliding_attention" else GLOBAL for n in names),
            sliding_window=get("sliding_window", 4096),
            rope_local_theta=required(local, "rope_theta", where, float),
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=_eos(config),
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
