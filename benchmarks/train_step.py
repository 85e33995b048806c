"""Training-step throughput (forward + loss + backward + AdamW step) against the peers.

Same shapes for everyone (issue 4): 6 layers, d_model 384, 6 heads, vocab 8192, T 256, B 8,
fp32, no dropout. Systems: torchformer GPT-2-style and Llama-style, HF transformers
GPT2LMHeadModel and LlamaForCausalLM (SDPA attention), x-transformers (attn_flash); each eager
and, unless --no-compile, under torch.compile. Timing rounds are interleaved across systems and
each system's best round counts: on this shared machine noise only ever slows a round (medians
of whole runs moved 10-15% between runs; best rounds move less). The fp32 matmul peak is
measured in the same run, also as a best (of 2048^2 matmuls, before and after), and MFU = achieved / peak,
with the PaLM/nanoGPT FLOP count of ``tfm.flops_per_token(cfg, T).training``.

    python -m benchmarks.train_step                       # full run; rewrites its RESULTS.md section
    python -m benchmarks.train_step --quick --no-compile  # smoke run (seconds), nothing written
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import torchformer as tfm
from benchmarks.results import write_section
from torchformer.analysis.accounting import flops_per_token, matmul_peak_flops
from torchformer.host_memory import keep_freed_memory

V, D, L, H, T, B = 8192, 384, 6, 6, 256, 8


def tf_gpt2_config():
    return tfm.presets.get(
        "gpt2-small", vocab_size=V, d_model=D, n_layers=L, max_seq_len=T, attention={"n_heads": H},
        bos_token_id=None, eos_token_id=None,
    )  # fmt: skip


def tf_llama_config():
    return tfm.presets.get("llama-tiny", vocab_size=V, d_model=D, n_layers=L, max_seq_len=T,
                           attention={"n_heads": H, "n_kv_heads": H})  # fmt: skip


def hf_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=V, n_positions=T, n_embd=D, n_layer=L, n_head=H, resid_pdrop=0.0, embd_pdrop=0.0,
                     attn_pdrop=0.0, bos_token_id=None, eos_token_id=None, attn_implementation="sdpa")  # fmt: skip
    return GPT2LMHeadModel(cfg), lambda m, x: m(input_ids=x).logits


def hf_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    c = tf_llama_config()
    cfg = LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=c.d_ff, num_hidden_layers=L,
                      num_attention_heads=H, num_key_value_heads=H, max_position_embeddings=T,
                      tie_word_embeddings=False, attn_implementation="sdpa")  # fmt: skip
    return LlamaForCausalLM(cfg), lambda m, x: m(input_ids=x).logits


def x_transformers():
    from x_transformers import Decoder, TransformerWrapper

    model = TransformerWrapper(
        num_tokens=V, max_seq_len=T, attn_layers=Decoder(dim=D, depth=L, heads=H, attn_flash=True)
    )
    return model, lambda m, x: m(x)


def ours(make_cfg):
    pos = torch.arange(T)[None, :].expand(B, T)

    def build():
        # logits() is the unchecked forward (the input checks sync on ids.min()/max(), a graph break
        # under torch.compile); the peers do no such checks either.
        return tfm.build_model(make_cfg()), lambda m, x: m.logits(x, pos, None, None)

    return build


# name -> (builder, config whose FLOPs it is charged)
SYSTEMS = {
    "torchformer gpt2": (ours(tf_gpt2_config), tf_gpt2_config),
    "HF GPT2LMHeadModel": (hf_gpt2, tf_gpt2_config),
    "torchformer llama": (ours(tf_llama_config), tf_llama_config),
    "HF LlamaForCausalLM": (hf_llama, tf_llama_config),
    "x-transformers": (x_transformers, tf_gpt2_config),
}
BASELINE = {"torchformer gpt2": "HF GPT2LMHeadModel", "torchformer llama": "HF LlamaForCausalLM"}


def make_step(name: str, compiled: bool):
    torch.manual_seed(0)
    model, forward = SYSTEMS[name][0]()
    model.train()
    # The fused AdamW kernel for every system: HF Trainer's default since torch 2.8, and what
    # torchformer's trainer uses on CPU and CUDA.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def loss_fn(x, y):
        return F.cross_entropy(forward(model, x).flatten(0, 1), y.flatten())

    fn = torch.compile(loss_fn) if compiled else loss_fn

    def step(x, y):
        loss = fn(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def measure(args) -> tuple[list[dict], float]:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)
    runs = {}
    for name in args.systems:
        for compiled in [False, True] if args.compile else [False]:
            step = make_step(name, compiled)
            for _ in range(args.warmup + (2 if compiled else 0)):  # compile happens here
                step(x, y)
            runs[(name, compiled)] = step
    peak = matmul_peak_flops(size=2048, repeats=3)
    times: dict[tuple, list[float]] = {key: [] for key in runs}
    for _ in range(args.rounds):
        for key, step in runs.items():
            start = time.perf_counter()
            for _ in range(args.steps):
                step(x, y)
            times[key].append((time.perf_counter() - start) / args.steps)
    peak = max(peak, matmul_peak_flops(size=2048, repeats=3))
    rows = []
    for (name, compiled), ts in times.items():
        tok_s = B * T / min(ts)
        flops = flops_per_token(SYSTEMS[name][1](), T).training * tok_s
        rows.append({"system": name, "compiled": compiled, "tok_s": tok_s, "gflops": flops / 1e9, "mfu": flops / peak})
    return rows, peak


def table(rows: list[dict], peak: float) -> str:
    by = {(r["system"], r["compiled"]): r for r in rows}
    lines = [
        "| system | mode | tokens/s | GFLOP/s | MFU | vs peer |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        peer = by.get((BASELINE.get(r["system"]), r["compiled"]))
        ratio = f"{r['tok_s'] / peer['tok_s']:.2f}x {peer['system'].split()[-1]}" if peer else "-"
        mode = "compiled" if r["compiled"] else "eager"
        lines.append(
            f"| {r['system']} | {mode} | {r['tok_s']:.0f} | {r['gflops']:.1f} | {100 * r['mfu']:.0f}% | {ratio} |"
        )
    lines += ["", f"fp32 matmul peak measured in this run: {peak / 1e9:.1f} GFLOP/s (2048x2048, best of 6)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.train_step", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=8, help="interleaved timing rounds (the best counts)")
    p.add_argument("--steps", type=int, default=1, help="optimizer steps per system per round")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--systems", type=lambda s: s.split(","), default=list(SYSTEMS), help="comma-separated names")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="eager only")
    p.add_argument(
        "--no-keep-host-memory",
        dest="keep_host_memory",
        action="store_false",
        help="leave glibc's malloc as it is (freed activations go back to the kernel each step)",
    )
    p.add_argument("--quick", action="store_true", help="smoke run: 1 round of 1 step, nothing written")
    p.add_argument("--no-write", dest="write", action="store_false", help="do not update RESULTS.md")
    args = p.parse_args([] if argv is None else argv)
    unknown = [s for s in args.systems if s not in SYSTEMS]
    if unknown:
        p.error(f"unknown system(s) {unknown}; choose from {list(SYSTEMS)}")
    if args.quick:
        args.rounds, args.steps, args.warmup, args.write = 1, 1, 1, False
    torch.set_num_threads(args.threads)
    # One process, so every system runs with the same allocator setting.
    kept = args.keep_host_memory and keep_freed_memory()
    rows, peak = measure(args)
    text = table(rows, peak)
    print(text)
    if args.write:
        shapes = f"shapes: {L} layers, d_model {D}, {H} heads, vocab {V}, T {T}, B {B}, fp32, no dropout; fused AdamW"
        shapes += "; glibc keeps freed memory (host_memory.py)" if kept else "; glibc malloc as is"
        command = "python -m benchmarks.train_step " + " ".join(argv or [])
        write_section("train_step", "Training step (issue 4)", command.strip(), shapes, text)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
