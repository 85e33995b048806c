"""No host syncs or graph breaks in a forward (issue 13): dynamo captures a whole training step
(forward + loss through the public, checked forward) and a whole decode step as one graph with
no break, while an eager call still gets the readable ValueError for bad ids and positions."""

import pytest
import torch
import torch.nn.functional as F

import torchformer as tfm
from tests.grid import build, params, variants
from torchformer.generation.steps import decoder_step, seq2seq_step


def llama_tiny():
    torch.manual_seed(0)
    cfg = tfm.presets.get("llama-tiny", vocab_size=97, d_model=32, n_layers=2, max_seq_len=32)
    return tfm.build_model(cfg)


def training_step(model, ids, targets):
    return F.cross_entropy(model(ids).flatten(0, 1), targets.flatten())


def one_graph(fn, *args) -> None:
    torch._dynamo.reset()
    out = torch._dynamo.explain(fn)(*args)
    assert out.graph_break_count == 0, [str(b.reason) for b in out.break_reasons]
    assert out.graph_count == 1


DECODERS = [v for v in variants(("decoder",))][:4]


@pytest.mark.parametrize(
    "model", [llama_tiny(), *[build(v) for v in DECODERS]], ids=["llama-tiny", *params(DECODERS)["ids"]]
)
def test_training_step_is_one_graph(model):
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    one_graph(training_step, model, ids, ids.roll(-1, 1))


def test_decode_steps_are_one_graph():
    model = llama_tiny().eval()
    cache = model.new_cache(2, 16)
    tok, pos = torch.randint(0, 97, (2, 1)), torch.tensor([[3], [5]])
    with torch.inference_mode():
        one_graph(decoder_step, model, tok, pos, cache)
        one_graph(lambda m, t, p, c: m(t, positions=p, cache=c), model, tok, pos, cache)  # the checked forward too
    v = variants(("encoder_decoder",))[0]
    s2s = build(v)
    src = torch.randint(0, s2s.config.vocab_size, (2, 5))
    cache = s2s.new_cache(2, 16, memory=s2s.encode(src), src_mask=None)
    with torch.inference_mode():
        one_graph(seq2seq_step, s2s, tok, pos, cache)


def test_eager_calls_still_get_the_readable_errors():
    model = llama_tiny().eval()
    with pytest.raises(ValueError, match=r"input_ids holds ids in \[0, 97\], outside \[0, vocab_size=97\)"):
        model(torch.tensor([[0, 97]]))
    cache = model.new_cache(1, 4)
    with pytest.raises(ValueError, match=r"positions reach 4 but the cache holds max_len=4"):
        model(torch.tensor([[1]]), positions=torch.tensor([4]), cache=cache)
    with pytest.raises(ValueError, match=r"cache was allocated for batch_size=1, got a batch of 2"):
        model(torch.tensor([[1], [2]]), positions=torch.tensor([0]), cache=cache)
