"""Sharded training checkpoints with torch.distributed.checkpoint (DCP): every rank writes its own
shards of the weights and the optimizer state, nothing is gathered, and any later layout (world
size, strategy: ddp, fsdp, tp, fsdp+tp, one process) reads them back, DCP resharding by the
parameters' names and global shapes.

A sharded checkpoint is the same folder as a whole one (checkpoint.py): ``step_000120/`` with
config.json, tokenizer.json, rng.safetensors (every data-parallel rank's stream) and state.json,
but the tensors live in ``dcp/`` (one ``__<rank>_0.distcp`` file per rank plus DCP's
``.metadata``) instead of model.safetensors and optimizer.safetensors. It is written into a
hidden ``.tmp_step_*`` folder that rank 0 renames into place only after every rank's shards and
the metadata are on disk, so a rank killed while writing leaves no ``step_*`` folder and
``--resume auto`` (list_checkpoints: ``step_*`` with state.json) never picks the torn one.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed
from safetensors.torch import save_file
from torch import nn

from ..atomic import TMP_PREFIX, publish
from ..models.saving import CONFIG_FILE, load_safetensors, read_json
from ..models.sharded import DCP_DIR, is_sharded  # noqa: F401 (is_sharded: run_state asks here)
from . import checkpoint as ckpt
from . import determinism, distributed


def save_state(*, step: int, elapsed: float, window: tuple[float, int], recipe, out: Path, model, optimizer, tok,
               rt, facts: dict) -> None:  # fmt: skip
    """run_state.save_state's sharded twin: the same state.json fields, every rank's RNG, DCP shards."""
    rng = distributed.gather_rng(ckpt.rng_state(rt.device), rt)  # every data-parallel rank's stream, on rank 0
    state = {"step": step, "elapsed_s": elapsed, "seed": recipe.train.seed, "recipe": recipe.to_dict(),
             "tokenizer_kind": tok.kind, "window": list(window), "run": _with_tp(facts, rt),
             "finetune": None}  # fmt: skip
    save_sharded(out, step, model=model, optimizer=optimizer, rng=rng, state=state, config=model.config.to_dict(),
                 tokenizer_json=tok.to_json(), keep_last=recipe.train.keep_last, is_main=rt.is_main)  # fmt: skip


def restore(path: Path, model: nn.Module, optimizer, rt, facts: dict) -> tuple[int, float, tuple[float, int]]:
    """run_state.restore's sharded twin: (step, elapsed seconds, running loss window)."""
    saved = load_sharded(path, model, optimizer)
    state = saved["state"]
    determinism.warn_if_different(state.get("run", {}), _with_tp(facts, rt), path)
    rng = ckpt.rank_rng(saved["rng"], rt.rank)
    if rng is not None:
        ckpt.restore_rng(rng, rt.device)
    else:  # saved by another data-parallel degree: a fresh, distinct dropout stream per rank (not bit-exact)
        torch.manual_seed(state["seed"] + rt.rank + 7919 * state["step"])
    window = state.get("window", [0.0, 0])
    return state["step"], state["elapsed_s"], (window[0], window[1])


def _with_tp(facts: dict, rt) -> dict:
    """The run facts plus the TP degree: TP's all-reduces sum in another order than one process,
    so a resume that changes it is not bit-exact either (the world in the facts is data-parallel)."""
    return {**facts, "tp": rt.tp}


def save_sharded(run_dir: Path, step: int, *, model: nn.Module, optimizer, rng: dict, state: dict, config: dict,
                 tokenizer_json: str, keep_last: int, is_main: bool) -> Path:  # fmt: skip
    """Checkpoint ``step`` as DCP shards; a collective: every rank calls it."""
    # DCP: ~1 s of CPU to import, which runs without dist.checkpoint=sharded never need
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    ckpts = Path(run_dir) / "checkpoints"
    final = ckpts / f"step_{step:06d}"
    tmp = ckpts / f"{TMP_PREFIX}{final.name}.dcp"  # one name every rank agrees on (no pid)
    if is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # a torn earlier attempt at this step
        tmp.mkdir(parents=True)
    _barrier()
    weights, optim = get_state_dict(model, optimizer)  # this rank's shards (DTensors) or whole tensors
    with _one_process_is_meant():
        dcp.save({"model": weights, "optim": optim}, checkpoint_id=str(tmp / DCP_DIR))  # rank 0 writes .metadata last
    if is_main:
        save_file(rng, str(tmp / ckpt.RNG), metadata={"format": "pt"})
        texts = {CONFIG_FILE: json.dumps(config, indent=2), ckpt.TOKENIZER: tokenizer_json,
                 ckpt.STATE: json.dumps({**state, "format": "dcp"}, indent=1)}  # fmt: skip
        for name, text in texts.items():
            (tmp / name).write_text(text)
        # A resumed run rewrites the step it resumed from: publish moves it aside, deletes it last.
        publish(tmp, final, [*tmp.iterdir(), *(tmp / DCP_DIR).iterdir(), tmp / DCP_DIR])
        for old in ckpt.list_checkpoints(run_dir)[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
        for stale in ckpts.glob(f"{TMP_PREFIX}step_*.dcp"):  # torn by a rank killed mid-write, earlier
            shutil.rmtree(stale, ignore_errors=True)
    _barrier()
    return final


def load_sharded(path: Path, model: nn.Module, optimizer) -> dict:
    """Read a sharded checkpoint into ``model`` and ``optimizer`` as they are laid out now (any
    strategy and world size); returns {"state", "rng"}. A collective under a process group."""
    import torch.distributed.checkpoint as dcp  # ~1 s of imports: only sharded runs pay them
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = Path(path)
    check_fits(path, model)
    weights, optim = get_state_dict(model, optimizer)
    both = {"model": weights, "optim": optim}
    with _one_process_is_meant():
        dcp.load(both, checkpoint_id=str(path / DCP_DIR))
    set_state_dict(model, optimizer, model_state_dict=both["model"], optim_state_dict=both["optim"])
    return {"state": read_json(path / ckpt.STATE), "rng": load_safetensors(path / ckpt.RNG)}


def check_fits(path: Path, model: nn.Module) -> None:
    """A sharded checkpoint of another model is refused before any read: its config must be the
    model's (DCP would otherwise fail deep inside, naming one tensor)."""
    saved = read_json(Path(path) / CONFIG_FILE)
    mine = model.config.to_dict()
    if saved != mine:
        differ = sorted(k for k in set(saved) | set(mine) if saved.get(k) != mine.get(k))
        raise ValueError(f"{path} is a checkpoint of another model: config fields differ: {differ[:8]}")


@contextlib.contextmanager
def _one_process_is_meant():
    """DCP warns when there is no process group that it assumes one process: that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
