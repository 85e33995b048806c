"""Issue 30: train.log_to. One short run logs to TensorBoard, MLflow and wandb (offline) at once;
each tracker's own reader then finds every metrics row the run wrote (every number at its step),
the recipe as hyper-parameters, the loss plot and the final sample. A tracker that is unknown, not
installed or cannot start is one clear error before the first step."""

from __future__ import annotations

import json

import pytest
import torch

from torchformer.extras import MissingExtra
from torchformer.training import trackers
from torchformer.training.report import read_metrics
from torchformer.training.train import train

from .tiny import tiny_recipe, words_text

LOGGED = {"log_to": ["tensorboard", "mlflow", "wandb"], "steps": 12, "eval_every": 4, "sample_chars": 24}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One run into all three trackers: (run folder, its metrics rows)."""
    root = tmp_path_factory.mktemp("trackers")
    (root / "corpus.txt").write_text(words_text(200))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = train(tiny_recipe(root / "run", root / "corpus.txt", train=LOGGED))
    finally:
        torch.set_num_threads(before)
    rows = read_metrics(result.out_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 4, 8, 12]
    return result.out_dir, rows


def _expected(rows) -> dict[str, dict[int, float]]:
    """{metric: {step: value}} of every number in every row (step 0 has no train_loss)."""
    out: dict[str, dict[int, float]] = {}
    for row in rows:
        for key, value in row.items():
            if key != "step" and value is not None:
                out.setdefault(key, {})[row["step"]] = float(value)
    return out


def test_tensorboard_event_files_hold_every_row(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, rows = run
    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    expected = _expected(rows)
    assert set(expected) <= set(acc.Tags()["scalars"])
    for key, by_step in expected.items():
        got = {e.step: e.value for e in acc.Scalars(key)}
        assert got == pytest.approx(by_step, rel=1e-6), key
    assert [e.step for e in acc.Images("loss")] == [12]
    texts = {tag: acc.Tensors(tag)[-1].tensor_proto.string_val[0].decode() for tag in acc.Tags()["tensors"]}
    assert '"lr": 0.003' in texts["recipe/text_summary"]
    assert len(texts["sample/text_summary"].strip()) >= 10
    assert "hparams" in acc.PluginTagToContent("hparams") or acc.PluginTagToContent("hparams")


def test_mlflow_search_runs_finds_every_row(run):
    import mlflow
    from mlflow import MlflowClient

    out, rows = run
    uri = (out / "mlruns").resolve().as_uri()
    mlflow.set_tracking_uri(uri)
    (found,) = mlflow.search_runs(experiment_names=["tiny"], output_format="list")
    assert found.info.status == "FINISHED"
    assert found.data.params["optim.lr"] == "0.003" and found.data.params["train.steps"] == "12"
    client = MlflowClient(tracking_uri=uri)
    for key, by_step in _expected(rows).items():
        got = {m.step: m.value for m in client.get_metric_history(found.info.run_id, key)}
        assert got == pytest.approx(by_step, rel=1e-6), key
    assert found.data.metrics["val_loss"] == pytest.approx(rows[-1]["val_loss"], rel=1e-6)
    artifacts = {a.path for a in client.list_artifacts(found.info.run_id)}
    assert {"loss.png", "sample.txt"} <= artifacts


def _wandb_records(path):
    """The records of a wandb transaction log (.wandb): a 7-byte header (":W&B", magic, version),
    then LevelDB-log style 32 KiB blocks of chunks (crc32c 4, length 2, type 1: full, first,
    middle, last), each record a protobuf ``Record``."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def test_wandb_offline_run_files_hold_every_row(run):
    out, rows = run
    (log,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    history, config, summary = {}, {}, {}
    for record in _wandb_records(log):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            history[items["_step"]] = items
        elif kind in ("run", "config"):  # the run record carries the config given to wandb.init
            update = record.run.config.update if kind == "run" else record.config.update
            config.update({i.key: json.loads(i.value_json) for i in update})
        elif kind == "summary":
            summary.update({i.key or "/".join(i.nested_key): i.value_json for i in record.summary.update})
    for key, by_step in _expected(rows).items():
        got = {step: items[key] for step, items in history.items() if key in items}
        assert got == pytest.approx(by_step, rel=1e-6), key
    assert config["optim"]["lr"] == 0.003 and config["train"]["log_to"] == LOGGED["log_to"]
    assert history[12]["loss/_type"] == "image-file"  # the plot, logged at the last step
    assert len(json.loads(summary["sample"]).strip()) >= 10


def test_unknown_tracker_is_refused_before_any_work(tmp_path, corpus):
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=r"train.log_to=\['tensorbored'\]: each one of \['mlflow', 'tensorboard'"):
        train(tiny_recipe(out, corpus, train={"log_to": ["tensorbored"]}))
    assert not out.exists()


def test_missing_extra_names_it_before_any_work(tmp_path, corpus, monkeypatch):
    real = trackers.importlib.util.find_spec
    monkeypatch.setattr(trackers.importlib.util, "find_spec", lambda name: None if name == "wandb" else real(name))
    out = tmp_path / "run"
    with pytest.raises(MissingExtra, match=r"wandb needs the `wandb` package.*pip install 'torchformer\[trackers\]'"):
        train(tiny_recipe(out, corpus, train={"log_to": ["tensorboard", "wandb"]}))
    assert not out.exists()


def test_tracker_that_cannot_start_stops_the_run_before_the_first_step(tmp_path, corpus):
    out = tmp_path / "run"
    out.mkdir()
    (out / "tensorboard").write_text("a file where the event folder would go")
    with pytest.raises(RuntimeError, match=r"the tensorboard tracker could not start, so training did not start"):
        train(tiny_recipe(out, corpus, train={"log_to": ["tensorboard"]}))
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()
