"""jcascade: long-context LLM inference in JAX with bounded KV memory (Cascading KV Cache and friends).

    import jcascade as jc
    policy = jc.Cascade(cache_size=16384, sinks=64, num_cascades=4)
    state = jc.init_cache(policy, batch=B, num_kv_heads=Hkv, head_dim=D, dtype=jnp.bfloat16)
    out, scores = jc.attend(policy, state, q, k, v, rope=jc.RoPE(500000.0))
    state = jc.update(policy, state, k, v, scores)
"""

from jcascade.attention import attend
from jcascade.cache import (
    CacheState,
    Scores,
    cached_kv,
    cached_positions,
    cached_scores,
    init_cache,
    update,
)
from jcascade.policies import Cascade, Full, Sink, SlidingWindow
from jcascade.rope import Llama3Scaling, RoPE

__all__ = [
    "CacheState",
    "Cascade",
    "Full",
    "Llama3Scaling",
    "RoPE",
    "Scores",
    "Sink",
    "SlidingWindow",
    "attend",
    "cached_kv",
    "cached_positions",
    "cached_scores",
    "init_cache",
    "update",
]
