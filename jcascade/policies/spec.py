"""Policies written as text, "NAME[:FIELD=VALUE,...]" (the command line's --policy; also for notebooks):

    parse_policy("cascade:cache_size=1024,sinks=64,stride=512") == Cascade(cache_size=1024, sinks=64, stride=512)
"""

from __future__ import annotations

import dataclasses
import inspect
import typing

from jcascade.policies.base import Policy


def policy_classes() -> dict[str, type]:
    """Lower-case name -> policy class, for every concrete policy that jcascade exports."""
    from jcascade import policies

    classes = (getattr(policies, name) for name in policies.__all__)
    return {cls.__name__.lower(): cls for cls in classes
            if isinstance(cls, type) and issubclass(cls, Policy) and not inspect.isabstract(cls)}


def _convert(cls: type, field: str, hint, text: str):
    where = f"{cls.__name__}.{field}"
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


def parse_policy(spec: str):
    """A policy from "NAME[:FIELD=VALUE,...]", e.g. "cascade:cache_size=1024,sinks=64": NAME a policy class in
    lower case ("-" and "_" ignored), FIELD any of its public dataclass fields. Field values are converted by
    the field's type; the policy validates them. Raises ValueError naming the spec."""
    classes = policy_classes()
    name, _, rest = spec.partition(":")
    cls = classes.get(name.strip().lower().replace("-", "").replace("_", ""))
    if cls is None:
        raise ValueError(f"policy {spec!r}: unknown policy {name!r}; known: {', '.join(classes)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.name.startswith("_")}  # "_": internal
    values = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        field, eq, text = item.partition("=")
        field = field.strip().replace("-", "_")
        if not eq or field not in fields:
            raise ValueError(f"policy {spec!r}: expected FIELD=VALUE with FIELD one of {', '.join(fields)}, "
                             f"got {item!r}")
        values[field] = _convert(cls, field, hints[field], text.strip())
    missing = [f for f, spec_field in fields.items() if f not in values and spec_field.default is dataclasses.MISSING
               and spec_field.default_factory is dataclasses.MISSING]
    if missing:
        raise ValueError(f"policy {spec!r}: {cls.__name__} needs {', '.join(f + '=...' for f in missing)}")
    try:
        return cls(**values)
    except ValueError as e:
        raise ValueError(f"policy {spec!r}: {e}") from None
