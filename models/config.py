"""Model configuration: one frozen dataclass for the Llama, Mistral, Qwen2, Qwen3 and Gemma 3 decoders, read from
Hugging Face `config.json` files or GGUF metadata."""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

from jcascade.rope import Llama3Scaling, RoPE

ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                 "Qwen3ForCausalLM": "qwen3", "Gemma3ForCausalLM": "gemma3"}
SLIDING, GLOBAL = "sliding", "global"  # layer types


def required(fields: dict[str, Any], name: str, source, kind: type = int):
    """fields[name] as `kind`: an int > 0 (int), a finite number (float) or a str; a ValueError naming the field
    and `source` (the file) when it is missing, null or of another kind."""
    value = fields.get(name)
    if value is None:
        raise ValueError(f"{source}: the required field {name!r} is missing")
    if kind is int:
        ok = isinstance(value, numbers.Integral) and not isinstance(value, bool) and value > 0
    elif kind is float:
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    else:
        ok = isinstance(value, kind)
    if not ok:
        wanted = {int: "a positive int", float: "a finite number"}.get(kind, kind.__name__)
        raise ValueError(f"{source}: field {name!r} must be {wanted}, got {value!r}")
    return kind(value)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "llama", "mistral", "qwen2", "qwen3" or "gemma3"
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
    layer_types: tuple[str, ...] = ()  # Gemma 3: SLIDING or GLOBAL per layer; () for all global
    sliding_window: int | None = None  # the tokens a sliding layer's query sees, itself included
    rope_local_theta: float | None = None  # RoPE base of the sliding layers
    query_scale: float | None = None  # attention scale (Gemma 3: query_pre_attn_scalar ** -0.5); None: head_dim ** -0.5
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES.values():
            raise ValueError(f"architecture must be one of {sorted(ARCHITECTURES.values())}, got {self.architecture!r}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.layer_types and (len(self.layer_types) != self.num_layers or set(self.layer_types) - {SLIDING, GLOBAL}):
            raise ValueError(f"ModelConfig.layer_types must name {SLIDING!r} or {GLOBAL!r} for each of the "
                             f"{self.num_layers} layers, got {self.layer_types!r}")
        if SLIDING in self.layer_types and not (isinstance(self.sliding_window, int) and self.sliding_window >= 2
                                                  and self.rope_local_theta):
            raise ValueError("sliding layers need ModelConfig.sliding_window (an int >= 2) and rope_local_theta, got "
                             f"{self.sliding_window!r} and {self.rope_local_theta!r}")

    @property
    def gemma(self) -> bool:
        """Gemma's layer: embeddings scaled by sqrt(hidden), (1 + w) norms, norms after attention and MLP too,
        a GeLU-tanh MLP."""
        return self.architecture == "gemma3"

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == SLIDING)

    @property
    def local_rope(self) -> RoPE:
        return RoPE(self.rope_local_theta)

    @property
    def rope(self) -> RoPE:
        return RoPE(self.rope_theta, self.rope_scaling)

    @classmethod
    def from_hf(cls, config: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """From a Hugging Face config.json dictionary (transformers 4 or 5 layout); `source` (the file) is named
        in the error for a required field that is missing or of the wrong kind."""
        names = config.get("architectures") or []
        known = [ARCHITECTURES[n] for n in names if n in ARCHITECTURES]
        if not known:
            raise ValueError(
                f"unsupported architecture {names or config.get('model_type')!r} in config.json; "
                f"jcascade supports {sorted(ARCHITECTURES)}"
            )
        arch = known[0]
        field = lambda name, kind=int: required(config, name, source, kind)  # noqa: E731
        if arch == "gemma3":
            return cls._gemma3(config, field, source)
        rope_params = dict(config.get("rope_parameters") or {})
        theta = config.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        scaling = config.get("rope_scaling") or rope_params or None
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if rope_type == "llama3":
            where = f"{source} ({'rope_scaling' if config.get('rope_scaling') else 'rope_parameters'})"
            scaling = Llama3Scaling(**{name: required(scaling, name, where, kind) for name, kind in (
                ("factor", float), ("low_freq_factor", float), ("high_freq_factor", float),
                ("original_max_position_embeddings", int))})
        elif rope_type == "default":
            scaling = None
        else:
            raise ValueError(f"unsupported rope scaling {rope_type!r} in config.json (supported: llama3)")
        if config.get("mlp_bias"):
            raise ValueError("unsupported config.json: mlp_bias=true")
        if config.get("use_sliding_window"):
            raise ValueError("unsupported config.json: use_sliding_window=true")
        window, positions = config.get("sliding_window"), config.get("max_position_embeddings", 2048)
        if arch == "mistral" and window is not None and window < positions:
            raise ValueError(f"unsupported config.json: sliding_window={window} < max_position_embeddings={positions} "
                             "(Mistral's sliding-window attention is not implemented; models with "
                             "sliding_window null, such as Mistral-7B v0.2 and later, load)")
        heads = field("num_attention_heads")
        attention_bias = bool(config.get("attention_bias", False))
        eos = config.get("eos_token_id")
        return cls(
            architecture=arch,
            vocab_size=field("vocab_size"),
            hidden_size=field("hidden_size"),
            intermediate_size=field("intermediate_size"),
            num_layers=field("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or field("hidden_size") // heads,
            rope_theta=float(theta),
            rope_scaling=scaling,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2" or attention_bias,
            o_bias=arch != "qwen2" and attention_bias,
            max_position_embeddings=positions,
            qk_norm=arch == "qwen3",
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
        )

    @classmethod
    def _gemma3(cls, config: dict[str, Any], field, source: str) -> ModelConfig:
        """Gemma 3's text config (model_type gemma3_text): sliding and global layers by `layer_types`."""
        per_type = config.get("rope_parameters") or {}  # transformers 5: one entry per layer type
        full = per_type.get("full_attention") or {"rope_theta": config.get("rope_theta", 1e6),
                                                  **(config.get("rope_scaling") or {})}
        local = per_type.get("sliding_attention") or {"rope_theta": config.get("rope_local_base_freq", 1e4)}
        for kind, params in (("full_attention", full), ("sliding_attention", local)):
            if params.get("rope_type", params.get("type", "default")) != "default":
                raise ValueError(f"unsupported rope scaling {params.get('rope_type', params.get('type'))!r} of the "
                                 f"{kind} layers in config.json (supported for Gemma 3: default)")
        for name in ("final_logit_softcapping", "attn_logit_softcapping"):
            if config.get(name) is not None:
                raise ValueError(f"unsupported config.json: {name}={config[name]} (Gemma 3 has none)")
        if config.get("use_bidirectional_attention"):
            raise ValueError("unsupported config.json: use_bidirectional_attention=true")
        if config.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise ValueError(f"unsupported config.json: hidden_activation={config['hidden_activation']!r} "
                             "(supported: gelu_pytorch_tanh)")
        layers, heads = field("num_hidden_layers"), field("num_attention_heads")
        pattern = config.get("sliding_window_pattern", 6)
        names = config.get("layer_types") or ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                                              for i in range(layers)]
        unknown = sorted(set(names) - {"sliding_attention", "full_attention"})
        if unknown:
            raise ValueError(f"unsupported layer types {unknown} in config.json (supported: sliding_attention, "
                             "full_attention)")
        eos = config.get("eos_token_id")
        return cls(
            architecture="gemma3", vocab_size=field("vocab_size"), hidden_size=field("hidden_size"),
            intermediate_size=field("intermediate_size"), num_layers=layers, num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or field("hidden_size") // heads,
            rope_theta=required(full, "rope_theta", f"{source} (rope_parameters.full_attention)", float),
            rope_scaling=None, rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
            qkv_bias=bool(config.get("attention_bias", False)), o_bias=bool(config.get("attention_bias", False)),
            max_position_embeddings=config.get("max_position_embeddings", 131072), qk_norm=True,
            layer_types=tuple(SLIDING if n == "sliding_attention" else GLOBAL for n in names),
            sliding_window=config.get("sliding_window", 4096),
            rope_local_theta=required(local, "rope_theta", f"{source} (rope_parameters.sliding_attention)", float),
            query_scale=float(config.get("query_pre_attn_scalar", 256)) ** -0.5,
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
        )
