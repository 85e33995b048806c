"""The project's CPU kernels (csrc/), compiled on first use by torch's extension loader.

- ``panel_mm`` / ``torchformer::panel_linear`` (kernels.cpp): few-row products over fp32 weights
  packed in 16-row panels (fast/panels.py); the op multiplies plainly once the weight has changed.
- ``decode_attention`` (kernels.cpp): one query per row over the live prefix of the static cache
  (nn/backends.py, ``prefix_sdpa``).
- ``torchformer::bf16_linear`` (bf16.cpp): the product over a bf16 weight as it is stored, and
  ``torchformer::int8_mm`` / ``int4_mm`` / ``int4_min_mm`` / ``intn_mm`` (quantized.cpp): products
  over int8 / int4 / 5- and 6-bit weights in 16-row panels with the activations quantized to int8
  per block (integer dot products, AVX512-VNNI where the CPU has it); both in fast/quant_panels.py.

Built once per machine (~35-75 s on 2 cores, one log line before it starts) into torch's
extensions cache (``TORCH_EXTENSIONS_DIR`` if set), in a folder named by a hash of the source,
flags, torch version, source folder and environment, so checkouts and venvs never rebuild each
other's copy. A finished build leaves a stamp of its library, and later processes import that
library directly (``built``), without torch's loader.
The build always runs the ``ninja`` of the ``ninja`` package when it is installed, whatever PATH
says: ninja 1.11 and 1.13 hash the same command differently in ``.ninja_log``, so a process that
found /usr/bin/ninja (1.11) and one that found the venv's (1.13) each rebuilt the other's build,
~75 s a time, all through a test run. Needs AVX-512, or AVX2 with FMA and F16C (csrc/wide.h:
the same kernels over 16 lanes in two ymm registers; a separate build, ~2 min on 2 cores), a C++
compiler (as torch.compile on CPU does) and ninja (the ``serve`` extra). Where any is missing, or
with ``TORCHFORMER_NATIVE=0``, ``kernels()`` is None and the callers take their library paths
(oneDNN, SDPA).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import logging
import os
import sys
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = [CSRC / name for name in ("kernels.cpp", "bf16.cpp", "quantized.cpp", "dequant.cpp", "step.cpp")]
# included by the sources: part of the build's key
INCLUDED = [CSRC / "quantized_kernels.inc", CSRC / "wide.h", CSRC / "guided.h", CSRC / "team.h", CSRC / "py_iter.h"]
NAME = "torchformer_kernels"  # the extension's name in torch's build cache
STAMP = "finished"  # written beside the library once a build and import succeeded (``built``)
# One build per instruction set (csrc/wide.h: 16 lanes as one zmm or two ymm registers).
# -fopenmp: at::parallel_for runs on torch's threads; CPU_CAPABILITY: the width of at::vec.
FLAGS = {
    "avx512": ["-O3", "-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl", "-mfma", "-fopenmp",
               "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"],
    "avx2": ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
}  # fmt: skip


def isa() -> str | None:
    """The instruction set the kernels are built for on this CPU: "avx512", "avx2" (AVX2 with FMA
    and F16C: every AVX2 CPU since Haswell and Zen), or None where they cannot run."""
    if torch.cpu._is_avx512_supported():
        return "avx512"
    if torch.cpu._is_avx2_supported() and cpu_flags() >= {"fma", "f16c"}:
        return "avx2"
    return None


def flags() -> list[str]:
    """The compiler flags of this CPU's build (AVX-512's where the kernels cannot run: a status key)."""
    return FLAGS[isa() or "avx512"]


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux names them (empty where /proc/cpuinfo cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


@functools.cache
def kernels():
    """The compiled extension module, or None where it cannot run or be built (logged once)."""
    if not enabled() or isa() is None:
        return None
    try:
        folder = build_folder(build_root())
        module = built(folder) or build(folder)
        fake = torch.library.register_fake("torchformer::panel_linear")
        fake(lambda x, w, panels, version: x.new_empty((x.shape[0], w.shape[0])))
        return module
    except Exception as err:  # noqa: BLE001 - no compiler, no ninja, ...: the library paths still work
        log.warning("torchformer: the CPU kernels could not be built (%s); using oneDNN and SDPA instead", err)
        return None


def build(folder: Path):
    """Build (or let ninja find up to date) and import the extension in ``folder``; then stamp it."""
    from torch.utils.cpp_extension import load

    with build_lock(folder), one_ninja():
        if not (folder / f"{NAME}.so").exists():
            log.warning("torchformer: building the CPU kernels once (~35-75 s) in %s", folder)
        module = load(name=NAME, sources=[str(s) for s in SOURCES], extra_cflags=flags(), build_directory=str(folder))
        (folder / STAMP).write_text(signature(folder / f"{NAME}.so"))
    return module


def built(folder: Path):
    """The extension ``build`` finished in ``folder`` before (its stamp matches the library), imported
    without torch's loader: the folder's name already hashes everything the build reads, and the
    loader imports setuptools (~100 modules, 4 MiB resident) and runs ninja on every first use.
    None where there is nothing finished to import."""
    library = folder / f"{NAME}.so"
    try:
        if (folder / STAMP).read_text() != signature(library):
            return None
    except OSError:
        return None
    spec = importlib.util.spec_from_file_location(NAME, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def signature(library: Path) -> str:
    """What a finished build's stamp holds: the library's size and modification time."""
    info = library.stat()
    return f"{info.st_size} {info.st_mtime_ns}"


def enabled() -> bool:
    """False where TORCHFORMER_NATIVE=0 turns the kernels off."""
    return os.environ.get("TORCHFORMER_NATIVE", "1").strip() != "0"


def build_root() -> Path:
    """TORCH_EXTENSIONS_DIR if set, else torch's default extensions cache."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())


def build_folder(root: Path) -> Path:
    """This source's build folder: one per (source and its folder, flags, torch, environment)."""
    key = hashlib.sha256(
        b"\0".join(
            [
                *(s.read_bytes() for s in SOURCES + INCLUDED),
                # ninja's build file names the sources by path: two checkouts sharing a folder
                # would rebuild it for each other (minutes each, under the lock) at every switch.
                str(SOURCES[0].parent.resolve()).encode(),
                " ".join(flags()).encode(),
                torch.__version__.encode(),
                # as spelled, not resolved: torch's build file names the include paths under
                # sys.prefix, so a venv reached through a symlink and its real path would rebuild
                # each other's copy at every switch
                sys.prefix.encode(),
            ]
        )
    ).hexdigest()[:16]
    folder = root / f"{NAME}-{key}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@contextlib.contextmanager
def one_ninja():
    """PATH led by the ``ninja`` package's binary while torch builds (module docstring: two ninja
    versions in one cache rebuild each other's output); unchanged where the package is missing."""
    try:
        from ninja import BIN_DIR
    except ImportError:
        yield
        return
    before = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([BIN_DIR, before])
    try:
        yield
    finally:
        os.environ["PATH"] = before


@contextlib.contextmanager
def build_lock(folder: Path):
    """Hold an OS file lock while torch builds or loads. torch's own lock is a plain file that a
    build killed midway leaves behind, and every later load would wait on it forever. The OS
    releases ours when its process dies, so once we hold it any torch lock left is stale."""
    stale = folder / "lock"
    try:
        import fcntl
    except ImportError:  # no POSIX locks: a torch lock older than any build (10 min) is stale
        if stale.exists() and time.time() - stale.stat().st_mtime > 600:
            stale.unlink(missing_ok=True)
        yield
        return
    with open(folder / "build.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        stale.unlink(missing_ok=True)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
