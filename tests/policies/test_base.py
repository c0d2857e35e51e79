"""Every policy's fields are checked at construction against their declared types (jcascade/policies/base.py's
`check_field`), the shared ones declared once by the bases; a `ScorerPolicy` is its score; policies are hashable,
immutable and static under jit."""

import dataclasses
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jcascade as jc
from jcascade.policies import policy_classes
from jcascade.policies.base import Positive


@pytest.mark.parametrize(
    "make,field",
    [
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
    ],
)
def test_invalid_policies_raise_value_error_naming_the_field(make, field):
    with pytest.raises(ValueError, match=field):
        make()


@pytest.mark.parametrize(
    "make,message",
    [
        (
            lambda: jc.Cascade(cache_size=8, num_cascades=31),
            "Cascade.num_cascades must be >= 1 (and at most 30), got 31",
        ),
        (lambda: jc.Cascade(cache_size=8, gamma="0.9"), "Cascade.gamma must be a number in (0, 1), got '0.9'"),
        (lambda: jc.Cascade(cache_size=8, gamma=True), "Cascade.gamma must be a number in (0, 1), got True"),
        (lambda: jc.Cascade(cache_size=True), "Cascade.cache_size must be an int, got True"),
        (
            lambda: jc.Cascade(cache_size=8, positions="rope"),
            "Cascade.positions must be one of ('cache', 'original'), got 'rope'",
        ),
        (lambda: jc.SnapKV(budget=64, kernel=4), "SnapKV.kernel must be odd, got 4"),
        (lambda: jc.PyramidKV(budget=1), "PyramidKV.budget must be >= 2 (and at most 2147483647), got 1"),
        (lambda: jc.Recycled(top_k=2, refresh_every=2, kernel=2), "Recycled.kernel must be odd, got 2"),
        (
            lambda: jc.Recycled(top_k=2, refresh_every=2, _branch="both"),
            "Recycled._branch must be one of ('full', 'recycled', None), got 'both'",
        ),
        (
            lambda: jc.ExpectedAttention(budget=8, covariance=1),
            "ExpectedAttention.covariance must be True or False, got 1",
        ),
        (
            lambda: jc.ExpectedAttention(budget=8, epsilon=-0.5),
            "ExpectedAttention.epsilon must be a number >= 0, got -0.5",
        ),
        (
            lambda: jc.KVzip(budget=8, instruction=(1, True)),
            "KVzip.instruction must be a tuple of token ids (ints >= 0), got (1, True)",
        ),
        (
            lambda: jc.AdaKV(jc.Full()),
            "AdaKV.scorer must be a jc.SnapKV or jc.PyramidKV, got Full(stride=4096, kv_dtype='model')",
        ),
        (lambda: jc.AdaKV(jc.SnapKV(budget=64), floor=1.5), "AdaKV.floor must be a number in [0, 1], got 1.5"),
        (
            lambda: jc.KNorm(budget=8, stride=2**31),
            "KNorm.stride must be >= 1 (and at most 2147483647), got 2147483648",
        ),
    ],
)
def test_a_field_of_the_wrong_type_or_out_of_its_rule_is_refused_naming_what_it_must_be(make, message):
    with pytest.raises(ValueError) as error:
        make()
    assert str(error.value) == message


def test_the_shared_fields_are_declared_once_and_stay_keyword_only():
    """stride, positions and head_reduction come from the bases (a policy may only give its own default), keyword-only
    in every policy, so that a policy's own first field stays positional (jc.Sink(1024), jc.AdaKV(snapkv))."""
    for cls in policy_classes().values():
        assert "stride" not in inspect.get_annotations(cls), cls
        fields = {f.name: f for f in dataclasses.fields(cls)}
        assert all(fields[name].kw_only for name in ("stride", "positions", "head_reduction") if name in fields), cls
    assert jc.Sink(1024) == jc.Sink(window=1024) and jc.KNorm(8) == jc.KNorm(budget=8)


@dataclasses.dataclass(frozen=True)
class Newest(jc.policies.ScorerPolicy):
    """A scorer outside the package: its score and a field. Keeps each head's `budget` newest prompt tokens, those of
    the first `oldest_too` positions besides."""

    oldest_too: Positive = 1

    def score(self, state):
        return jnp.where(state.pos < self.oldest_too, jnp.inf, state.pos.astype(jnp.float32))


def test_a_scorer_policy_is_its_score_function_plus_its_fields():
    policy = Newest(5, oldest_too=2, stride=4)
    assert policy.label == "Newest 5" and policy.needs_prompt and not policy.bounded
    with pytest.raises(ValueError, match="Newest.oldest_too must be >= 1"):
        Newest(5, oldest_too=0)
    lengths = jnp.asarray([9, 4], jnp.int32)
    state = jc.init_cache(policy, 2, 1, 2, max_tokens=9)
    state = jc.update(policy, state, jnp.ones((2, 9, 1, 2)), jnp.ones((2, 9, 1, 2)), None, lengths)
    state = jc.compress(policy, state, room=3)
    assert state.capacity == 5 + 3
    assert [[int(p) for p in row[0] if p >= 0] for row in np.asarray(state.pos)] == [[0, 1, 6, 7, 8], [0, 1, 2, 3]]


def test_policies_are_hashable_and_static_under_jit():
    policy = jc.Cascade(cache_size=8, sinks=2, num_cascades=2)
    assert hash(policy) == hash(jc.Cascade(cache_size=8, sinks=2, num_cascades=2))
    with pytest.raises(AttributeError):
        policy.gamma = 0.5
    f = jax.jit(lambda p, x: x * p.gamma, static_argnums=0)
    assert float(f(policy, jnp.float32(2.0))) == pytest.approx(2 * 0.9999)
