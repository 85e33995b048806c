"""compile=True with inductor (issues 3 and 13): same tokens as eager and logits within 1e-4 at
batch 1 and left-padded batch 4, exactly one compiled graph per batch shape for 64 new tokens (and
none for a second call of the same shape), no graph break. One 1-layer model: an inductor compile
costs ~20-60 s on this CPU; test_compile_grid.py covers the variant grid."""

import pytest
import torch
from torch._dynamo.utils import counters

import torchformer as tfm
from tests.grid import build, variants
from torchformer.fast import exported
from torchformer.generation.generate import decode
from torchformer.generation.request import make_request, sampling_options

GREEDY = sampling_options(0.0, None, None, None, 1.0, 0)


def run(model, ids, mask, compiled: bool):
    req = make_request(model, ids, max_new_tokens=64, attention_mask=mask, eos_token_id=None)
    pairs = list(decode(model, req, GREEDY, None, compiled, scores=True))
    return torch.stack([t for t, _ in pairs], 1), torch.stack([lg for _, lg in pairs], 1)  # (B, N), (B, N, V)


def compiles(ahead: bool) -> int:
    """Decode steps compiled since the counters were cleared: dynamo's graphs, or AOTInductor's
    steps (fast/exported.py) while dynamo compiled none."""
    if not ahead:
        assert counters["aot_autograd"]["total"] == counters["stats"]["unique_graphs"]
        assert sum(counters["graph_break"].values()) == 0
        return counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == 0
    return exported.BUILT[0] - counters["exported"]["start"]


def clear() -> None:
    counters.clear()
    counters["exported"]["start"] = exported.BUILT[0]


@pytest.mark.parametrize("ahead", [True, False], ids=["aoti", "dynamo"])
def test_compiled_decode_step_compiles_once_and_matches_eager(ahead, monkeypatch):
    """Both compiled paths: AOTInductor's step (the default for a small CPU model) and dynamo's."""
    monkeypatch.setenv("TORCHFORMER_AOT_STEP", "1" if ahead else "0")
    v = next(v for v in variants(("decoder", "encoder_decoder")) if v["arch"] == "decoder" and v["position"] != "none")
    model = build(v, init_std=0.1, n_layers=1, max_seq_len=80)
    ids = torch.randint(1, model.config.vocab_size, (4, 6))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1], [1, 1, 1, 1, 1, 1]])
    torch._dynamo.reset()
    for rows in (slice(0, 4), slice(1, 2)):  # left-padded batch 4, then batch 1
        clear()
        tok, logits = run(model, ids[rows], mask[rows], True)  # 63 compiled steps
        assert compiles(ahead) == 1
        eager_tok, eager_logits = run(model, ids[rows], mask[rows], False)
        assert torch.equal(tok, eager_tok)
        torch.testing.assert_close(logits, eager_logits, rtol=0, atol=1e-4)
    clear()
    again = tfm.generate(model, ids.flip(0), attention_mask=mask.flip(0), max_new_tokens=64, compile=True)
    assert compiles(ahead) == 0  # a new cache of the same shape: no recompile
    assert torch.equal(again, tfm.generate(model, ids.flip(0), attention_mask=mask.flip(0), max_new_tokens=64))


def test_lengths_and_batch_sizes_seen_before_never_recompile(aot_eager):
    """Issue 25: the cache length goes up in steps (steps.CACHE_STEP, capped at max_seq_len), so
    another prompt length or max_new_tokens reuses the graph; a batch size seen before reuses its
    own, also after another batch size (packed weights for batch >= 3 come and go). Recompiles are
    dynamo's guards: through AOT autograd, not a cold inductor compile per graph (~8 s)."""
    v = next(v for v in variants(("decoder",)) if v["position"] != "none")
    model = build(v, init_std=0.1, n_layers=1, max_seq_len=96)
    torch._dynamo.reset()

    def graphs(batch: int, prompt: int, new: int) -> int:
        counters.clear()
        ids = torch.randint(1, model.config.vocab_size, (batch, prompt))
        tfm.generate(model, ids, max_new_tokens=new, compile=True)
        return counters["stats"]["unique_graphs"]

    assert graphs(1, 5, 8) == 1
    assert graphs(1, 9, 20) == 0  # another prompt length and max_new_tokens
    assert graphs(4, 7, 8) == 1  # a new batch size: its own graph (over packed weights)
    assert graphs(1, 30, 3) == 0  # batch 1 again, after batch 4
    assert graphs(4, 5, 30) == 0
    assert len(aot_eager) == 2  # the two graphs went through the counting backend


def test_steps_compiled_ahead_never_recompile_for_shapes_seen_before(monkeypatch):
    """The same for AOTInductor's steps (fast/exported.py): one per batch size, none for another
    prompt length or max_new_tokens; a batch of 4 runs over packed twins that are new each call
    (fast/panels.py), so its step is bound to the new tensors, not compiled again, and its tokens
    stay eager's."""
    monkeypatch.setenv("TORCHFORMER_AOT_STEP", "1")
    v = next(v for v in variants(("decoder",)) if v["position"] != "none")
    model = build(v, init_std=0.1, n_layers=1, max_seq_len=96)

    def built(batch: int, prompt: int, new: int) -> int:
        start = exported.BUILT[0]
        ids = torch.randint(1, model.config.vocab_size, (batch, prompt))
        out = tfm.generate(model, ids, max_new_tokens=new, compile=True)
        assert torch.equal(out, tfm.generate(model, ids, max_new_tokens=new))
        return exported.BUILT[0] - start

    assert built(1, 5, 8) == 1
    assert built(1, 9, 20) == 0  # another prompt length and max_new_tokens
    assert built(4, 7, 8) == 1  # a new batch size: its own step (over packed weights)
    assert built(1, 30, 3) == 0  # batch 1 again, after batch 4
    assert built(4, 5, 30) == 0  # new packed twins: bound again, not compiled
