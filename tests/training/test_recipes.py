"""Issue 4, test 6: a short run of each shipped recipe (shrunk) lowers validation loss, and the
run folder holds what the default run promises: checkpoint, tokenizer, metrics, loss plot."""

import json
import math

import pytest

import torchformer as tfm
from torchformer.cli.main import main
from torchformer.training import recipe
from torchformer.training.train import train

SHRINK = ["model.d_model=32", "model.n_layers=1", "model.attention.n_heads=2", "train.eval_batches=4",
          "train.log_every=5", "train.device=cpu", "train.max_time_s=null"]  # fmt: skip


@pytest.mark.parametrize(
    "name,extra",
    [
        ("shakespeare-char", ["train.steps=40", "train.eval_every=40", "train.batch_size=16"]),
        ("mlm-tiny", ["train.steps=40", "train.eval_every=40", "data.seq_len=32", "model.block.d_ff=64",
                      "schedule.warmup=5", "optim.lr=3e-3"]),
        ("reverse", ["train.steps=60", "train.eval_every=60", "model.n_decoder_layers=1", "model.block.d_ff=64",
                     "data.synthetic.n_train=2000", "data.synthetic.n_val=64", "train.batch_size=32",
                     "schedule.warmup=60", "schedule.factor=0.5"]),
    ],
)  # fmt: skip
def test_each_recipe_lowers_validation_loss(tmp_path, corpus, name, extra):
    data = [f"data.source={corpus}"] if name == "mlm-tiny" else []  # mlm: a small corpus keeps it quick
    r = recipe.load(name, [*SHRINK, *extra, *data, f"train.out_dir={tmp_path / 'run'}"])
    result = train(r)
    rows = result.metrics
    assert rows[0]["step"] == 0 and rows[-1]["step"] == r.train.steps
    first, last = rows[0]["val_loss"], rows[-1]["val_loss"]
    assert abs(first - math.log(result.model.config.vocab_size)) < 1.0  # untrained: about ln V
    assert last < first - 0.3, (first, last)


def test_default_run_folder_contents(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["train", "--out", str(out), *SHRINK, "train.steps=20", "train.eval_every=10", "train.sample_chars=40"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "val" in printed and "ppl" in printed and "done: step 20" in printed
    for name in ("config.json", "model.safetensors", "tokenizer.json", "metrics.jsonl", "loss.png"):
        assert (out / name).is_file(), name
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 10, 20]
    assert {"step", "train_loss", "val_loss", "elapsed_s"} <= rows[-1].keys()
    assert 0 < rows[1]["elapsed_s"] < rows[2]["elapsed_s"]
    model, tok = tfm.load(out), tfm.load_tokenizer(out)  # the folder opens with the public loaders
    ids = tok.encode("ROMEO\nO").ids
    assert tok.decode(ids) == "ROMEO\nO" and max(ids) < model.config.vocab_size
    sample = printed.split("-" * 72)[1]
    assert len(sample.strip("\n")) >= 30


def test_demo_reverse_reports_exact_match_and_cross_attention(tmp_path, capsys):
    tiny = ["model.d_model=32", "model.n_layers=1", "model.n_decoder_layers=1", "model.attention.n_heads=2",
            "model.block.d_ff=64", "data.synthetic.n_train=256", "data.synthetic.n_val=16", "train.steps=4",
            "train.eval_every=4", "train.eval_batches=1", "train.batch_size=32",
            f"train.out_dir={tmp_path}"]  # fmt: skip
    assert main(["demo", "reverse", *tiny]) == 0
    out = capsys.readouterr().out
    assert "held-out exact match:" in out and "of 16 reversals" in out
    grid = out.split("(rows: output, columns: input):\n")[1].splitlines()
    assert grid[0].strip().endswith("<") and len(grid) >= 2  # key labels, then one row per output token
    assert main(["demo", "nonsense"]) == 2


def test_overrides_before_and_after_options_all_count():
    """`train model.n_layers=6 --out runs/x train.steps=50` (the docs' form): options between
    overrides once made argparse refuse the second group ("unrecognized arguments")."""
    from torchformer.cli.main import parse
    from torchformer.cli.train import parse as train_parse

    argv = ["model.n_layers=6", "--out", "runs/x", "train.steps=50", "--recipe", "reverse", "optim.lr=1e-3"]
    for args in (parse("train", argv), train_parse(argv)):
        assert args.overrides == ["model.n_layers=6", "train.steps=50", "optim.lr=1e-3"]
        assert (args.out, args.recipe) == ("runs/x", "reverse")


def test_reverse_recipe_learns_reversal(tmp_path):
    """The demo's recipe, shrunk (d_model 64, strings of 3-6 letters, 300 steps, ~13 s), really
    learns the task: greedy decoding reverses >= 90% of held-out strings (measured 95-98.5% over
    seeds 1-3 and 1337). An untrained model scores 0%, and a broken mask, position or schedule
    leaves it far below."""
    from torchformer.training.reverse_eval import exact_match

    small = ["model.d_model=64", "model.attention.n_heads=4", "model.block.d_ff=256", "train.steps=300",
             "schedule.warmup=60", "optim.lr=5e-3", "data.synthetic.n_train=5000", "data.synthetic.n_val=200",
             "data.synthetic.max_len=6", "train.batch_size=64", "train.eval_every=300", "train.max_time_s=null",
             "train.device=cpu", f"train.out_dir={tmp_path}"]  # fmt: skip
    result = train(recipe.load("reverse", small))
    acc, examples = exact_match(result.model, result.tokenizer, result.data.val)
    assert len(examples) == 200
    assert acc >= 0.9, [e for e in examples if e[1] != e[2]][:5]
