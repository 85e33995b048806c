"""One generic renamer between torchformer's state-dict names and another project's.

A family is a list of ``Rule``s. Each rule ties a group of our names to a group of theirs
(``{i}`` stands for a layer number) and, where the tensors differ, names the transform each way:
most rules are one name to one name, GPT-2's fused ``c_attn`` is three of ours to one of theirs.
The same rules convert in both directions, so the loader checks a checkpoint by converting the
meta-device model the config builds (names and shapes, no data) to the other side and comparing.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from torch import Tensor

Convert = Callable[[list[Tensor]], list[Tensor]]


def _same(tensors: list[Tensor]) -> list[Tensor]:
    return tensors


@dataclass(frozen=True)
class Rule:
    """ours[j] <-> theirs[j]; ``to_ours`` maps the list of their tensors (in ``theirs`` order)
    to the list of ours, ``to_theirs`` the reverse. Identity when not given."""

    ours: tuple[str, ...]
    theirs: tuple[str, ...]
    to_ours: Convert = _same
    to_theirs: Convert = _same


def rule(ours: str | tuple[str, ...], theirs: str | tuple[str, ...], to_ours=None, to_theirs=None) -> Rule:
    as_tuple = lambda names: (names,) if isinstance(names, str) else tuple(names)  # noqa: E731
    return Rule(as_tuple(ours), as_tuple(theirs), to_ours or _same, to_theirs or _same)


def renamed(pairs: Iterable[tuple[str, str]], suffixes: Iterable[str] = ("weight", "bias")) -> list[Rule]:
    """Plain renames of module paths, one rule per parameter suffix (weight, bias)."""
    return [rule(f"{ours}.{s}", f"{theirs}.{s}") for ours, theirs in pairs for s in suffixes]


class Converted(NamedTuple):
    tensors: dict[str, Tensor]
    unmatched: list[str]  # source names no rule knows
    missing: list[str]  # source names a rule needs but the source lacks


def _pattern(template: str) -> re.Pattern:
    return re.compile(re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)") + r"\Z")


class KeyMap:
    def __init__(self, rules: Iterable[Rule]) -> None:
        self.rules = list(rules)
        self._ours = [[_pattern(t) for t in r.ours] for r in self.rules]
        self._theirs = [[_pattern(t) for t in r.theirs] for r in self.rules]

    def to_theirs(self, state: Mapping[str, Tensor]) -> Converted:
        """Our tensors -> theirs (names and values)."""
        return self._convert(list(state), state.__getitem__, self._ours, "ours", "theirs", "to_theirs")

    def to_ours(self, names: Iterable[str], get: Callable[[str], Tensor]) -> Converted:
        """Their tensors -> ours. ``get(name)`` is called once per name, group by group, so a
        lazy reader holds at most one group of source tensors beside the converted ones."""
        return self._convert(list(names), get, self._theirs, "theirs", "ours", "to_ours")

    def _convert(self, names, get, patterns, src: str, dst: str, fn: str) -> Converted:
        groups: dict[tuple[int, str | None], dict[int, str]] = {}
        unmatched = []
        for name in names:
            hit = self._match(name, patterns)
            if hit is None:
                unmatched.append(name)
                continue
            r, slot, layer = hit
            groups.setdefault((r, layer), {})[slot] = name
        out: dict[str, Tensor] = {}
        missing = []
        for (r, layer), found in groups.items():
            rule_ = self.rules[r]
            wanted = getattr(rule_, src)
            if len(found) < len(wanted):
                missing += [_fill(t, layer) for j, t in enumerate(wanted) if j not in found]
                continue
            values = getattr(rule_, fn)([get(found[j]) for j in range(len(wanted))])
            for template, value in zip(getattr(rule_, dst), values, strict=True):
                out[_fill(template, layer)] = value
        return Converted(out, unmatched, sorted(missing))

    @staticmethod
    def _match(name: str, patterns: list[list[re.Pattern]]) -> tuple[int, int, str | None] | None:
        for r, group in enumerate(patterns):
            for slot, pattern in enumerate(group):
                m = pattern.match(name)
                if m is not None:
                    return r, slot, m.groupdict().get("i")
        return None


def _fill(template: str, layer: str | None) -> str:
    return template if layer is None else template.replace("{i}", layer)
