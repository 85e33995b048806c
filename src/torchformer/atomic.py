"""Write a folder so that readers see the old folder or the new one, never a mix.

Every file goes into a hidden temporary sibling folder, is fsynced, and the folder is renamed into
place; the folder it replaces is moved aside first and deleted only after. A process killed at any
moment (even by SIGKILL) leaves the previous folder intact and at most a hidden `.tmp_*` sibling.
Used by `tfm.save`, `tfm.to_hf` and training checkpoints.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

from safetensors.torch import save_file
from torch import Tensor

TMP_PREFIX = ".tmp_"


def fsync_path(path: Path) -> None:
    """Flush a file's or a folder's entry to disk (a folder's fsync makes renames durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_folder(
    path: str | os.PathLike,
    *,
    tensors: Mapping[str, Mapping[str, Tensor]] | None = None,
    texts: Mapping[str, str] | None = None,
) -> Path:
    """Create or replace folder ``path`` holding safetensors files (file name -> tensors) and text
    files (file name -> content). Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{path.name}.", dir=path.parent))
    old = None
    try:
        for name, state in (tensors or {}).items():
            save_file(dict(state), str(tmp / name), metadata={"format": "pt"})
        for name, text in (texts or {}).items():
            (tmp / name).write_text(text)
        for f in tmp.iterdir():
            fsync_path(f)
        fsync_path(tmp)
        if path.exists():
            old = path.with_name(f".old_{path.name}.{os.getpid()}")
            shutil.rmtree(old, ignore_errors=True)
            path.rename(old)
        tmp.rename(path)
        fsync_path(path.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return path
