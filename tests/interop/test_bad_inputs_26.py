"""Issue 26, Hugging Face folders: a shard index may name only files inside its folder; sizes of
the wrong type and configs claiming more layers than the weights hold fail fast, naming the file;
to_hf replaces only an earlier export or an empty folder."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

import torchformer as tfm
from torchformer.interop import from_hf, to_hf


@pytest.fixture
def hf(tmp_path):
    cfg = tfm.presets.get("llama-tiny").replace(vocab_size=32, d_model=16, n_layers=2, max_seq_len=16)
    return to_hf(tfm.build_model(cfg), tmp_path / "hf")


def shard(folder, entry: str) -> None:
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = list(f.keys())  # noqa: SIM118
    (folder / "model.safetensors").rename(folder / "model-00001.safetensors")
    weight_map = {name: "model-00001.safetensors" for name in names}
    weight_map[names[-1]] = entry
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def test_a_sharded_folder_still_loads(hf):
    shard(hf, "model-00001.safetensors")
    assert from_hf(hf).config.n_layers == 2


@pytest.mark.parametrize("entry", ["../../../../etc/passwd", "/etc/passwd", "sub/../../x.safetensors", ""])
def test_a_shard_outside_the_folder_is_refused(hf, entry, monkeypatch):
    shard(hf, entry)
    opened = []
    monkeypatch.setattr("torchformer.models.saving.safe_open", lambda *a, **k: opened.append(a))
    with pytest.raises(ValueError, match=rf"index.json: weight_map\['.*'\] = '{entry}' is not a file name inside"):
        from_hf(hf)
    assert opened == []  # refused before any file is opened


def test_a_shard_index_that_is_not_json_is_named(hf):
    shard(hf, "model-00001.safetensors")
    (hf / "model.safetensors.index.json").write_text("{oops")
    with pytest.raises(ValueError, match=r"model.safetensors.index.json: not a JSON file"):
        from_hf(hf)


def edit(folder, **changes) -> None:
    file = folder / "config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **changes}))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"num_hidden_layers": "4"}, r"config.json: num_hidden_layers='4' must be a non-negative integer"),
        ({"hidden_size": 16.0}, r"config.json: hidden_size=16.0 must be a non-negative integer"),
        ({"num_attention_heads": True}, r"num_attention_heads=True must be a non-negative integer"),
        ({"num_hidden_layers": 10**6}, r"config.json: n_layers=1000000 but .*hf holds 2 layers"),
        ({"hidden_size": 10**9}, r"config.json: d_model=1000000000 but no tensor in .*hf is that wide"),
        ({"rope_parameters": [1, 2]}, r"config.json: a setting has the wrong type"),
    ],
)
def test_sizes_are_checked_before_anything_is_built(hf, changes, message, monkeypatch):
    import torchformer.interop.hf as hf_module

    edit(hf, **changes)
    # Not even on the meta device: 1e6 meta layers took minutes before the check.
    monkeypatch.setattr(hf_module, "build_meta", lambda *a: pytest.fail("built a model before the size check"))
    with pytest.raises(ValueError, match=message):
        from_hf(hf)


@pytest.mark.parametrize(("text", "message"), [("not json", "not a JSON file"), ("[]", "got a JSON list")])
def test_an_unreadable_config_is_named(hf, text, message):
    (hf / "config.json").write_text(text)
    with pytest.raises(ValueError, match=rf"{hf / 'config.json'}: .*{message}"):
        from_hf(hf)
    with pytest.raises(ValueError, match=rf"{hf / 'config.json'}: .*{message}"):
        tfm.load_any(hf)


def test_to_hf_replaces_an_export_but_not_other_files(hf, tmp_path):
    model = from_hf(hf)
    to_hf(model, hf)  # an earlier export (config.json, generation_config.json, model.safetensors)
    (hf / "README.md").write_text("mine")
    with pytest.raises(ValueError, match=r"hf holds files that are not part of the model folder .*\(README.md\)"):
        to_hf(model, hf)
    assert (hf / "README.md").read_text() == "mine"
    to_hf(model, hf, force=True)
    assert not (hf / "README.md").exists()


def test_convert_replaces_its_own_output_and_force_replaces_any_folder(hf, tmp_path, capsys):
    from torchformer.cli.main import main

    out = tmp_path / "ckpt"
    args = ["convert", "--from-hf", str(hf), "--out", str(out)]
    assert main(args) == 0 and main(args) == 0  # the second run replaces the checkpoint the first wrote
    (out / "notes.txt").write_text("mine")
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "(notes.txt): replacing it would delete them" in err and "--force" in err and (out / "notes.txt").is_file()
    assert main([*args, "--force"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert main(["convert", "--from-hf", str(hf), "--out", str(hf), "--force"]) == 2  # never the source
    assert "is the source folder" in capsys.readouterr().err
