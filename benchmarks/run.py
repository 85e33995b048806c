"""`make bench`: run every benchmark in turn (each prints its table and rewrites its section of
benchmarks/RESULTS.md). Run on a quiet machine: a second busy process skews CPU timings 4-8x."""

from __future__ import annotations

import importlib
import sys

BENCHMARKS = [
    "benchmarks.decode",
    "benchmarks.formats",
    "benchmarks.train_step",
    "benchmarks.serve",
    "benchmarks.attention",
    "benchmarks.finetune",
    "benchmarks.moe",
]


def main() -> int:
    only = sys.argv[1:]
    for name in BENCHMARKS:
        if only and name.rsplit(".", 1)[-1] not in only:
            continue
        importlib.import_module(name).main([])
    return 0


if __name__ == "__main__":
    sys.exit(main())
