"""What a training run holds while it runs, for train(): the process and its folder (``Session``)
and the counters and their sinks (``Progress``: metrics.jsonl, the trackers, the terminal).

Split from train.py so the loop reads as the loop; nothing here decides anything the recipe did
not already say.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from ..analysis.accounting import flops_per_token, matmul_peak_flops
from ..atomic import NewFolders
from ..host_memory import keep_freed_memory
from . import determinism, trackers
from . import distributed as dist
from .report import Reporter, append_metrics, truncate_metrics
from .run_state import resume_point


@dataclass
class Session:
    rt: dist.Runtime
    out: Path
    found: Path | None  # the checkpoint to resume from
    facts: dict  # determinism and world size, recorded in each checkpoint
    amp: object  # a context factory: bf16 autocast or nothing
    reporter: Reporter
    made: NewFolders  # the folders this run created, removed if setup fails

    @property
    def device(self) -> torch.device:
        return self.rt.device


def start(recipe, resume: str | None, reporter: Reporter | None, scope: contextlib.ExitStack) -> Session:
    """The process group, threads, determinism (before any model is built) and the run folder."""
    t = recipe.train
    rt = dist.setup(t.device, recipe.dist.strategy, recipe.dist.tp)
    scope.push(dist.teardown)  # after a normal end: a barrier, then the group goes
    reporter = (reporter or Reporter()) if rt.is_main else Reporter()  # rank 0 alone talks to the terminal
    if t.threads is not None:
        torch.set_num_threads(t.threads)
    if t.keep_host_memory and rt.device.type == "cpu":
        keep_freed_memory()
    exact = determinism.resolve(t.deterministic, rt.device)
    scope.enter_context(determinism.deterministic(exact, rt.device))
    out = Path(t.out_dir)
    found = resume_point(resume, out)  # a bad --resume path is refused before any data is written
    made = scope.enter_context(NewFolders(*([out, out / "data"] if rt.is_main else [])))  # gone if setup fails
    facts = determinism.run_facts(exact, rt.world)
    return Session(rt, out, found, facts, autocast(t.precision, rt.device), reporter, made)


def autocast(precision: str, device: torch.device):
    """bf16 autocast on CUDA by default (weights and optimizer stay fp32); fp32 elsewhere, since
    CPUs without bf16 units run bf16 matmuls ~100x slower."""
    bf16 = precision == "bf16" or (precision == "auto" and device.type == "cuda")
    return partial(torch.autocast, device_type=device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext


@dataclass
class Progress:
    """The step counters (checkpointed, so a resumed run continues them) and where each row goes."""

    run: Session
    metrics_file: Path
    sinks: trackers.Trackers
    tokens_per_step: int
    flops: float  # training FLOPs per token
    peak: float  # the machine's measured matmul FLOP/s
    step: int = 0
    elapsed: float = 0.0  # training seconds, across resumes
    window: tuple[float, int] = (0.0, 0)  # summed loss and tokens since the last evaluation
    val_loss: float = float("nan")
    wall0: float = 0.0

    @classmethod
    def open(cls, recipe, run: Session, model, cfg, data, counters, scope: contextlib.ExitStack) -> Progress:
        """Trackers start before the first step (one that cannot start fails here, not an hour in);
        metrics.jsonl is cut back to the resumed step."""
        t, task = recipe.train, recipe.data.task
        sinks = scope.enter_context(trackers.open_all(t.log_to if run.rt.is_main else [], recipe, run.out))
        run.made.keep()
        metrics_file = run.out / "metrics.jsonl"
        if run.rt.is_main:
            run.out.mkdir(parents=True, exist_ok=True)
            truncate_metrics(metrics_file, counters[0]) if metrics_file.exists() else None
        length = recipe.data.seq_len if task != "seq2seq" else mean_len(data)
        tokens = t.batch_size * length * (2 if t.objective is not None else 1)  # preference: two rows per pair
        peak = measured_peak(run.device)
        flops = flops_per_token(cfg, max(1, length)).training
        p = cls(run, metrics_file, sinks, tokens, flops, peak, *counters, wall0=time.perf_counter())
        run.reporter.start({"recipe": recipe.name, "params": sum(q.numel() for q in model.parameters()),
                            "device": str(run.device), "world": run.rt.world, "start": p.step, "steps": t.steps,
                            "peak_gflops": peak / 1e9, "out_dir": str(run.out)})  # fmt: skip
        return p

    def tick(self, loss_sum: float, tokens: int, seconds: float) -> None:
        self.step += 1
        self.elapsed += seconds
        self.window = (self.window[0] + loss_sum, self.window[1] + tokens)

    def log_step(self, every: int, last: int, loss_sum: float, tokens: int, lr: float, seconds: float, extra: dict):
        if self.run.rt.is_main and (self.step % every == 0 or self.step == last):
            tps = self.tokens_per_step / seconds
            self.run.reporter.step({"step": self.step, "loss": loss_sum / max(1, tokens), "lr": lr, "tok_s": tps,
                                    "mfu": tps * self.flops / self.peak, "elapsed_s": self.elapsed,
                                    **{k: float(v) for k, v in extra.items()}})  # fmt: skip

    def out_of_time(self, max_time_s: float | None) -> bool:
        return max_time_s is not None and time.perf_counter() - self.wall0 >= max_time_s

    def evaluate(self, measured: dict, lr: float) -> None:
        """One evaluation row (step 0: the untrained baseline, about ln(vocab_size))."""
        self.val_loss = measured["val_loss"]
        if self.step:  # re-measured: a busy start understates the peak
            self.peak = max(self.peak, measured_peak(self.run.device))
        loss, tokens = self.window
        row = {"step": self.step, "train_loss": loss / max(1, tokens) if self.step else None, **measured, "lr": lr,
               "elapsed_s": round(self.elapsed, 3), "tokens": self.step * self.tokens_per_step}  # fmt: skip
        self.window = (0.0, 0)
        if self.run.rt.is_main:
            append_metrics(self.metrics_file, row)
            self.sinks.log(row)
            self.run.reporter.evaluate(row)


_PEAKS: dict[tuple[str, int], tuple[float, int]] = {}  # (device, threads) -> (best FLOP/s, times measured)


def measured_peak(device: torch.device) -> float:
    """The matmul peak MFU is reported against, on the run's device at its thread count: measured
    at most twice a process (a run's start and its first evaluation), the best kept. Each
    measurement costs ~0.25 s at one CPU thread; later evaluations and later runs in the process
    (a sweep, a notebook, the test suite) reuse it."""
    key = (str(device), torch.get_num_threads())
    best, times = _PEAKS.get(key, (0.0, 0))
    if times < 2:
        best, times = max(best, matmul_peak_flops(device=device)), times + 1
        _PEAKS[key] = (best, times)
    return best


def mean_len(data) -> int:
    """A seq2seq pair's mean length per side (source and target tokens plus BOS/EOS, halved)."""
    pairs = data.train[:1000]
    return round(sum(len(s) + len(t) + 2 for s, t in pairs) / max(1, len(pairs)) / 2)
