"""Long streams: constant memory, one compilation, finite log-probabilities, and a clear error before the
int32 token clock would wrap."""

import dataclasses
import importlib.util
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

import jcascade as jc
from jcascade.eval import perplexity

spec = importlib.util.spec_from_file_location(
    "endless_stream", pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "endless_stream.py"
)
endless_stream = importlib.util.module_from_spec(spec)
spec.loader.exec_module(endless_stream)


@pytest.mark.slow
def test_a_100k_token_stream_runs_at_constant_memory():
    r = endless_stream.run(100_000, jc.Cascade(cache_size=256, sinks=4, stride=512))
    assert r["compilations"] == 1 and r["non_finite"] == 0
    assert abs(r["rss_growth"]) <= 0.05, r["rss_mib"]
    assert max(r["live_arrays"]) == min(r["live_arrays"]), r["live_arrays"]


def test_the_token_clock_refuses_to_wrap():
    policy = jc.Cascade(cache_size=8, sinks=2, num_cascades=2, stride=4)
    state = jc.init_cache(policy, batch=2, num_kv_heads=1, head_dim=4)
    state = dataclasses.replace(state, seen=jnp.array([10, jc.checks.CLOCK_LIMIT - 3], jnp.int32))
    k = jnp.ones((2, 4, 1, 4))
    scores = jc.Scores(cache=jnp.zeros((2, 1, 10)), chunk=jnp.zeros((2, 1, 4)))
    jc.update(policy, state, k, k, scores, lengths=jnp.array([4, 3]))  # exactly reaches the limit
    with pytest.raises(ValueError, match=r"rows \[1\] would receive more than 2147483647 tokens"):
        jc.update(policy, state, k, k, scores)
    with pytest.raises(ValueError, match="longer than the int32 token clock"):
        perplexity.stream(None, policy, np.broadcast_to(np.int32(0), (jc.checks.CLOCK_LIMIT + 1,)))


def test_a_full_cache_overflowing_under_jit_is_nan_or_a_checkify_error():
    """Unchecked, the overflowed row's attention is NaN (the other rows are untouched); under checkify the
    same jitted step reports the row and how many tokens it would hold."""
    import jax
    from jax.experimental import checkify

    policy = jc.Full(stride=8)
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 6, 1, 4)), jnp.float32) for _ in range(3))

    @jax.jit
    def two_chunks(q, k, v, lengths):
        state = jc.init_cache(policy, batch=2, num_kv_heads=1, head_dim=4, max_tokens=8)
        state = jc.update(policy, state, k, v, None, lengths)
        state = jc.update(policy, state, k, v, None, lengths)
        return jc.attend(policy, state, q, k, v, lengths)[0]

    lengths = jnp.array([3, 6])  # row 0 holds 6 tokens after two chunks, row 1 would hold 12 of 8
    out = np.asarray(two_chunks(q, k, v, lengths))
    assert np.isnan(out[1]).all() and np.isfinite(out[0]).all()
    error, _ = checkify.checkify(two_chunks)(q, k, v, lengths)
    with pytest.raises(checkify.JaxRuntimeError, match="Full cache of 8 slots overflows: row 1 would hold 12 tokens"):
        error.throw()
    error, _ = checkify.checkify(two_chunks)(q, k, v, jnp.array([3, 4]))
    error.throw()  # no overflow: no error
