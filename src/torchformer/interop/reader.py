"""Lazy reading of a Hugging Face folder's safetensors weights, single file or sharded.

Opening reads only the headers (names, shapes, dtypes): the loader checks everything against
them before any tensor data is read, so a bad checkpoint fails before anything is half-loaded.
Pickled ``pytorch_model.bin`` files are never opened (they can execute code).
"""

from __future__ import annotations

from pathlib import Path, PurePath

from torch import Tensor

from ..models.saving import header_shapes, open_safetensors, read_json, read_tensor

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"


class SafetensorsFolder:
    def __init__(self, folder: Path, device: str = "cpu") -> None:
        files = self._files(folder)
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._where = {}
        for file in files:
            handle = open_safetensors(file, device)
            for name, shape in header_shapes(handle).items():
                self._where[name] = (handle, file)
                self.shapes[name] = shape

    @staticmethod
    def _files(folder: Path) -> list[Path]:
        if (folder / INDEX).is_file():
            weight_map = read_json(folder / INDEX).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ValueError(f"{folder / INDEX} has no 'weight_map' of tensor name -> shard file")
            for name, shard in weight_map.items():
                check_shard(folder / INDEX, name, shard)
            files = [folder / name for name in sorted(set(weight_map.values()))]
            absent = [f.name for f in files if not f.is_file()]
            if absent:
                raise FileNotFoundError(f"{folder / INDEX} lists shard(s) missing from the folder: {absent}")
            return files
        if (folder / SINGLE).is_file():
            return [folder / SINGLE]
        if (folder / "pytorch_model.bin").is_file():
            raise ValueError(
                f"{folder} holds only pytorch_model.bin: pickled weights are never loaded here (unpickling can run "
                "code). Re-save it with transformers' save_pretrained(..., safe_serialization=True)."
            )
        raise FileNotFoundError(f"{folder} has no {SINGLE} nor {INDEX}")

    @property
    def names(self) -> list[str]:
        return list(self.shapes)

    def get(self, name: str) -> Tensor:
        handle, file = self._where[name]
        return read_tensor(handle, name, file)


def check_shard(index: Path, name: str, shard) -> None:
    """A weight_map entry must name a file inside the folder: an index is data from whoever made
    the folder, and '../../etc/passwd' or '/abs/path' would open files elsewhere. Checked on the
    text, not the resolved path: hub caches link shards to blobs outside the snapshot folder."""
    path = PurePath(shard) if isinstance(shard, str) else None
    if path is None or path.is_absolute() or ".." in path.parts or not path.parts:
        raise ValueError(
            f"{index}: weight_map[{name!r}] = {shard!r} is not a file name inside the folder "
            "(shards must be relative paths without '..')"
        )
