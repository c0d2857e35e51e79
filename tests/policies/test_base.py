"""Every policy's fields are checked at construction (jcascade/policies/base.py's `check_int` and friends),
and policies are hashable, immutable and static under jit."""

import jax
import jax.numpy as jnp
import pytest

import jcascade as jc


@pytest.mark.parametrize("make,field", [
    (lambda: jc.Cascade(cache_size=10, num_cascades=4), "num_cascades"),
    (lambda: jc.Cascade(cache_size=0), "cache_size"),
    (lambda: jc.Cascade(cache_size=-8), "cache_size"),
    (lambda: jc.Cascade(cache_size=8, sinks=-1), "sinks"),
    (lambda: jc.Cascade(cache_size=8, num_cascades=0), "num_cascades"),
    (lambda: jc.Cascade(cache_size=8, gamma=1.0), "gamma"),
    (lambda: jc.Cascade(cache_size=8, gamma=0.0), "gamma"),
    (lambda: jc.Cascade(cache_size=8, gamma="0.9"), "gamma"),
    (lambda: jc.Cascade(cache_size=8, head_reduction="sum"), "head_reduction"),
    (lambda: jc.Cascade(cache_size=8, positions="rope"), "positions"),
    (lambda: jc.Cascade(cache_size=8, stride=0), "stride"),
    (lambda: jc.Cascade(cache_size=8.0), "cache_size"),
    (lambda: jc.Sink(window=0), "window"),
    (lambda: jc.Sink(window=8, sinks=-2), "sinks"),
    (lambda: jc.Sink(window=8, positions="absolute"), "positions"),
    (lambda: jc.SlidingWindow(window=-1), "window"),
    (lambda: jc.SlidingWindow(window=4, stride=0), "stride"),
    (lambda: jc.Full(stride=0), "stride"),
    (lambda: jc.H2O(heavy=0, recent=4), "heavy"),
    (lambda: jc.H2O(heavy=4, recent=0), "recent"),
    (lambda: jc.H2O(heavy=4, recent=4, head_reduction="sum"), "head_reduction"),
    (lambda: jc.H2O(heavy=4, recent=4, positions="abs"), "positions"),
])
def test_invalid_policies_raise_value_error_naming_the_field(make, field):
    with pytest.raises(ValueError, match=field):
        make()


def test_policies_are_hashable_and_static_under_jit():
    policy = jc.Cascade(cache_size=8, sinks=2, num_cascades=2)
    assert hash(policy) == hash(jc.Cascade(cache_size=8, sinks=2, num_cascades=2))
    with pytest.raises(AttributeError):
        policy.gamma = 0.5
    f = jax.jit(lambda p, x: x * p.gamma, static_argnums=0)
    assert float(f(policy, jnp.float32(2.0))) == pytest.approx(2 * 0.9999)
