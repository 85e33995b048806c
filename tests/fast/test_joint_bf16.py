"""Joint bf16 projections (fast/bf16_joint.py ``Bf16Joint``): an attention's q/k/v and a gated MLP's
gate/up ``Bf16Linear``s run as one product over their weights laid end to end. Over the grid: the
joint model's outputs equal, bit for bit, the same model's with each member's own product, and every
group of plain bf16 members is joint. The joint weight is a window onto the members' own bytes (a
loaded model's lie end to end already: no copy), each with a storage of its own, so members run on
their own where the joint does not take the call (bf16 prefills through oneDNN, compile regions).
A load into a member writes through; a replaced weight is seen; training and saving see the
members' own Parameters, unchanged."""

import pytest
import torch
from torch import nn

import torchformer as tfm
from tests.fast.test_joint import apart, joint_and_apart, joints
from tests.grid import build, forward, params, variants
from torchformer.fast import bf16 as fast_bf16
from torchformer.fast import bf16_joint, formats
from torchformer.fast.bf16_joint import Bf16Joint
from torchformer.fast.joint import OWNERS
from torchformer.nn.attention import Attention
from torchformer.nn.linear import Linear
from torchformer.nn.mlp import GatedMLP

pytestmark = pytest.mark.skipif(
    not formats.ops_ready(), reason="the CPU kernels are not built here (no AVX-512 or AVX2, or no compiler)"
)


def plain_groups(model: nn.Module) -> int:
    """Owners (exact Attention / GatedMLP) whose members are all plain ``Linear``s: bf16 joins them."""
    return sum(
        type(m) in OWNERS and all(type(getattr(m, n, None)) is Linear for n in OWNERS[type(m)][1])
        for m in model.modules()
    )


def bf16_model(v: dict, seed: int = 0) -> nn.Module:
    model = build(v, seed).bfloat16()
    formats.prepare(model)
    return model


@pytest.mark.parametrize("v", variants(), ids=params(variants())["ids"])
def test_joint_bf16_products_equal_the_members_own_and_every_plain_group_joins(v):
    model = build(v).bfloat16()
    expected = plain_groups(model)  # counted before prepare joins them (their class changes)
    formats.prepare(model)
    assert len(joints(model)) == expected and all(isinstance(m.joint, Bf16Joint) for m in joints(model))
    together, own = joint_and_apart(model)
    assert torch.equal(together, own)


def swiglu_decoder() -> dict:
    """A SwiGLU decoder row with GQA (q wider than k and v) and biases on every projection."""
    return dict(next(v for v in variants(("decoder",)) if v["mlp"] == "swiglu"), heads="gqa", bias=True)


@pytest.mark.parametrize("rows,dtype", [(1, torch.bfloat16), (3, torch.bfloat16), (15, torch.bfloat16),
                                        (16, torch.bfloat16), (40, torch.bfloat16), (1, torch.float32),
                                        (9, torch.float32), (fast_bf16.WIDEN_ROWS, torch.float32)])  # fmt: skip
def test_each_route_gives_the_members_own_outputs_and_only_the_kernels_run_joint(monkeypatch, rows, dtype):
    """q/k/v of unequal widths (GQA) with biases: below DOT_ROWS bf16 rows (vdpbf16ps where the CPU
    has it) and below WIDEN_ROWS fp32 rows (the kernel) one product over the joint weight; oneDNN's
    bf16 product and the widened slices run per member. Outputs equal the members' own either way."""
    model = bf16_model(swiglu_decoder())
    attn = next(m for m in joints(model) if isinstance(m, Attention))
    widths = [attn.q_proj.out_features, attn.k_proj.out_features]
    assert widths[0] != widths[1] and attn.q_proj.bias is not None
    seen = []
    product = fast_bf16.bf16_product

    def spy(x, w):
        seen.append(w.shape[0])
        return product(x, w)

    monkeypatch.setattr(bf16_joint, "bf16_product", spy)
    x = torch.randn(rows, model.config.d_model).to(dtype)
    with torch.inference_mode():
        together = attn.project(x)
        own = tuple(m(x) for m in (attn.q_proj, attn.k_proj, attn.v_proj))
    assert all(torch.equal(a, b) for a, b in zip(together, own, strict=True))
    takes = fast_bf16.kernels_take(x)
    assert seen == ([sum(m.out_features for m in attn.joint.members)] if takes else [])


def test_the_joint_weight_is_a_window_onto_the_members_bytes_each_with_its_own_storage():
    model = bf16_model(swiglu_decoder())
    for owner in joints(model):
        members = owner.joint.members
        fused = owner.joint.fused.weight
        assert fused.data_ptr() == members[0].weight.data_ptr()
        assert torch.equal(fused, torch.cat([m.weight for m in members]))
        storages = {fused.untyped_storage()._cdata} | {m.weight.untyped_storage()._cdata for m in members}
        assert len(storages) == len(members) + 1  # no two share a storage (a compile region refuses that)


def test_a_loaded_models_members_already_lie_end_to_end_and_are_not_copied(tmp_path, monkeypatch):
    """A safetensors folder's weights move into one huge-page arena with each group's members end to
    end (fast/formats.py ``stream_mapped_bf16``), so joining copies nothing. Without huge pages (the
    switch off) they stay in the file's mapping, where q/k/v are not in order: joined by a copy."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=256, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    for huge in ("1", "0"):
        monkeypatch.setenv("TORCHFORMER_HUGE_PAGES", huge)
        apart_model = tfm.load_any(str(tmp_path / "hf"))  # bf16 stays bf16; the first scope prepares it
        with monkeypatch.context() as mp:
            mp.setattr(formats, "join", lambda model: 0)
            formats.prepare(apart_model)  # Bf16Linears, the mapped weights moved: all but the joins
        pointers = {n: p.data_ptr() for n, p in apart_model.named_parameters()}
        assert formats.join(apart_model) == 2 * 2
        moved = [n for n, p in apart_model.named_parameters() if p.data_ptr() != pointers[n]]
        if huge == "1" and formats.huge_arena([((1 << 20,), torch.bfloat16)]) is not None:
            assert moved == []  # laid end to end at load: the joint weight is their own bytes
        else:
            assert moved and all(n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight",
                                              "gate.weight", "up.weight")) for n in moved)  # fmt: skip
        loaded = tfm.load_any(str(tmp_path / "hf"))
        formats.prepare(loaded)
        ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(1))
        with torch.inference_mode():
            assert torch.equal(forward(loaded, ids), forward(apart_model, ids))
            with apart(loaded):
                assert torch.equal(forward(loaded, ids), forward(apart_model, ids))


def test_a_load_writes_through_a_replaced_weight_is_seen_and_prepare_joins_again():
    v = swiglu_decoder()
    model, other = bf16_model(v), bf16_model(v, seed=5)
    ids = torch.randint(0, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        want = forward(other, ids)
    model.load_state_dict(other.state_dict())  # in place: through each member's window
    assert all(m.joint.current(m) for m in joints(model))
    with torch.inference_mode():
        assert torch.equal(forward(model, ids), want)
    mlp = next(m for m in joints(model) if isinstance(m, GatedMLP))
    mlp.up.weight.data = mlp.up.weight.data * 2  # another tensor under the same Parameter (a cast would)
    assert not mlp.joint.current(mlp)
    with torch.inference_mode():
        with apart(model):
            doubled = forward(model, ids)
        assert not torch.equal(doubled, want)
        assert torch.equal(forward(model, ids), doubled)  # the members' own products
    formats.prepare(model)
    assert mlp.joint.current(mlp)
    with torch.inference_mode():
        assert torch.equal(forward(model, ids), doubled)


def test_the_state_dict_saving_and_training_see_the_members_own_parameters(tmp_path):
    from safetensors.torch import load_file, save_file

    v = swiglu_decoder()
    model = bf16_model(v)
    assert joints(model)
    plain = build(v).bfloat16()
    a, b = {k: t.clone() for k, t in model.state_dict().items()}, plain.state_dict()  # a: as it is now
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    save_file(a, tmp_path / "w.safetensors")  # no two tensors share a storage: nothing refused
    back = load_file(tmp_path / "w.safetensors")
    assert all(torch.equal(back[k], a[k]) for k in a)
    # Training: the owners go back to their members (the reference products); an optimizer step
    # moves the members' Parameters in place, and the next scope joins them again over the new values.
    groups = len(joints(model))
    model.train()
    assert not joints(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(2))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    forward(model, ids).float().square().mean().backward()
    opt.step()
    trained = model.state_dict()
    assert not torch.equal(trained["stack.blocks.0.attn.q_proj.weight"], a["stack.blocks.0.attn.q_proj.weight"])
    model.eval()
    assert formats.join(model) == groups
    for owner in joints(model):
        assert torch.equal(owner.joint.fused.weight, torch.cat([m.weight for m in owner.joint.members]))
    with torch.inference_mode():
        together = forward(model, ids)
        with apart(model):
            own = forward(model, ids)
    assert torch.equal(together, own)


def test_compiled_steps_decode_as_eager_joint_or_apart(exported_eager):
    model = bf16_model(swiglu_decoder())
    assert joints(model)
    ids = torch.randint(0, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(4))
    compiled = tfm.generate(model, ids, max_new_tokens=8, compile=True)
    assert exported_eager  # the step compiled ahead ran, with the joint weights as its inputs
    eager = tfm.generate(model, ids, max_new_tokens=8)
    with apart(model):
        own = tfm.generate(model, ids, max_new_tokens=8)
    assert torch.equal(compiled, eager) and torch.equal(eager, own)


def test_compile_regions_take_joint_decode_steps_and_members_own_prefills(aot_eager):
    """A stack whose layers run through compile regions (models/regions.py refuses inputs sharing a
    storage): a prompt of DOT_ROWS tokens or more prefills through each member's oneDNN product
    while the joint weight (a window of its own) is the decode steps' input."""
    torch.manual_seed(0)
    cfg = tfm.presets.get("llama-tiny", vocab_size=97, d_model=32, n_layers=3, max_seq_len=64)
    model = tfm.build_model(cfg).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.5)  # varied greedy tokens from random weights
    model = model.bfloat16()
    formats.prepare(model)
    assert len(joints(model)) == 2 * 3
    model.stack.regions = True
    ids = torch.randint(1, 97, (1, fast_bf16.DOT_ROWS + 4), generator=torch.Generator().manual_seed(7))
    eager = tfm.generate(model, ids, max_new_tokens=10)
    assert torch.equal(tfm.generate(model, ids, max_new_tokens=10, compile=True), eager)
    assert aot_eager  # compiled graphs ran
