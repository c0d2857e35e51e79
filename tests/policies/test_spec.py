"""Policy specs (jcascade.policies.spec): spec(policy) and parse_policy(text) name every registered policy both
ways, nested policies and token ids included, and every concrete policy class is registered."""

import dataclasses
import importlib
import inspect
import pathlib
import pkgutil
import re
import typing

import jax.numpy as jnp
import pytest
from hypothesis import given, reject
from hypothesis import strategies as st

import jcascade as jc
from jcascade.policies import Policy, parse_policy, policy_classes, spec

# every registered policy with every public field away from its default (checked below)
NON_DEFAULT = {
    "full": dict(stride=96, kv_dtype="int8"),
    "slidingwindow": dict(window=12, positions="original", stride=33, kv_dtype="float8_e4m3fn"),
    "sink": dict(window=12, sinks=3, positions="original", stride=7, kv_dtype="int8"),
    "cascade": dict(
        cache_size=24,
        sinks=5,
        num_cascades=3,
        gamma=0.1 + 0.2,
        head_reduction="mean",
        positions="original",
        stride=17,
        kv_dtype="float8_e4m3fn",
    ),
    "h2o": dict(heavy=3, recent=5, head_reduction="max", positions="original", stride=9, kv_dtype="int8"),
    "tova": dict(cache_size=6, head_reduction="max", positions="cache", stride=11, kv_dtype="float8_e4m3fn"),
    "snapkv": dict(
        budget=40,
        window=5,
        kernel=3,
        pooling="avg",
        head_reduction="max",
        positions="cache",
        stride=13,
        kv_dtype="int8",
    ),
    "pyramidkv": dict(
        budget=30,
        window=4,
        beta=7,
        kernel=5,
        pooling="avg",
        head_reduction="max",
        positions="cache",
        stride=19,
        kv_dtype="float8_e4m3fn",
    ),
    "adakv": dict(
        scorer=jc.PyramidKV(
            budget=30, window=4, beta=7, kernel=5, pooling="avg", head_reduction="max", stride=19, kv_dtype="int8"
        ),
        floor=1 / 3,
    ),
    "knorm": dict(budget=5, positions="cache", stride=21, kv_dtype="float8_e4m3fn"),
    "expectedattention": dict(
        budget=9,
        window=3,
        future=100,
        sinks=2,
        covariance=False,
        value_norm=False,
        epsilon=1e-7,
        stride=23,
        kv_dtype="int8",
    ),
    "kvzip": dict(
        budget=7,
        instruction=(1, 22, 333),
        continuation=(0,),
        turn=(4, 5),
        chunk=64,
        overlap=3,
        sinks=2,
        skip=6,
        allocation="global",
        stride=29,
        kv_dtype="float8_e4m3fn",
    ),
    "recycled": dict(top_k=3, refresh_every=5, kernel=3, positions="cache", stride=31, kv_dtype="int8"),
}


def public_fields(cls) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if not f.name.startswith("_")]


def test_every_concrete_policy_class_is_registered():
    """A public policy class of any jcascade.policies module that policy_classes() misses could not be named."""
    import jcascade.policies

    for module in pkgutil.iter_modules(jcascade.policies.__path__):
        importlib.import_module(f"jcascade.policies.{module.name}")
    found, todo = set(), [Policy]
    while todo:
        for sub in todo.pop().__subclasses__():
            todo.append(sub)
            if (
                sub.__module__.startswith("jcascade.policies")
                and not sub.__name__.startswith("_")
                and not inspect.isabstract(sub)
                and dataclasses.is_dataclass(sub)
            ):
                found.add(sub)
    assert found and found <= set(policy_classes().values()), found - set(policy_classes().values())


def test_every_policy_jcascade_exports_is_registered_and_exported_at_the_top():
    """The registry (policy_classes) is every concrete policy of jcascade.policies's and jc's exports, and jc exports
    each (messages name them jc.NAME)."""
    import jcascade.policies

    exported = [getattr(module, name) for module in (jc, jcascade.policies) for name in module.__all__]
    concrete = {c for c in exported if isinstance(c, type) and issubclass(c, Policy) and not inspect.isabstract(c)}
    assert concrete == set(policy_classes().values())
    assert all(getattr(jc, cls.__name__) is cls for cls in policy_classes().values())


def listed(text: str) -> list[str]:
    """The policy names of the last parenthesised list in a message, "jc." prefixes dropped."""
    return [name.strip().removeprefix("jc.") for name in re.findall(r"\(([^()]*)\)", text)[-1].split(",")]


def test_every_list_of_policies_in_a_message_is_the_registry_s():
    """Messages that list policies list the registered ones that fit (policy_names), so a new policy joins them."""
    from jcascade.cli import build_parser
    from jcascade.eval import perplexity

    names = [cls.__name__ for cls in policy_classes().values()]
    with pytest.raises(TypeError) as error:
        jc.policies.check_policy("cascade")
    assert listed(str(error.value)) == names
    with pytest.raises(ValueError) as error:
        perplexity.check_streaming(jc.KNorm(budget=4))
    assert (
        listed(str(error.value))
        == [n for n in names if not getattr(jc, n).needs_prompt]
        == ["Cascade", "Full", "H2O", "Sink", "SlidingWindow", "TOVA"]
    )
    k = jnp.zeros((1, 2, 1, 8))
    with pytest.raises(ValueError) as error:
        jc.attend_shared(jc.H2O(heavy=2, recent=2), None, k, k, k, [])
    assert listed(str(error.value)) == [n for n in names if not getattr(jc, n).keeps_scores]
    assert build_parser().epilog == "policies: " + ", ".join(policy_classes())


def test_the_policy_table_of_the_docs_lists_every_registered_policy_once():
    table = (pathlib.Path(__file__).parents[2] / "docs/policies.md").read_text().split("## The policies")[1]
    rows = re.findall(r"^\| `(\w+)\(", table.split("\n## ")[0], re.MULTILINE)
    assert sorted(rows) == sorted(cls.__name__ for cls in policy_classes().values())


def test_a_spec_writes_a_policy_s_own_fields_then_head_reduction_positions_stride_kv_dtype():
    """The shared fields, which the bases declare keyword-only, come last in a spec and in this order (as the specs
    of earlier versions wrote them); the others in the constructor's order."""
    shared = ["head_reduction", "positions", "stride", "kv_dtype"]
    for name, cls in policy_classes().items():
        written = [item.partition("=")[0] for item in _top_level(spec(cls(**NON_DEFAULT[name])))]
        own = [p for p in inspect.signature(cls).parameters if p not in shared and not p.startswith("_")]
        assert written == own + [f for f in shared if f in written], name


def _top_level(text: str) -> list[str]:
    """ "name:a=1,b=x(c=2,d=3)" -> ["a=1", "b=x(c=2,d=3)"]."""
    return re.split(r",(?![^()]*\))", text.partition(":")[2])


def test_every_registered_policy_round_trips_with_every_field_off_its_default():
    assert set(NON_DEFAULT) == set(policy_classes())  # a new policy needs its row here
    for name, cls in policy_classes().items():
        policy = cls(**NON_DEFAULT[name])
        for f in public_fields(cls):
            assert f.default is dataclasses.MISSING or getattr(policy, f.name) != f.default, (name, f.name)
        text = spec(policy)
        assert text.startswith(name + ":") and parse_policy(text) == policy, text
    assert spec(jc.AdaKV(jc.SnapKV(budget=512, window=32), floor=0.25)) == (
        "adakv:scorer=snapkv(budget=512,window=32,kernel=7,pooling=max,head_reduction=mean,positions=original,"
        "stride=4096,kv_dtype=model),floor=0.25"
    )
    assert spec(jc.KVzip(budget=4, turn=(7,))).startswith("kvzip:budget=4,instruction=(),continuation=(),turn=(7),")


def values(hint) -> st.SearchStrategy:
    """Values of the kind a field's type hint names: ints, any finite float, choices, token ids, policies."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return st.sampled_from(args)
    if origin is tuple:
        return st.lists(st.integers(0, 2**31 - 1), max_size=4).map(tuple)
    if hint in (int, float, bool, str):
        return {
            int: st.integers(0, 4096),
            float: st.floats(0, 1) | st.floats(allow_nan=False, allow_infinity=False),
            bool: st.booleans(),
            str: st.sampled_from(["cache", "original"]),
        }[hint]
    return st.sampled_from(args if args else [hint]).flatmap(policies)


def policies(cls) -> st.SearchStrategy:
    """Valid instances of cls: its NON_DEFAULT row with one to three fields redrawn."""
    hints, name = typing.get_type_hints(cls), cls.__name__.lower()

    @st.composite
    def draw(data):
        fields = data(st.sets(st.sampled_from([f.name for f in public_fields(cls)]), min_size=1, max_size=3))
        try:
            return cls(**NON_DEFAULT[name] | {f: data(values(hints[f])) for f in fields})
        except ValueError:
            reject()

    return draw()


@given(st.sampled_from(sorted(policy_classes())).flatmap(lambda name: policies(policy_classes()[name])))
def test_specs_round_trip_for_any_valid_policy(policy):
    text = spec(policy)
    assert parse_policy(text) == policy and spec(parse_policy(text)) == text


@dataclasses.dataclass(frozen=True)
class Outside(jc.Full):
    """A policy class outside jcascade: named by module.Class."""


def test_a_policy_outside_the_registry_is_named_by_its_module_and_class():
    text = spec(Outside(stride=8))
    assert text == f"{__name__}.Outside:stride=8,kv_dtype=model" and parse_policy(text) == Outside(stride=8)


def test_specs_that_do_not_read_back_are_refused_by_name():
    with pytest.raises(ValueError, match="cannot be written as a spec that reads back"):
        spec(jc.Recycled(top_k=2, refresh_every=2, _branch="full"))  # internal state: no spec
    with pytest.raises(ValueError, match="expected a dataclass policy"):
        spec("full")
    for text, match in [
        ("adakv:scorer=snapkv(budget=64", "unbalanced parentheses"),
        ("adakv:scorer=snapkv(budget=64))", "unbalanced parentheses"),
        ("adakv:scorer=snapkv(budget=64)x", "AdaKV.scorer must be a policy, NAME or NAME"),
        ("adakv:scorer=full", "AdaKV.scorer must be a jc.SnapKV or jc.PyramidKV"),
        ("adakv:floor=0.5", "AdaKV needs scorer=..."),
        ("kvzip:budget=4,turn=7", r"KVzip.turn must be token ids in parentheses"),
        ("kvzip:budget=4,turn=(7,-1)", r"KVzip.turn must be token ids \(ints >= 0\)"),
        ("os.path:stride=4", "unknown policy 'os.path'"),
    ]:
        with pytest.raises(ValueError, match=match):
            parse_policy(text)
