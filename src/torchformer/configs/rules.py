"""Rules every config class shares: collect problems, check scalar types, raise one ValueError
that names each field, its value and what is allowed. Imports no torch."""

from __future__ import annotations

import dataclasses
from functools import cache
from typing import Any, get_args, get_type_hints


def _check(problems: list[str], ok: bool, name: str, value: Any, allowed: str) -> None:
    if not ok:
        problems.append(f"{name}={value!r}: {allowed}")


def _check_choice(problems: list[str], name: str, value: Any, literal: Any) -> None:
    choices = get_args(literal)
    _check(problems, value in choices, name, value, f"must be one of {list(choices)}")


def _raise(cls_name: str, problems: list[str]) -> None:
    if problems:
        lines = "\n  - ".join(problems)
        raise ValueError(f"invalid {cls_name}:\n  - {lines}")


_SCALARS = {bool: "true or false", int: "an integer", float: "a number"}


def _is(value: Any, kind: type) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, int | float) and not isinstance(value, bool)


@cache
def _scalar_fields(cls: type) -> tuple[tuple[str, tuple[type, ...], bool], ...]:
    """(name, scalar kinds, None allowed) for every bool/int/float field of a config class."""
    out = []
    for f in dataclasses.fields(cls):
        hint = get_type_hints(cls)[f.name]
        options = get_args(hint) or (hint,)
        kinds = tuple(k for k in options if isinstance(k, type) and k in _SCALARS)
        if kinds:
            out.append((f.name, kinds, type(None) in options))
    return tuple(out)


def _type_problems(obj: Any, prefix: str) -> list[str]:
    """Scalar fields of the wrong type (e.g. "4" or 4.0 for an int), reported before the range
    rules, which could not even compare such values."""
    problems = []
    for name, kinds, optional in _scalar_fields(type(obj)):
        value = getattr(obj, name)
        if not (value is None and optional) and not any(_is(value, k) for k in kinds):
            allowed = " or ".join(_SCALARS[k] for k in kinds) + (" or None" if optional else "")
            problems.append(f"{prefix}{name}={value!r}: must be {allowed}")
    return problems


class _Validated:
    """Nested configs check their own fields on construction; ModelConfig adds cross-field rules."""

    _prefix = "positions."  # how messages name this class's fields inside a ModelConfig

    def __post_init__(self) -> None:
        problems = _type_problems(self, self._prefix)
        if not problems:
            self._problems(problems)  # type: ignore[attr-defined]
        _raise(type(self).__name__, problems)


def _reject_unknown(cls: type, data: dict[str, Any], where: str) -> None:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown key(s) in {where}: {unknown}; allowed: {sorted(known)}")


def _tagged(kinds: dict[str, type], data: dict[str, Any], where: str) -> Any:
    data = dict(data)
    kind = data.pop("kind", None)
    if kind not in kinds:
        raise ValueError(f"{where}.kind={kind!r}: must be one of {list(kinds)}")
    return _from_plain(kinds[kind], data, where)


def _from_plain(cls: type, data: dict[str, Any], where: str) -> Any:
    _reject_unknown(cls, data, where)
    return cls(**data)
