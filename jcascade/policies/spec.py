"""Policies written as text, the one name of a policy: the command line's --policy, the JSON of every run.

    NAME[:FIELD=VALUE,...]     e.g. "cascade:cache_size=1024,sinks=64,stride=512"

NAME is a policy class in lower case (`policy_classes()`; "-" and "_" ignored), or "module.Class" for a policy
class outside jcascade; FIELD any of its public dataclass fields. A VALUE is written by the field's type:
ints and floats as Python writes them (`repr`: floats round-trip exactly), booleans `true` / `false`, choices
by name (`head_reduction=mean`), token ids as a parenthesised list (`instruction=(12,873,9)`, `()` empty), and
a policy inside a policy as NAME(FIELD=VALUE,...) (`adakv:scorer=snapkv(budget=512,window=32),floor=0.2`):

    spec(Cascade(cache_size=1024)) == "cascade:cache_size=1024,sinks=64,num_cascades=4,gamma=0.9999,..."
    parse_policy(spec(policy)) == policy      (every registered policy; `spec` checks it)

`spec` writes every public field (defaults included), so a spec names the same policy whatever the defaults of
the version that reads it. In a shell, quote a spec with parentheses.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import numbers
import re
import types
import typing

from jcascade.policies.base import Policy


def policy_classes() -> dict[str, type]:
    """Lower-case name -> policy class, for every concrete policy that jcascade exports: the registry, which every
    list of policies (the command line's help, the messages) is read from."""
    from jcascade import policies

    classes = (getattr(policies, name) for name in policies.__all__)
    return {
        cls.__name__.lower(): cls
        for cls in classes
        if isinstance(cls, type) and issubclass(cls, Policy) and not inspect.isabstract(cls)
    }


def policy_names(**attributes) -> list[str]:
    """The class names of the registered policies whose class attributes have the values given (e.g.
    `policy_names(needs_prompt=True)`), in the registry's order."""
    return [
        cls.__name__
        for cls in policy_classes().values()
        if all(getattr(cls, name) == value for name, value in attributes.items())
    ]


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    """The public fields ("_": internal) in the constructor's order, except that the keyword-only ones, which a
    policy's bases declare, come nearest base first: a policy's own fields, then head_reduction, positions, stride."""
    fields = [f for f in dataclasses.fields(cls) if not f.name.startswith("_")]
    mro = [c for c in cls.__mro__ if dataclasses.is_dataclass(c)]
    base = {f.name: max(i for i, c in enumerate(mro) if f.name in inspect.get_annotations(c)) for f in fields}
    return {f.name: f for f in sorted(fields, key=lambda f: (f.kw_only, base[f.name] if f.kw_only else 0))}


def _name(cls: type) -> str:
    """The spec's NAME of a policy class: its registered name, else module.Class."""
    name = cls.__name__.lower()
    return name if policy_classes().get(name) is cls else f"{cls.__module__}.{cls.__qualname__}"


def _class(name: str, spec: str) -> type:
    classes = policy_classes()
    cls = classes.get(name.strip().lower().replace("-", "").replace("_", ""))
    if cls is None and "." in name:
        module, _, attribute = name.strip().rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), attribute, None)
        except ImportError:
            cls = None
    if not (isinstance(cls, type) and issubclass(cls, Policy) and dataclasses.is_dataclass(cls)):
        raise ValueError(
            f"policy {spec!r}: unknown policy {name!r}; known: {', '.join(classes)} (or module.Class "
            "of a dataclass policy)"
        )
    return cls


def _split(text: str, spec: str) -> list[str]:
    """ "a=1,b=x(c=2,d=(3,4))" -> ["a=1", "b=x(c=2,d=(3,4))"]: split at the commas outside parentheses."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth < 0:
            break
        if char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"policy {spec!r}: unbalanced parentheses in {text!r}")
    return [p.strip() for p in [*parts, text[start:]] if p.strip()]


_NESTED = re.compile(r"([\w.-]+)\s*(?:\((.*)\))?", re.DOTALL)


def _convert(cls: type, field: str, hint, text: str, spec: str):
    where = f"{cls.__name__}.{field}"
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    if all(isinstance(o, type) and issubclass(o, Policy) for o in options):
        match = _NESTED.fullmatch(text)
        if match is None:
            raise ValueError(f"{where} must be a policy, NAME or NAME(FIELD=VALUE,...), got {text!r}")
        return _policy(match[1], match[2] or "", spec)
    if typing.get_origin(hint) is tuple:
        if not (text.startswith("(") and text.endswith(")")):
            raise ValueError(f"{where} must be token ids in parentheses, e.g. (12,873,9) or (), got {text!r}")
        items = [t.strip() for t in text[1:-1].split(",")]
        if items == [""]:
            return ()
        if not all(re.fullmatch(r"\d+", t) for t in items):
            raise ValueError(f"{where} must be token ids (ints >= 0) in parentheses, got {text!r}")
        return tuple(int(t) for t in items)
    if typing.get_origin(hint) is typing.Literal:
        if text not in typing.get_args(hint):
            raise ValueError(f"{where} must be one of {typing.get_args(hint)}, got {text!r}")
        return text
    if hint is bool:
        if text.lower() not in ("true", "false"):
            raise ValueError(f"{where} must be true or false, got {text!r}")
        return text.lower() == "true"
    if hint in (int, float):
        try:
            return hint(text)
        except ValueError:
            raise ValueError(f"{where} must be {'an int' if hint is int else 'a number'}, got {text!r}") from None
    return text


def _policy(name: str, fields_text: str, spec: str):
    cls = _class(name, spec)
    hints, fields = typing.get_type_hints(cls), _fields(cls)
    values = {}
    for item in _split(fields_text, spec):
        field, eq, text = item.partition("=")
        field = field.strip().replace("-", "_")
        if not eq or field not in fields:
            raise ValueError(
                f"policy {spec!r}: expected FIELD=VALUE with FIELD one of {', '.join(fields)}, got {item!r}"
            )
        values[field] = _convert(cls, field, hints[field], text.strip(), spec)
    missing = [
        f
        for f, spec_field in fields.items()
        if f not in values
        and spec_field.default is dataclasses.MISSING
        and spec_field.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ValueError(f"policy {spec!r}: {cls.__name__} needs {', '.join(f + '=...' for f in missing)}")
    try:
        return cls(**values)
    except ValueError as e:
        raise ValueError(f"policy {spec!r}: {e}") from None


def parse_policy(spec: str):
    """A policy from its spec (this module's doc), e.g. "cascade:cache_size=1024,sinks=64". Field values are
    converted by the field's type; the policy validates them. Raises ValueError naming the spec."""
    name, _, rest = spec.partition(":")
    return _policy(name, rest, spec)


def _value(value) -> str:
    if isinstance(value, Policy):
        return f"{_name(type(value))}({_field_values(value)})"
    if isinstance(value, tuple):
        return "(" + ",".join(_value(v) for v in value) + ")"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, numbers.Real):
        return repr(float(value))
    return str(value)


def _field_values(policy) -> str:
    return ",".join(f"{name}={_value(getattr(policy, name))}" for name in _fields(type(policy)))


def spec(policy) -> str:
    """The spec of a policy (this module's doc): NAME:FIELD=VALUE,... with every public field, so that
    parse_policy(spec(policy)) == policy. Raises ValueError for a policy whose spec would not read back as
    it (e.g. a text field holding "," or "(")."""
    if not (isinstance(policy, Policy) and dataclasses.is_dataclass(policy)):
        raise ValueError(f"spec: expected a dataclass policy (a jc.Policy), got {policy!r}")
    fields = _field_values(policy)
    text = _name(type(policy)) + (f":{fields}" if fields else "")
    try:
        problem = None if parse_policy(text) == policy else f"{text!r} names another policy (internal fields?)"
    except ValueError as e:
        problem = str(e)
    if problem:
        raise ValueError(f"spec: {policy!r} cannot be written as a spec that reads back: {problem}")
    return text
