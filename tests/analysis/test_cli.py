"""`torchformer plan` and `torchformer attention` on presets, checkpoints and HF folders."""

import json
import re

import matplotlib.image
import pytest
import torch

import torchformer as tfm
from torchformer.cli.main import main

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_plan_llama3_8b_table(capsys):
    assert main(["plan", "llama3-8b", "--seq-len", "8192", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "8,030,261,248" in out  # total
    for part in ("embeddings", "attention", "mlp", "norms", "lm_head"):
        assert part in out
    assert "KV cache      1.00 GiB" in out  # 2 * 32 * 8 * 128 * 8192 * 2 bytes
    assert "vs MHA (32 KV heads) 4.00 GiB: GQA keeps 1/4" in out
    assert "forward 19.30 GFLOP" in out and "training 57.91 GFLOP" in out
    assert "weights       14.96 GiB" in out  # 8.03e9 * 2 bytes


def test_plan_mha_model_has_no_gqa_line_and_mfu(capsys):
    args = ["plan", "gpt2-small", "--seq-len", "1024", "--tokens-per-second", "1000", "--peak-tflops", "1"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "124,439,808" in out and "GQA" not in out
    # 1000 tok/s * 3 * 284,812,800 FLOPs / 1e12
    assert "MFU           85.4% at 1,000 tokens/s of 1 TFLOP/s peak" in out


def test_plan_reads_checkpoint_and_hf_folders(tmp_path, capsys):
    cfg = tfm.presets.get("llama-tiny")
    model = tfm.build_model(cfg)
    tfm.save(model, tmp_path / "ckpt")
    from torchformer.interop import to_hf

    to_hf(model, tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"]
    for folder in ("ckpt", "hf"):
        assert main(["plan", str(tmp_path / folder)]) == 0
        assert f"{tfm.count_params(cfg):,}" in capsys.readouterr().out


def test_plan_bad_arguments_are_one_line_errors(capsys):
    assert main(["plan", "gpt2-small", "--seq-len", "5000"]) == 2
    assert "--seq-len=5000" in capsys.readouterr().err
    assert main(["plan", "gpt2-small", "--dtype", "int3"]) == 2
    assert "dtype='int3'" in capsys.readouterr().err
    assert main(["plan", "gpt2-small", "--tokens-per-second", "1", "--peak-tflops", "fast"]) == 2
    assert "--peak-tflops='fast'" in capsys.readouterr().err


def check_png(path, min_pixels=200):
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    image = matplotlib.image.imread(str(path))
    assert image.shape[0] >= min_pixels and image.shape[1] >= min_pixels


def test_attention_on_a_preset_prints_stats_and_ascii_and_writes_png(tmp_path, capsys):
    out_png = tmp_path / "attn.png"
    assert main(["attention", "llama-tiny", "--text", "To be, or not", "--out", str(out_png)]) == 0
    out = capsys.readouterr().out
    assert "entropy" in out and "stack.blocks.3.attn" in out
    table = [line for line in out.splitlines() if re.match(r"stack\.blocks\.\d\.attn +\d", line)]
    assert len(table) == 4 * 4  # layers x heads
    assert "rows: queries" in out
    check_png(out_png)


def char_tokenizer_json(text: str) -> str:
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(sorted(set(text)))}
    tok = Tokenizer(models.WordLevel(vocab | {"<unk>": len(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    return tok.to_str()


def test_attention_on_a_checkpoint_uses_its_tokenizer_and_one_head(tmp_path, capsys):
    text = "ROMEO: soft"
    cfg = tfm.presets.get("shakespeare-char", vocab_size=len(set(text)) + 1)
    tfm.save(tfm.build_model(cfg), tmp_path / "ckpt", extra_files={"tokenizer.json": char_tokenizer_json(text)})
    args = ["attention", str(tmp_path / "ckpt"), "--text", text, "--layer", "1", "--head", "2"]
    assert main([*args, "--out", str(tmp_path / "one.png")]) == 0
    out = capsys.readouterr().out
    assert "stack.blocks.1.attn head 2" in out
    assert "stack.blocks.0.attn" not in out  # only the chosen layer
    ascii_rows = out.split("denser = more weight)\n")[1].splitlines()
    assert ascii_rows[1].strip().startswith("R") and ascii_rows[0].strip().startswith("ROMEO")
    check_png(tmp_path / "one.png", min_pixels=100)


def test_attention_cross_on_an_encoder_decoder(tmp_path, capsys):
    args = ["attention", "vanilla-base", "--text", "abc def", "--target", "xyz", "--kind", "cross"]
    # vanilla-base is 63M parameters at random init: keep it, it is the 2017 model itself
    assert main([*args, "--layer", "0"]) == 0
    out = capsys.readouterr().out
    assert "decoder.blocks.0.cross_attn" in out and "encoder.blocks" not in out
    assert main(["attention", "vanilla-base", "--text", "abc def", "--kind", "encoder", "--layer", "5"]) == 0
    out = capsys.readouterr().out
    assert "encoder.blocks.5.attn" in out and "decoder.blocks" not in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["llama-tiny", "--text", "x", "--kind", "cross"], "needs an encoder-decoder"),
        (["llama-tiny", "--text", "x", "--layer", "9"], "--layer=9"),
        (["llama-tiny", "--ids", "1,999"], "outside [0, vocab_size=256)"),
        (["shakespeare-char", "--text", "caf\u00e9"], "pass --ids instead"),
    ],
)
def test_attention_bad_inputs(args, message, capsys):
    assert main(["attention", *args]) == 2
    assert message in capsys.readouterr().err


def test_ascii_ramp_is_denser_for_larger_weights():
    from torchformer.analysis import ascii_attention
    from torchformer.analysis.plots import RAMP

    text = ascii_attention(torch.tensor([[1.0, 0.0, 0.0], [0.6, 0.25, 0.08]]), ["a", "b"])
    assert RAMP == " .:-=+*#%@"
    # relative to the row's largest weight: 0.25 / 0.6 * 9 = 3.75 -> 4 "=", 0.08 / 0.6 * 9 = 1.2 -> 1 "."
    assert text.splitlines() == ["   a @  ", "   b @=."]


def test_attention_on_an_encoder_preset(capsys):
    assert main(["attention", "minilm-l6", "--text", "hello there", "--layer", "5"]) == 0
    out = capsys.readouterr().out
    assert "stack.blocks.5.attn" in out and "stack.blocks.4.attn" not in out
