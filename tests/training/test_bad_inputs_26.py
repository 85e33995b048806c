"""Issue 26, training: recipe files are read as YAML's safe subset with bounded aliases and errors
that name the file; a run refused on bad input leaves no run folder (no <out_dir>/data) behind."""

from __future__ import annotations

import time

import pytest

import torchformer as tfm
from torchformer.training import recipe
from torchformer.training.tokenizers import build_tokenizer
from torchformer.training.train import train

from .tiny import tiny_recipe

BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [{', '.join(['*' + p] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi")
)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("name: !!python/object/apply:os.system ['true']\n", r"line 1, column 7: could not determine a constructor"),
        ("model: {preset: [unclosed\n", r"not valid YAML at line 2"),
        (b"\xc5\x00\xff" * 50, r"not UTF-8 text \(byte 0xc5 at byte offset 0"),
        (BOMB, r"expands to more than 100,000 values \(YAML aliases\)"),
        ("a" * (2 << 20), r"2,097,152 bytes; a recipe is a few KB"),
        ("train: [1, 2]\n", r"recipe section train must be a mapping"),
    ],
)
def test_a_bad_recipe_file_is_named_quickly(tmp_path, text, message):
    file = tmp_path / "r.yaml"
    file.write_bytes(text if isinstance(text, bytes) else text.encode())
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=rf"{file}.*{message}" if "section" not in message else message):
        recipe.load(file)
    assert time.perf_counter() - t0 < 5  # the alias bomb took 25 s


def test_yaml_aliases_of_a_normal_size_still_work(tmp_path):
    file = tmp_path / "r.yaml"
    file.write_text("train: {steps: &n 7, eval_every: *n}\n")
    assert recipe.load(file).train.eval_every == 7
    assert recipe.load(None, ["train.steps=12"]).train.steps == 12  # overrides are read as YAML too


def test_a_bad_json_recipe_is_named(tmp_path):
    file = tmp_path / "r.json"
    file.write_text("{oops")
    with pytest.raises(ValueError, match=rf"recipe {file}: not valid JSON"):
        recipe.load(file)


@pytest.fixture
def small(tmp_path):
    (tmp_path / "small.txt").write_text("to be or not to be\n" * 3)
    return tmp_path / "small.txt"


def broken_init(tmp_path, text: str):
    """A model.init checkpoint (with the data's tokenizer) whose weights file is cut in half."""
    tok = build_tokenizer("char", text)
    cfg = tfm.presets.get("shakespeare-char").replace(vocab_size=tok.vocab_size, d_model=16, n_layers=1)
    folder = tfm.save(tfm.build_model(cfg), tmp_path / "init", extra_files={"tokenizer.json": tok.to_json()})
    raw = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(raw[: len(raw) // 2])
    return folder


@pytest.mark.parametrize("case", ["batch-too-large", "bad-resume", "broken-init"])
@pytest.mark.parametrize("existing", [False, True])
def test_a_refused_run_writes_nothing(tmp_path, small, case, existing):
    out = tmp_path / "run"
    if existing:  # a run folder the user already has: kept as it was, and no data/ in it
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    resume, r = None, tiny_recipe(out, small)
    if case == "batch-too-large":
        r = tiny_recipe(out, small, train={"batch_size": 64})
    elif case == "bad-resume":
        resume = str(tmp_path / "nowhere")
    else:
        raw = r.to_dict()
        raw["model"] = {"init": str(broken_init(tmp_path, small.read_text()))}
        r = recipe.from_dict(raw)
    with pytest.raises(
        (ValueError, FileNotFoundError), match="larger than the training|nowhere|init/model.safetensors"
    ):
        train(r, resume=resume)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"] if existing else not out.exists()
