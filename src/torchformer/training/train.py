"""``train(recipe)``: the whole training run, top to bottom.

build (the plan, the process, the data, the model and its objective, the optimizer) -> loop:
batch, accumulate, clip, step, log, evaluate, checkpoint -> finish (the plan's outputs: merged
model, PEFT adapter, eval.json; the loss plot and the trackers' sample).

Fine-tuning is data, not hooks: ``Plan.of(recipe)`` (plan.py) decides once which model the run
starts from, which parameters train, what each checkpoint holds and what the run folder gets at
the end, and the loop consults it at those four places. What the run holds while it runs (the
process, its folder, the counters and where each metrics row goes) is session.py's.

Batches are a pure function of (seed, step), every rank's dropout RNG and the running loss window
are checkpointed, and ``train.deterministic`` (default on for CPU) makes the kernels sum in a fixed
order, so a resumed run continues bit-exactly where an uninterrupted one would be, at any thread
count and world size as long as they are the same before and after (determinism.py).
"""

from __future__ import annotations

import math
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..models.build import build_model
from . import checkpoint as ckpt
from . import distributed as dist
from . import instruct, preference, preference_data, trackers
from .batches import LMBatches, MLMBatches, PackedLMBatches, PairBatches, n_targets, rows
from .data import PairData, prepare
from .losses import ARCH_OF_TASK, OBJECTIVES
from .optim import build as build_optimizer
from .plan import Plan
from .recipe import Recipe, check
from .report import Reporter, plot_losses, read_metrics
from .run_state import restore, save_state
from .sample import sample_text
from .schedules import Schedule
from .session import Progress, Session, start
from .validation import validate


class NonFiniteLoss(RuntimeError):
    """Training stopped because the loss or the gradients became NaN/inf."""


@dataclass
class Result:
    step: int
    val_loss: float
    out_dir: Path
    model: nn.Module
    tokenizer: object
    data: object  # TextData | PairData: the tokenized splits
    metrics: list[dict] = field(default_factory=list)
    sample: str | None = None  # the final sample, when train.log_to's trackers were sent it


def train(
    recipe: Recipe, *, resume: str | None = None, stop_after: int | None = None, reporter: Reporter | None = None
) -> Result:
    """Run ``recipe``. resume: None (fresh), "auto" (latest checkpoint in out_dir if any) or a
    checkpoint folder. stop_after: end this call after that step (evaluate and checkpoint there),
    as an interruption would; the schedule still plans for ``train.steps``."""
    t = recipe.train
    check(recipe)
    plan = Plan.of(recipe)  # what trains, what checkpoints hold, what the folder gets: before any work
    trackers.check(t.log_to)  # train.log_to: known names, extras installed
    with ExitStack() as scope:
        run = start(recipe, resume, reporter, scope)  # process group, threads, determinism, run folder
        data = load_data(recipe, plan, run)
        batches = make_batches(recipe, data)  # checks the batch fits the data before any model work
        model, objective, cfg = build(recipe, plan, data.tokenizer, run)
        step_fn, optimizer, schedule = optimize(recipe, model, objective, cfg, run)
        counters = resumed(recipe, plan, run, model, optimizer)  # (step, elapsed, loss window)
        progress = Progress.open(recipe, run, model, cfg, data, counters, scope)
        evals = batches.eval_batches(t.eval_batches)
        save = partial(save_state, recipe=recipe, plan=plan, out=run.out, model=model, optimizer=optimizer,
                       tok=data.tokenizer, rt=run.rt, facts=run.facts)  # fmt: skip
        if progress.step == 0:  # the untrained baseline (about ln(vocab_size)), so every run shows its progress
            progress.evaluate(validate(objective, evals, run.device, run.amp), lr=0.0)
        while progress.step < t.steps:
            t0, step = time.perf_counter(), progress.step + 1
            lr = schedule.apply(optimizer, step)
            loss_sum, tokens = accumulate(step_fn, batches.batch(step - 1), run.rt, t.grad_accum, run.amp)
            descend(model, optimizer, t.grad_clip, loss_sum, step, run.out)  # clip, refuse NaN/inf, step
            dt = time.perf_counter() - t0
            progress.tick(loss_sum, tokens, dt)
            progress.log_step(t.log_every, t.steps, loss_sum, tokens, lr, dt, objective.router_losses)
            stop = progress.out_of_time(t.max_time_s) or step == stop_after
            if step % t.eval_every == 0 or step == t.steps or stop:
                progress.evaluate(validate(objective, evals, run.device, run.amp), lr)
            if (t.checkpoint_every and step % t.checkpoint_every == 0) or step == t.steps or stop:
                save(step=step, elapsed=progress.elapsed, window=progress.window)
            if stop:
                run.reporter.message(
                    f"stopped at step {step} (train.max_time_s={t.max_time_s}, stop_after={stop_after})"
                )
                break
        return finish(recipe, plan, run, progress, counters[0], model, data)


# -- the pieces, in the order train() uses them ---------------------------------------------------


def load_data(recipe: Recipe, plan: Plan, run: Session):
    """Rank 0 tokenizes into <out_dir>/data; the other ranks wait, then read the same cache."""
    spec = {k: getattr(recipe.data, k) for k in ("source", "task", "tokenizer", "bpe_vocab_size", "pack")}
    spec["synthetic"] = recipe.data.synthetic if recipe.data.task == "seq2seq" else {}
    spec["init_tokenizer"] = plan.tokenizer  # model.init's tokenizer, when fine-tuning
    if recipe.train.objective is not None:  # JSONL preference pairs (prompt, chosen, rejected)
        return preference_data.prepare(recipe, plan.tokenizer)
    if recipe.data.instruct:  # JSONL conversations or prompt/completion pairs, loss on the answers only
        return instruct.prepare(recipe, plan.tokenizer)
    if run.rt.is_main:
        data = prepare(spec, run.out / "data")
    dist.barrier()
    return data if run.rt.is_main else prepare(spec, run.out / "data", build=False)


def build(recipe: Recipe, plan: Plan, tok, run: Session):
    """(model, objective, config): model.init with the recipe's safe changes, or a fresh model from
    the recipe's config; the plan's adapters; the task's objective (or a preference objective)."""
    t, task = recipe.train, recipe.data.task
    base = plan.base(recipe, run.device, tok.vocab_size)  # None when built from scratch
    cfg = base.config if base is not None else recipe.model_config(tok.vocab_size, special_ids(tok, task))
    if cfg.arch != ARCH_OF_TASK[task]:
        raise ValueError(f"data.task={task!r} trains arch {ARCH_OF_TASK[task]!r}, but the model is {cfg.arch!r}")
    torch.manual_seed(t.seed)  # the same initial weights on every rank (FSDP shards them as they are)
    model = plan.adapt(build_model(cfg).to(run.device) if base is None else base)  # finetune.lora: adapters train
    torch.manual_seed(t.seed + run.rt.rank)  # distinct dropout streams per rank
    if t.objective is None:
        objective = OBJECTIVES[task](model, t.label_smoothing, t.moe_balance, t.moe_z_loss)
    else:  # preference tuning (preference.py): DPO against a frozen reference, or SimPO / ORPO
        objective = preference.build(recipe, model, plan.reference_model(recipe, run.device, cfg.vocab_size))
    if t.activation_checkpointing:
        checkpoint_blocks(model)
    return model, objective, cfg


def optimize(recipe: Recipe, model: nn.Module, objective: nn.Module, cfg, run: Session):
    """(the step function, the optimizer, the schedule): the objective wrapped for the strategy
    (before the optimizer: FSDP swaps in sharded parameters) and compiled if asked."""
    wrapped = dist.wrap(objective, run.rt, recipe.dist.strategy)
    optimizer = build_optimizer(model, recipe.optim, run.device.type)  # optim.name: adamw | muon
    s = recipe.schedule
    schedule = Schedule(s.name, recipe.optim.lr, s.warmup, recipe.train.steps, s.min_ratio, s.decay_fraction,
                        cfg.d_model, s.factor)  # fmt: skip
    return (torch.compile(wrapped) if recipe.train.compile else wrapped), optimizer, schedule


def resumed(recipe: Recipe, plan: Plan, run: Session, model: nn.Module, optimizer) -> tuple[int, float, tuple]:
    """(step, elapsed seconds, running loss window): zeros, or the checkpoint's when resuming."""
    if run.found is None:
        return 0, 0.0, (0.0, 0)
    plan.check_resume(run.found)  # the adapters' base: same init, LoRA and quantization
    counters = restore(run.found, model, optimizer, run.rt, recipe.dist.strategy, run.facts, plan)
    run.reporter.message(f"resumed from {run.found} at step {counters[0]}")
    return counters


def descend(model: nn.Module, optimizer, grad_clip: float | None, loss_sum: float, step: int, out: Path) -> None:
    """Clip, refuse a non-finite loss or gradient (no checkpoint is written), step, zero."""
    norm = nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip else math.inf)
    if not (math.isfinite(loss_sum) and math.isfinite(float(norm))):
        raise NonFiniteLoss(
            f"non-finite loss or gradient at step {step} (loss sum {loss_sum}, grad norm {float(norm)}); "
            f"stopped without writing a checkpoint. Last good checkpoint: {ckpt.latest_checkpoint(out) or 'none'}. "
            "Lower optim.lr, set train.grad_clip, or check the data."
        )
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def finish(recipe: Recipe, plan: Plan, run: Session, progress: Progress, start: int, model, data) -> Result:
    """The loss plot, the plan's outputs (merged model, PEFT adapter, eval.json), the trackers' sample."""
    t, tok = recipe.train, data.tokenizer
    if run.rt.is_main and progress.step > start:
        progress.sinks.image("loss", plot_losses(progress.metrics_file, run.out / "loss.png"))
    scored = plan.finish(recipe, model, tok, run.out) if run.rt.is_main else None
    sample = None
    if progress.sinks and t.sample_chars and recipe.data.task == "lm":  # the sample the CLI prints (Result.sample)
        sample = sample_text(model, tok, t.sample_prompt, t.sample_chars, temperature=t.sample_temperature,
                             seed=t.seed)  # fmt: skip
        progress.sinks.text("sample", sample)
    if scored is not None:
        run.reporter.message(f"eval {scored}")
    run.reporter.close()
    return Result(step=progress.step, val_loss=progress.val_loss, out_dir=run.out, model=model.eval(), tokenizer=tok,
                  data=data, metrics=read_metrics(progress.metrics_file), sample=sample)  # fmt: skip


def special_ids(tok, task: str) -> dict[str, int]:
    ids = {"pad_token_id": tok.pad_id, "bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id}
    if task == "seq2seq":
        ids["decoder_start_token_id"] = tok.bos_id
    return ids


def make_batches(recipe: Recipe, data):
    t, d = recipe.train, recipe.data
    if isinstance(data, instruct.InstructData):  # data.pack: examples share rows as documents
        kind = instruct.PackedInstructBatches if d.pack else instruct.InstructBatches
        return kind(data, batch_size=t.batch_size, seq_len=d.seq_len, seed=t.seed)
    if isinstance(data, preference_data.PreferenceData):  # two rows per pair: chosen, then rejected
        return preference_data.PreferenceBatches(data, batch_size=t.batch_size, seq_len=d.seq_len, seed=t.seed)
    if isinstance(data, PairData):
        tok = data.tokenizer
        return PairBatches(data.train, data.val, batch_size=t.batch_size, seed=t.seed, pad=tok.pad_id,
                           bos=tok.bos_id, eos=tok.eos_id)  # fmt: skip
    if d.task == "mlm":
        return MLMBatches(data.train, data.val, batch_size=t.batch_size, seq_len=d.seq_len, seed=t.seed,
                          mask_id=data.tokenizer.mask_id, ordinary=data.tokenizer.ordinary_ids(),
                          p=d.mlm_probability)  # fmt: skip
    if d.pack:
        return PackedLMBatches(data.train, data.val, data.train_docs, data.val_docs, batch_size=t.batch_size,
                               seq_len=d.seq_len, seed=t.seed)  # fmt: skip
    return LMBatches(data.train, data.val, batch_size=t.batch_size, seq_len=d.seq_len, seed=t.seed)


def checkpoint_blocks(model: nn.Module) -> None:
    """Activation checkpointing per block: keep only block inputs, recompute inside on backward."""
    for name in ("stack", "encoder", "decoder"):
        for block in getattr(model, name).blocks if hasattr(model, name) else []:
            block.forward = partial(checkpoint, block.forward, use_reentrant=False)


def accumulate(step_fn, batch, rt: dist.Runtime, accum: int, amp) -> tuple[float, int]:
    """Forward/backward over this rank's rows in ``accum`` micro-batches. Each micro-batch's summed
    loss is divided by the target count of the WHOLE global batch (all micro-batches, all ranks),
    so the gradient equals that of one big batch whatever the split or the padding."""
    total = n_targets(batch)
    per_rank = len(batch["labels"]) // rt.world
    local = rows(batch, rt.rank * per_rank, (rt.rank + 1) * per_rank)
    micro = per_rank // accum
    loss_sum = torch.zeros((), device=rt.device)
    for i in range(accum):
        mb = {k: v.to(rt.device, non_blocking=True) for k, v in rows(local, i * micro, (i + 1) * micro).items()}
        with dist.grad_sync(step_fn, i == accum - 1), amp():
            loss = step_fn(mb)
        # DDP averages gradients over ranks; multiplying by world makes the result a sum over ranks.
        (loss * (rt.world / max(1, total))).backward()
        loss_sum += loss.detach()
    return float(loss_sum), n_targets(local)
