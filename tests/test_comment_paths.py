"""Comments point only at things that exist (issue 28).

Every file a comment or docstring of src/torchformer names (``nn/patterns.py``, ``(prefix.py)``,
``docs/concepts/cache.md``, ``csrc/kernels.cpp``) must be in the repository: at that path from
the repository root, the package, the file's own folder or the folder above it; a bare file name
anywhere in the repository. Files of other projects are named in OTHER_PROJECTS, with whose.
"""

from __future__ import annotations

import ast
import io
import os
import re
import tokenize
from pathlib import Path

import pytest

import torchformer

SRC = Path(torchformer.__file__).parent
ROOT = SRC.parents[1]
# a path-like word ending in a source or docs suffix, not inside a longer word or URL
MENTION = re.compile(r"(?<![\w./:-])((?:[\w-]+/)*[\w-]+\.(?:py|md|cpp|h|yaml|sh))\b")
OTHER_PROJECTS = {
    "llama.cpp": "a project's name, not a file",
    "llama-vocab.cpp": "llama.cpp",
    "convert_hf_to_gguf.py": "llama.cpp",
    "malloc.h": "glibc",
    "modeling_rope_utils.py": "transformers",
}
SKIP_DIRS = {".git", ".venv", ".cache", "__pycache__", "build", "dist", "site"}


def mentions(source: str) -> list[tuple[int, str]]:
    """(line, path) of each file named in a comment or docstring of ``source``."""
    found = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.COMMENT]  # fmt: skip
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                found.append((node.body[0].lineno, doc))
    return [(line, path) for line, text in found for path in MENTION.findall(text)]


def file_names(root: Path) -> set[str]:
    names = set()
    for _folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS]
        names.update(files)
    return names


def missing(src: Path, root: Path, names: set[str]) -> list[str]:
    """'file:line: path' for each named file that is not in the repository."""

    def exists(file: Path, path: str) -> bool:
        places = (root / path, src / path, file.parent / path, file.parent.parent / path)
        return path in OTHER_PROJECTS or any(p.exists() for p in places) or ("/" not in path and path in names)

    bad = []
    for file in sorted(src.rglob("*.py")):
        text = file.read_text()
        # tokenizing costs ~5 ms a file: only files with a word no place explains are tokenized
        if all(exists(file, path) for path in set(MENTION.findall(text))):
            continue
        bad += [f"{file.relative_to(root)}:{line}: {path}" for line, path in mentions(text) if not exists(file, path)]
    return bad


def test_every_file_a_comment_names_exists():
    if not (ROOT / "pyproject.toml").is_file():
        pytest.skip("torchformer is installed, not checked out: no repository to look in")
    assert missing(SRC, ROOT, file_names(ROOT)) == []


def test_a_comment_naming_a_missing_file_is_found(tmp_path):
    src = tmp_path / "src" / "torchformer"
    (src / "nn").mkdir(parents=True)
    (src / "nn" / "masks.py").write_text('"""Rules once (nn/patterns.py); see masks.py."""\n')
    (src / "nn" / "patterns.py").write_text("x = 1  # prefix attention: nn/prefix.py, FACTS.md\n")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "cache.md").write_text("")
    (src / "serve.py").write_text("def f():\n    '''cache.md, then glibc's malloc.h'''\n")
    found = missing(src, tmp_path, file_names(tmp_path))
    assert found == ["src/torchformer/nn/patterns.py:1: nn/prefix.py", "src/torchformer/nn/patterns.py:1: FACTS.md"]
