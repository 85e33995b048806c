"""Open a GGUF file and check its container before anything is built: the header parses, every
tensor lies inside the file, the tensor count is the header's, every type is one we load.

GGUF (llama.cpp's single-file format) holds typed metadata (``general.*``, ``{arch}.*``,
``tokenizer.ggml.*``) and tensors whose dimensions are listed fastest-first (``ne``, the reverse
of PyTorch's order). The ``gguf`` package parses it and memory-maps the data; errors here become
one ValueError naming the file.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ...extras import require

logger = logging.getLogger(__name__)

# Types loaded as they are (float), into quantized modules (Q4_0), or dequantized at load.
FLOAT_TYPES = ("F32", "F16", "BF16")
DEQUANTIZED_TYPES = ("Q8_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K")
SUPPORTED_TYPES = (*FLOAT_TYPES, "Q4_0", *DEQUANTIZED_TYPES)


@dataclass(frozen=True)
class GGUFFile:
    """The parsed file: metadata values by key and the tensors (gguf.ReaderTensor) by name."""

    path: Path
    meta: dict[str, Any]
    tensors: dict[str, Any]
    lengths: dict[str, int] = field(default_factory=dict)  # arrays left out of meta (open_gguf's vocabulary)

    def get(self, key: str, default: Any = None) -> Any:
        return self.meta.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.meta:
            raise ValueError(f"{self.path}: metadata key {key!r} is missing; llama.cpp's writers always set it")
        return self.meta[key]

    def torch_shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape in PyTorch order (GGUF lists dimensions fastest first)."""
        return tuple(int(n) for n in reversed(self.tensors[name].shape))

    def type_name(self, name: str) -> str:
        return self.tensors[name].tensor_type.name

    def length(self, key: str) -> int:
        """How many elements the array ``key`` holds (0 where the file has none), read or left out."""
        return len(self.meta[key] or []) if key in self.meta else self.lengths.get(key, 0)


def gguf_module():
    return require("gguf", extra="gguf")


# The vocabulary's arrays: a Llama 3 file's 128256 tokens and types and 280147 merges, ~120 MiB as
# Python lists (and the reader's fragments around them) that a load of the weights never reads.
VOCABULARY = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.scores")


def open_gguf(path: str | os.PathLike, vocabulary: bool = True) -> GGUFFile:
    """Parse ``path``; a missing, truncated or foreign file, a tensor count that does not match the
    header or a tensor type we cannot load is one ValueError naming the file. vocabulary=False
    leaves the VOCABULARY arrays out of ``meta`` (their lengths stay: ``GGUFFile.length``)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such GGUF file")
    gguf = gguf_module()
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError, EOFError) as err:
        raise ValueError(f"{path} is not a readable GGUF file (truncated or corrupt?): {err}") from None
    skipped = () if vocabulary else VOCABULARY
    meta = {key: _value(f, gguf) for key, f in reader.fields.items() if key not in skipped}
    lengths = {key: len(f.data) for key, f in reader.fields.items() if key in skipped}
    tensors = {t.name: t for t in reader.tensors}
    count = meta.get("GGUF.tensor_count")
    unnamed = [i for i, t in enumerate(reader.tensors) if not t.name.isprintable() or not t.name.strip()]
    if unnamed:  # a header counting more tensors than written reads the data's bytes as descriptions
        raise ValueError(
            f"{path}: the header's tensor_count={count} counts more tensors than the file describes "
            f"(tensor {unnamed[0]} has no valid name)"
        )
    if count != len(reader.tensors) or len(tensors) != len(reader.tensors):
        raise ValueError(
            f"{path}: the header says tensor_count={count}, the file holds {len(reader.tensors)} tensors "
            f"({len(tensors)} distinct names); they must agree"
        )
    _check_extent(path, reader)
    bad = sorted({t.tensor_type.name for t in reader.tensors} - set(SUPPORTED_TYPES))
    if bad:
        raise ValueError(f"{path}: tensor types {bad} are not supported; supported: {list(SUPPORTED_TYPES)}")
    return GGUFFile(path, meta, tensors, lengths)


def _value(field, gguf):
    """A field's value; a float32 scalar as the shortest decimal that is the same float32 (the
    converter wrote 1e-05, not 9.999999747378752e-06: configs compare equal to the source's)."""
    value = field.contents()
    if field.types == [gguf.GGUFValueType.FLOAT32]:
        return float(str(np.float32(value)))
    return value


def _check_extent(path: Path, reader) -> None:
    """Every tensor's bytes inside the file (numpy's memmap of a truncated file can end short), and
    no more than alignment padding after the last: a header counting fewer tensors than the file
    holds shifts every offset, which shows as bytes left over."""
    size, last = path.stat().st_size, 0
    for t in reader.tensors:
        end = t.data_offset + int(t.n_bytes)
        if end > size or t.data.nbytes != int(t.n_bytes):
            raise ValueError(f"{path} is truncated: tensor {t.name!r} needs bytes up to {end}, the file has {size}")
        last = max(last, end)
    if size - last >= reader.alignment:
        raise ValueError(
            f"{path}: {size - last} bytes follow the last tensor; the header's tensor_count="
            f"{len(reader.tensors)} is less than the tensors the file holds (or the file is corrupt)"
        )
