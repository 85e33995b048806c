"""The project's two CPU kernels (csrc/kernels.cpp), compiled on first use by torch's extension loader.

- ``panel_mm`` / ``torchformer::panel_linear``: few-row products over weights packed in 16-row
  panels (nn/packed.py), with the registry of current panels the op reads.
- ``decode_attention``: one query per row over the live prefix of the static cache
  (nn/backends.py, ``prefix_sdpa``).

Built once per machine (~35 s on 2 cores); torch keeps the build in its extensions cache and
rebuilds only when the source or flags change. Needs AVX-512, a C++ compiler (as torch.compile on
CPU does) and ninja (the ``serve`` extra). Where any is missing, or with ``TORCHFORMER_NATIVE=0``,
``kernels()`` is None and the callers take their library paths (oneDNN, SDPA).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "kernels.cpp"
NAME = "torchformer_kernels"  # the extension's name in torch's build cache
FLAGS = [  # -fopenmp: at::parallel_for runs on torch's threads; CPU_CAPABILITY: 16-wide at::vec
    "-O3", "-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl", "-mfma", "-fopenmp",
    "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512",
]  # fmt: skip


@functools.cache
def kernels():
    """The compiled extension module, or None where it cannot run or be built (logged once)."""
    if not int(os.environ.get("TORCHFORMER_NATIVE", "1")) or not torch.cpu._is_avx512_supported():
        return None
    try:
        from torch.utils.cpp_extension import get_default_build_root, load

        # A build killed midway leaves torch's lock file behind, and every later load would wait on
        # it forever: a lock older than any build (10 min) is stale.
        lock = Path(get_default_build_root()) / NAME / "lock"
        if lock.exists() and time.time() - lock.stat().st_mtime > 600:
            lock.unlink(missing_ok=True)
        module = load(name=NAME, sources=[str(SOURCE)], extra_cflags=FLAGS, verbose=False)
        torch.library.register_fake("torchformer::panel_linear")(lambda x, w: x.new_empty((x.shape[0], w.shape[0])))
        return module
    except Exception as err:  # noqa: BLE001 - no compiler, no ninja, ...: the library paths still work
        log.warning("torchformer: the CPU kernels could not be built (%s); using oneDNN and SDPA instead", err)
        return None
