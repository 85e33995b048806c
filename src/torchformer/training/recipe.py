"""Training recipes: YAML (or JSON) with sections model, data, optim, schedule, train, dist,
plus dotted command-line overrides (``model.n_layers=4 optim.lr=3e-4``). Unknown keys are
errors that list what is allowed. The model section is a preset name plus ModelConfig fields.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import presets
from ..configs import ModelConfig
from ..lora import LoRASpec
from ..models.sizing import check_fits_memory
from . import preference
from .finetune import check_init, check_quantize, check_reference
from .optim import OPTIMIZERS
from .recipe_files import apply_overrides, read_file

TASKS = ("lm", "mlm", "seq2seq")
PRECISIONS = ("auto", "fp32", "bf16")


SYNTHETIC_DEFAULTS = {
    "n_train": 20000,
    "n_val": 500,
    "min_len": 4,
    "max_len": 12,
    "alphabet": "abcdefghijklmnopqrstuvwxyz",
    "seed": 0,
}


@dataclass(frozen=True, kw_only=True)
class Data:
    source: str = "shakespeare"  # shakespeare | reverse | a path
    task: str = "lm"  # lm | mlm | seq2seq
    tokenizer: str = "char"  # char | byte | bpe
    bpe_vocab_size: int = 4096
    seq_len: int = 64
    mlm_probability: float = 0.15
    synthetic: dict = field(default_factory=dict)  # source "reverse": keys of SYNTHETIC_DEFAULTS
    pack: bool = False  # lm: windows packed from whole documents (instruct: whole examples), attention kept inside each
    instruct: bool = False  # lm: JSONL of {"messages": [...]} or {"prompt", "completion"}; loss on answers only
    chat_template: str | None = None  # instruct: a jinja2 file (default: model.init's template, else plain)
    eval_file: str | None = None  # a text file scored at the end: strided perplexity, bits per byte

    def __post_init__(self) -> None:
        if not isinstance(self.pack, bool):
            raise ValueError(f"data.pack={self.pack!r}: must be true or false")
        if self.pack and self.task != "lm":
            raise ValueError(
                f"data.pack=true with data.task={self.task!r}: packing is for the causal lm task only "
                "(seq2seq batches pairs by length; mlm windows need no document boundaries)"
            )
        unknown = sorted(set(self.synthetic) - set(SYNTHETIC_DEFAULTS))
        if unknown:
            raise ValueError(f"unknown key(s) data.synthetic.{unknown}; allowed: {sorted(SYNTHETIC_DEFAULTS)}")
        object.__setattr__(self, "synthetic", {**SYNTHETIC_DEFAULTS, **self.synthetic})


@dataclass(frozen=True, kw_only=True)
class Optim:
    name: str = "adamw"  # adamw | muon: Muon for the blocks' 2-D matrices, AdamW for the rest (optim.py)
    lr: float = 1e-3  # AdamW's (muon: the embeddings', head's, norms' and biases')
    betas: tuple[float, float] = (0.9, 0.99)
    eps: float = 1e-8
    weight_decay: float = 0.1
    muon_lr: float = 0.02  # muon: the matrices' peak lr (the schedule scales it as it scales lr)
    momentum: float = 0.95  # muon: Nesterov momentum of the matrices' updates

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(f"optim.name={self.name!r}: must be one of {list(OPTIMIZERS)}")
        for key in ("lr", "muon_lr"):
            if not getattr(self, key) > 0:
                raise ValueError(f"optim.{key}={getattr(self, key)!r}: must be > 0")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"optim.momentum={self.momentum!r}: must be in [0, 1)")


@dataclass(frozen=True, kw_only=True)
class ScheduleSpec:
    name: str = "cosine"  # noam | cosine | wsd | constant
    warmup: int = 100
    min_ratio: float = 0.1
    decay_fraction: float = 0.2
    factor: float = 1.0  # noam only


@dataclass(frozen=True, kw_only=True)
class Train:
    steps: int = 1000
    batch_size: int = 16  # the global batch, in sequences
    grad_accum: int = 1
    grad_clip: float | None = 1.0
    label_smoothing: float = 0.0
    objective: str | None = None  # None: data.task's own; dpo | simpo | orpo: preference tuning (preference section)
    log_to: list[str] = field(default_factory=list)  # experiment trackers: tensorboard, mlflow, wandb (trackers.py)
    moe_balance: float = 0.01  # MoE load-balancing loss weight (Switch alpha 0.01; ignored by dense models)
    moe_z_loss: float = 0.0  # MoE router z-loss weight (ST-MoE uses 1e-3)
    eval_every: int = 100
    eval_batches: int = 20
    log_every: int = 10
    checkpoint_every: int = 0  # 0: only at the end
    keep_last: int = 2
    seed: int = 1337
    device: str = "auto"
    threads: int | None = None  # CPU threads for torch (None: torch's default, one per core)
    deterministic: bool | None = None  # fixed-order kernels: None = on for CPU, off for CUDA/MPS (determinism.py)
    keep_host_memory: bool = True  # CPU: glibc keeps freed memory (no page faults per step; host_memory.py)
    precision: str = "auto"  # auto (bf16 autocast on CUDA, fp32 elsewhere) | fp32 | bf16
    compile: bool = False
    activation_checkpointing: bool = False
    max_time_s: float | None = None  # stop early (and checkpoint) after this much training time
    out_dir: str = "runs/default"
    sample_chars: int = 0  # print a sample of this many characters at the end (text tasks)
    sample_prompt: str = "\n"
    sample_temperature: float = 0.8


@dataclass(frozen=True, kw_only=True)
class Dist:
    strategy: str = "ddp"  # ddp | fsdp | tp | fsdp+tp (training/distributed.py)
    tp: int = 1  # ranks per tensor-parallel group: the world with "tp", a divisor of it with "fsdp+tp"
    checkpoint: str = "full"  # full (rank 0 writes whole safetensors) | sharded (DCP: every rank its shards)


@dataclass(frozen=True, kw_only=True)
class Finetune:
    lora: dict | None = None  # {rank, alpha, dropout, targets}: train LoRA adapters only (lora/)
    quantize: str | None = None  # int8 | int4: LoRA over a frozen weight-only quantized base (QLoRA)
    group_size: int | None = None  # int4: inputs per scale (default 64); int8 has one scale per row
    reference: str | None = None  # train.objective=dpo: the reference model (default: the model as it starts)

    def __post_init__(self) -> None:
        object.__setattr__(self, "group_size", check_quantize(self.quantize, self.group_size, self.lora))
        if self.reference is not None:
            check_reference(self.reference)
        if self.lora is None:
            return
        allowed = {f.name for f in dataclasses.fields(LoRASpec)}
        if not isinstance(self.lora, dict) or set(self.lora) - allowed:
            bad = sorted(set(self.lora) - allowed) if isinstance(self.lora, dict) else self.lora
            raise ValueError(f"finetune.lora: unknown {bad!r}; allowed keys: {sorted(allowed)}")
        try:
            object.__setattr__(self, "lora", LoRASpec(**self.lora))
        except ValueError as err:
            raise ValueError(f"finetune.lora: {err}") from None


SECTIONS = {"data": Data, "optim": Optim, "schedule": ScheduleSpec, "train": Train, "dist": Dist,
            "finetune": Finetune}  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class Recipe:
    name: str = "default"
    model: dict = field(default_factory=lambda: {"preset": "shakespeare-char"})
    data: Data = field(default_factory=Data)
    optim: Optim = field(default_factory=Optim)
    schedule: ScheduleSpec = field(default_factory=ScheduleSpec)
    train: Train = field(default_factory=Train)
    dist: Dist = field(default_factory=Dist)
    finetune: Finetune = field(default_factory=Finetune)
    preference: dict = field(default_factory=dict)  # train.objective's settings (preference.py: DPO, SimPO, ORPO)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def model_config(self, vocab_size: int, special: dict[str, int]) -> ModelConfig:
        """The preset with the recipe's changes, vocab_size from the tokenizer and the special ids."""
        spec = dict(self.model)
        name = spec.pop("init", None) or spec.pop("preset", "shakespeare-char")  # model.init may name a preset
        base = presets.get(name).to_dict()
        merged = _deep_merge(base, spec, "model")
        merged["vocab_size"] = vocab_size
        if self.data.task != "seq2seq":  # the model must take a whole training window
            merged["max_seq_len"] = max(merged["max_seq_len"], self.data.seq_len)
        merged.update({k: v for k, v in special.items() if k in merged})
        return ModelConfig.from_dict(merged)


def _deep_merge(base: dict, changes: dict, where: str) -> dict:
    out = dict(base)
    for key, value in changes.items():
        if key not in base:
            raise ValueError(f"unknown key {where}.{key}; allowed: {sorted(base)}")
        nested = isinstance(base[key], dict) and isinstance(value, dict) and "kind" not in value
        out[key] = _deep_merge(base[key], value, f"{where}.{key}") if nested else value
    return out


_TYPES = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,), "dict": (dict,)}


def _check_types(cls: type, section: dict[str, Any], where: str) -> None:
    """Scalars must have their declared type (a YAML typo like lr: 3e-4x is caught here)."""
    for f in dataclasses.fields(cls):
        if f.name not in section:
            continue
        value, (kind, optional, _) = section[f.name], str(f.type).partition(" | None")
        if value is None and optional:
            continue
        ok = _TYPES.get(kind)
        if ok is not None and (not isinstance(value, ok) or (kind != "bool" and isinstance(value, bool))):
            raise ValueError(f"{where}.{f.name}={value!r}: must be {f.type}")


def from_dict(raw: dict[str, Any]) -> Recipe:
    allowed = {"name", "model", "preference", *SECTIONS}
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise ValueError(f"unknown recipe section(s) {unknown}; allowed: {sorted(allowed)}")
    kwargs: dict[str, Any] = {}
    for name, cls in SECTIONS.items():
        section = raw.get(name) or {}
        if not isinstance(section, dict):
            raise ValueError(f"recipe section {name} must be a mapping of settings, got {section!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        bad = sorted(set(section) - known)
        if bad:
            raise ValueError(f"unknown key(s) {[f'{name}.{b}' for b in bad]}; allowed in {name}: {sorted(known)}")
        _check_types(cls, section, name)
        kwargs[name] = cls(**section)
    model = raw.get("model") or {"preset": "shakespeare-char"}
    if not isinstance(model, dict):
        raise ValueError(f"recipe section model must be a mapping (preset + ModelConfig fields), got {model!r}")
    recipe = Recipe(name=str(raw.get("name", "default")), model=dict(model), **kwargs,
                    preference=_preference(raw.get("preference"), kwargs["train"].objective))  # fmt: skip
    if "init" in recipe.model:  # fine-tuning: only safe changes on top of the init model (finetune.py)
        check_init(recipe.model)
    else:  # validate model changes now (vocab_size is filled in from the tokenizer later)
        check_fits_memory(recipe.model_config(8, {}), "model")
    return recipe


def _preference(section, objective) -> dict:
    """The preference section, checked against train.objective (its own keys and values)."""
    section = {} if section is None else section
    if objective is not None and objective not in preference.OBJECTIVES:
        raise ValueError(
            f"train.objective={objective!r}: must be one of {sorted(preference.OBJECTIVES)}, or absent "
            "(data.task's own objective)"
        )
    if objective is None:
        if section:
            raise ValueError(
                f"recipe section preference={section!r} needs train.objective (one of {sorted(preference.OBJECTIVES)})"
            )
        return {}
    preference.config(objective, section)  # raises naming the key, the value and what is allowed
    return dict(section)


def _dist_problems(recipe: Recipe) -> list[str]:
    """What tensor parallelism and sharded checkpoints do not cover yet (training/distributed.py)."""
    t, d, ds = recipe.train, recipe.data, recipe.dist
    problems = []
    if ds.checkpoint not in ("full", "sharded"):
        problems.append(f"dist.checkpoint={ds.checkpoint!r}: must be one of ['full', 'sharded']")
    if ds.checkpoint == "sharded" and (recipe.finetune.lora is not None or t.objective is not None):
        problems.append("dist.checkpoint='sharded': not supported with finetune.lora or train.objective yet; use full")
    if "tp" in ds.strategy:
        if d.task != "lm" or t.objective is not None or recipe.finetune.lora is not None:
            problems.append(f"dist.strategy={ds.strategy!r}: trains data.task 'lm' without finetune.lora or "
                            "train.objective so far")  # fmt: skip
        if t.label_smoothing:
            problems.append(f"dist.strategy={ds.strategy!r}: train.label_smoothing={t.label_smoothing} is not "
                            "supported (the vocabulary-sharded loss has none); use 0")  # fmt: skip
    return problems


def check(recipe: Recipe) -> None:
    """Settings that can be checked before any work, with what is allowed."""
    t, d = recipe.train, recipe.data
    problems = []
    if d.task not in TASKS:
        problems.append(f"data.task={d.task!r}: must be one of {list(TASKS)}")
    for name in ("steps", "batch_size", "grad_accum", "eval_every", "eval_batches", "log_every"):
        if not isinstance(getattr(t, name), int) or getattr(t, name) < 1:
            problems.append(f"train.{name}={getattr(t, name)!r}: must be an integer >= 1")
    if isinstance(t.batch_size, int) and isinstance(t.grad_accum, int) and t.grad_accum >= 1:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if t.batch_size % (world * t.grad_accum):
            problems.append(
                f"train.batch_size={t.batch_size}: must be divisible by world size {world} "
                f"x train.grad_accum={t.grad_accum}"
            )
    if t.precision not in PRECISIONS:
        problems.append(f"train.precision={t.precision!r}: must be one of {list(PRECISIONS)}")
    if not 0.0 <= t.label_smoothing < 1.0:
        problems.append(f"train.label_smoothing={t.label_smoothing}: must be in [0, 1)")
    for name in ("moe_balance", "moe_z_loss"):
        if not getattr(t, name) >= 0:
            problems.append(f"train.{name}={getattr(t, name)}: must be >= 0")
    if d.seq_len < 1:
        problems.append(f"data.seq_len={d.seq_len}: must be >= 1")
    if d.instruct and d.task != "lm":
        problems.append(f"data.instruct=true: needs data.task 'lm' (got {d.task!r})")
    if d.eval_file is not None and not Path(d.eval_file).is_file():
        problems.append(f"data.eval_file={d.eval_file!r}: no such file (a UTF-8 text file to score at the end)")
    if t.objective is not None:
        problems += _preference_problems(recipe)
    problems += _dist_problems(recipe)
    if problems:
        raise ValueError("invalid recipe:\n  - " + "\n  - ".join(problems))


def _preference_problems(recipe: Recipe) -> list[str]:
    """Settings preference tuning does not take (yet), each with why."""
    t, d, o = recipe.train, recipe.data, recipe.train.objective
    problems = []
    if d.task != "lm":
        problems.append(f"train.objective={o!r}: needs data.task 'lm' (got {d.task!r})")
    if d.pack:
        problems.append(f"data.pack=true: not supported with train.objective={o!r} yet (pairs are padded per row)")
    if d.instruct:
        problems.append(f"data.instruct=true: train.objective={o!r} reads preference pairs; leave data.instruct out")
    if t.label_smoothing:
        problems.append(
            f"train.label_smoothing={t.label_smoothing}: a token-loss setting; with train.objective={o!r} use "
            "preference.label_smoothing"
        )
    if recipe.dist.strategy == "fsdp":
        problems.append(f"dist.strategy='fsdp': not supported with train.objective={o!r} yet; use ddp")
    if recipe.finetune.reference is not None and o != "dpo":
        problems.append(f"finetune.reference={recipe.finetune.reference!r}: train.objective={o!r} uses no reference")
    return problems


def load(path: str | Path | None = None, overrides: list[str] = ()) -> Recipe:
    """The recipe at ``path`` (default: shakespeare-char) with ``overrides`` applied."""
    raw = read_file(path if path is not None else "shakespeare-char")
    return from_dict(apply_overrides(raw, list(overrides)))
