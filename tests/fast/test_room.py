"""The fast paths live in their own room above nn/ (DESIGN section 8): no module of nn/ imports
torchformer.fast, at module level or inside a function; fast/ reaches nn/ only downwards."""

import ast
from pathlib import Path

import torchformer

SRC = Path(torchformer.__file__).parent


def imported_modules(source: str, path: Path) -> set[str]:
    """Absolute names of every module ``source`` (the text of file ``path``) imports, relative
    imports resolved against ``path``'s package."""
    package = ".".join(path.relative_to(SRC.parent).with_suffix("").parts[:-1])
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            names |= {module} | {f"{module}.{alias.name}" for alias in node.names}
    return names


def test_nn_never_imports_the_fast_room():
    offenders = {}
    for path in sorted((SRC / "nn").glob("*.py")):
        found = sorted(n for n in imported_modules(path.read_text(), path) if n.startswith("torchformer.fast"))
        if found:
            offenders[str(path.relative_to(SRC))] = found
    assert not offenders


def test_the_check_resolves_relative_and_function_level_imports():
    """The negative control: what nn/backends.py held before the decode kernel moved out."""
    source = "from .patterns import Pattern\ndef f():\n    from ..fast.native import kernels\n"
    names = imported_modules(source, SRC / "nn" / "backends.py")
    assert "torchformer.fast.native" in names and "torchformer.nn.patterns" in names
