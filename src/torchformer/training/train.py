"""``train(recipe)``: the whole training run, top to bottom.

setup (process group, device, seeds) -> data (tokenized once, cached) -> model and objective ->
optimizer and schedule -> resume -> wrap (DDP/FSDP, compile) -> loop: batch, accumulate, clip,
step, log, evaluate, checkpoint -> final checkpoint, loss plot.

Batches are a pure function of (seed, step), every rank's dropout RNG and the running loss window
are checkpointed, and ``train.deterministic`` (default on for CPU) makes the kernels sum in a fixed
order, so a resumed run continues bit-exactly where an uninterrupted one would be, at any thread
count and world size as long as they are the same before and after (determinism.py).
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..analysis.accounting import flops_per_token, matmul_peak_flops
from ..atomic import NewFolders
from ..host_memory import keep_freed_memory
from ..models.build import build_model
from . import checkpoint as ckpt
from . import determinism, finetune, instruct, preference, preference_data, trackers
from . import distributed as dist
from .batches import LMBatches, MLMBatches, PackedLMBatches, PairBatches, n_targets, rows
from .data import PairData, prepare
from .losses import ARCH_OF_TASK, OBJECTIVES
from .optim import build as build_optimizer
from .recipe import Recipe, check
from .report import Reporter, append_metrics, plot_losses, read_metrics, truncate_metrics
from .run_state import restore, resume_point, save_state
from .schedules import Schedule
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
    reporter = reporter or Reporter()
    t, task = recipe.train, recipe.data.task
    check(recipe)
    finetune.check(recipe)  # LoRA targets exist: before any data or folder is written
    trackers.check(t.log_to)  # train.log_to: known names, extras installed
    rt = dist.setup(t.device, recipe.dist.strategy, recipe.dist.tp)
    reporter = reporter if rt.is_main else Reporter()  # rank 0 alone talks to the terminal
    if t.threads is not None:
        torch.set_num_threads(t.threads)
    if t.keep_host_memory and rt.device.type == "cpu":
        keep_freed_memory()
    exact = determinism.resolve(t.deterministic, rt.device)
    with contextlib.ExitStack() as scope:
        scope.callback(dist.teardown)
        scope.enter_context(determinism.deterministic(exact, rt.device))  # before the model is built
        out = Path(t.out_dir)
        found = resume_point(resume, out)  # a bad --resume path is refused before any data is written
        made = scope.enter_context(NewFolders(*([out, out / "data"] if rt.is_main else [])))  # gone if setup fails
        data = load_data(recipe, out, rt)
        batches = make_batches(recipe, data)  # checks the batch fits the data before any model work
        tok = data.tokenizer
        base = finetune.load_init(recipe, rt.device, tok.vocab_size)  # model.init: None when built from scratch
        cfg = base.config if base is not None else recipe.model_config(tok.vocab_size, special_ids(tok, task))
        if cfg.arch != ARCH_OF_TASK[task]:
            raise ValueError(f"data.task={task!r} trains arch {ARCH_OF_TASK[task]!r}, but the model is {cfg.arch!r}")
        torch.manual_seed(t.seed)  # the same initial weights on every rank (FSDP shards them as they are)
        model = build_model(cfg).to(rt.device) if base is None else base
        finetune.apply_lora(recipe, model, t.seed)  # finetune.lora: adapters only train
        torch.manual_seed(t.seed + rt.rank)  # distinct dropout streams per rank
        if t.objective is None:
            objective = OBJECTIVES[task](model, t.label_smoothing, t.moe_balance, t.moe_z_loss)
        else:  # preference tuning (preference.py): DPO against a frozen reference, or SimPO / ORPO
            reference = finetune.load_reference(recipe, rt.device, cfg.vocab_size)
            objective = preference.build(recipe, model, reference)
        if t.activation_checkpointing:
            checkpoint_blocks(model)
        wrapped = dist.wrap(objective, rt, recipe.dist.strategy)  # before the optimizer: FSDP swaps in sharded params
        optimizer = build_optimizer(model, recipe.optim, rt.device.type)  # optim.name: adamw | muon
        s = recipe.schedule
        schedule = Schedule(
            s.name, recipe.optim.lr, s.warmup, t.steps, s.min_ratio, s.decay_fraction, cfg.d_model, s.factor
        )
        start, elapsed, window = 0, 0.0, (0.0, 0)
        facts = determinism.run_facts(exact, rt.world)
        if found is not None:
            finetune.check_resume(recipe, found)  # the adapters' base: same init, LoRA and quantization
            start, elapsed, window = restore(found, model, optimizer, rt, recipe.dist.strategy, facts)
            reporter.message(f"resumed from {found} at step {start}")
        metrics_file = out / "metrics.jsonl"
        # Trackers start before the first step: one that cannot start fails here, not an hour in.
        sinks = scope.enter_context(trackers.open_all(t.log_to if rt.is_main else [], recipe, out))
        made.keep()
        if rt.is_main:
            out.mkdir(parents=True, exist_ok=True)
            truncate_metrics(metrics_file, start) if metrics_file.exists() else None
        step_fn = torch.compile(wrapped) if t.compile else wrapped
        amp = autocast(t.precision, rt.device)

        tokens_per_step = t.batch_size * (recipe.data.seq_len if task != "seq2seq" else _mean_len(data))
        tokens_per_step *= 2 if t.objective is not None else 1  # preference: a chosen and a rejected row per pair
        flops = flops_per_token(cfg, recipe.data.seq_len if task != "seq2seq" else max(1, _mean_len(data))).training
        with torch.random.fork_rng(devices=[]):  # the timing's random matrices must not shift the dropout stream
            peak = matmul_peak_flops()
        evals = batches.eval_batches(t.eval_batches)
        save = partial(save_state, recipe=recipe, out=out, model=model, optimizer=optimizer, tok=tok, rt=rt,
                       facts=facts)  # fmt: skip
        reporter.start({"recipe": recipe.name, "params": sum(p.numel() for p in model.parameters()),
                        "device": str(rt.device), "world": rt.world, "start": start, "steps": t.steps,
                        "peak_gflops": peak / 1e9, "out_dir": str(out)})  # fmt: skip

        wall0, (window_loss, window_tokens), val_loss = time.perf_counter(), window, float("nan")
        step = start
        if start == 0:  # the untrained baseline (about ln(vocab_size)), so every run shows its progress
            measured = validate(objective, evals, rt.device, amp)
            val_loss = measured["val_loss"]
            row = {"step": 0, "train_loss": None, **measured, "lr": 0.0, "elapsed_s": 0.0, "tokens": 0}
            if rt.is_main:
                append_metrics(metrics_file, row)
                sinks.log(row)
                reporter.evaluate(row)
        while step < t.steps:
            step += 1
            t0 = time.perf_counter()
            lr = schedule.apply(optimizer, step)
            loss_sum, local_tokens = accumulate(step_fn, batches.batch(step - 1), rt, t.grad_accum, amp)
            norm = nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip if t.grad_clip else math.inf)
            if not (math.isfinite(loss_sum) and math.isfinite(float(norm))):
                last = ckpt.latest_checkpoint(out)
                raise NonFiniteLoss(
                    f"non-finite loss or gradient at step {step} (loss sum {loss_sum}, grad norm {float(norm)}); "
                    f"stopped without writing a checkpoint. Last good checkpoint: {last or 'none'}. "
                    "Lower optim.lr, set train.grad_clip, or check the data."
                )
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            dt = time.perf_counter() - t0
            elapsed += dt
            window_loss, window_tokens = window_loss + loss_sum, window_tokens + local_tokens
            if rt.is_main and (step % t.log_every == 0 or step == t.steps):
                tps = tokens_per_step / dt
                reporter.step({"step": step, "loss": loss_sum / max(1, local_tokens), "lr": lr,
                               "tok_s": tps, "mfu": tps * flops / peak, "elapsed_s": elapsed,
                               **{k: float(v) for k, v in objective.router_losses.items()}})  # fmt: skip
            out_of_time = t.max_time_s is not None and time.perf_counter() - wall0 >= t.max_time_s
            out_of_time = out_of_time or step == stop_after
            if step % t.eval_every == 0 or step == t.steps or out_of_time:
                with torch.random.fork_rng(devices=[]):  # re-measured: a busy start understates the peak
                    peak = max(peak, matmul_peak_flops())
                measured = validate(objective, evals, rt.device, amp)
                val_loss = measured["val_loss"]
                row = {"step": step, "train_loss": window_loss / max(1, window_tokens), **measured, "lr": lr,
                       "elapsed_s": round(elapsed, 3), "tokens": step * tokens_per_step}  # fmt: skip
                window_loss, window_tokens = 0.0, 0
                if rt.is_main:
                    append_metrics(metrics_file, row)
                    sinks.log(row)
                    reporter.evaluate(row)
            if (t.checkpoint_every and step % t.checkpoint_every == 0) or step == t.steps or out_of_time:
                save(step=step, elapsed=elapsed, window=(window_loss, window_tokens))
            if out_of_time:
                reporter.message(f"stopped at step {step} (train.max_time_s={t.max_time_s}, stop_after={stop_after})")
                break
        if rt.is_main and step > start:
            sinks.image("loss", plot_losses(metrics_file, out / "loss.png"))
        if rt.is_main:
            finetune.export(recipe, model, out)  # LoRA: the merged model and a PEFT adapter in the run folder
        sample = None
        if sinks and t.sample_chars and task == "lm":  # the sample the CLI prints (Result.sample), for the trackers
            from .sample import sample_text

            sample = sample_text(model, tok, t.sample_prompt, t.sample_chars, temperature=t.sample_temperature,
                                 seed=t.seed)  # fmt: skip
            sinks.text("sample", sample)
        scored = finetune.evaluate_file(recipe, model, tok, out) if rt.is_main else None  # data.eval_file
        if scored is not None:
            reporter.message(f"eval {scored}")
        reporter.close()
        metrics = read_metrics(metrics_file)
        return Result(step=step, val_loss=val_loss, out_dir=out, model=model.eval(), tokenizer=tok, data=data,
                      metrics=metrics, sample=sample)  # fmt: skip


# -- the pieces, in the order train() uses them ---------------------------------------------------


def load_data(recipe: Recipe, out: Path, rt: dist.Runtime):
    """Rank 0 tokenizes into <out_dir>/data; the other ranks wait, then read the same cache."""
    spec = {k: getattr(recipe.data, k) for k in ("source", "task", "tokenizer", "bpe_vocab_size", "pack")}
    spec["synthetic"] = recipe.data.synthetic if recipe.data.task == "seq2seq" else {}
    spec["init_tokenizer"] = finetune.init_tokenizer(recipe)  # model.init's tokenizer, when fine-tuning
    if recipe.train.objective is not None:  # JSONL preference pairs (prompt, chosen, rejected)
        return preference_data.prepare(recipe, spec["init_tokenizer"])
    if recipe.data.instruct:  # JSONL conversations or prompt/completion pairs, loss on the answers only
        return instruct.prepare(recipe, spec["init_tokenizer"])
    if rt.is_main:
        data = prepare(spec, out / "data")
    dist.barrier()
    return data if rt.is_main else prepare(spec, out / "data", build=False)


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


def _mean_len(data) -> int:
    pairs = data.train[:1000]
    return round(sum(len(s) + len(t) + 2 for s, t in pairs) / max(1, len(pairs)) / 2)


def checkpoint_blocks(model: nn.Module) -> None:
    """Activation checkpointing per block: keep only block inputs, recompute inside on backward."""
    for name in ("stack", "encoder", "decoder"):
        for block in getattr(model, name).blocks if hasattr(model, name) else []:
            block.forward = partial(checkpoint, block.forward, use_reentrant=False)


def autocast(precision: str, device: torch.device):
    """bf16 autocast on CUDA by default (weights and optimizer stay fp32); fp32 elsewhere, since
    CPUs without bf16 units run bf16 matmuls ~100x slower."""
    bf16 = precision == "bf16" or (precision == "auto" and device.type == "cuda")
    return partial(torch.autocast, device_type=device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext


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
