"""Model configuration: one frozen dataclass for the Llama, Mistral, Qwen2 and Qwen3 decoders, read from Hugging
Face `config.json` files or GGUF metadata."""

from __future__ import annotations

import dataclasses
from typing import Any

from jcascade.rope import Llama3Scaling, RoPE

ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                 "Qwen3ForCausalLM": "qwen3"}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "llama", "mistral", "qwen2" or "qwen3"
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
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's features of q and k, before the rotation
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

    @property
    def rope(self) -> RoPE:
        return RoPE(self.rope_theta, self.rope_scaling)

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> ModelConfig:
        """From a Hugging Face config.json dictionary (transformers 4 or 5 layout)."""
        names = config.get("architectures") or []
        known = [ARCHITECTURES[n] for n in names if n in ARCHITECTURES]
        if not known:
            raise ValueError(
                f"unsupported architecture {names or config.get('model_type')!r} in config.json; "
                f"jcascade supports {sorted(ARCHITECTURES)}"
            )
        arch = known[0]
        rope_params = dict(config.get("rope_parameters") or {})
        theta = config.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        scaling = config.get("rope_scaling") or rope_params or None
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if rope_type == "llama3":
            scaling = Llama3Scaling(
                factor=float(scaling["factor"]),
                low_freq_factor=float(scaling["low_freq_factor"]),
                high_freq_factor=float(scaling["high_freq_factor"]),
                original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
            )
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
        heads = config["num_attention_heads"]
        attention_bias = bool(config.get("attention_bias", False))
        eos = config.get("eos_token_id")
        return cls(
            architecture=arch,
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
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
