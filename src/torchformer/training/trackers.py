"""Experiment trackers: ``train.log_to: [tensorboard, mlflow, wandb]`` (the ``trackers`` extra).

Each tracker is a sink of what the run writes anyway: every metrics row (metrics.jsonl, at each
evaluation), the resolved recipe as hyper-parameters, the loss plot and the final sample. Rank 0
alone opens them. Names and installed packages are checked before any work, and every tracker
starts before the first step, so one that cannot start is an error naming it, not a crash an
hour into training.

Where they write: tensorboard, event files in <out_dir>/tensorboard; mlflow, $MLFLOW_TRACKING_URI
(a server or a database) else a file store in <out_dir>/mlruns, experiment $MLFLOW_EXPERIMENT_NAME
else the recipe's name; wandb, under <out_dir>/wandb in $WANDB_MODE, offline by default (no
network unless asked), project $WANDB_PROJECT else "torchformer".
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import time
from pathlib import Path

import numpy as np

from ..extras import MissingExtra

EXTRA = "trackers"


def flat(tree: dict, prefix: str = "") -> dict:
    """{"optim": {"lr": 1e-3}} -> {"optim.lr": 1e-3}; lists and None as their JSON text."""
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flat(value, name + "."))
        elif isinstance(value, (bool, int, float, str)):
            out[name] = value
        else:
            out[name] = json.dumps(value)
    return out


class TensorBoard:
    def __init__(self, recipe: dict, out: Path) -> None:
        # Each tracker imports its package when a run names it: they are optional (the trackers
        # extra), and mlflow or wandb cost seconds of imports a run without them never pays.
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        self.writer = SummaryWriter(log_dir=str(out / "tensorboard"))
        self.writer.add_text("recipe", "    " + json.dumps(recipe, indent=1).replace("\n", "\n    "))  # preformatted
        for summary in hparams(flat(recipe), {}):  # the HPARAMS tab, in this run's own event file
            self.writer.file_writer.add_summary(summary)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def image(self, name: str, path: Path, step: int) -> None:
        from PIL import Image  # comes with the trackers extra (tensorboard), not with torchformer

        self.writer.add_image(name, np.asarray(Image.open(path).convert("RGB")), step, dataformats="HWC")

    def text(self, name: str, text: str, step: int) -> None:
        self.writer.add_text(name, "    " + text.replace("\n", "\n    "), step)

    def close(self, ok: bool) -> None:
        self.writer.close()


class MLflow:
    def __init__(self, recipe: dict, out: Path) -> None:
        from mlflow import MlflowClient  # optional: the trackers extra
        from mlflow.entities import Param

        uri = os.environ.get("MLFLOW_TRACKING_URI") or (out / "mlruns").resolve().as_uri()
        if uri.startswith("file:"):  # MLflow 3 refuses its file store unless opted in; a run folder has no server
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or recipe["name"]
        found = self.client.get_experiment_by_name(name)
        experiment = found.experiment_id if found is not None else self.client.create_experiment(name)
        self.run_id = self.client.create_run(experiment, run_name=out.name).info.run_id
        params = [Param(k, str(v)[:6000]) for k, v in flat(recipe).items()]  # 6000: MLflow's value limit
        for i in range(0, len(params), 100):  # log_batch takes at most 100 params a call
            self.client.log_batch(self.run_id, params=params[i : i + 100])

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric  # optional (trackers extra)

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()])

    def image(self, name: str, path: Path, step: int) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def text(self, name: str, text: str, step: int) -> None:
        self.client.log_text(self.run_id, text, f"{name}.txt")

    def close(self, ok: bool) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if ok else "FAILED")


class WandB:
    def __init__(self, recipe: dict, out: Path) -> None:
        import wandb  # optional: the trackers extra

        settings = wandb.Settings(silent=True, console="off", x_disable_stats=True)  # the run's own output only
        self.run = wandb.init(mode=os.environ.get("WANDB_MODE", "offline"), dir=str(out), name=recipe["name"],
                              project=os.environ.get("WANDB_PROJECT", "torchformer"), config=recipe,
                              settings=settings, reinit="create_new")  # fmt: skip

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def image(self, name: str, path: Path, step: int) -> None:
        import wandb  # optional (trackers extra)

        self.run.log({name: wandb.Image(str(path))}, step=step)

    def text(self, name: str, text: str, step: int) -> None:
        self.run.summary[name] = text

    def close(self, ok: bool) -> None:
        self.run.finish(exit_code=0 if ok else 1)


TRACKERS = {"tensorboard": TensorBoard, "mlflow": MLflow, "wandb": WandB}
PACKAGES = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}


def check(names) -> None:
    """train.log_to before any work: a list of known tracker names, each installed."""
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"train.log_to={names!r}: must be a list of tracker names from {sorted(TRACKERS)}")
    unknown = [n for n in names if n not in TRACKERS]
    if unknown or len(set(names)) != len(names):
        raise ValueError(f"train.log_to={list(names)!r}: each one of {sorted(TRACKERS)}, at most once")
    for name in names:
        if importlib.util.find_spec(PACKAGES[name]) is None:
            raise MissingExtra(
                f"train.log_to: {name} needs the `{PACKAGES[name]}` package, which is not installed: "
                f"pip install 'torchformer[{EXTRA}]'"
            )


class Trackers:
    """The open trackers; each call goes to all of them (none on ranks other than 0)."""

    def __init__(self, sinks: dict) -> None:
        self.sinks, self.step = sinks, 0

    def __bool__(self) -> bool:
        return bool(self.sinks)

    def log(self, row: dict) -> None:
        """One metrics row: its numbers at its step (step 0's missing train loss is left out)."""
        self.step = row["step"]
        numbers = {k: float(v) for k, v in row.items() if k != "step" and _number(v)}
        for sink in self.sinks.values():
            sink.log(row["step"], numbers)

    def image(self, name: str, path: Path | None) -> None:
        for sink in self.sinks.values() if path is not None else []:  # None: no plot (matplotlib missing)
            sink.image(name, path, self.step)

    def text(self, name: str, text: str) -> None:
        for sink in self.sinks.values():
            sink.text(name, text, self.step)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@contextlib.contextmanager
def open_all(names, recipe, out: Path):
    """Start each tracker (an error naming the one that fails), yield them, close them at the end
    (marked failed when the run raised)."""
    sinks: dict = {}
    ok = False
    try:
        for name in names:
            try:
                sinks[name] = TRACKERS[name](recipe.to_dict(), Path(out))
            except Exception as err:
                raise RuntimeError(
                    f"train.log_to: the {name} tracker could not start, so training did not start "
                    f"({type(err).__name__}: {err})"
                ) from err
        yield Trackers(sinks)
        ok = True
    finally:
        for sink in sinks.values():
            sink.close(ok)
