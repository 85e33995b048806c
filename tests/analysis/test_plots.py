"""plot_attention writes a valid PNG grid (layers x heads); ascii_attention draws one head."""

import matplotlib.image
import pytest
import torch

from torchformer.analysis import ascii_attention, plot_attention


def weights(B=1, H=3, T=5, S=5):
    return torch.rand(B, H, T, S).softmax(-1)


def test_grid_png_has_one_panel_per_layer_and_head(tmp_path):
    layers = [weights(), weights()]
    tokens = list("abcde")
    full = plot_attention(layers, tmp_path / "full.png", tokens=tokens, titles=["l0", "l1"])
    one = plot_attention(layers, tmp_path / "sub" / "one.png", tokens=tokens, heads=[1])
    assert full.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    wide, narrow = matplotlib.image.imread(str(full)), matplotlib.image.imread(str(one))
    assert wide.shape[0] == narrow.shape[0]  # same number of layer rows
    assert wide.shape[1] > 2 * narrow.shape[1]  # 3 head columns against 1


def test_cross_attention_grid_with_separate_key_tokens(tmp_path):
    path = plot_attention([weights(T=2, S=4)], tmp_path / "x.png", tokens=["q0", "q1"], key_tokens=list("wxyz"))
    assert matplotlib.image.imread(str(path)).shape[0] > 50


def test_plot_and_ascii_reject_bad_input(tmp_path):
    with pytest.raises(ValueError, match="weights is empty"):
        plot_attention([], tmp_path / "none.png")
    with pytest.raises(ValueError, match=r"\(T, S\)"):
        ascii_attention(weights())


def test_ascii_has_a_row_per_query_and_a_key_header():
    text = ascii_attention(torch.eye(3), ["a", "b", "c"], ["a", "b", " "]).splitlines()
    assert len(text) == 4 and text[0].endswith("ab\u2423")
    assert [row[-3:] for row in text[1:]] == ["@  ", " @ ", "  @"]
