"""Flax models of every family in `config.ARCHITECTURES` (docs/models.md) and weight loading (installed as
`jcascade.models`)."""

from jcascade.models.config import ModelConfig
from jcascade.models.decoder import CausalLM, shard
from jcascade.models.loading import load_pretrained, load_tokenizer, read_config, save_converted
from jcascade.models.packaged import GEMMA3_270M, QWEN25_CODER_05B_INSTRUCT, SMOLLM2_135M_INSTRUCT, PackagedModel, fetch
from jcascade.models.state import ModelState

__all__ = [
    "GEMMA3_270M",
    "QWEN25_CODER_05B_INSTRUCT",
    "SMOLLM2_135M_INSTRUCT",
    "CausalLM",
    "ModelConfig",
    "ModelState",
    "PackagedModel",
    "fetch",
    "load_pretrained",
    "read_config",
    "load_tokenizer",
    "save_converted",
    "shard",
]
