"""A run's state on disk for ``train()``: where to resume from, restoring it, saving it.

Weights, optimizer, every rank's dropout stream and the running loss window go into each
checkpoint (checkpoint.py's format), so a resumed run continues bit-exactly (train.py docstring).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from . import checkpoint as ckpt
from . import determinism, sharded_checkpoint
from . import distributed as dist
from .plan import Plan
from .recipe import Recipe


def resume_point(resume: str | None, out: Path) -> Path | None:
    if resume is None:
        return None
    if resume == "auto":
        return ckpt.latest_checkpoint(out)  # None: nothing to resume, start fresh
    path = Path(resume)
    if not path.is_dir():
        raise FileNotFoundError(f"--resume {resume!r}: no such checkpoint folder (or use --resume auto)")
    return path


def restore(path: Path, model: nn.Module, optimizer, rt: dist.Runtime, strategy: str, facts: dict, plan: Plan):
    """Weights, optimizer, this rank's RNG; returns (step, elapsed seconds, running loss window)."""
    if sharded_checkpoint.is_sharded(path):  # DCP shards, read into whatever layout this run has
        return sharded_checkpoint.restore(path, model, optimizer, rt, facts)
    saved = ckpt.load_checkpoint(path)
    state = saved["state"]
    determinism.warn_if_different(state.get("run", {}), facts, path)
    optim_state = ckpt.optimizer_state(saved["optim"], state["optimizer"])
    if not dist.scatter_state(model, optimizer, saved["model"], optim_state, strategy, rt.world):
        plan.load_weights(model, {k: v.to(rt.device) for k, v in saved["model"].items()}, ckpt.load_model_state)
        optimizer.load_state_dict(optim_state)
    rng = ckpt.rank_rng(saved["rng"], rt.rank)
    if rng is not None:
        ckpt.restore_rng(rng, rt.device)
    else:  # saved by another world size: a fresh, distinct dropout stream per rank (not bit-exact)
        torch.manual_seed(state["seed"] + rt.rank + 7919 * state["step"])
    window = state.get("window", [0.0, 0])
    return state["step"], state["elapsed_s"], (window[0], window[1])


def save_state(*, step: int, elapsed: float, window: tuple[float, int], recipe: Recipe, plan: Plan, out: Path, model,
               optimizer, tok, rt, facts: dict) -> None:  # fmt: skip
    if recipe.dist.checkpoint == "sharded":  # every rank writes its shards, nothing gathered
        return sharded_checkpoint.save_state(step=step, elapsed=elapsed, window=window, recipe=recipe, out=out,
                                             model=model, optimizer=optimizer, tok=tok, rt=rt, facts=facts)  # fmt: skip
    weights, optim_state = dist.gather_state(model, optimizer, recipe.dist.strategy, rt.world)  # all ranks
    weights_file, weights = plan.checkpoint_weights(model, weights)  # LoRA: the adapters alone
    rng = dist.gather_rng(ckpt.rng_state(rt.device), rt)  # every rank's dropout stream, collected on rank 0
    if not rt.is_main:
        dist.barrier()
        return
    state = {"step": step, "elapsed_s": elapsed, "seed": recipe.train.seed, "recipe": recipe.to_dict(),
             "tokenizer_kind": tok.kind, "window": list(window), "run": facts,
             "finetune": plan.record}  # fmt: skip
    ckpt.save_checkpoint(out, step, model_state=weights, config=model.config.to_dict(),
                         tokenizer_json=tok.to_json(), optim=ckpt.optimizer_tensors(optim_state),
                         rng=rng, state=state, keep_last=recipe.train.keep_last,
                         weights_file=weights_file or None)  # fmt: skip
    dist.barrier()
