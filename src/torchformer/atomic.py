"""Write a folder so that readers see the old folder or the new one, never a mix.

Every file goes into a hidden temporary sibling folder, is fsynced, and the folder is renamed into
place; the folder it replaces is moved aside first and deleted only after. A process killed at any
moment (even by SIGKILL) leaves the previous folder intact and at most a hidden `.tmp_*` sibling.
Used by `tfm.save`, `tfm.to_hf` and training checkpoints. One file is replaced the same way
(``write_file``): the data cache, a LoRA run's merged weights, eval.json.

What it may replace is checked first: a new path, an empty folder, or a folder holding only the
files this write produces (an earlier save of the same kind, a checkpoint rewritten on resume).
A folder with anything else in it, or a path that is a file, is refused before anything is
written; ``force=True`` replaces any folder.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
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


def write_file(path: str | os.PathLike, write: Callable[[Path], object]) -> Path:
    """Create or replace the file ``path`` so that readers see the old file or the new one:
    ``write(tmp)`` fills a hidden file beside it, which is flushed to disk, renamed over ``path``
    and the rename made durable. A failing ``write`` leaves ``path`` as it was and no temporary."""
    path = Path(path)
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}")
    try:
        write(tmp)
        fsync_path(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_path(path.parent)
    return path


def check_target(path: Path, names: set[str], force: bool = False) -> None:
    """Refuse to replace ``path`` when it is not a folder, or (unless force) when it holds
    anything but files named in ``names``: replacing it would delete what the user keeps there."""
    if not path.exists():
        return
    if not path.is_dir():
        raise ValueError(f"{path} exists and is not a folder: refusing to replace it; give a folder path")
    if force:
        return
    others = sorted(
        f"{p.name}/" if p.is_dir() else p.name for p in path.iterdir() if not (p.is_file() and p.name in names)
    )
    if others:
        shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
        raise ValueError(
            f"{path} holds files that are not part of the model folder being written ({shown}): replacing it "
            "would delete them; write to a new or empty folder, or pass force=True (torchformer convert --force)"
        )


def write_folder(
    path: str | os.PathLike,
    *,
    tensors: Mapping[str, Mapping[str, Tensor]] | None = None,
    texts: Mapping[str, str] | None = None,
    replaces: tuple[str, ...] = (),
    force: bool = False,
) -> Path:
    """Create or replace folder ``path`` holding safetensors files (file name -> tensors) and text
    files (file name -> content). An existing folder is replaced only if it holds nothing but
    those files and the ones named in ``replaces`` (or with ``force``). Returns the path."""
    path = Path(path)
    check_target(path, {*(tensors or {}), *(texts or {}), *replaces}, force)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{path.name}.", dir=path.parent))
    try:
        for name, state in (tensors or {}).items():
            save_file(dict(state), str(tmp / name), metadata={"format": "pt"})
        for name, text in (texts or {}).items():
            (tmp / name).write_text(text)
        publish(tmp, path, list(tmp.iterdir()))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def publish(tmp: Path, path: Path, files: list[Path]) -> None:
    """Make the filled hidden folder ``tmp`` the folder ``path``: ``files`` (what tmp holds) and tmp
    flushed to disk, an existing ``path`` moved aside, tmp renamed into place and the rename made
    durable, and only then the old folder deleted, so a crash at any point leaves the old folder
    or the new one whole (write_folder; training/sharded_checkpoint.py's DCP checkpoints)."""
    for f in [*files, tmp]:
        fsync_path(f)
    old = path.with_name(f".old_{path.name}.{os.getpid()}")
    moved = path.exists()
    if moved:
        shutil.rmtree(old, ignore_errors=True)
        path.rename(old)
    tmp.rename(path)
    fsync_path(path.parent)
    if moved:
        shutil.rmtree(old, ignore_errors=True)


class NewFolders:
    """The folders of ``paths`` that do not exist yet; as a context, removed again when the block
    raises before ``keep()``. A training run refused on bad input that shows only after its data
    was tokenized (a batch larger than the data, a broken model.init) leaves no folder behind."""

    def __init__(self, *paths: str | os.PathLike) -> None:
        self.new = [Path(p) for p in paths if not Path(p).exists()]
        self.kept = False

    def keep(self) -> None:
        self.kept = True

    def __enter__(self) -> NewFolders:
        return self

    def __exit__(self, kind, error, trace) -> None:
        if kind is not None and not self.kept:
            for folder in self.new:
                shutil.rmtree(folder, ignore_errors=True)
