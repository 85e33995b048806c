"""Decode steps compiled ahead (fast/exported.py) kept on disk, so that a later process loads a
model's step instead of exporting and compiling it again: the toy shape's int4 step loads in well
under a second against ~15-30 s of export and compile, and the process never imports dynamo or
inductor (~190 MiB resident: a compiled generate's memory becomes an eager one's).

A package is named by a hash of everything its graph was traced from: torch's and Python's
versions, torchformer's own source (every file of the package, so an edited forward is a new
key), the step function, each module's name, class and plain attributes (numbers, flags, dtypes,
functions by name, a config's repr), each parameter's and buffer's name, shape, strides and dtype,
the step's input shapes, the thread count, the CPU's vector ISA and flags, and every
``TORCHFORMER_*`` variable. A model with hooks (arbitrary Python the hash cannot see) is compiled
every time and never stored. The weights are not in the package (they are bound at load, no
copy), so two models of one architecture share one.

``TORCHFORMER_STEP_CACHE``: the folder (default ``$XDG_CACHE_HOME/torchformer/steps``, else
``~/.cache/torchformer/steps``), or ``0`` for none.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import logging
import os
import sys
import types
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

log = logging.getLogger(__name__)

PACKAGE = Path(__file__).resolve().parent.parent  # torchformer/
SOURCE_SUFFIXES = (".py", ".cpp", ".inc", ".h")


def folder() -> Path | None:
    """Where packages are kept (module docstring), or None when turned off."""
    value = os.environ.get("TORCHFORMER_STEP_CACHE", "").strip()
    if value == "0":
        return None
    if value:
        return Path(value)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "torchformer" / "steps"


@functools.cache
def source_hash() -> str:
    """A hash of torchformer's own source files (names and bytes), read once per process."""
    digest = hashlib.sha256()
    for path in sorted(p for p in PACKAGE.rglob("*") if p.suffix in SOURCE_SUFFIXES and p.is_file()):
        digest.update(str(path.relative_to(PACKAGE)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


@functools.cache
def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def plain(value) -> str:
    """What a traced forward may read from an attribute, as text: the value of plain data, a
    function's or class's qualified name, a dataclass's repr (a config); else the type's name."""
    if value is None or isinstance(value, bool | int | float | str | torch.dtype | torch.device | enum.Enum):
        return repr(value)
    if isinstance(value, tuple | list):
        return "(" + ",".join(plain(v) for v in value) + ")"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return repr(value)
    if isinstance(value, types.FunctionType | types.BuiltinFunctionType | type | functools.partial):
        target = value.func if isinstance(value, functools.partial) else value
        return f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', repr(target))}"
    return type(value).__qualname__


def hooked(model: nn.Module) -> bool:
    """Whether any module hook (the model's own or a global one) would run in the step."""
    glob = nn.modules.module
    if glob._global_forward_hooks or glob._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def fingerprint(model: nn.Module, fn: Callable, structure: tuple, inputs: list[Tensor]) -> str | None:
    """The package name for ``fn``'s step over ``model`` (module docstring); None for a model with
    hooks. ``structure``: fast/exported.py ``structure`` (the modules' names and classes, each
    tensor's layout); ``inputs``: the step's."""
    if hooked(model):
        return None
    parts = [torch.__version__, sys.version, source_hash(), f"{fn.__module__}.{fn.__qualname__}"]
    parts += [str(torch.get_num_threads()), torch.backends.cpu.get_cpu_capability(), cpu_flags()]
    parts += sorted(f"{k}={v}" for k, v in os.environ.items() if k.startswith("TORCHFORMER_"))
    parts.append(repr(structure))
    for name, m in model.named_modules():  # what the structure leaves out: the plain attributes
        parts.append(f"{name}:{sorted((k, plain(v)) for k, v in vars(m).items() if not k.startswith('_'))}")
    parts += [f"{tuple(t.shape)}:{t.stride()}:{t.dtype}:{t.device}" for t in inputs]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def load(path: Path):
    """The loader of the package at ``path``, or None where there is none or it cannot be loaded
    (then it is removed, to be compiled again)."""
    if not path.is_file():
        return None
    try:
        return torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
    except Exception as err:  # a truncated or foreign file: the C++ loader's errors have no common base
        log.warning("torchformer: the compiled step %s could not be loaded (%s); compiling it again", path, err)
        path.unlink(missing_ok=True)
        return None


def store(compile_to: Callable[[str], str], path: Path) -> str:
    """``compile_to(a temporary name)`` renamed to ``path`` once whole: a reader never sees half a
    package, and two processes compiling one step leave one of theirs."""
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(f"{path.stem}.{os.getpid()}.part.pt2")
    try:
        compile_to(str(part))
        os.replace(part, path)
    finally:
        part.unlink(missing_ok=True)
    return str(path)
