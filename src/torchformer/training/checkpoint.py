"""Training checkpoints: safetensors for every tensor, JSON for everything else; no pickle.

Each checkpoint is a folder ``<run>/checkpoints/step_000120/`` holding config.json and
model.safetensors (so ``tfm.load`` opens it), tokenizer.json, optimizer.safetensors (Adam
moments and step counters), rng.safetensors and state.json (step, optimizer param groups, elapsed
time, recipe). It is written into a hidden temporary folder, every file fsynced, then renamed into
place: a crash mid-write leaves the previous checkpoint untouched and no half folder under a
``step_*`` name. Older checkpoints beyond ``keep_last`` are deleted after the new one is in place.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
from torch import nn

from ..atomic import TMP_PREFIX, write_file, write_folder
from ..models.saving import CONFIG_FILE, WEIGHTS_FILE, load_safetensors, read_json, unique_state

STATE, OPTIM, RNG, TOKENIZER = "state.json", "optimizer.safetensors", "rng.safetensors", "tokenizer.json"
ADAPTERS = "adapters.safetensors"  # a LoRA run's checkpoint: adapter tensors only (finetune.py)
_STEP_DIR = re.compile(r"^step_(\d+)$")


def optimizer_tensors(sd: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """Split an optimizer state dict into flat tensors (safetensors) and the JSON-able rest.
    Parameters are keyed by index (plain optimizer) or by name (FSDP's full state dict)."""
    tensors, scalars = {}, {}
    for idx, entry in sd["state"].items():
        for name, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{idx}.{name}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{idx}.{name}"] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def restore_optimizer(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    optimizer.load_state_dict(optimizer_state(tensors, meta))


def optimizer_state(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    """The inverse of ``optimizer_tensors``."""
    state: dict = {}
    items = [(k.removeprefix("state."), v) for k, v in tensors.items()] + list(meta["scalars"].items())
    for key, value in items:
        param, name = key.rsplit(".", 1)  # the state's own names (step, exp_avg, ...) hold no dots
        state.setdefault(int(param) if param.isdigit() else param, {})[name] = value
    groups = [dict(g, betas=tuple(g["betas"])) if "betas" in g else g for g in meta["param_groups"]]
    return {"state": state, "param_groups": groups}


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    out = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state(device)
    return out


def rank_rng(tensors: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor] | None:
    """Rank ``rank``'s states from a checkpoint's rng tensors: rank 0's are saved as ``cpu``/``cuda``,
    rank r's as ``cpu.rank{r}``. None when the checkpoint has none for this rank (another world size)."""
    if rank == 0:
        return {k: v for k, v in tensors.items() if "." not in k}
    mine = {k.rsplit(".", 1)[0]: v for k, v in tensors.items() if k.endswith(f".rank{rank}")}
    return mine or None


def restore_rng(tensors: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(tensors["cpu"])
    if device.type == "cuda" and "cuda" in tensors:
        torch.cuda.set_rng_state(tensors["cuda"], device)


def save_checkpoint(
    run_dir: Path,
    step: int,
    *,
    model_state: dict[str, torch.Tensor],
    config: dict,
    tokenizer_json: str,
    optim: tuple[dict[str, torch.Tensor], dict],
    rng: dict[str, torch.Tensor],
    state: dict,
    keep_last: int,
    weights_file: str | None = None,
) -> Path:
    """Write checkpoint ``step`` atomically; also refresh the run folder's top-level model files.
    weights_file: where model_state goes (a LoRA run saves adapters.safetensors, not a model)."""
    ckpts = run_dir / "checkpoints"
    texts = {
        CONFIG_FILE: json.dumps(config, indent=2),
        TOKENIZER: tokenizer_json,
        STATE: json.dumps({**state, "optimizer": optim[1]}, indent=1),
    }
    tensors = {weights_file or WEIGHTS_FILE: model_state, OPTIM: optim[0], RNG: rng}
    # A resumed run rewrites the step it resumed from: a full run's or a LoRA run's files.
    final = write_folder(ckpts / f"step_{step:06d}", tensors=tensors, texts=texts, replaces=(WEIGHTS_FILE, ADAPTERS))
    _export(final, run_dir)
    _prune(ckpts, keep_last)
    return final


def _export(ckpt: Path, run_dir: Path) -> None:
    """Copy the model files to the run folder's top, so ``tfm.load(run_dir)`` and
    ``torchformer generate run_dir`` see the latest weights (each file replaced atomically)."""
    for name in (n for n in (WEIGHTS_FILE, ADAPTERS, CONFIG_FILE, TOKENIZER) if (ckpt / n).is_file()):
        write_file(run_dir / name, lambda tmp, name=name: shutil.copyfile(ckpt / name, tmp))


def _prune(ckpts: Path, keep_last: int) -> None:
    for old in list_checkpoints(ckpts.parent)[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    for stale in ckpts.glob(f"{TMP_PREFIX}step_*"):  # left by a process killed mid-write
        if not stale.name.endswith(f"_{os.getpid()}"):
            shutil.rmtree(stale, ignore_errors=True)


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints (state.json present), oldest first."""
    ckpts = Path(run_dir) / "checkpoints"
    found = []
    for d in ckpts.iterdir() if ckpts.is_dir() else []:
        m = _STEP_DIR.match(d.name)
        if m and (d / STATE).is_file():
            found.append((int(m.group(1)), d))
    return [d for _, d in sorted(found)]


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def load_checkpoint(path: Path) -> dict:
    """Everything a resume needs, read without unpickling: weights, optimizer, rng, state."""
    path = Path(path)
    weights = ADAPTERS if (path / ADAPTERS).is_file() else WEIGHTS_FILE
    for name in (weights, OPTIM, RNG, STATE):
        if not (path / name).is_file():
            raise FileNotFoundError(f"{path} is not a training checkpoint: {name} is missing")
    return {
        "model": load_safetensors(path / weights),
        "optim": load_safetensors(path / OPTIM),
        "rng": load_safetensors(path / RNG),
        "state": read_json(path / STATE),
        "tokenizer_json": (path / TOKENIZER).read_text(),
    }


def load_model_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load weights saved with tied tensors once; any other mismatch is an error."""
    expected = set(unique_state(model))
    if set(state) != expected:
        raise ValueError(
            f"checkpoint weights do not fit the model: missing {sorted(expected - set(state))}, "
            f"unexpected {sorted(set(state) - expected)}"
        )
    model.load_state_dict(state, strict=False)
