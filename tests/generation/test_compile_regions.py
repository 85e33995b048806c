"""Issue 25: a compiled decode step over big layers runs its blocks through one nested compile
region (models/regions.py), so identical layers are traced once by dynamo and compiled once: the
step is still one graph, every layer calls one shared subgraph, each layer's keys and values land
in its own cache, and greedy tokens equal eager. Dynamo + AOT autograd only (tests/conftest.py
``aot_eager``): the graph's structure is the property under test."""

import pytest
import torch
from torch._dynamo.variables.invoke_subgraph import InvokeSubgraphHigherOrderVariable

import torchformer as tfm
from torchformer.generation.steps import decoder_step


def subgraph_calls(gm: torch.fx.GraphModule) -> list[str]:
    """The subgraph each invoke_subgraph call of the graph runs, in order."""
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and "invoke_subgraph" in str(n.target)]
    return [n.args[0].target for n in calls]


@pytest.fixture
def region_traces(monkeypatch):
    """How many times dynamo traced a region's body (a reused subgraph is stamped out, not traced)."""
    traced, trace = [], InvokeSubgraphHigherOrderVariable.create_wrapped_node

    def counting(self, *args, **kwargs):
        traced.append(1)
        return trace(self, *args, **kwargs)

    monkeypatch.setattr(InvokeSubgraphHigherOrderVariable, "create_wrapped_node", counting)
    return traced


def region_model(n_layers: int = 3):
    torch.manual_seed(0)
    cfg = tfm.presets.get("llama-tiny", vocab_size=97, d_model=32, n_layers=n_layers, max_seq_len=48)
    model = tfm.build_model(cfg).eval()
    assert not model.stack.regions  # small layers are traced inline (a region costs host time per call)
    model.stack.regions = True
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.5)  # varied greedy tokens from random weights
    return model


def test_identical_layers_are_traced_once_and_decode_as_eager(aot_eager, region_traces):
    model = region_model()
    ids = torch.randint(1, 97, (1, 6))
    eager = tfm.generate(model, ids, max_new_tokens=12)
    assert len(set(eager[0, 6:].tolist())) >= 4
    compiled = tfm.generate(model, ids, max_new_tokens=12, compile=True)
    assert len(aot_eager) == 1, "the compiled step ran as one graph"
    calls = subgraph_calls(aot_eager[0])
    assert len(calls) == 3 and len(set(calls)) == 1, calls  # every layer calls one subgraph
    assert len(region_traces) == 1, "dynamo traced the layer body once and reused it for the others"
    assert torch.equal(compiled, eager)


@torch.no_grad()
def test_each_layer_writes_its_own_cache_through_the_shared_region(aot_eager):
    """The region's body writes k/v into its inputs: the compiled step must leave every layer's
    cache as the eager step does (not all in the first layer's, nor in a copy)."""
    model = region_model()
    ids = torch.randint(1, 97, (2, 5))
    caches = [model.new_cache(2, 16) for _ in range(2)]
    for cache in caches:
        model.logits(ids, torch.arange(5)[None, :].expand(2, -1), None, cache)  # prefill 5 positions
    token, pos = torch.tensor([[7], [11]]), torch.tensor([[5], [5]])
    eager = decoder_step(model, token, pos, caches[0])
    compiled = torch.compile(decoder_step, dynamic=False, fullgraph=True)(model, token, pos, caches[1])
    assert len(aot_eager) == 1 and len(subgraph_calls(aot_eager[0])) == 3
    torch.testing.assert_close(compiled, eager)
    for layer, (a, b) in enumerate(zip(caches[0].layers, caches[1].layers)):
        assert a.k[:, :, 5].abs().sum() > 0, f"layer {layer}: the eager step wrote slot 5"
        torch.testing.assert_close(b.k, a.k, msg=f"layer {layer} keys")
        torch.testing.assert_close(b.v, a.v, msg=f"layer {layer} values")


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
    with pytest.raises(ValueError, match=r"TORCHFORMER_CPP_WRAPPER='yes': must be auto, 0 or 1"):
        tfm.build_model(cfg)


@torch.no_grad()
def test_inductor_compiles_an_int8_step_of_more_rows_than_compiled_rows_inside_regions(monkeypatch):
    """Where the project's kernels do not run (neither AVX-512 nor AVX2, TORCHFORMER_NATIVE=0), an int8 model with
    bf16 activations multiplies more than COMPILED_ROWS rows by torch's int8 weight-only kernel;
    inductor's own lowering of that op failed inside a region (a batch-8 step of the 1B shape on an
    AVX2 CPU, issue 25). Inductor itself here, since the failure was in its lowering."""
    from torchformer.fast import formats
    from torchformer.nn.linear import COMPILED_ROWS
    from torchformer.nn.quant import Int8Linear

    monkeypatch.setattr(formats, "ops_ready", lambda: False)  # the library path, on any CPU
    model = tfm.quantize(region_model(n_layers=2).to(torch.bfloat16), "int8")
    assert type(model.stack.blocks[0].mlp.down) is Int8Linear and model.stack.regions
    rows = COMPILED_ROWS + 4
    ids = torch.randint(1, 97, (rows, 5))
    caches = [model.new_cache(rows, 16, dtype=torch.bfloat16) for _ in range(2)]
    for cache in caches:
        model.logits(ids, torch.arange(5)[None, :].expand(rows, -1), None, cache)
    token, pos = torch.randint(1, 97, (rows, 1)), torch.full((rows, 1), 5)
    eager = decoder_step(model, token, pos, caches[0])
    torch._dynamo.reset()
    compiled = torch.compile(decoder_step, dynamic=False, fullgraph=True)(model, token, pos, caches[1])
    gap = (compiled.float() - eager.float()).abs().max()  # bf16 activations, rounded where one fuses and one does not
    assert gap <= 0.08 * eager.float().abs().max(), (gap, eager.float().abs().max())  # measured 0.04
    assert (compiled.argmax(-1) == eager.argmax(-1)).float().mean() >= 0.75


@pytest.mark.parametrize("takes_entries", [True, False])
def test_regions_are_made_with_or_without_max_reuse_entries(monkeypatch, takes_entries):
    """torch 2.13's nested_compile_region takes max_reuse_entries; torch 2.11's has no such argument
    (torchformer failed at import there): a region is made either way, roomy where it can be."""
    from torchformer.models import regions

    made = []

    def with_entries(fn, max_reuse_entries=8):
        made.append(max_reuse_entries)
        return fn

    def without_entries(fn):
        made.append(None)
        return fn

    monkeypatch.setattr(torch.compiler, "nested_compile_region", with_entries if takes_entries else without_entries)
    assert regions._region(regions.run_block) is regions.run_block
    assert made == [256 if takes_entries else None]
