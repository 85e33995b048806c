"""Peak and resident memory of loading the engines benchmark's models (issue 25's memory target,
issue 29's GGUF files): one fresh process per format, `tfm.load_any` of the bf16 HF folder (quantized
as it is read for int8 / int4) or of llama.cpp's GGUF file, with the model's own bytes beside it.

    python -m benchmarks.load_memory --shape 1b --formats int4,int8,Q4_0,Q8_0,Q4_K_M
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from benchmarks import engines

GGUF = ("F16", "Q8_0", "Q4_0", "Q4_K_M")


def child(shape: str, fmt: str) -> dict:
    import torch

    import torchformer as tfm

    before = engines.resident_bytes() / 2**20
    t0 = time.perf_counter()
    if fmt in GGUF:
        model = tfm.load_any(str(engines.gguf_file(shape, fmt, engines.CACHE)), dtype=torch.bfloat16)
    else:
        scheme = None if fmt == "bf16" else fmt
        group = 64 if fmt == "int4" else None
        model = tfm.load_any(str(engines.hf_folder(shape, engines.CACHE)), dtype=torch.bfloat16, quantize=scheme,
                             group_size=group)  # fmt: skip
    seconds = time.perf_counter() - t0
    return {"load_s": seconds, "before_mib": before, "rss_mib": engines.resident_bytes() / 2**20,
            "peak_mib": engines.peak_rss_mb(), "model_mib": engines.torch_held_bytes(model) / 2**20}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="1b", choices=("toy", "1b"))
    p.add_argument("--formats", default="bf16,int8,int4,Q8_0,Q4_0,Q4_K_M")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(*json.loads(args.child))))
        return 0
    columns = ["load (s)", "model's bytes (MiB)", "RSS after load (MiB)", "peak RSS (MiB)"]
    columns.append("peak - model - torch (MiB)")
    print("| format | " + " | ".join(columns) + " |")
    print("|---|---:|---:|---:|---:|---:|")
    for fmt in args.formats.split(","):
        cmd = [sys.executable, "-m", "benchmarks.load_memory", "--child", json.dumps([args.shape, fmt])]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        r = json.loads(done.stdout.strip().splitlines()[-1])
        extra = r["peak_mib"] - r["model_mib"] - r["before_mib"]
        cells = [f"{r['load_s']:.1f}", *(f"{r[k]:.0f}" for k in ("model_mib", "rss_mib", "peak_mib")), f"{extra:.0f}"]
        print(f"| {fmt} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
