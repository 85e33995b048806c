"""`torchformer attention --html/--out` with --layers/--heads: the files hold what a direct
recording gives; bad input (a backend that cannot record, too long, empty, layers or heads outside
the model, a directory as output) is a one-line error and nothing is written."""

import types

import matplotlib.image
import pytest
import torch

import torchformer as tfm
from tests.analysis.html_page import page_data
from torchformer.analysis import record_attention
from torchformer.cli.main import main
from torchformer.nn.attention import Attention

CONTEXT = tfm.presets.get("llama-tiny").max_seq_len


def test_html_and_png_of_a_preset_match_a_direct_recording(tmp_path, capsys):
    text = "To be, or not"
    args = ["attention", "llama-tiny", "--text", text, "--layers", "1,3", "--heads", "0,2"]
    assert main([*args, "--html", str(tmp_path / "a.html"), "--out", str(tmp_path / "a.png")]) == 0
    assert "wrote" in capsys.readouterr().out
    data = page_data((tmp_path / "a.html").read_text(encoding="utf-8"))
    (group,) = data["groups"]
    assert group["queries"] == group["keys"] == list(text)
    torch.manual_seed(0)  # load_any's preset seed (--seed 0)
    model = tfm.build_model(tfm.presets.get("llama-tiny")).eval()
    with torch.no_grad(), record_attention(model, layers=[1, 3]) as rec:
        model(torch.tensor([list(text.encode())]))
    assert [layer["name"] for layer in group["layers"]] == ["stack.blocks.1.attn", "stack.blocks.3.attn"]
    for layer in group["layers"]:
        assert layer["heads"] == [0, 2]
        torch.testing.assert_close(layer["w"], rec.weights[layer["name"]][0, [0, 2]], atol=1e-6, rtol=0)
    two_by_two = matplotlib.image.imread(str(tmp_path / "a.png"))
    assert main([*args[:4], "--layers", "1", "--heads", "0", "--out", str(tmp_path / "b.png")]) == 0
    one = matplotlib.image.imread(str(tmp_path / "b.png"))
    assert two_by_two.shape[0] > 1.5 * one.shape[0] and two_by_two.shape[1] > 1.5 * one.shape[1]


def test_encoder_decoder_html_has_encoder_decoder_and_cross_groups(tmp_path, capsys):
    args = ["attention", "vanilla-base", "--text", "abc def", "--target", "xyz", "--layers", "0"]
    assert main([*args, "--kind", "cross", "--html", str(tmp_path / "ed.html")]) == 0
    capsys.readouterr()
    groups = page_data((tmp_path / "ed.html").read_text(encoding="utf-8"))["groups"]
    shapes = {g["title"]: (len(g["queries"]), len(g["keys"]), len(g["layers"])) for g in groups}
    assert shapes == {
        "encoder self-attention": (7, 7, 1),
        "decoder self-attention": (3, 3, 1),
        "decoder cross-attention": (3, 7, 1),
    }


def no_recording_model(*args, **kwargs):
    """llama-tiny whose attention calls a backend bound at build time (as a fused or compiled path
    would), so swapping the module's ``backend`` attribute records nothing."""
    model = tfm.build_model(tfm.presets.get("llama-tiny")).eval()
    for m in model.modules():
        if isinstance(m, Attention):
            fixed = m.backend

            def attend(self, q, k, v, ctx, fixed=fixed):
                out = fixed(q, k, v, mask=ctx.mask, bias=ctx.bias, is_causal=ctx.is_causal, scale=self.scale)
                return self.o_proj(out.transpose(1, 2).flatten(2))  # (B, T, D)

            m.attend = types.MethodType(attend, m)
    return model


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["llama-tiny", "--text", "x" * (CONTEXT + 1)], f"{CONTEXT + 1} tokens > max_seq_len={CONTEXT}"),
        (["llama-tiny", "--text", ""], "the input is empty"),
        (["vanilla-base", "--text", "abc", "--target", ""], "the input is empty"),
        (["llama-tiny", "--text", "abc", "--layers", "1,4"], "--layers=1,4: [4] outside the model's blocks [0, 4)"),
        (["llama-tiny", "--text", "abc", "--layers", "a"], "--layers='a': must be comma-separated integers"),
        (["llama-tiny", "--text", "abc", "--heads", "-1"], "--heads=-1: [-1] outside the model's heads [0, 4)"),
        (["vanilla-base", "--text", "ab", "--kind", "encoder", "--layers", "6"], "[6] outside the model's blocks"),
        (["llama-tiny", "--text", "abc", "--html", "."], "--html=.: is a directory"),
    ],
)
def test_bad_input_is_an_error_and_writes_nothing(tmp_path, monkeypatch, capsys, args, message):
    monkeypatch.chdir(tmp_path)
    outputs = ["--out", str(tmp_path / "x.png")] + ([] if "--html" in args else ["--html", str(tmp_path / "x.html")])
    assert main(["attention", *args, *outputs]) == 2
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_backend_that_cannot_record_is_an_error_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("torchformer.loading.load_any", no_recording_model)
    args = ["attention", "llama-tiny", "--text", "abc", "--html", str(tmp_path / "x.html")]
    assert main([*args, "--out", str(tmp_path / "x.png")]) == 2
    assert "its attention backend cannot be recorded" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
