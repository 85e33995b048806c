"""Issue 31: sharded checkpoints (DCP). A run under FSDP(2) x TP(2) (4 processes) writes every
rank's shards, nothing gathered; its steps equal the single process's within 1e-5; resumed at the
same layout it continues bit-exactly; resumed under TP=2 (2 processes) or in one process it
continues with the same weights and loss within 1e-5, with the reproducibility warning; a rank
killed while writing (under TP=2) leaves no checkpoint that ``--resume auto`` picks; ``tfm.load`` and
``torchformer convert --from-dcp`` give a one-file folder."""

import json
import shutil

import pytest
import torch

import torchformer as tfm
from torchformer.cli.main import main
from torchformer.training.checkpoint import latest_checkpoint
from torchformer.training.run_state import resume_point
from torchformer.training.train import train

from ..training.tiny import tiny_recipe, words_text
from .launch import ranks

pytestmark = pytest.mark.xdist_group("parallel")

STEPS = {"steps": 4, "batch_size": 8, "eval_every": 1, "eval_batches": 1, "checkpoint_every": 1, "keep_last": 5}


def recipe(tmp, name, **dist):
    corpus = tmp / "corpus.txt"
    if not corpus.exists():
        corpus.write_text(words_text(400))
    return tiny_recipe(tmp / name, corpus, train=STEPS, dist={"checkpoint": "sharded", **dist})


def launch(tmp, name, n, *extra, module="torchformer.cli.main", before=(), **dist):
    file = tmp / f"{name}.json"
    file.write_text(json.dumps(recipe(tmp, name, **dist).to_dict()))
    return ranks(n, module, *before, "train", "--recipe", str(file), *extra, timeout=300)


def step(run, k):
    return run / "checkpoints" / f"step_{k:06d}"


def weights(folder):
    return {k: v.detach() for k, v in tfm.load(folder).state_dict().items()}


def rows(run):
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines)}


def resumed_from(straight, tmp, name, k):
    """A run folder holding only checkpoint k of ``straight``: ``--resume auto`` starts there."""
    (tmp / name / "checkpoints").mkdir(parents=True)
    shutil.copytree(step(straight, k), step(tmp / name, k))
    shutil.copytree(straight / "data", tmp / name / "data")
    return tmp / name


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("straight")  # (straight's data/ is copied along, so no rank re-tokenizes)
    proc = launch(tmp, "run", 4, strategy="fsdp+tp", tp=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp / "run"


def test_every_rank_writes_its_shards_and_the_steps_equal_one_process(tmp_path, straight):
    files = sorted(p.name for p in (step(straight, 4) / "dcp").iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp"]
    assert not (straight / "model.safetensors").exists()  # nothing whole was written
    single = train(recipe(tmp_path, "single", strategy="ddp", checkpoint="full"))
    for k in (1, 4):
        ref = weights(step(tmp_path / "single", k))
        for name, tensor in weights(step(straight, k)).items():
            torch.testing.assert_close(tensor, ref[name], atol=1e-5, rtol=0, msg=f"step {k}: {name}")
    assert single.step == 4


def test_resumed_at_the_same_layout_is_bit_exact(tmp_path, straight):
    run = resumed_from(straight, tmp_path, "again", 2)
    proc = launch(tmp_path, "again", 4, "--resume", "auto", strategy="fsdp+tp", tp=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for k in (3, 4):
        ref = weights(step(straight, k))
        for name, tensor in weights(step(run, k)).items():
            assert torch.equal(tensor, ref[name]), f"step {k}: {name}"
    drop = lambda r: {k: v for k, v in r.items() if k != "elapsed_s"}  # noqa: E731
    assert [drop(rows(run)[k]) for k in (3, 4)] == [drop(rows(straight)[k]) for k in (3, 4)]


def test_resumed_at_another_layout_continues_within_1e_5(tmp_path, straight):
    # TP=2 (2 processes) from step 2; rank 1 is killed while writing step 4's checkpoint (die_in_dcp.py).
    two = resumed_from(straight, tmp_path, "tp2", 2)
    proc = launch(tmp_path, "tp2", 2, "--resume", "auto", module="tests.parallel.die_in_dcp", before=("4", "1"),
                  strategy="tp", tp=2)  # fmt: skip
    assert "not bit-identical" in proc.stderr  # the reproducibility rules' warning (world 2 -> 1)
    one = resumed_from(straight, tmp_path, "one", 2)
    with pytest.warns(UserWarning, match="not bit-identical"):
        train(recipe(tmp_path, "one", strategy="ddp"), resume="auto", stop_after=3)
    for run in (two, one):
        assert rows(run)[3]["val_loss"] == pytest.approx(rows(straight)[3]["val_loss"], abs=1e-5)
        ref = weights(step(straight, 3))
        for name, tensor in weights(step(run, 3)).items():
            torch.testing.assert_close(tensor, ref[name], atol=1e-5, rtol=0, msg=f"{run.name}: {name}")
    # The torn checkpoint: rank 1's shard is on disk, the step is not published, --resume auto takes step 3.
    assert proc.returncode != 0
    assert (two / "checkpoints" / ".tmp_step_000004.dcp" / "dcp" / "__1_0.distcp").is_file()
    assert not step(two, 4).exists()
    assert resume_point("auto", two) == latest_checkpoint(two) == step(two, 3)


def test_convert_and_load_give_a_one_file_folder(tmp_path, straight, capsys):
    out = tmp_path / "whole"
    # The CLI's main in this process (a subprocess would add only its start-up).
    assert main(["convert", "--from-dcp", str(step(straight, 4)), "--out", str(out)]) == 0, capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    ref = weights(step(straight, 4))
    assert all(torch.equal(t, ref[k]) for k, t in weights(out).items())


def test_a_sharded_checkpoint_of_another_model_is_refused(tmp_path, straight, capsys):
    run = resumed_from(straight, tmp_path, "other", 2)
    (tmp_path / "corpus.txt").write_text(words_text(400))
    other = tiny_recipe(tmp_path / "other", tmp_path / "corpus.txt", train=STEPS,
                        model={"d_model": 48}, dist={"checkpoint": "sharded"})  # fmt: skip
    with pytest.raises(ValueError, match=r"is a checkpoint of another model: config fields differ: \['d_model'"):
        train(other, resume="auto")
    assert main(["convert", "--from-dcp", str(run), "--out", str(tmp_path / "x")]) == 2
    assert "not a sharded checkpoint (no dcp/ folder inside)" in capsys.readouterr().err
