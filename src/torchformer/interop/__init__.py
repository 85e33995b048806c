"""Checkpoint interop: Hugging Face folders <-> torchformer models (issue 5).

keymap.py (the generic renamer), transforms.py (transpose, split/fuse, RoPE row permutations),
reader.py (lazy safetensors), hf.py (from_hf / to_hf and the family table), one file per family.
"""

from .hf import FAMILIES, config_from_hf, from_hf, to_hf

__all__ = ["FAMILIES", "config_from_hf", "from_hf", "to_hf"]
