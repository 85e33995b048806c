"""Attention memory and time per position scheme (issue 12): the default path (backend "auto")
against the dense-bias path of before (backend "sdpa": a (B, H, T, S) float bias or a (B, 1, T, S)
bool mask per forward) and against RoPE + SDPA is_causal, measured in the same run.

One attention call as the stack makes it: the per-forward context (positions, RoPE rows, pattern,
block mask or dense tensors) and the backend on q, k, v of batch 1, 8 heads, head_dim 64; with
--modes fwd,bwd also the backward (q, k, v and a learned T5 table require grad). Peak memory
growth is the resident set's peak during the call minus before it, sampled every 0.5 ms; the
process runs with MALLOC_MMAP_THRESHOLD_ fixed so every large tensor is mapped and unmapped (glibc
would otherwise keep freed memory resident and hide later growth). Time: best of --rounds rounds,
systems interleaved within a round. The first call per shape compiles flex: reported separately
(first call minus the best call). The dense path is skipped where its bias alone would exceed
--dense-max-gb.

    python -m benchmarks.attention                                 # full table; rewrites RESULTS.md
    python -m benchmarks.attention --lengths 1024 --rounds 1 --no-write
    python -m benchmarks.attention --threads 1    # on a busy machine: many mid-size matmuls suffer
                                                  # most from contended OpenMP threads
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time

import torch

import torchformer as tfm
from benchmarks.engines import resident_bytes
from benchmarks.results import write_section

H, E = 8, 64
SCHEMES = {
    "RoPE": (tfm.RoPE, None),
    "ALiBi": (tfm.ALiBi, None),
    "relative": (lambda: tfm.RelativeBias(num_buckets=32, max_distance=128), None),
    "window 1024": (tfm.RoPE, 1024),
}
SYSTEMS = {"auto": "auto", "dense": "sdpa"}  # label -> backend word
TARGET = 1.5  # issue 12: at T = 8192, at most 1.5x the memory and time of RoPE + SDPA


class PeakRSS:
    """Peak resident set size during the block, sampled on a thread."""

    def __enter__(self):
        self.base = self.peak = resident_bytes()
        self.running = True
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()
        return self

    def sample(self) -> None:
        while self.running:
            self.peak = max(self.peak, resident_bytes())
            time.sleep(0.0005)

    def __exit__(self, *exc) -> None:
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, resident_bytes())

    @property
    def growth_mb(self) -> float:
        return (self.peak - self.base) / 2**20


def build(scheme: str, backend: str, T: int) -> torch.nn.Module:
    positions, window = SCHEMES[scheme]
    attention = tfm.AttentionConfig(n_heads=H, backend=backend, sliding_window=window)
    cfg = tfm.ModelConfig(vocab_size=16, d_model=H * E, n_layers=1, max_seq_len=T, attention=attention,
                          positions=positions())  # fmt: skip
    model = tfm.build_model(cfg)
    for p in model.parameters():
        p.requires_grad_(False)
    bias = getattr(model.stack, "score_bias", None)
    if bias is not None and hasattr(bias, "weight"):
        bias.weight.requires_grad_(True)  # T5's table learns: its gradient is part of the backward
    return model


def call(model: torch.nn.Module, q, k, v, backward: bool) -> None:
    """Context + attention (+ backward), exactly as a forward's first layer runs them."""
    T = q.shape[2]
    ctx = model.stack.context(torch.arange(T)[None], None, None, aligned=True)  # as forward(ids) builds it
    attn = model.stack.blocks[0].attn
    if ctx.rope is not None:
        q, k = attn.rotate(q, *ctx.rope), attn.rotate(k, *ctx.rope)
    out = attn.backend(q, k, v, mask=ctx.mask, bias=ctx.bias, is_causal=ctx.is_causal, scale=attn.scale,
                       dropout_p=0.0, softcap=None, pattern=ctx.pattern)  # fmt: skip
    if backward:
        out.sum().backward()


def measure(model, T: int, backward: bool) -> tuple[float, float]:
    """(seconds, peak MB growth) of one call."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, T, E, generator=g).requires_grad_(backward) for _ in range(3))
    with PeakRSS() as peak:
        t0 = time.perf_counter()
        call(model, q, k, v, backward)
        seconds = time.perf_counter() - t0
    return seconds, peak.growth_mb


def run(lengths, modes, rounds: int, dense_max_gb: float) -> tuple[list[dict], list[str]]:
    rows, compile_notes = [], []
    for T in lengths:
        for mode in modes:
            backward = mode == "fwd+bwd"
            systems = [("RoPE + SDPA", "RoPE", "sdpa")]
            for scheme in SCHEMES:
                for label, backend in SYSTEMS.items():
                    dense_gb = 4 * H * T * T / 1e9 * (3 if backward else 1)
                    if label == "dense" and (scheme == "RoPE" or dense_gb > dense_max_gb):
                        continue
                    systems.append((f"{scheme} {label}", scheme, backend))
            models = {name: build(scheme, backend, T) for name, scheme, backend in systems}
            best: dict[str, tuple[float, float]] = {}
            first: dict[str, float] = {}
            for r in range(rounds + 1):  # round 0 warms up (flex compiles there)
                for name in models:
                    s, mb = measure(models[name], T, backward)
                    if r == 0:
                        best[name], first[name] = (float("inf"), mb), s
                        continue
                    best[name] = (min(best[name][0], s), min(best[name][1], mb))
            for name in models:
                if name.endswith("auto") and first[name] - best[name][0] > 1.0:
                    compile_notes.append(f"T={T} {mode} {name}: first call {first[name]:.1f} s, "
                                         f"{first[name] - best[name][0]:.1f} s of it compiling")  # fmt: skip
            base_s, base_mb = best["RoPE + SDPA"]
            for name, (s, mb) in best.items():
                rows.append({"T": T, "mode": mode, "system": name, "s": s, "mb": mb,
                             "x_time": s / base_s, "x_mem": mb / max(base_mb, 1.0)})  # fmt: skip
            print(f"T={T} {mode}: " + ", ".join(f"{n} {s:.2f}s {mb:.0f}MB" for n, (s, mb) in best.items()), flush=True)
    return rows, compile_notes


def table(rows: list[dict]) -> str:
    lines = ["| T | pass | system | time (s) | peak growth (MB) | time / RoPE+SDPA | memory / RoPE+SDPA |",
             "|---:|---|---|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['T']} | {r['mode']} | {r['system']} | {r['s']:.3f} | {r['mb']:.0f} | "
                     f"{r['x_time']:.2f}x | {r['x_mem']:.2f}x |")  # fmt: skip
    return "\n".join(lines)


def verdicts(rows: list[dict]) -> str:
    out = []
    for r in rows:
        if r["T"] == 8192 and r["system"].endswith("auto") and not r["system"].startswith("RoPE"):
            ok = r["x_time"] <= TARGET and r["x_mem"] <= TARGET
            out.append(f"- T=8192 {r['mode']} {r['system']}: time {r['x_time']:.2f}x, memory {r['x_mem']:.2f}x "
                       f"(target <= {TARGET}x both): {'met' if ok else 'MISSED'}")  # fmt: skip
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,4096,8192,16384")
    parser.add_argument("--modes", default="fwd,fwd+bwd")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dense-max-gb", type=float, default=3.0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != "65536":  # see the module docstring
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
        cmd = [sys.executable, "-m", "benchmarks.attention", *(argv if argv is not None else sys.argv[1:])]
        return subprocess.call(cmd, env=env)
    lengths = [int(x) for x in args.lengths.split(",")]
    modes = ["fwd+bwd" if m == "bwd" else m for m in args.modes.split(",")]
    rows, notes = run(lengths, modes, args.rounds, args.dense_max_gb)
    text = table(rows) + "\n\n" + verdicts(rows) + "\n\nOne-time flex compile cost (first call per shape):\n"
    text += "\n".join(f"- {n}" for n in notes) or "- none above 1 s"
    print(text)
    if not args.no_write:
        command = "python -m benchmarks.attention " + " ".join(argv if argv is not None else sys.argv[1:])
        setting = f"batch 1, {H} heads, head_dim {E}, best of {args.rounds} rounds"
        write_section("attention", "Attention memory and time per position scheme (issue 12)", command.strip(),
                      setting, text)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
