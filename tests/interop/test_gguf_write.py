"""tfm.to_gguf / convert --to-gguf (issue 29): a torchformer decoder written as GGUF runs in
llama.cpp with our logits and greedy tokens, and reads back as the same model.

Tolerances as in test_gguf_parity.py: the file's numbers are shared; llama.cpp rounds activations
to f16 for F16 products (2e-3) and to 8 bits per block for Q8_0 / Q4_0 products (0.1)."""

from __future__ import annotations

import gguf
import pytest
import torch
from tokenizers import Tokenizer

from torchformer.cli.main import main
from torchformer.interop import from_hf
from torchformer.interop.gguf import from_gguf, to_gguf
from torchformer.interop.gguf.tokenizer import tokenizer_from_gguf
from torchformer.nn.quant import Int4Linear

from .gguf_llamacpp import TEXTS, hf_folder, llama_greedy, llama_logits, llama_tokenize, need_llama_cpp

# One xdist worker makes the GGUF files once (a conversion takes ~15 s).
pytestmark = pytest.mark.xdist_group("gguf")

IDS = [1, 17, 200, 45, 3, 99, 310, 7]


def source(family):
    folder = hf_folder(family)
    return from_hf(folder), Tokenizer.from_file(str(folder / "tokenizer.json"))


def logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids]))[0]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_f16_reads_back_as_the_f16_rounded_model_and_tokenizer(tmp_path, family):
    model, tok = source(family)
    back = from_gguf(to_gguf(model, tmp_path / "m.gguf", dtype="f16", tokenizer=tok))
    assert back.config == model.config.replace(positions=back.config.positions)
    ours, again = model.state_dict(), back.state_dict()
    for name, t in ours.items():  # matrices f16 (llama's q/k permuted there and back), vectors f32
        assert torch.equal(again[name], t.half().float() if t.dim() == 2 else t), name
    read = tokenizer_from_gguf(tmp_path / "m.gguf")
    assert all(read.encode(text).ids == tok.encode(text).ids for text in TEXTS)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_llama_cpp_runs_our_export(tmp_path, family):
    need_llama_cpp()
    model, tok = source(family)
    f16 = to_gguf(model, tmp_path / "f16.gguf", dtype="f16", tokenizer=tok)
    assert (logits(from_gguf(f16), IDS) - llama_logits(f16, IDS)).abs().max() < 2e-3
    ours = []
    back, ids = from_gguf(f16), list(IDS[:4])
    for _ in range(32):
        ours.append(int(logits(back, ids + ours)[-1].argmax()))
    assert ours == llama_greedy(f16, IDS[:4], 32)
    assert llama_tokenize(f16, TEXTS[3], add_bos=False) == tok.encode(TEXTS[3]).ids
    for kind in ("q8_0", "q4_0"):
        path = to_gguf(model, tmp_path / f"{kind}.gguf", dtype=kind, tokenizer=tok)
        assert (logits(from_gguf(path), IDS) - llama_logits(path, IDS)).abs().max() < 0.1


def test_q4_0_export_reads_into_int4_modules_equal_to_ggufs_dequantization(tmp_path):
    model, tok = source("qwen3")
    path = to_gguf(model, tmp_path / "q4.gguf", dtype="q4_0", tokenizer=tok)
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.attn_output.weight")
    module = from_gguf(path).stack.blocks[0].attn.o_proj
    assert isinstance(module, Int4Linear)
    assert torch.equal(module.dequantized(), torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type)))


def test_convert_to_gguf_from_a_checkpoint(tmp_path, capsys):
    model, tok = source("llama-tied")
    ckpt = tmp_path / "ckpt"
    assert main(["convert", "--from-hf", str(hf_folder("llama-tied")), "--out", str(ckpt)]) == 0
    out = tmp_path / "m.gguf"
    assert main(["convert", "--to-gguf", str(ckpt), "--out", str(out), "--outtype", "q8_0"]) == 0
    assert "GGUF file (q8_0)" in capsys.readouterr().out
    back = from_gguf(out)
    assert back.config.tie_embeddings and "output.weight" not in {t.name for t in gguf.GGUFReader(out).tensors}
    assert (logits(back, IDS) - logits(model, IDS)).abs().max() < 0.1  # Q8_0 weights, float activations


def test_bad_export_arguments(tmp_path):
    model, tok = source("llama")
    with pytest.raises(ValueError, match=r"dtype='q4_k': must be one of \['f16', 'bf16', 'q8_0', 'q4_0'\]"):
        to_gguf(model, tmp_path / "x.gguf", dtype="q4_k", tokenizer=tok)
    with pytest.raises(ValueError, match="tokenizer=None"):
        to_gguf(model, tmp_path / "x.gguf", dtype="f16")
    from tokenizers import models

    with pytest.raises(ValueError, match="GGUF export writes byte-level BPE"):
        to_gguf(model, tmp_path / "x.gguf", tokenizer=Tokenizer(models.WordLevel({"a": 0}, unk_token="a")))
    assert not (tmp_path / "x.gguf").exists()
