"""jcascade: long-context LLM inference in JAX with bounded KV memory (Cascading KV Cache and friends).

    import jcascade as jc
    policy = jc.Cascade(cache_size=16384, sinks=64, num_cascades=4)
    state = jc.init_cache(policy, batch=B, num_kv_heads=Hkv, head_dim=D, dtype=jnp.bfloat16)  # kernels=jc.Kernels(...)
    out, scores = jc.attend(policy, state, q, k, v, rope=jc.RoPE(500000.0))
    state = jc.update(policy, state, k, v, scores)

A new policy subclasses `jc.Policy` (see `jcascade.policies.base` and "Writing a policy" in docs/policies.md).
"""

import importlib.util

if importlib.util.find_spec("jcascade.pallas_kernels") is None:  # a source tree on sys.path, not installed
    raise ImportError(
        "jcascade is not installed: its models/ and pallas_kernels/ folders join the jcascade "
        "package at install time; run `pip install -e .` in the repository root"
    )

from jcascade.cache_api import attend, cache_occupancy, compress, init_cache, update
from jcascade.cache_state import CacheState, Scores, cached_kv, cached_positions, cached_scores, write_kv
from jcascade.checkpoint import load_stream, save_stream
from jcascade.compilation import COMPILER_OPTIONS
from jcascade.generation import generate, prefill, score
from jcascade.models import (
    CausalLM,
    ModelConfig,
    ModelState,
    load_pretrained,
    load_tokenizer,
    read_config,
    save_converted,
)
from jcascade.pallas_kernels import Kernels, Stored
from jcascade.policies import (
    H2O,
    TOVA,
    AdaKV,
    Cascade,
    ExpectedAttention,
    Full,
    KNorm,
    KVzip,
    Policy,
    PyramidKV,
    Recycled,
    RingPolicy,
    Sink,
    SlidingWindow,
    SnapKV,
)
from jcascade.rope import Llama3Scaling, RoPE
from jcascade.shared import SharedPrefix, attend_shared, merge_attention, share_prefix

__all__ = [
    "AdaKV",
    "COMPILER_OPTIONS",
    "CacheState",
    "CausalLM",
    "Cascade",
    "ExpectedAttention",
    "Full",
    "H2O",
    "KNorm",
    "KVzip",
    "Kernels",
    "Llama3Scaling",
    "ModelConfig",
    "ModelState",
    "Policy",
    "PyramidKV",
    "Recycled",
    "RingPolicy",
    "RoPE",
    "Scores",
    "SharedPrefix",
    "Sink",
    "SlidingWindow",
    "SnapKV",
    "Stored",
    "TOVA",
    "attend",
    "attend_shared",
    "cache_occupancy",
    "cached_kv",
    "cached_positions",
    "cached_scores",
    "compress",
    "generate",
    "init_cache",
    "load_pretrained",
    "read_config",
    "load_stream",
    "load_tokenizer",
    "merge_attention",
    "prefill",
    "save_converted",
    "save_stream",
    "score",
    "share_prefix",
    "update",
    "write_kv",
]
