"""The floors of the house, as a test (DESIGN section 8, "The floors").

Every module of src/torchformer sits on one floor. It imports modules of its own room and of
lower floors, never a higher floor and never another room of its own floor, so the rooms' import
graph is a ladder with no circle. Imports inside functions (and under TYPE_CHECKING) count the
same as those at the top of a file: a function-level import hides an arrow, it does not remove
it. Nor may the modules' graph have a circle, inside a room either.

    floor 0  configs/ (+ config.py)                    frozen, validated configs (no torch);
                                                        config.py: their import path before
                                                        configs/, re-exported, kept for users
             text/                                      byte-level BPE's alphabet, chat templates
             atomic.py  extras.py  host_memory.py       the atomic writer, optional dependencies,
             _version.py                                glibc's freed-memory setting, the version
    floor 1  nn/                                       building blocks, none knowing its model;
                                                        nn/loss.py: the token loss all rooms sum
             presets.py (+ moe_presets.py)              named shapes as data (one room, two files)
    floor 2  fast/                                     CPU fast paths, module swaps over nn/ (nn/
                                                        never opens them; models/ packs and
                                                        quantizes with fast/formats.py)
    floor 3  models/                                   config -> modules (build.py, kinds.py),
                                                        the stack, saving, quantizing, sizing
    floor 4  generation/  interop/  analysis/          run, convert, explain a built model
    floor 5  lora/  verify/  parallel/  loading.py     adapters (PEFT files name interop's
                                                        families), checks (record attention with
                                                        analysis/), tensor parallelism, and the one
                                                        resolver of folders, HF folders, GGUF files
                                                        and presets
    floor 6  evaluation/                               scores a model (perplexity, embeddings)
    floor 7  training/  serve/                         the two programs
    floor 8  torchformer/__init__.py                   the public surface, re-exported
    floor 9  cli/                                      the terminal, one module per subcommand
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import torchformer

SRC = Path(torchformer.__file__).parent
FLOORS = [
    {"configs", "text", "atomic", "extras", "host_memory", "_version"},
    {"nn", "presets"},
    {"fast"},
    {"models"},
    {"generation", "interop", "analysis"},
    {"lora", "verify", "parallel", "loading"},
    {"evaluation"},
    {"training", "serve"},
    {"torchformer"},
    {"cli"},
]
FLOOR_OF = {room: i for i, rooms in enumerate(FLOORS) for room in rooms}


def module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(source: str, module: str, is_package: bool, known: set[str]) -> dict[str, int]:
    """{imported torchformer module: first line} for every import in ``source``, at any depth
    (module level, inside functions, classes, TYPE_CHECKING blocks). ``from X import y`` names
    the module X.y when that is a module, else X."""
    package = module if is_package else module.rpartition(".")[0]
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            base = ".".join(p for p in ((base if node.level else ""), node.module or "") if p)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            if target.split(".")[0] == "torchformer":
                found.setdefault(target, node.lineno)
    return found


def import_graph(src: Path) -> dict[str, dict[str, int]]:
    files = {module_name(p, src): p for p in src.rglob("*.py")}
    known = set(files)
    return {m: imports_of(p.read_text(), m, p.name == "__init__.py", known) for m, p in files.items()}


# presets.py lists moe_presets.py's shapes with its own; config.py re-exports configs/
ONE_ROOM = {"moe_presets": "presets", "config": "configs"}


def room(module: str) -> str:
    parts = module.split(".")
    name = parts[1] if len(parts) > 1 else "torchformer"
    return ONE_ROOM.get(name, name)


def upward(graph: dict[str, dict[str, int]]) -> list[str]:
    """Each import of a module on a higher floor or of another room on the same floor, as
    'module:line (floor i) imports other (floor j)'."""
    bad = []
    for module, targets in sorted(graph.items()):
        for target, line in sorted(targets.items()):
            here, there = FLOOR_OF[room(module)], FLOOR_OF[room(target)]
            if there > here or (there == here and room(target) != room(module)):
                bad.append(f"{module}:{line} (floor {here}) imports {target} (floor {there})")
    return bad


def circle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph ``edges`` as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def module_edges(graph: dict[str, dict[str, int]]) -> dict[str, set[str]]:
    return {m: {t for t in targets if t != m} for m, targets in graph.items()}


@pytest.fixture(scope="module")
def graph():
    return import_graph(SRC)


def test_every_room_has_a_floor(graph):
    rooms = {room(m) for m in graph}
    assert not sorted(rooms - set(FLOOR_OF)), "a new room: give it a floor in FLOORS (and the docstring)"


def test_the_old_config_path_names_the_same_classes():
    import torchformer.config as old
    import torchformer.configs as configs

    assert sorted(old.__all__) == sorted(configs.__all__)
    assert all(getattr(old, name) is getattr(configs, name) for name in configs.__all__)


def test_nothing_imports_upward_or_sideways(graph):
    assert upward(graph) == []


def test_the_modules_have_no_circle(graph):
    assert circle(module_edges(graph)) is None


# -- the checks can fail: the same functions over trees that break the rules ---------------------


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    src = tmp_path / "torchformer"
    for name, text in files.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_text(text)
    return src


def test_an_upward_import_inside_a_function_is_found(tmp_path):
    src = _tree(tmp_path, {
        "__init__.py": "",
        "nn/__init__.py": "",
        "nn/block.py": "def f():\n    from ..models.build import build_model\n",
        "models/__init__.py": "",
        "models/build.py": "from ..nn import block\n",
    })  # fmt: skip
    assert upward(import_graph(src)) == [
        "torchformer.nn.block:2 (floor 1) imports torchformer.models.build (floor 3)"
    ]  # fmt: skip


def test_an_import_between_rooms_of_one_floor_is_found(tmp_path):
    src = _tree(tmp_path, {
        "__init__.py": "",
        "training/__init__.py": "",
        "training/instruct.py": "import torchformer.serve.chat\n",
        "serve/__init__.py": "",
        "serve/chat.py": "",
    })  # fmt: skip
    assert upward(import_graph(src)) == [
        "torchformer.training.instruct:1 (floor 7) imports torchformer.serve.chat (floor 7)"
    ]  # fmt: skip


def test_a_circle_of_modules_through_a_type_checking_import_is_found(tmp_path):
    src = _tree(tmp_path, {
        "__init__.py": "",
        "configs/__init__.py": "",
        "configs/model.py": "from .layers import LayerKind\n",
        "configs/layers.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .model import X\n",
    })  # fmt: skip
    graph = import_graph(src)
    assert upward(graph) == []  # one room: only the circle is wrong
    assert circle(module_edges(graph)) == [
        "torchformer.configs.layers", "torchformer.configs.model", "torchformer.configs.layers"
    ]  # fmt: skip


def test_from_package_import_module_names_the_module(tmp_path):
    src = _tree(tmp_path, {"__init__.py": "", "presets.py": "", "training/__init__.py": "",
                           "training/recipe.py": "from .. import presets\nfrom ..presets import get\n"})  # fmt: skip
    assert import_graph(src)["torchformer.training.recipe"] == {"torchformer.presets": 1}
