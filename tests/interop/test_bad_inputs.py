"""Bad checkpoints fail with one clear error that names the problem, before any tensor is read."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import torchformer as tfm
from torchformer.interop import from_hf, to_hf
from torchformer.interop.reader import SafetensorsFolder


@pytest.fixture
def llama_copy(hf_model, tmp_path):
    folder, _ = hf_model("llama")
    dst = tmp_path / "llama"
    shutil.copytree(folder, dst)
    return dst


@pytest.fixture
def reads(monkeypatch):
    """Counts tensor reads, to prove a failing load read nothing."""
    calls = []
    original = SafetensorsFolder.get
    monkeypatch.setattr(SafetensorsFolder, "get", lambda self, name: calls.append(name) or original(self, name))
    return calls


def rewrite(folder, change) -> None:
    file = folder / "model.safetensors"
    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def edit_config(folder, **changes) -> None:
    file = folder / "config.json"
    config = json.loads(file.read_text())
    config.update(changes)
    file.write_text(json.dumps(config))


def test_folder_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        from_hf(tmp_path)


def test_hub_id_is_not_downloaded():
    with pytest.raises(FileNotFoundError, match="not a local folder.*hub id"):
        from_hf("meta-llama/Llama-2-7b-hf")


def test_unsupported_model_type_lists_the_supported_ones(llama_copy):
    edit_config(llama_copy, model_type="mamba")
    with pytest.raises(ValueError, match=r"model_type='mamba'.*supported: \[.*'llama', 'mistral', 'qwen2', 'gpt2'"):
        from_hf(llama_copy)


def test_a_missing_required_key_is_named(llama_copy):
    edit_config(llama_copy, model_type="t5")  # a Llama config.json has no d_model
    with pytest.raises(ValueError, match=r"lacks 'd_model', which model_type='t5' needs"):
        from_hf(llama_copy)


def test_missing_tensor_is_named(llama_copy, reads):
    rewrite(llama_copy, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensors: \['model.layers.1.mlp.up_proj.weight'\]"):
        from_hf(llama_copy)
    assert reads == []


def test_misshaped_tensor_names_both_shapes(llama_copy, reads):
    rewrite(llama_copy, lambda t: t.update({"model.norm.weight": torch.ones(32)}))
    with pytest.raises(
        ValueError, match=r"'model.norm.weight' has shape \(32,\) in the file, the config implies \(64,\)"
    ):
        from_hf(llama_copy)
    assert reads == []


def test_unexpected_tensor_is_named_unless_not_strict(llama_copy, reads):
    rewrite(llama_copy, lambda t: t.update({"model.layers.0.adapter.weight": torch.ones(4)}))
    with pytest.raises(
        ValueError, match=r"unexpected tensors \(pass strict=False to drop them\): \['model.layers.0.adapter"
    ):
        from_hf(llama_copy)
    assert reads == []
    with pytest.warns(UserWarning, match="dropped tensors.*adapter"):
        assert isinstance(from_hf(llama_copy, strict=False), tfm.DecoderLM)


def test_truncated_safetensors(llama_copy, reads):
    file = llama_copy / "model.safetensors"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        from_hf(llama_copy)
    assert reads == []


def test_pickled_weights_are_refused(llama_copy):
    (llama_copy / "model.safetensors").rename(llama_copy / "pytorch_model.bin")
    with pytest.raises(ValueError, match="never loaded"):
        from_hf(llama_copy)


def test_missing_shard_is_named(llama_copy):
    index = {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    (llama_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        from_hf(llama_copy)


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"rope_parameters": {"rope_type": "proportional", "rope_theta": 1e4}}, "rope_type='proportional'"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ],
)
def test_unsupported_settings_are_errors(llama_copy, changes, match):
    edit_config(llama_copy, **changes)
    with pytest.raises(ValueError, match=match):
        from_hf(llama_copy)


def test_rope_pairing_checked(hf_model):
    llama, _ = hf_model("llama")
    gpt2, _ = hf_model("gpt2")
    with pytest.raises(ValueError, match="rope_pairing='meta'"):
        from_hf(llama, rope_pairing="meta")
    with pytest.raises(ValueError, match="applies to RoPE models"):
        from_hf(gpt2, rope_pairing="interleaved")


def test_to_hf_refuses_a_model_no_family_fits(tmp_path):
    model = tfm.build_model(tfm.presets.get("vanilla-base", vocab_size=64, d_model=32, attention={"n_heads": 2}))
    with pytest.raises(ValueError, match="(?s)no Hugging Face family fits.*bart/marian: needs BART"):
        to_hf(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    llama = tfm.build_model(tfm.presets.get("llama-tiny"))
    with pytest.raises(ValueError, match="cannot be written as gpt2"):
        to_hf(llama, tmp_path / "out", model_type="gpt2")
    with pytest.raises(TypeError, match="torchformer model"):
        to_hf(torch.nn.Linear(2, 2), tmp_path / "out")
