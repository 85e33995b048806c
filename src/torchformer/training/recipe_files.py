"""Recipe files and overrides as plain data: a YAML or JSON file (a bare name is a packaged
recipe) and dotted ``section.key=value`` overrides. Only YAML's safe subset is read (a tag that
would build a Python object is an error), aliases are bounded, and every error names the file.
"""

from __future__ import annotations

import importlib.resources
import json
import re
from pathlib import Path
from typing import Any

from ..extras import require
from .data import read_utf8

# Recipes ship inside the package (package data), so a bare name works from an installed wheel too.
RECIPES = importlib.resources.files("torchformer") / "recipes"


def _numbers(value: Any) -> Any:
    """YAML 1.1 reads '3e-4' (no dot) as a string; recipes mean the number."""
    if isinstance(value, dict):
        return {k: _numbers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_numbers(v) for v in value]
    if isinstance(value, str) and _FLOAT.match(value):
        return float(value)
    return value


_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")


def parse_override(text: str) -> tuple[list[str], Any]:
    """'optim.lr=3e-4' -> (['optim', 'lr'], 0.0003); values are parsed as YAML scalars/lists."""
    yaml = require("yaml")

    if "=" not in text:
        raise ValueError(f"override {text!r}: expected section.key=value, e.g. optim.lr=3e-4")
    path, value = text.split("=", 1)
    keys = path.strip().split(".")
    if len(keys) < 2 and keys[0] != "name":
        raise ValueError(f"override {text!r}: name a section and a key, e.g. train.steps=100")
    return keys, _numbers(safe_yaml(yaml, value, f"override {text!r}")) if value.strip() else ""


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    raw = json.loads(json.dumps(raw))  # deep copy of plain data
    for text in overrides:
        keys, value = parse_override(text)
        node = raw
        for key in keys[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ValueError(f"override {text!r}: {key} is not a section")
        node[keys[-1]] = value
    return raw


def read_file(path: str | Path) -> dict[str, Any]:
    """A recipe file (YAML or JSON) as plain data; a bare name is one of the packaged recipes."""
    yaml = require("yaml")

    p = Path(path)
    if not p.exists() and not p.suffix and (RECIPES / f"{p}.yaml").is_file():
        p = RECIPES / f"{p}.yaml"
    if not p.is_file():
        raise FileNotFoundError(
            f"recipe {str(path)!r} not found: give a YAML/JSON file or one of the packaged recipes {recipe_names()}"
        )
    if p.stat().st_size > MAX_RECIPE_BYTES:
        raise ValueError(f"recipe {p}: {p.stat().st_size:,} bytes; a recipe is a few KB (at most {MAX_RECIPE_BYTES:,})")
    text = read_utf8(p)  # a binary file is named, with the offset of its first bad byte
    if p.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"recipe {p}: not valid JSON ({err})") from None
    else:
        data = safe_yaml(yaml, text, f"recipe {p}")
    data = _numbers(data or {})
    if not isinstance(data, dict):
        raise ValueError(f"recipe {p} must be a mapping of sections, got {type(data).__name__}")
    return data


MAX_RECIPE_BYTES = 1 << 20
MAX_YAML_VALUES = 100_000  # after alias expansion; the packaged recipes hold about 50


def safe_yaml(yaml, text: str, what: str):
    """YAML's safe subset (no tags that build Python objects), with errors that name ``what`` and
    the line. Aliases are expanded on the node graph first: a 1 KB "billion laughs" file refers to
    the same nodes 10^9 times and would take minutes (or all memory) to walk once loaded."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is not None and _expanded_size(node, {}) > MAX_YAML_VALUES:
            raise ValueError(f"{what}: expands to more than {MAX_YAML_VALUES:,} values (YAML aliases); refused")
        return loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ValueError(f"{what}: not valid YAML{where}: {problem}") from None
    finally:
        loader.dispose()


def _expanded_size(node, sizes: dict[int, int]) -> int:
    """Values under ``node`` counting every alias as the copy it stands for (memoised per node)."""
    if id(node) not in sizes:
        sizes[id(node)] = 0  # a recursive alias counts once
        children = node.value if isinstance(node.value, list) else []
        pairs = [item for child in children for item in (child if isinstance(child, tuple) else (child,))]
        sizes[id(node)] = 1 + sum(min(_expanded_size(c, sizes), MAX_YAML_VALUES + 1) for c in pairs)
    return sizes[id(node)]


def recipe_names() -> list[str]:
    """The recipes that ship with torchformer (``torchformer train --recipe NAME``)."""
    return sorted(f.name.removesuffix(".yaml") for f in RECIPES.iterdir() if f.name.endswith(".yaml"))
