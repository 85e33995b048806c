"""The tensor-parallel row of benchmarks/gpu.py (issue 31): prefill and decode tokens/s of one bf16
model at TP 1 and at TP N (every GPU the machine has), NCCL, each run a torchrun launch of this
module's worker. Needs CUDA; ``--device cpu`` runs the same worker on gloo with a tiny shape (a
smoke check of the code path, not a measurement).

    python -m benchmarks.gpu --sections tp          # as a section of the GPU check
    python -m benchmarks.gpu_tp --tp 1,8            # this table alone
    torchrun --nproc_per_node 2 -m benchmarks.gpu_tp --worker --device cpu --quick   # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

import torch

SHAPE = {"vocab": 32000, "d_model": 4096, "n_layers": 8, "n_heads": 32, "n_kv_heads": 8, "d_ff": 11008}
TINY = {"vocab": 512, "d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "d_ff": 128}


def build(shape: dict, max_len: int):
    import torchformer as tfm

    cfg = tfm.presets.get("llama-tiny", vocab_size=shape["vocab"], d_model=shape["d_model"],
                          n_layers=shape["n_layers"], max_seq_len=max_len, tie_embeddings=False,
                          attention={"n_heads": shape["n_heads"], "n_kv_heads": shape["n_kv_heads"]},
                          block={"d_ff": shape["d_ff"]})  # fmt: skip
    torch.manual_seed(0)  # the same weights on every rank before the split
    return tfm.build_model(cfg)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


@torch.inference_mode()
def worker(args) -> None:
    """One rank: build, split over all ranks (TP = world), time a prefill and greedy decode steps."""
    import torch.distributed as dist

    from torchformer.parallel import parallelize, tp_mesh

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo")
    shape = TINY if args.quick or not cuda else SHAPE
    P, N = (32, 16) if args.quick or not cuda else (1024, 128)
    model = build(shape, P + N).to(dev, torch.bfloat16 if cuda else torch.float32).eval()
    if world > 1:
        parallelize(model, tp_mesh(dev.type, world))
    ids = torch.randint(0, shape["vocab"], (1, P), generator=torch.Generator().manual_seed(1)).to(dev)
    best_prefill = best_decode = float("inf")
    for _ in range(args.rounds):
        cache = model.new_cache(1, P + N)
        pos = torch.arange(P, device=dev)[None]
        sync(dev)
        t0 = time.perf_counter()
        tok = model.logits(ids, pos, None, cache)[:, -1].argmax(-1, keepdim=True)
        sync(dev)
        t1 = time.perf_counter()
        pos = pos[:, -1:] + 1
        for _ in range(N - 1):
            tok = model.logits(tok, pos, None, cache)[:, -1].argmax(-1, keepdim=True)
            pos = pos + 1
        sync(dev)
        best_prefill, best_decode = min(best_prefill, t1 - t0), min(best_decode, time.perf_counter() - t1)
    if world == 1 or dist.get_rank() == 0:
        print(json.dumps({"tp": world, "prefill_tok_s": P / best_prefill, "decode_tok_s": (N - 1) / best_decode}))
    if world > 1:
        dist.destroy_process_group()


def launch(n: int, device: str, quick: bool, timeout: float = 900) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n), "-m",
           "benchmarks.gpu_tp", "--worker", "--device", device, *(["--quick"] if quick else [])]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:  # torchrun's summary ends stderr: name the worker's own error first
        errors = [line for line in proc.stderr.splitlines() if re.match(r"\w+(Error|Exception)\b.*:", line)]
        raise RuntimeError(f"TP={n} worker failed: {errors[0] if errors else ''}\n{proc.stderr[-1500:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def check_degrees(degrees: list[int], available: int) -> None:
    for n in degrees:
        if n < 1 or n > available or SHAPE["n_kv_heads"] % n:
            raise ValueError(f"--tp {n}: must be in [1, {available}] (the GPUs here) and divide the model's "
                             f"{SHAPE['n_kv_heads']} KV heads")  # fmt: skip


def tp_rows(args, dev=None) -> list[tuple]:
    """gpu.py's section: TP 1 and TP = every GPU (rows: check, system, result, ratio to TP 1)."""
    n = torch.cuda.device_count()
    degrees = getattr(args, "tp", None) or sorted({1, n})
    check_degrees(degrees, n)
    results = {d: launch(d, "cuda", args.quick) for d in degrees}
    base = results[1] if 1 in results else results[degrees[0]]
    rows = []
    for d, r in results.items():
        for kind in ("prefill", "decode"):
            rows.append((f"TP {kind} bf16 b1", f"torchformer TP={d} (NCCL)", f"{r[f'{kind}_tok_s']:.0f} tok/s",
                         r[f"{kind}_tok_s"] / base[f"{kind}_tok_s"]))  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_tp", description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=lambda s: [int(x) for x in s.split(",")], default=None, help="degrees, e.g. 1,8")
    p.add_argument("--quick", action="store_true", help="a tiny shape, fewer rounds")
    p.add_argument("--worker", action="store_true", help="(internal) one rank under torchrun")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = p.parse_args(argv)
    args.rounds = 2 if args.quick else 5
    if args.worker:
        worker(args)
        return 0
    if not torch.cuda.is_available():
        print("benchmarks.gpu_tp: no CUDA: skipped")
        return 0
    for row in tp_rows(args):
        print("| " + " | ".join(str(x) if not isinstance(x, float) else f"{x:.2f}x" for x in row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
