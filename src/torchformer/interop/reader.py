"""Lazy reading of a Hugging Face folder's safetensors weights, single file or sharded.

Opening reads only the headers (names, shapes, dtypes): the loader checks everything against
them before any tensor data is read, so a bad checkpoint fails before anything is half-loaded.
Pickled ``pytorch_model.bin`` files are never opened (they can execute code).
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import SafetensorError, safe_open
from torch import Tensor

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"


class SafetensorsFolder:
    def __init__(self, folder: Path, device: str = "cpu") -> None:
        files = self._files(folder)
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._where = {}
        for file in files:
            handle = _open(file, device)
            for name in handle.keys():  # noqa: SIM118 (safe_open is not iterable)
                self._where[name] = handle
                self.shapes[name] = tuple(handle.get_slice(name).get_shape())

    @staticmethod
    def _files(folder: Path) -> list[Path]:
        if (folder / INDEX).is_file():
            weight_map = json.loads((folder / INDEX).read_text()).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ValueError(f"{folder / INDEX} has no 'weight_map' of tensor name -> shard file")
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
        return self._where[name].get_tensor(name)


def _open(file: Path, device: str):
    try:
        return safe_open(str(file), framework="pt", device=device)
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{file} is not a readable safetensors file (truncated or corrupt?): {err}") from err
