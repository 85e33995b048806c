"""Mixture-of-experts training throughput (forward + loss + backward) against a dense model with
the same active parameters and against transformers' Mixtral on the same shape (issue 17).

Shape: 4 layers, d_model 384, 6 heads, vocab 8192, T 256, B 8, fp32. MoE: 8 experts of width 512,
top-2 (each token multiplies 2 experts = 2 x 3 x 384 x 512 MLP weights); the dense model's SwiGLU
is 1024 wide (the same weights per token); Mixtral: MixtralForCausalLM with the same sizes (SDPA
attention, transformers' default expert implementation: grouped_mm on CPU). torchformer MoE runs
with dispatch "loop" (a matmul per expert) and "grouped" (grouped_mm, like transformers). Rounds
interleave the systems and each system's best round counts (noise on a shared machine only slows
a round). Targets: MoE (the faster dispatch) >= 1.0x Mixtral, MoE time <= 1.5x the dense model's.

    python -m benchmarks.moe              # full run; rewrites its RESULTS.md section
    python -m benchmarks.moe --quick      # smoke run (seconds), nothing written
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

import torchformer as tfm
from benchmarks.results import load_note, write_section

V, D, L, H, T, B = 8192, 384, 4, 6, 256, 8
E, K, FE = 8, 2, 512


def ours(moe: bool, dispatch: str = "loop") -> torch.nn.Module:
    cfg = tfm.ModelConfig(
        vocab_size=V, d_model=D, n_layers=L, max_seq_len=T, attention=tfm.AttentionConfig(n_heads=H),
        block=tfm.BlockConfig(norm="rmsnorm", mlp="swiglu", d_ff=FE if moe else K * FE), positions=tfm.RoPE(),
        tie_embeddings=False, moe=tfm.MoE(n_experts=E, top_k=K, dispatch=dispatch) if moe else None,
    )  # fmt: skip
    return tfm.build_model(cfg).train()


def mixtral() -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=V, hidden_size=D, intermediate_size=FE, num_hidden_layers=L, num_attention_heads=H,
                        num_key_value_heads=H, num_local_experts=E, num_experts_per_tok=K, max_position_embeddings=T,
                        attn_implementation="sdpa")  # fmt: skip
    return MixtralForCausalLM(cfg).train()


def step_ours(model, ids):
    logits = model(ids[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()


def step_hf(model, ids):
    logits = model(input_ids=ids[:, :-1]).logits
    F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()


def measure(rounds: int, steps: int, batch: int) -> dict[str, float]:
    systems = {"torchformer MoE": (ours(True), step_ours),
               "torchformer MoE grouped": (ours(True, "grouped"), step_ours),
               "torchformer dense": (ours(False), step_ours),
               "transformers Mixtral": (mixtral(), step_hf)}  # fmt: skip
    ids = torch.randint(0, V, (batch, T + 1))
    best = dict.fromkeys(systems, float("inf"))
    for model, step in systems.values():  # warm-up: allocator, kernels
        step(model, ids)
        model.zero_grad(set_to_none=True)
    for _ in range(rounds):
        for name, (model, step) in systems.items():
            start = time.perf_counter()
            for _ in range(steps):
                step(model, ids)
                model.zero_grad(set_to_none=True)
            best[name] = min(best[name], (time.perf_counter() - start) / steps)
    return {name: batch * T / s for name, s in best.items()}


def table(tps: dict[str, float]) -> str:
    moe = max(tps["torchformer MoE"], tps["torchformer MoE grouped"])  # the faster dispatch
    dense, hf = tps["torchformer dense"], tps["transformers Mixtral"]
    rows = ["| system | tokens/s (fwd+bwd) | vs transformers Mixtral |", "|---|---:|---:|"]
    rows += [f"| {name} | {v:,.0f} | {v / hf:.2f}x |" for name, v in tps.items()]
    rows += ["", f"MoE (faster dispatch) vs Mixtral: {moe / hf:.2f}x (target >= 1.0x); MoE time / dense time: "
             f"{dense / moe:.2f}x (target <= 1.5x). Equal active parameters per token: {K} of {E} experts vs a "
             f"{K * FE}-wide SwiGLU."]  # fmt: skip
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.moe", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="1 round, batch 2, nothing written")
    p.add_argument("--no-write", dest="write", action="store_false", help="do not update RESULTS.md")
    args = p.parse_args([] if argv is None else argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    load = os.getloadavg()
    tps = measure(1 if args.quick else args.rounds, 1 if args.quick else args.steps, 2 if args.quick else B)
    text = table(tps)
    print(text)
    if args.write and not args.quick:
        command = ("python -m benchmarks.moe " + " ".join(argv or [])).strip()
        setting = f"L{L} d{D} H{H} V{V} T{T} B{B}, {E} experts top-{K}; {load_note(load)}"
        write_section("moe", "Mixture of experts training step (issue 17)", command, setting, text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
