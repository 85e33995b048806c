"""`torchformer kernels`: build the CPU kernels ahead of the first run, or say where they stand."""

from __future__ import annotations

import argparse
import time


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "action", choices=["build", "status"], help="build: compile them now (once per machine); status: report only"
    )


def run(args: argparse.Namespace) -> int:
    """The project's CPU kernels (src/torchformer/fast/csrc: packed and quantized products, bf16
    products, decode attention) are compiled once per machine by torch's extension loader, on
    first use, into TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions). `build` does it now,
    say in an image or before a server starts; `status` says whether they are on, built and where.
    TORCHFORMER_NATIVE=0 turns them off; without AVX-512 or AVX2, or without a C++ compiler, the
    library paths run (oneDNN, SDPA, torch's own products), with the same results. `build` also does
    inductor's one-time work ahead (fast/compiled.py ``warm_inductor``), which a first compiled run
    (`--compile`) would otherwise stop for."""
    from ..fast import native

    folder = native.build_folder(native.build_root())
    built = (folder / f"{native.NAME}.so").exists()
    if not native.enabled():
        print("the CPU kernels are turned off (TORCHFORMER_NATIVE=0): the library paths run")
    elif native.isa() is None:
        print("this CPU has neither AVX-512 nor AVX2 with FMA and F16C: the library paths run (oneDNN, SDPA, ...)")
    elif args.action == "status":
        print(f"the CPU kernels are {'built' if built else 'not built yet (torchformer kernels build)'}: {folder}")
    else:
        start = time.perf_counter()
        if native.kernels() is None:
            raise OSError(
                f"the CPU kernels could not be built in {folder} (see the warning above); the library paths run"
            )
        took = "already built" if built else f"built in {time.perf_counter() - start:.0f} s"
        print(f"the CPU kernels are ready for {native.isa()} ({took}): {folder}")
    if args.action == "build":
        from ..fast.compiled import warm_inductor

        print(f"inductor's one-time work on this machine is done ({warm_inductor():.0f} s)")
    return 0
