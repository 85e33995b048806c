"""Issue 25: a compiled decode step over big layers traces its blocks through one nested compile
region (models/stack.py ``region_block``), so identical layers compile once: the step is still one graph,
its later layers call one shared subgraph, and greedy tokens equal eager. Dynamo + AOT autograd only
(tests/conftest.py ``aot_eager``): the graph's structure is the property under test."""

import pytest
import torch

import torchformer as tfm


def subgraph_calls(gm: torch.fx.GraphModule) -> list[str]:
    """The subgraph each invoke_subgraph call of the graph runs, in order."""
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and "invoke_subgraph" in str(n.target)]
    return [n.args[0].target for n in calls]


def test_identical_layers_share_one_region_and_decode_as_eager(aot_eager):
    torch.manual_seed(0)
    cfg = tfm.presets.get("llama-tiny", vocab_size=97, d_model=32, n_layers=3, max_seq_len=48)
    model = tfm.build_model(cfg).eval()
    assert not model.stack.regions  # small layers are traced inline (a region costs host time per call)
    model.stack.regions = True
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.5)  # varied greedy tokens from random weights
    ids = torch.randint(1, 97, (1, 6))
    eager = tfm.generate(model, ids, max_new_tokens=12)
    assert len(set(eager[0, 6:].tolist())) >= 4
    compiled = tfm.generate(model, ids, max_new_tokens=12, compile=True)
    assert len(aot_eager) == 1, "the compiled step ran as one graph"
    calls = subgraph_calls(aot_eager[0])
    # Dynamo inlines a region's first call and reuses one subgraph for the later ones.
    assert len(calls) == 2 and len(set(calls)) == 1, calls
    assert torch.equal(compiled, eager)


def test_regions_from_a_layer_of_region_params_weights():
    from torchformer.models import stack

    def layer_params(d_model: int) -> tuple[int, bool]:
        cfg = tfm.presets.get("llama-tiny", vocab_size=97, d_model=d_model, n_layers=1, max_seq_len=8)
        model = tfm.build_model(cfg)
        return sum(p.numel() for p in model.stack.blocks[0].parameters()), model.stack.regions

    small, big = layer_params(256), layer_params(1280)
    assert small[0] < stack.REGION_PARAMS <= big[0]
    assert (small[1], big[1]) == (False, True)


def test_the_cpp_wrapper_switch_turns_regions_off_at_build(monkeypatch):
    """Inductor's cpp_wrapper cannot emit a region: a big-layer stack built under the switch runs its
    blocks plainly, and a bad value is refused when such a stack is built."""
    cfg = tfm.presets.get("llama-tiny", vocab_size=97, d_model=1280, n_layers=1, max_seq_len=8)
    monkeypatch.setenv("TORCHFORMER_CPP_WRAPPER", "1")
    assert not tfm.build_model(cfg).stack.regions
    monkeypatch.setenv("TORCHFORMER_CPP_WRAPPER", "yes")
    with pytest.raises(ValueError, match=r"TORCHFORMER_CPP_WRAPPER='yes': must be 0 or 1"):
        tfm.build_model(cfg)
