"""Issue 26: tfm.load on a broken native checkpoint, or one whose config does not describe its
weights, is one ValueError naming the file, raised from the header before any model is built;
tfm.save replaces only an empty folder or a checkpoint (force=True: any folder), never a file."""

from __future__ import annotations

import hashlib
import json
import struct
import time

import pytest
import torch

import torchformer as tfm


@pytest.fixture
def ckpt(tmp_path):
    cfg = tfm.presets.get("llama-tiny").replace(vocab_size=32, d_model=16, n_layers=2, max_seq_len=16)
    return tfm.save(tfm.build_model(cfg), tmp_path / "ckpt")


def blob(meta: dict, payload: bytes = b"") -> bytes:
    text = json.dumps(meta).encode()
    return struct.pack("<Q", len(text)) + text + payload


BROKEN = {
    "truncated": lambda raw: raw[: len(raw) // 2],
    "empty": lambda raw: b"",
    "header-2^62": lambda raw: struct.pack("<Q", 2**62) + b"{}",
    "huge-tensor": lambda raw: blob({"w": {"dtype": "F32", "shape": [10**6, 10**6], "data_offsets": [0, 4 * 10**12]}}),
    "shape-vs-offsets": lambda raw: blob({"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 8]}}, b"\0" * 8),
    "pickle": lambda raw: b"\x80\x04\x95" + raw[:64],
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_broken_weights_file_is_named(case, ckpt):
    file = ckpt / "model.safetensors"
    file.write_bytes(BROKEN[case](file.read_bytes()))
    with pytest.raises(ValueError, match=rf"{file} is not a readable safetensors file"):
        tfm.load(ckpt)


def edit(ckpt, **changes) -> None:
    file = ckpt / "config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **changes}))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"n_layers": 10**6}, r"n_layers=1000000 but .*model.safetensors holds 2 layers"),
        ({"n_layers": 10**9}, r"n_layers=1000000000 but .*holds 2 layers"),
        ({"d_model": 10**9}, r"d_model=1000000000 but no tensor in .*model.safetensors is that wide"),
        ({"vocab_size": 10**7}, r"vocab_size=10000000 but no tensor"),
        ({"n_layers": "4"}, r"config.json: invalid ModelConfig: n_layers='4': must be an integer"),
    ],
)
def test_a_config_that_does_not_describe_the_file_fails_fast(ckpt, changes, message):
    edit(ckpt, **changes)
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=message):
        tfm.load(ckpt)
    assert time.perf_counter() - t0 < 5  # was > 90 s for 1e6 layers (built on the meta device first)


def test_a_wider_d_ff_is_named_with_both_shapes(ckpt):
    edit(ckpt, block={**json.loads((ckpt / "config.json").read_text())["block"], "d_ff": 40})
    with pytest.raises(ValueError, match=r"model.safetensors: tensor '.*mlp.*' has shape \(\d+, \d+\), its config"):
        tfm.load(ckpt)


@pytest.mark.parametrize(
    ("text", "message"),
    [("{oops", "not a JSON file"), ("[1, 2]", "must hold a JSON object of settings, got a JSON list")],
)
def test_an_unreadable_config_is_named(ckpt, text, message):
    (ckpt / "config.json").write_text(text)
    with pytest.raises(ValueError, match=rf"{ckpt / 'config.json'}: {message}"):
        tfm.load(ckpt)
    with pytest.raises(ValueError, match=rf"{ckpt / 'config.json'}: {message}"):
        tfm.load_any(ckpt)


def digest(folder) -> dict:
    return {p.name: p.is_dir() or hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_save_replaces_a_checkpoint_but_not_a_folder_of_other_files(ckpt, tmp_path):
    model = tfm.load(ckpt)
    tfm.save(model, ckpt, extra_files={"tokenizer.json": "{}"})  # a checkpoint: replaced
    tfm.save(model, ckpt)  # its tokenizer.json was part of it
    assert sorted(p.name for p in ckpt.iterdir()) == ["config.json", "model.safetensors"]
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    (mine / "sub").mkdir()
    before = digest(mine)
    with pytest.raises(ValueError, match=r"mine holds files that are not part of the model .*\(notes.txt, sub/\)"):
        tfm.save(model, mine)
    assert digest(mine) == before == {"notes.txt": hashlib.sha256(b"keep me").hexdigest(), "sub": True}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left
    tfm.save(model, mine, force=True)
    assert sorted(p.name for p in mine.iterdir()) == ["config.json", "model.safetensors"]


def test_save_never_replaces_a_file(ckpt, tmp_path):
    file = tmp_path / "model.txt"
    file.write_text("keep me")
    for force in (False, True):
        with pytest.raises(ValueError, match=r"model.txt exists and is not a folder"):
            tfm.save(tfm.load(ckpt), file, force=force)
    assert file.read_text() == "keep me" and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "model.txt"]


def test_a_model_larger_than_memory_is_refused_before_it_is_built():
    from torchformer.models.sizing import check_fits_memory

    cfg = tfm.presets.get("llama-tiny")
    t0 = time.perf_counter()
    with pytest.raises(
        ValueError, match=r"model: n_layers=1000000000, d_model=128 make a model of (at least )?[\d,]+ param"
    ):
        check_fits_memory(cfg.replace(n_layers=10**9), "model")
    with pytest.raises(ValueError, match=r"n_layers=4, d_model=1000000000 make a model of at least [\d,]+ param"):
        check_fits_memory(cfg.replace(d_model=10**9), "model")
    assert time.perf_counter() - t0 < 5
    check_fits_memory(cfg, "model")  # a real size passes
    with torch.device("meta"):
        assert tfm.build_model(cfg)  # and builds
