"""save / load round trip: bit-equal weights and outputs, ties restored, all three archs."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import torchformer as tfm

from . import grid


def row(arch: str, i: int, position: str) -> dict:
    return dict(grid.variants((arch,))[i], position=position)


# Each case also exercises a different derived buffer (position tables, RoPE rows, ALiBi slopes).
CASES = {
    "decoder-tied": (row("decoder", 0, "rope-interleaved"), dict(tie_embeddings=True)),
    "decoder-untied": (row("decoder", 1, "alibi"), dict(tie_embeddings=False)),
    "encoder": (row("encoder", 0, "relative_bias"), dict(n_token_types=2)),
    "encdec-shared-tied": (row("encoder_decoder", 0, "sinusoidal"), dict(tie_embeddings=True)),
    "encdec-unshared-untied": (
        row("encoder_decoder", 1, "rope-half"),
        dict(tie_embeddings=False, share_embeddings=False),
    ),
}


def out(model, ids):
    return grid.forward(model, ids)


@pytest.mark.parametrize("case", list(CASES))
@torch.no_grad()
def test_round_trip_is_bit_equal(case, tmp_path):
    v, changes = CASES[case]
    model = grid.build(v, **changes)
    path = tfm.save(model, tmp_path / "ckpt", extra_files={"tokenizer.json": '{"x": 1}'})
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    loaded = tfm.load(path)
    assert type(loaded) is type(model) and loaded.config == model.config
    a, b = model.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    ids = torch.randint(0, grid.VOCAB, (2, 7))
    assert torch.equal(out(model, ids), out(loaded, ids))
    cfg = model.config
    if cfg.arch != "encoder":
        tok = loaded.tgt_embed.tok if cfg.arch == "encoder_decoder" else loaded.embed.tok
        assert (loaded.lm_head.weight is tok.weight) == cfg.tie_embeddings
    if cfg.arch == "encoder_decoder":
        assert (loaded.src_embed.tok.weight is loaded.tgt_embed.tok.weight) == cfg.share_embeddings
    # Tied tensors are stored once; buffers (position tables) are not stored at all.
    stored = load_file(str(path / "model.safetensors"))
    assert ("lm_head.weight" in stored) == (cfg.arch != "encoder" and not cfg.tie_embeddings)
    assert not any(k.endswith(("table", ".cos", ".sin", "slopes")) for k in stored)


def test_loaded_model_still_trains_with_ties(tmp_path):
    model = grid.build(grid.variants(("decoder",))[0], tie_embeddings=True)
    loaded = tfm.load(tfm.save(model, tmp_path / "m")).train()
    ids = torch.randint(0, grid.VOCAB, (2, 6))
    loaded(ids).sum().backward()
    assert loaded.embed.tok.weight.grad is not None
    assert sum(1 for _ in loaded.parameters()) == sum(1 for _ in model.parameters())


def test_save_replaces_an_existing_checkpoint(tmp_path):
    a = grid.build(grid.variants(("decoder",))[0], seed=1)
    b = grid.build(grid.variants(("decoder",))[0], seed=2)
    tfm.save(a, tmp_path / "m")
    tfm.save(b, tmp_path / "m")
    assert torch.equal(tfm.load(tmp_path / "m").lm_head.weight, b.lm_head.weight)
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no temp folders left behind


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        tfm.load(tmp_path)
    model = grid.build(grid.variants(("decoder",))[0])
    path = tfm.save(model, tmp_path / "m")
    state = load_file(str(path / "model.safetensors"))
    state["embed.tok.weight"] = state["embed.tok.weight"][:10]
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"embed.tok.weight.*\(10, 32\).*\(97, 32\)"):
        tfm.load(path)
    del state["embed.tok.weight"]
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="missing.*embed.tok.weight"):
        tfm.load(path)
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        tfm.load(path)
    (path / "config.json").write_text(json.dumps({**model.config.to_dict(), "n_layer": 3}))
    with pytest.raises(ValueError, match="n_layer"):
        tfm.load(path)
    with pytest.raises(TypeError, match="ModelConfig"):
        tfm.save(torch.nn.Linear(2, 2), tmp_path / "x")
