"""Long streams: constant memory, one compilation, finite log-probabilities, and a clear error before the
int32 token clock would wrap."""

import importlib.util
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

import jcascade as jc
from jcascade import perplexity

spec = importlib.util.spec_from_file_location(
    "endless_stream", pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "endless_stream.py")
endless_stream = importlib.util.module_from_spec(spec)
spec.loader.exec_module(endless_stream)


@pytest.mark.slow
def test_a_200k_token_stream_runs_at_constant_memory():
    r = endless_stream.run(200_000, jc.Cascade(cache_size=256, sinks=4, stride=512))
    assert r["compilations"] == 1 and r["non_finite"] == 0
    assert abs(r["rss_growth"]) <= 0.05, r["rss_mib"]
    assert max(r["live_arrays"]) == min(r["live_arrays"]), r["live_arrays"]


def test_the_token_clock_refuses_to_wrap():
    policy = jc.Cascade(cache_size=8, sinks=2, num_cascades=2, stride=4)
    state = jc.init_cache(policy, batch=2, num_kv_heads=1, head_dim=4)
    state = jc.CacheState(k=state.k, v=state.v, score=state.score, pos=state.pos,
                          seen=jnp.array([10, jc.cache.CLOCK_LIMIT - 3], jnp.int32))
    k = jnp.ones((2, 4, 1, 4))
    scores = jc.Scores(cache=jnp.zeros((2, 1, 10)), chunk=jnp.zeros((2, 1, 4)))
    jc.update(policy, state, k, k, scores, lengths=jnp.array([4, 3]))  # exactly reaches the limit
    with pytest.raises(ValueError, match=r"rows \[1\] would receive more than 2147483647 tokens"):
        jc.update(policy, state, k, k, scores)
    with pytest.raises(ValueError, match="longer than the int32 token clock"):
        perplexity.stream(None, policy, np.broadcast_to(np.int32(0), (jc.cache.CLOCK_LIMIT + 1,)))
