"""jcascade: long-context LLM inference in JAX with bounded KV memory (Cascading KV Cache and friends).

    import jcascade as jc
    policy = jc.Cascade(cache_size=16384, sinks=64, num_cascades=4)
    state = jc.init_cache(policy, batch=B, num_kv_heads=Hkv, head_dim=D, dtype=jnp.bfloat16)
    out, scores = jc.attend(policy, state, q, k, v, rope=jc.RoPE(500000.0))
    state = jc.update(policy, state, k, v, scores)
"""

from jcascade.attention import attend
from jcascade.generation import generate, prefill, score
from jcascade.cache import (
    CacheState,
    Scores,
    cached_kv,
    cached_positions,
    cached_scores,
    init_cache,
    update,
)
from jcascade.policies import H2O, Cascade, Full, PyramidKV, Recycled, Sink, SlidingWindow, SnapKV
from jcascade.selection import compress
from jcascade.shared import SharedPrefix, attend_shared, merge_attention, share_prefix
from jcascade.models import CausalLM, ModelConfig, load_pretrained, load_tokenizer, save_converted
from jcascade.rope import Llama3Scaling, RoPE

__all__ = [
    "CacheState",
    "CausalLM",
    "Cascade",
    "Full",
    "H2O",
    "Llama3Scaling",
    "ModelConfig",
    "PyramidKV",
    "Recycled",
    "RoPE",
    "Scores",
    "SharedPrefix",
    "Sink",
    "SlidingWindow",
    "SnapKV",
    "attend",
    "attend_shared",
    "cached_kv",
    "cached_positions",
    "cached_scores",
    "compress",
    "generate",
    "init_cache",
    "load_pretrained",
    "load_tokenizer",
    "merge_attention",
    "prefill",
    "save_converted",
    "score",
    "share_prefix",
    "update",
]
