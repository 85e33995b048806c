"""Checkpoint interop: Hugging Face folders <-> torchformer models (issue 5).

keymap.py (the generic renamer), transforms.py (transpose, split/fuse, RoPE row permutations),
reader.py (lazy safetensors), hf.py (from_hf / to_hf and FAMILIES), family.py (a Family: one
model_type's field table, key map and named rules), layouts.py (what families share: the Llama
trunk, RoPE and per-layer rules, stacked experts, BERT's encoder), one hf_*.py of tables per family.
"""

from .hf import FAMILIES, config_from_hf, from_hf, to_hf

__all__ = ["FAMILIES", "config_from_hf", "from_hf", "to_hf"]
