"""One output file written atomically (atomic.write_file): a reader (or a failed run) sees the old file or
the new one."""

from __future__ import annotations

import os
from pathlib import Path

from .. import atomic


def check_file_path(path: str | os.PathLike, name: str = "path") -> Path:
    """``path`` as a Path, refused when it names a directory (checked before any work)."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{name}={str(path)!r} is a directory; give a file name")
    return path


def write_file(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` through atomic.py's writer (a hidden sibling, fsynced, renamed)."""
    path = check_file_path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic.write_file(path, lambda tmp: tmp.write_bytes(data))
