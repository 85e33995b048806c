"""GPU check (issue 13): bf16 decode compiled with CUDA graphs, a bf16 training step's MFU, flex and
SDPA attention, each against HF transformers on the same device, and every CUDA path the README
claims (NCCL, bf16 autocast, fused AdamW, FSDP2 on one GPU, the trainer on CUDA) run once. One
table; exits 1 when a path fails, 0 with "no CUDA: skipped" on a machine without a GPU.

    python -m benchmarks.gpu              # full check; rewrites its RESULTS.md section
    python -m benchmarks.gpu --quick      # smaller shapes and fewer rounds (a few minutes)
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import time
import traceback

import torch
import torch.nn.functional as F

DECODE = {"vocab": 32000, "d_model": 2048, "n_layers": 16, "n_heads": 16, "n_kv_heads": 8, "d_ff": 5632}
TRAIN = {"vocab": 32000, "d_model": 1024, "n_layers": 12, "n_heads": 16, "n_kv_heads": 16, "d_ff": 2816}
SPEC_PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12}  # dense TFLOP/s


def ours(shape: dict, max_len: int, backend: str = "sdpa"):
    import torchformer as tfm

    cfg = tfm.presets.get(
        "llama-tiny",
        vocab_size=shape["vocab"],
        d_model=shape["d_model"],
        n_layers=shape["n_layers"],
        max_seq_len=max_len,
        tie_embeddings=False,
        attention={"n_heads": shape["n_heads"], "n_kv_heads": shape["n_kv_heads"], "backend": backend},
        block={"d_ff": shape["d_ff"]},
    )
    return tfm.build_model(cfg)


def hf(shape: dict, max_len: int, attn: str = "sdpa"):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=shape["vocab"],
        hidden_size=shape["d_model"],
        intermediate_size=shape["d_ff"],
        num_hidden_layers=shape["n_layers"],
        num_attention_heads=shape["n_heads"],
        num_key_value_heads=shape["n_kv_heads"],
        max_position_embeddings=max_len,
        attn_implementation=attn,
    )
    model = LlamaForCausalLM(cfg)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
    return model


def cuda_time(fn, rounds: int) -> float:
    """Best seconds of ``rounds`` calls, each synchronised (after one warm-up call)."""
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


def decode_rows(args, dev) -> list[tuple]:
    """Batch-1 bf16 greedy decode: our step compiled with mode='reduce-overhead' (CUDA graphs; the
    static cache's tensors marked static so their in-place writes stay inside the graph) against
    HF generate with its static cache, eager and compiled."""
    from torchformer.generation.steps import decoder_step

    shape = dict(DECODE, n_layers=4) if args.quick else DECODE
    P, N = 128, 64 if args.quick else 256
    model = ours(shape, P + N).to(dev, torch.bfloat16).eval()
    ids = torch.randint(0, shape["vocab"], (1, P), device=dev)
    step = torch.compile(decoder_step, mode="reduce-overhead", fullgraph=True, dynamic=False)

    cache = model.new_cache(1, P + N)  # one cache for every round: fixed addresses for the CUDA graph
    for layer in cache.layers:
        torch._dynamo.mark_static_address(layer.k)
        torch._dynamo.mark_static_address(layer.v)

    @torch.inference_mode()
    def run_ours():  # a reused cache needs no clearing: slot t is rewritten before position t reads it
        pos = torch.arange(P, device=dev)[None]
        tok = model.lm_head(model.hidden(ids, pos, None, cache)[:, -1]).argmax(-1, keepdim=True)
        pos = pos[:, -1:] + 1
        for _ in range(N - 1):
            tok = step(model, tok, pos, cache).argmax(-1, keepdim=True)  # (1, 1)
            pos = pos + 1
        return tok

    hf_model = hf(shape, P + N).to(dev, torch.bfloat16).eval()

    def run_hf(compiled: bool):
        kw = {"cache_implementation": "static"} if compiled else {}
        with torch.inference_mode():
            hf_model.generate(ids, max_new_tokens=N, min_new_tokens=N, do_sample=False, **kw)

    if not args.quick:  # HF's documented way to compile generate: a static cache and a compiled forward
        hf_model.forward = torch.compile(hf_model.forward, mode="reduce-overhead", fullgraph=True)
    rows = []
    t_ours = cuda_time(run_ours, args.rounds)
    t_hf = cuda_time(lambda: run_hf(not args.quick), args.rounds)
    n_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n != "embed.tok.weight")
    rows.append(("decode bf16 b1", "torchformer compiled + CUDA graphs", f"{N / t_ours:.0f} tok/s", t_hf / t_ours))
    label = "HF generate static cache, compiled" if not args.quick else "HF generate"
    rows.append(("decode bf16 b1", label, f"{N / t_hf:.0f} tok/s", 1.0))
    rows.append(("decode bf16 b1", "weights streamed", f"{n_bytes * N / t_ours / 1e9:.0f} GB/s", None))
    return rows


def peak_bf16(dev) -> tuple[float, str]:
    name = torch.cuda.get_device_name(dev)
    spec = next((v for k, v in SPEC_PEAK_BF16.items() if k in name), None)
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    measured = 2 * 8192**3 / cuda_time(lambda: a @ a, 10)
    return (spec, "spec sheet") if spec else (measured, "measured 8192^3 matmul")


def train_rows(args, dev) -> list[tuple]:
    """bf16 autocast training step (fp32 weights, fused AdamW), compiled, ours vs HF Llama."""
    import torchformer as tfm

    shape = dict(TRAIN, n_layers=4) if args.quick else TRAIN
    B, T = 8, 1024
    cfg_model = ours(shape, T).to(dev)
    flops = tfm.flops_per_token(cfg_model.config, T).training
    ids = torch.randint(0, shape["vocab"], (B, T + 1), device=dev)
    peak, source = peak_bf16(dev)
    rows = []
    for name, model, call in (
        ("torchformer", cfg_model, lambda m, x: m(x)),
        ("HF LlamaForCausalLM", hf(shape, T).to(dev), lambda m, x: m(input_ids=x).logits),
    ):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        fwd = torch.compile(lambda x, m=model, c=call: c(m, x))

        def step(fwd=fwd, opt=opt):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = fwd(ids[:, :-1])
            F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten()).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()  # compile outside the timing
        t = cuda_time(step, args.rounds)
        rows.append(("train bf16 step", name, f"{B * T / t:.0f} tok/s, MFU {B * T / t * flops / peak:.0%}", t))
    base = rows[1][3]
    rows = [(a, b, c + f" of {peak / 1e12:.0f} TFLOP/s ({source})", base / t) for a, b, c, t in rows]
    return rows


def attention_rows(args, dev) -> list[tuple]:
    """Forward + backward of a 2-layer model at long context: our flex and sdpa backends against HF's
    flex_attention and sdpa implementations."""
    shape = dict(TRAIN, n_layers=2)
    B, T = 2, 2048 if args.quick else 8192
    ids = torch.randint(0, shape["vocab"], (B, T), device=dev)
    rows = []
    for backend, hf_attn in (("sdpa", "sdpa"), ("flex", "flex_attention")):
        times = {}
        for who, model, call in (
            ("torchformer", ours(shape, T, backend), lambda m: m(ids)),
            ("HF", hf(shape, T, hf_attn), lambda m: m(input_ids=ids).logits),
        ):
            model = model.to(dev, torch.bfloat16)
            fn = torch.compile(lambda m=model, c=call: c(m).float().mean().backward())
            times[who] = cuda_time(fn, args.rounds)
        rows.append(
            (
                f"attention {backend} T={T}",
                "torchformer",
                f"{times['torchformer'] * 1e3:.1f} ms",
                times["HF"] / times["torchformer"],
            )
        )
        rows.append((f"attention {backend} T={T}", f"HF {hf_attn}", f"{times['HF'] * 1e3:.1f} ms", 1.0))
    return rows


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def paths_rows(args, dev) -> list[tuple]:
    """NCCL (one rank), FSDP2 fully_shard as distributed.wrap applies it, bf16 autocast and the
    library's fused AdamW for a few steps; then the trainer itself on CUDA (train.device=cuda)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from torchformer.training import optim, recipe
    from torchformer.training.train import train

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=dev)
    try:
        x = torch.ones(4, device=dev)
        dist.all_reduce(x)
        assert torch.equal(x, torch.ones(4, device=dev)), "NCCL all_reduce over one rank changed the tensor"
        model = ours(dict(TRAIN, n_layers=2), 256).to(dev)
        for block in model.stack.blocks:  # as training/distributed.wrap shards: each block, then the whole
            fully_shard(block)
        fully_shard(model)
        opt = optim.adamw(model, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, device_type="cuda")
        assert opt.defaults.get("fused"), "adamw did not pick the fused kernel on CUDA"
        ids = torch.randint(0, TRAIN["vocab"], (4, 257), device=dev)
        losses = []
        for _ in range(5):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(ids[:, :-1]).float().flatten(0, 1), ids[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        assert losses[-1] < losses[0], f"FSDP2 steps did not lower the loss: {losses}"
    finally:
        dist.destroy_process_group()
    rows = [("paths", "NCCL + FSDP2 + bf16 autocast + fused AdamW", f"loss {losses[0]:.2f} -> {losses[-1]:.2f}", None)]
    with tempfile.TemporaryDirectory() as out:
        for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
            os.environ.pop(key, None)
        overrides = [f"train.out_dir={out}", "train.device=cuda", "train.steps=60", "train.eval_every=30"]
        rec = recipe.load("reverse", [*overrides, "schedule.warmup=10"])
        result = train(rec)
    rows.append(
        (
            "paths",
            "torchformer trainer on CUDA (reverse recipe, bf16 autocast)",
            f"val loss {result.val_loss:.2f}",
            None,
        )
    )
    return rows


def tp_rows(args, dev) -> list[tuple]:
    from benchmarks.gpu_tp import tp_rows as rows  # its own file: torchrun workers per TP degree

    return rows(args, dev)


SECTIONS = {"decode": decode_rows, "train": train_rows, "attention": attention_rows, "paths": paths_rows,
            "tp": tp_rows}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller shapes, fewer rounds")
    p.add_argument(
        "--sections", type=lambda s: s.split(","), default=list(SECTIONS), help=f"subset of {list(SECTIONS)}"
    )
    p.add_argument("--no-write", dest="write", action="store_false", help="do not update RESULTS.md")
    args = p.parse_args([] if argv is None else argv)
    if not torch.cuda.is_available():
        print("benchmarks.gpu: no CUDA: skipped")
        return 0
    args.rounds = 3 if args.quick else 10
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    rows, failed = [], []
    for name in args.sections:
        try:
            rows += SECTIONS[name](args, dev)
        except Exception as err:  # one failing path must not hide the others; it fails the run below
            traceback.print_exc()
            failed.append(name)
            rows.append((name, "FAILED", f"{type(err).__name__}: {str(err).splitlines()[0][:100]}", None))
    lines = ["| check | system | result | vs HF |", "|---|---|---|---:|"]
    lines += [f"| {a} | {b} | {c} | {'-' if r is None else f'{r:.2f}x'} |" for a, b, c, r in rows]
    text = "\n".join(lines + ["", f"Device: {torch.cuda.get_device_name(dev)}. Failed: {failed or 'none'}."])
    print(text)
    if args.write:
        from benchmarks.results import write_section

        command = "python -m benchmarks.gpu " + " ".join(argv or [])
        write_section("gpu", "GPU check (issue 13)", command.strip(), "one GPU", text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
