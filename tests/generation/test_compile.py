"""compile=True (issue 3, test 6): same tokens as eager, and the decode step compiles once for
32 tokens (and not again for a second call of the same shape). One 1-layer model: the first
inductor compile costs ~20-60 s on this CPU."""

import torch
from torch._dynamo.utils import counters

import torchformer as tfm
from tests.grid import build, variants


def test_compiled_decode_step_compiles_once_and_matches_eager():
    v = next(v for v in variants(("decoder", "encoder_decoder")) if v["arch"] == "decoder" and v["position"] != "none")
    model = build(v, init_std=0.1, n_layers=1)
    ids = torch.randint(1, model.config.vocab_size, (2, 6))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    torch._dynamo.reset()
    counters.clear()
    compiled = tfm.generate(model, ids, attention_mask=mask, max_new_tokens=33, compile=True)  # 32 compiled steps
    assert counters["stats"]["unique_graphs"] == 1
    assert counters["aot_autograd"]["total"] == 1
    assert sum(counters["graph_break"].values()) == 0
    eager = tfm.generate(model, ids, attention_mask=mask, max_new_tokens=33)
    assert torch.equal(compiled, eager)
    counters.clear()
    again = tfm.generate(model, ids.flip(0), attention_mask=mask.flip(0), max_new_tokens=33, compile=True)
    assert counters["stats"]["unique_graphs"] == 0  # a new cache of the same shape: no recompile
    assert torch.equal(again, eager.flip(0)[:, : again.shape[1]])
