"""to_html: the page embeds exactly the recorded weights of the real positions and exactly
head_stats for each head, for every grid row (decoder, encoder, encoder-decoder; math and sdpa);
token text cannot break out of the page; bad input is refused before any work."""

import html

import pytest
import torch

import torchformer as tfm
from tests.analysis.html_page import padded_recording, page_args, page_data
from tests.grid import params, variants
from torchformer.analysis import AttentionHTML, Recording, head_stats, record_attention, to_html
from torchformer.analysis.html import GROUPS


@pytest.mark.parametrize("v", **params(variants()))
def test_page_holds_the_recorded_weights_of_real_positions_and_head_stats(v):
    model, rec, ids, mask = padded_recording(v)
    b = 1  # the padded row
    data = page_data(to_html(rec, batch_index=b, **page_args(v, ids, mask, b)).html)
    real = mask[b].bool()
    expected_groups = [title for key, title in GROUPS.items() if rec.select(kind=key[1], stack=key[0])]
    assert [g["title"] for g in data["groups"]] == expected_groups
    for group in data["groups"]:
        (stack, kind) = next(k for k, t in GROUPS.items() if t == group["title"])
        caps = sorted(rec.select(kind=kind, stack=stack), key=lambda c: c.layer)
        assert [layer["name"] for layer in group["layers"]] == [c.name for c in caps]
        padded_queries = stack in ("stack", "decoder")  # the grid pads ids: the decoder input of enc-dec rows
        q_keep = real if padded_queries else torch.ones(caps[0].weights.shape[2], dtype=torch.bool)
        k_keep = q_keep if kind == "self" else torch.ones(caps[0].weights.shape[3], dtype=torch.bool)
        assert len(group["queries"]) == int(q_keep.sum()) and len(group["keys"]) == int(k_keep.sum())
        for layer, c in zip(group["layers"], caps):
            want = c.weights[b][:, q_keep][:, :, k_keep]
            assert torch.equal(layer["w"], want)  # bit for bit: float32 through base64
            stats = head_stats(c.weights[b : b + 1], mask=q_keep[None] if padded_queries else None)
            for h, shown, exact in zip(layer["heads"], layer["stats"], layer["exact"]):
                values = (float(stats.entropy[h]), float(stats.max_weight[h]), float(stats.distance[h]))
                assert exact == list(values)
                assert shown == [f"{values[0]:.2f}", f"{values[1]:.2f}", f"{values[2]:.1f}"]


def test_padded_tokens_are_not_drawn_and_head_subset():
    v = variants(["decoder"])[0]
    _, rec, ids, mask = padded_recording(v)
    tokens = [f"tok{i}" for i in range(ids.shape[1])]
    data = page_data(to_html(rec, tokens, mask=mask, batch_index=1, heads=[2, 0]).html)
    (group,) = data["groups"]
    assert group["queries"] == group["keys"] == tokens[3:]  # row 1 is left-padded by 3
    assert all(layer["heads"] == [2, 0] and layer["w"].shape[0] == 2 for layer in group["layers"])
    torch.testing.assert_close(group["layers"][0]["w"][0], rec.select()[0].weights[1, 2, 3:, 3:], atol=0, rtol=0)


def test_token_text_cannot_end_the_data_block_or_inject_markup(tmp_path):
    model = tfm.build_model(tfm.presets.get("llama-tiny")).eval()
    tokens = ["</script><img src=x onerror=alert(1)>", "<!--", "&amp;", '"q"', "\n", " "]
    with torch.no_grad(), record_attention(model, layers=[0]) as rec:
        model(torch.randint(0, 256, (1, len(tokens))))
    view = to_html(rec, tokens, title="<b>title</b>")
    assert "</script><img" not in view.html and "<b>title</b>" not in view.html
    assert page_data(view.html)["groups"][0]["queries"] == tokens
    assert view.html.count("<script") == 2  # the data block and the explorer script, nothing else
    path = view.save(tmp_path / "sub" / "page.html")
    assert path.read_text(encoding="utf-8") == view.html
    assert [p.name for p in path.parent.iterdir()] == ["page.html"]  # no temporary left behind


def test_notebook_repr_is_an_iframe_holding_the_page():
    model = tfm.build_model(tfm.presets.get("llama-tiny")).eval()
    with torch.no_grad(), record_attention(model, layers=[1]) as rec:
        model(torch.randint(0, 256, (1, 5)))
    view = to_html(rec, list("abcde"))
    frame = view._repr_html_()
    assert frame.startswith('<iframe srcdoc="') and frame.endswith("</iframe>")
    srcdoc = frame[len('<iframe srcdoc="') : frame.index('" style=')]
    assert '"' not in srcdoc and html.unescape(srcdoc) == view.html


def small_recording() -> Recording:
    model = tfm.build_model(tfm.presets.get("llama-tiny")).eval()
    with torch.no_grad(), record_attention(model, layers=[0]) as rec:
        model(torch.randint(0, 256, (2, 4)))
    return rec


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"recording": {"a": 1}}, TypeError, "recording must be a Recording"),
        ({"recording": Recording()}, ValueError, "recording has no captures"),
        ({"tokens": "abcd"}, TypeError, "tokens must be a list of token strings"),
        ({"tokens": []}, ValueError, "tokens is empty"),
        ({"tokens": list("abc")}, ValueError, r"needs \(B, H, 3, 3\) for 3 query and 3 key tokens"),
        ({"heads": [4]}, ValueError, r"heads=\[4\]: must be a non-empty list of head indices in \[0, 4\)"),
        ({"heads": []}, ValueError, "must be a non-empty list"),
        ({"mask": torch.ones(3, 4)}, ValueError, r"mask has shape \(3, 4\); expected \(4,\) or \(B, 4\) = \(2, 4\)"),
        ({"mask": [0, 0, 0, 0]}, ValueError, "mask row 0 marks no real token"),
        ({"batch_index": 2}, ValueError, r"batch_index=2: must be an int in \[0, 2\)"),
        ({"batch_index": -1}, ValueError, r"batch_index=-1: must be an int in \[0, 2\)"),
    ],
)
def test_bad_input_is_refused(kwargs, error, message):
    args = {"recording": small_recording(), "tokens": list("abcd")} | kwargs
    with pytest.raises(error, match=message):
        to_html(args.pop("recording"), args.pop("tokens"), **args)


def test_cached_decoding_step_is_refused_with_a_hint():
    model = tfm.build_model(tfm.presets.get("llama-tiny")).eval()
    cache = model.new_cache(1, 8)
    with torch.no_grad(), record_attention(model, layers=[0]) as rec:
        model(torch.tensor([[1, 2, 3]]), positions=torch.tensor([[0, 1, 2]]), cache=cache)
    with pytest.raises(ValueError, match="not a cached decoding step"):
        to_html(rec, list("abc"))


def test_save_refuses_a_directory(tmp_path):
    view = AttentionHTML("<!DOCTYPE html>")
    with pytest.raises(ValueError, match="is a directory"):
        view.save(tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("backend", ["flex", "auto"])
@pytest.mark.parametrize("position", ["alibi", "relative_bias"])
def test_flex_and_auto_models_give_the_page_of_the_math_model(backend, position):
    """Recording reads weights from the math reference whatever the backend: the page of a flex or
    auto model equals the page of the same weights built on math."""
    import dataclasses

    from tests.grid import build, config

    v = dict(variants(["decoder"])[0], position=position, backend="math")
    ids = torch.randint(0, 97, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    pages = []
    for name in (backend, "math"):
        attention = dataclasses.replace(config(v).attention, backend=name)
        model = build(v, seed=3, attention=attention)
        with torch.no_grad(), record_attention(model) as rec:
            model(ids, attention_mask=mask)
        pages.append(page_data(to_html(rec, [str(i) for i in ids[1].tolist()], mask=mask, batch_index=1).html))
    for got, want in zip(pages[0]["groups"][0]["layers"], pages[1]["groups"][0]["layers"]):
        torch.testing.assert_close(got["w"], want["w"], atol=1e-6, rtol=0)
        assert got["stats"] == want["stats"]
