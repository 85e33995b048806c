"""Issue 4, test 7: bad input gives a clear error or message and loses nothing."""

import math

import pytest
import torch

from torchformer.cli.main import main
from torchformer.training import losses, recipe
from torchformer.training.checkpoint import list_checkpoints
from torchformer.training.train import NonFiniteLoss, train

from .tiny import tiny_recipe


def test_missing_data_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="data.source=.*no such file"):
        train(tiny_recipe(tmp_path / "run", tmp_path / "nope.txt"))


def test_empty_corpus(tmp_path):
    (tmp_path / "empty.txt").write_text("  \n\n")
    with pytest.raises(ValueError, match="corpus is empty"):
        train(tiny_recipe(tmp_path / "run", tmp_path / "empty.txt"))


def test_recipe_with_unknown_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  stepz: 10\n")
    with pytest.raises(ValueError, match=r"train\.stepz.*allowed in train"):
        recipe.load(bad)
    bad.write_text("trainer:\n  steps: 10\n")
    with pytest.raises(ValueError, match="unknown recipe section.*trainer"):
        recipe.load(bad)


def test_override_of_unknown_field():
    with pytest.raises(ValueError, match=r"unknown key model\.n_layer;"):
        recipe.load(None, ["model.n_layer=4"])
    with pytest.raises(ValueError, match=r"optim\.lrr"):
        recipe.load(None, ["optim.lrr=1e-3"])
    with pytest.raises(ValueError, match=r"optim\.lr='fast': must be float"):
        recipe.load(None, ["optim.lr=fast"])
    with pytest.raises(ValueError, match="expected section.key=value"):
        recipe.load(None, ["optim.lr"])


def test_batch_larger_than_corpus(tmp_path):
    (tmp_path / "small.txt").write_text("to be or not to be\n" * 3)
    with pytest.raises(ValueError, match="larger than the training split"):
        train(tiny_recipe(tmp_path / "run", tmp_path / "small.txt", train={"batch_size": 64}))


def test_cli_shows_one_line_errors(tmp_path, capsys):
    assert main(["train", "--data", str(tmp_path / "missing.txt"), "train.steps=1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("torchformer train: error: data.source=") and err.count("\n") == 1
    assert main(["train", "model.n_layer=4"]) == 2
    assert "unknown key model.n_layer" in capsys.readouterr().err


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(tmp_path, corpus, monkeypatch):
    out = tmp_path / "run"
    make = lambda: tiny_recipe(out, corpus, train={"steps": 20, "checkpoint_every": 5})  # noqa: E731
    real, calls = losses.token_loss, []

    def poisoned(logits, labels, smoothing=0.0):
        calls.append(1)
        loss = real(logits, labels, smoothing)
        return loss * math.nan if len(calls) > 2 + 7 else loss  # step-0 eval (2 batches), 7 fine steps, then NaN

    monkeypatch.setattr(losses, "token_loss", poisoned)
    with pytest.raises(NonFiniteLoss, match=r"non-finite loss.*step 8.*Last good checkpoint: .*step_000005"):
        train(make())
    assert [p.name for p in list_checkpoints(out)] == ["step_000005"]
    monkeypatch.setattr(losses, "token_loss", real)
    resumed = train(make(), resume="auto")  # nothing lost: continues from step 5
    assert resumed.step == 20 and math.isfinite(resumed.val_loss)
    assert all(torch.isfinite(p).all() for p in resumed.model.parameters())


def test_cli_reports_non_finite_loss(tmp_path, corpus, monkeypatch, capsys):
    monkeypatch.setattr(losses, "token_loss", lambda logits, labels, smoothing=0.0: logits.sum() * math.inf)
    args = ["train", "--data", str(corpus), "--out", str(tmp_path / "run"), "train.steps=3", "model.n_layers=1"]
    assert main(args) == 1
    assert "stopped: non-finite loss" in capsys.readouterr().err
