"""Static figures a reader can read: at the default size, for up to 128 tokens, every text on the
figure is >= 6 pt, the outer panels carry token labels (every k-th when they would not fit) that
never overlap, each panel title holds that head's head_stats, and there is one colour bar."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from torchformer.analysis import attention_figure, head_stats, plot_attention  # noqa: E402


def texts(fig) -> list:
    found = fig.findobj(lambda o: isinstance(o, matplotlib.text.Text) and o.get_visible() and o.get_text().strip())
    return list(found)


def tick_labels(ax, axis: str) -> list:
    return [t for t in getattr(ax, f"get_{axis}ticklabels")() if t.get_text()]


@pytest.mark.parametrize("T", [8, 33, 64, 128])
@pytest.mark.parametrize(("layers", "heads"), [(1, 1), (2, 4), (4, 4)])
def test_labels_are_legible_and_do_not_overlap(T, layers, heads):
    weights = [torch.rand(1, heads, T, T).softmax(-1) for _ in range(layers)]
    tokens = [f"w{i}" for i in range(T)]
    fig = attention_figure(weights, tokens=tokens)
    try:
        renderer = fig.canvas.get_renderer()
        fig.draw(renderer)  # the layout the saved PNG gets
        assert min(t.get_fontsize() for t in texts(fig)) >= 6
        panels = [ax for ax in fig.axes if ax.get_label() != "<colorbar>"]
        assert len(panels) == layers * heads
        grid = [panels[r * heads : (r + 1) * heads] for r in range(layers)]
        outer = [(row[0], "y") for row in grid] + [(ax, "x") for ax in grid[-1]]
        for ax, axis in outer:
            labels = tick_labels(ax, axis)
            step = round(T / len(labels)) if len(labels) < T else 1
            # Labels are the tokens at the labelled positions, spread over the whole sequence.
            positions = getattr(ax, f"get_{axis}ticks")()
            assert [t.get_text() for t in labels] == [tokens[int(p)] for p in positions]
            assert len(labels) >= min(T, 16) and positions[-1] >= T - 2 * step
            boxes = [t.get_window_extent(renderer) for t in labels]
            assert not any(a.overlaps(b) for a, b in zip(boxes, boxes[1:]))
        inner = [ax for row in grid[:-1] for ax in row[1:]]
        assert all(not tick_labels(ax, "x") and not tick_labels(ax, "y") for ax in inner)
    finally:
        plt.close(fig)


def test_all_128_labels_fit_a_single_panel_and_size_grows_with_tokens():
    sizes = []
    for T in (8, 32, 128):
        fig = attention_figure([torch.rand(1, 1, T, T).softmax(-1)], tokens=[str(i) for i in range(T)])
        sizes.append(fig.get_size_inches()[1])
        if T == 128:
            fig.draw_without_rendering()
            assert len(tick_labels(fig.axes[0], "y")) == 128
        plt.close(fig)
    assert sizes[0] < sizes[1] < sizes[2]


def test_titles_carry_head_stats_and_there_is_one_colour_bar():
    weights = [torch.rand(2, 3, 6, 9).softmax(-1) for _ in range(2)]
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])
    fig = attention_figure(weights, titles=["enc 0", "enc 1"], heads=[2, 0], batch_index=1, mask=mask)
    try:
        panels = [ax for ax in fig.axes if ax.get_label() != "<colorbar>"]
        bars = [ax for ax in fig.axes if ax.get_label() == "<colorbar>"]
        assert len(bars) == 1 and "attention weight" in bars[0].get_ylabel()
        for n, ax in enumerate(panels):
            r, h = divmod(n, 2)
            h = [2, 0][h]
            s = head_stats(weights[r][1:2], mask=mask[1:2])
            want = (
                f"enc {r} head {h}\n"
                f"ent {float(s.entropy[h]):.2f}  max {float(s.max_weight[h]):.2f}  dist {float(s.distance[h]):.1f}"
            )
            assert ax.get_title() == want
    finally:
        plt.close(fig)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"heads": [3]}, r"heads=\[3\]: must be a non-empty list of head indices in \[0, 3\)"),
        ({"tokens": list("abc")}, "tokens has 3 labels for 4 positions"),
        ({"tokens": list("abcd"), "key_tokens": list("xy")}, "key_tokens has 2 labels for 5 positions"),
        ({"titles": ["a", "b"]}, "titles has 2 entries for 1 layers"),
        ({"batch_index": 1}, r"batch_index=1: must be in \[0, 1\)"),
    ],
)
def test_bad_arguments_are_refused_before_drawing(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        plot_attention([torch.rand(1, 3, 4, 5).softmax(-1)], tmp_path / "x.png", **kwargs)
    with pytest.raises(ValueError, match="weights must be"):
        plot_attention([torch.rand(1, 3, 4, 5), torch.rand(1, 3, 4, 4)], tmp_path / "x.png")
    with pytest.raises(ValueError, match="is a directory"):
        plot_attention([torch.rand(1, 3, 4, 5)], tmp_path)
    assert list(tmp_path.iterdir()) == []
