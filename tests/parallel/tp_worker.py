"""One torchrun launch for most of tests/parallel (each launch costs every rank its start-up: Python,
torch, the process group). ``torchrun --nproc_per_node 2 -m tests.parallel.tp_worker OUT
[--generate MODEL IDS] [--train RECIPE]``: each rank builds every model of the grid twice from one
seed, splits one copy with parallel.parallelize, and measures what test_tp_inference.py asserts
(the largest logit difference, greedy tokens of both copies, the bytes this rank holds); then it
runs ``torchformer generate MODEL --tp 2 --ids IDS`` and last ``torchformer train --recipe RECIPE``
(which ends the process group) in this process, as torchrun would start them, recording what
each printed. Rank r writes OUT.r as JSON; the assertions live in the tests (conftest.py's
``launched`` fixture reads the files)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import torchformer as tfm
from tests.decoding import varied_case
from torchformer.parallel import local_bytes, parallelize, tp_mesh

V = 43  # odd on purpose: the vocabulary is split unevenly (22 + 21 rows)


def decoder(heads: int, kv: int, mlp: str, tied: bool, **kw) -> tfm.ModelConfig:
    return tfm.ModelConfig(arch="decoder", vocab_size=V, d_model=32, n_layers=2, max_seq_len=48,
                           attention=tfm.AttentionConfig(n_heads=heads, n_kv_heads=kv, bias=kw.pop("bias", False)),
                           block=tfm.BlockConfig(norm=kw.pop("norm", "rmsnorm"), mlp=mlp), tie_embeddings=tied,
                           **kw)  # fmt: skip


ENCODER = tfm.ModelConfig(
    arch="encoder", vocab_size=V, d_model=32, n_layers=2, max_seq_len=48, attention=tfm.AttentionConfig(n_heads=4),
    n_token_types=2, positions=tfm.Learned(),
    block=tfm.BlockConfig(norm="layernorm", mlp="gelu", norm_placement="post"),
)  # fmt: skip
ENCODER_DECODER = tfm.ModelConfig(
    arch="encoder_decoder", vocab_size=V, d_model=32, n_layers=2, n_decoder_layers=2, max_seq_len=48,
    attention=tfm.AttentionConfig(n_heads=4), positions=tfm.Sinusoidal(),
    block=tfm.BlockConfig(norm="layernorm", mlp="relu"), decoder_start_token_id=0,
)  # fmt: skip
GRID = {
    "mha-swiglu-tied": decoder(4, 4, "swiglu", True),
    "gqa-gelu-untied": decoder(4, 2, "gelu", False),
    "gqa-swiglu-untied-bias": decoder(4, 2, "swiglu", False, bias=True),
    "mha-gelu-tied-learned": decoder(2, 2, "gelu", True, norm="layernorm", positions=tfm.Learned()),
    "encoder": ENCODER,
    "encoder-decoder": ENCODER_DECODER,
}


def build(cfg, seed: int):
    torch.manual_seed(seed)
    return tfm.build_model(cfg).eval()


def sharded_fraction(model) -> float:
    """Bytes this rank holds of the split weights, over their whole size."""
    split = [p for p in model.parameters() if isinstance(p, DTensor) and p.to_local().numel() < p.numel()]
    return sum(p.to_local().numel() for p in split) / sum(p.numel() for p in split)


@torch.no_grad()
def measure(name: str, cfg, mesh) -> dict:
    ref, tp = build(cfg, 0), build(cfg, 0)
    parallelize(tp, mesh)
    ids = torch.randint(0, V, (2, 11), generator=torch.Generator().manual_seed(1))
    if cfg.arch == "encoder_decoder":
        run = lambda m: m(ids, ids[:, :7])  # noqa: E731
    elif cfg.arch == "encoder":
        types = torch.zeros_like(ids).index_fill_(1, torch.arange(6, 11), 1)
        run = lambda m: m(ids, token_type_ids=types)  # noqa: E731
    else:
        run = lambda m: m(ids)  # noqa: E731
    local, whole = local_bytes(tp)
    row = {"max_diff": (run(ref) - run(tp)).abs().max().item(), "fraction": local / whole,
           "split_fraction": sharded_fraction(tp)}  # fmt: skip
    if cfg.arch != "encoder":
        # Inputs whose plain greedy continuation is varied (tests/decoding.py), then both copies. Wide
        # initial weights (std 0.5): at 0.02 a tiny random model repeats one token.
        cfg = dataclasses.replace(cfg, init_std=1.0 if cfg.arch == "encoder_decoder" else 0.5)
        candidates = torch.randint(0, V, (12, 5), generator=torch.Generator().manual_seed(2))
        tried: list[int] = []
        ref, prompt = varied_case(lambda s: tried.append(s) or build(cfg, s), candidates, 16, 8, seeds=range(6))
        tp = build(cfg, tried[-1])  # the seed varied_case chose
        parallelize(tp, mesh)
        row["ref_tokens"] = tfm.generate(ref, prompt, max_new_tokens=16)[0, -16:].tolist()
        row["tp_tokens"] = tfm.generate(tp, prompt, max_new_tokens=16)[0, -16:].tolist()
    return row


def sharded_loss(mesh) -> dict:
    """The training split (loss_parallel=True): the head's logits stay a DTensor sharded by vocabulary,
    and the loss and every gradient equal the single process's."""
    from torchformer.nn.loss import token_loss

    cfg = GRID["gqa-swiglu-untied-bias"]
    ref, tp = build(cfg, 0).train(), build(cfg, 0).train()
    parallelize(tp, mesh, loss_parallel=True)
    ids = torch.randint(0, V, (2, 11), generator=torch.Generator().manual_seed(3))
    labels = ids.roll(-1, 1).index_fill_(1, torch.tensor([10]), -100)
    logits = tp(ids)
    loss, want = token_loss(logits, labels), token_loss(ref(ids), labels)
    loss.backward()
    want.backward()
    grads = {n: p.grad for n, p in ref.named_parameters()}
    diff = max((p.grad.full_tensor() - grads[n]).abs().max().item() for n, p in tp.named_parameters())
    return {"logits_type": type(logits).__name__, "placements": [str(x) for x in logits.placements],
            "local_vocab": logits.to_local().shape[-1],
            "loss_diff": abs(loss.item() - want.item()) / (labels != -100).sum().item(),  # per target token
            "grad_diff": diff}  # fmt: skip


def command(argv: list[str]) -> dict:
    """``torchformer ARGV`` in this process: its exit status and what it printed on stdout."""
    from torchformer.cli.main import main as cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = cli(argv)
    return {"status": status, "stdout": out.getvalue()}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--generate", nargs=2, metavar=("MODEL", "IDS"))
    parser.add_argument("--train", metavar="RECIPE")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = tp_mesh("cpu", dist.get_world_size())
    rows = {name: measure(name, cfg, mesh) for name, cfg in GRID.items()}
    rows["sharded-loss"] = sharded_loss(mesh)
    if args.generate:  # greedy: no eos in the model, 16 tokens
        model, ids = args.generate
        rows["generate"] = command(["generate", model, "--tp", "2", "--ids", ids, "--max-new-tokens", "16"])
    if args.train:  # last: the run ends the process group
        rows["train"] = command(["train", "--recipe", args.train])
    with open(f"{args.out}.{rank}", "w") as f:
        json.dump(rows, f)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
