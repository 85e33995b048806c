"""Joint input projections (fast/joint.py): an attention's q/k/v and a gated MLP's gate/up panel
twins run as one product over one buffer. Over the grid: the joint model's outputs equal, bit for
bit, the same model's with each member's own product (eager and compiled greedy decoding), its
state dict is the unjoined model's, and exactly the groups whose members fit are joint. A load into
a member, a member swapped for another module, a hook, or members that do not fit: the members'
own products, and ``prepare`` joins again where it can."""

import contextlib
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import torchformer as tfm
from tests.grid import KV_HEADS, N_HEADS, build, forward, params, variants
from torchformer.fast import formats
from torchformer.fast.joint import JointOwner, joinable
from torchformer.nn.attention import Attention
from torchformer.nn.mlp import GatedMLP

pytestmark = pytest.mark.skipif(
    not formats.ops_ready(), reason="the CPU kernels are not built here (no AVX-512 or no compiler)"
)

HEAD = 8  # the grid's head size: d_model 32 over 4 heads
SCHEMES = (("int8", None), ("int4", 16), ("int8", 16))


def joints(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, JointOwner) and m.joint is not None]


@contextlib.contextmanager
def apart(model: nn.Module):
    """The model with every owner on its members' own products while the block runs."""
    with pytest.MonkeyPatch.context() as mp:
        for m in joints(model):
            mp.setattr(m, "joint", None)
        yield


def joint_and_apart(model: nn.Module, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's outputs over a fixed (2, 7) batch with its joints, then with its members' own products."""
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode():
        together = forward(model, ids)
        with apart(model):
            return together, forward(model, ids)


def expected_joints(model: nn.Module, v: dict) -> int:
    """Groups whose members are all whole 16-row panels: q (32 wide) with k and v (8 per KV head),
    and every gated MLP's gate and up."""
    kv_fits = KV_HEADS[v["heads"]] * HEAD % 16 == 0 and N_HEADS * HEAD % 16 == 0
    attention = sum(type(m) is Attention for m in model.modules()) if kv_fits else 0
    gated = [m for m in model.modules() if type(m) is GatedMLP]
    return attention + sum(m.gate.out_features % 16 == 0 for m in gated)


ROWS = [(v, *SCHEMES[i % len(SCHEMES)]) for i, v in enumerate(variants())]  # each row with one scheme, in turn
IDS = [f"{vid}-{s}{g or ''}" for vid, (_, s, g) in zip(params(variants())["ids"], ROWS)]


@pytest.mark.parametrize("v,scheme,group", ROWS, ids=IDS)
def test_joint_products_equal_the_members_own_and_only_fitting_groups_join(v, scheme, group):
    model = build(v)
    expected = expected_joints(model, v)  # counted before quantize joins them (their class changes)
    model = tfm.quantize(model, scheme, group_size=group)
    assert len(joints(model)) == expected
    joint, own = joint_and_apart(model)
    assert torch.equal(joint, own)


@pytest.mark.parametrize("scheme,group", SCHEMES)
def test_the_state_dict_is_the_unjoined_models(scheme, group):
    v = next(v for v in variants(("decoder",)) if v["mlp"] == "swiglu" and v["heads"] != "mqa")
    joint = tfm.quantize(build(v), scheme, group_size=group)
    assert len(joints(joint)) == 2 * 2  # two layers: attention and MLP each
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(formats, "join", lambda model: 0)
        plain = tfm.quantize(build(v), scheme, group_size=group)
    assert not joints(plain)
    a, b = joint.state_dict(), plain.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def swiglu_decoder() -> dict:
    return next(v for v in variants(("decoder",)) if v["mlp"] == "swiglu" and v["heads"] == "mha")


def test_compiled_greedy_decoding_is_the_same_joint_or_apart():
    model = tfm.quantize(build(swiglu_decoder()), "int4", group_size=16)
    assert joints(model)
    ids = torch.randint(0, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(4))
    joint = tfm.generate(model, ids, max_new_tokens=8, compile=True)
    eager = tfm.generate(model, ids, max_new_tokens=8)
    with apart(model):
        own = tfm.generate(model, ids, max_new_tokens=8, compile=True)
    assert torch.equal(joint, own) and torch.equal(joint, eager)


def test_a_load_writes_through_the_views_and_a_replaced_tensor_is_seen():
    v = swiglu_decoder()
    model = tfm.quantize(build(v), "int8", group_size=None)
    other = tfm.quantize(build(v, seed=5), "int8", group_size=None)
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        want = forward(other, ids)
    model.load_state_dict(other.state_dict())  # repacks each member in place: into the joint buffer
    assert all(m.joint.current(m) for m in joints(model))
    with torch.inference_mode():
        assert torch.equal(forward(model, ids), want)
    # A member's tensor replaced (as a repack into new tensors, or a cast, does): no longer the
    # joint buffer's view, so the owner takes its members' products until prepare joins again.
    owner = next(m for m in joints(model) if isinstance(m, Attention))
    owner.q_proj.scale = owner.q_proj.scale * 2
    assert not owner.joint.current(owner)
    with torch.inference_mode():
        with apart(model):
            doubled = forward(model, ids)
        assert not torch.equal(doubled, want)
        assert torch.equal(forward(model, ids), doubled)
    formats.prepare(model)
    assert owner.joint.current(owner)
    with torch.inference_mode():
        assert torch.equal(forward(model, ids), doubled)


class Shifted(nn.Module):
    """Another module in a member's place (as an adapter's wrapper is): its own output + 1."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x) + 1


def test_a_swapped_or_hooked_member_takes_its_own_forward():
    model = tfm.quantize(build(swiglu_decoder()), "int4", group_size=16)
    mlp = next(m for m in joints(model) if isinstance(m, GatedMLP))
    x = torch.randn(3, model.config.d_model)
    with torch.inference_mode():
        gate, up = mlp.gate(x), mlp.up(x)
        mlp.up = Shifted(mlp.up)
        assert torch.equal(mlp.gate_up(x)[1], up + 1)
        formats.prepare(model)  # the swapped member no longer fits: the owner goes back to its own
        assert mlp.joint is None
        mlp.up = mlp.up.inner
        formats.prepare(model)
        assert mlp.joint is not None
        handle = mlp.gate.register_forward_hook(lambda mod, args, out: out * 2)
        assert torch.equal(mlp.gate_up(x)[0], gate * 2)
        handle.remove()
        assert torch.equal(mlp.gate_up(x)[0], gate)


def test_members_that_do_not_share_a_format_or_whole_panels_stay_apart():
    v = swiglu_decoder()
    int8 = tfm.quantize(build(v), "int8", group_size=None)
    int4 = tfm.quantize(build(v), "int4", group_size=16)
    a8 = next(m for m in int8.modules() if isinstance(m, Attention))
    a4 = next(m for m in int4.modules() if isinstance(m, Attention))
    assert joinable([a8.q_proj, a8.k_proj, a8.v_proj])
    assert not joinable([a8.q_proj, a4.k_proj, a8.v_proj])  # int8 beside int4
    int4_32 = tfm.quantize(build(v), "int4", group_size=32)
    assert not joinable([a4.q_proj, next(m for m in int4_32.modules() if isinstance(m, Attention)).k_proj])
    narrow = tfm.quantize(build(v, attention=tfm.AttentionConfig(n_heads=4, n_kv_heads=1)), "int8", group_size=None)
    assert not any(isinstance(m, Attention) for m in joints(narrow))  # k and v: 8 rows, half a panel


def region_model() -> nn.Module:
    """A quantized llama-tiny whose stack runs its layers through compile regions (models/regions.py),
    which refuse inputs that alias one another: the joint buffer's views, if two reach one region."""
    torch.manual_seed(0)
    cfg = tfm.presets.get("llama-tiny", vocab_size=97, d_model=32, n_layers=3, max_seq_len=48)
    model = tfm.build_model(cfg).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.5)  # varied greedy tokens from random weights
    model = tfm.quantize(model, "int4", group_size=16)
    model.stack.regions = True
    return model


def test_compiled_regions_run_joint_and_apart_after_a_swap_or_training(aot_eager):
    model = region_model()
    assert len(joints(model)) == 2 * 3
    ids = torch.randint(1, 97, (1, 6), generator=torch.Generator().manual_seed(7))
    eager = tfm.generate(model, ids, max_new_tokens=10)
    assert torch.equal(tfm.generate(model, ids, max_new_tokens=10, compile=True), eager)
    # A member swapped (as an adapter's wrapper is): the next scope drops that joint and gives
    # its members their own copies, so the region gets no aliasing inputs.
    attn = next(m for m in joints(model) if isinstance(m, Attention))
    attn.k_proj = Shifted(attn.k_proj)
    shifted = tfm.generate(model, ids, max_new_tokens=10)
    assert attn.joint is None
    assert torch.equal(tfm.generate(model, ids, max_new_tokens=10, compile=True), shifted)
    attn.k_proj = attn.k_proj.inner
    # Training mode: every owner's members part (the reference products run), joined again by the
    # next scope.
    model.train().eval()
    assert not joints(model)
    assert torch.equal(tfm.generate(model, ids, max_new_tokens=10, compile=True), eager)
    assert len(joints(model)) == 2 * 3



@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and malloc_trim are Linux's glibc's")
def test_joining_after_a_quantizing_load_holds_no_more_memory(tmp_path):
    """In a fresh process, a quantizing load (joins off), then ``join``: the resident memory stays
    where it was, the members' freed buffers given back to the system. Measured on this folder
    without the trim after each group: +29 MB of its 38 MB of joined panels (the 1B shape in int8:
    +243 MB); with it +0.3 MB."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=1024, intermediate_size=4096, num_hidden_layers=4, num_attention_heads=16,
        num_key_value_heads=4, tie_word_embeddings=True, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    script = textwrap.dedent(
        f"""
        import torch, torchformer as tfm
        from torchformer.fast import formats
        torch.set_num_threads(1)
        def rss():
            return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS:"))
        join, formats.join = formats.join, lambda model: 0
        model = tfm.load_any({str(tmp_path / "hf")!r}, quantize="int8")
        names = ("q_proj", "k_proj", "v_proj", "gate", "up")
        joined = sum(b.numel() for n, b in model.named_buffers() if n.rsplit(".", 2)[-2] in names)
        before = rss()
        print(join(model), joined // 1024, rss() - before)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    groups, joined_kib, grown_kib = (int(n) for n in done.stdout.split()[-3:])
    assert groups == 2 * 4 and joined_kib > 30 * 1024, (groups, joined_kib)
    assert grown_kib < 0.1 * joined_kib, (grown_kib, joined_kib)


def test_a_prefills_parts_are_the_members_products_as_views(monkeypatch):
    """Past CONTIGUOUS_ROWS rows the parts are views of one output (no copies at a prefill's size):
    the same values as the members' own products, and a model's logits within an ulp's rounding.
    The integer kernels' product here (fp32 x through an AMX CPU's bf16 prefill comes back as a
    conversion's copy: test_bf16_prefill.py)."""
    from torchformer.fast import quant_panels
    from torchformer.fast.joint import CONTIGUOUS_ROWS

    monkeypatch.setattr(quant_panels, "BF16_ROWS", 1 << 30)

    v = next(v for v in variants(("decoder",)) if v["mlp"] == "geglu" and v["heads"] == "mha")
    model = tfm.quantize(build(v), "int8", group_size=None)
    mlp = next(m for m in joints(model) if isinstance(m, GatedMLP))
    x = torch.randn(CONTIGUOUS_ROWS + 5, model.config.d_model)
    with torch.inference_mode():
        gate, up = mlp.gate_up(x)
        assert not gate.is_contiguous()
        assert torch.equal(gate, mlp.gate(x)) and torch.equal(up, mlp.up(x))
        ids = torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(8))
        joint = forward(model, ids)
        with apart(model):
            own = forward(model, ids)
    torch.testing.assert_close(joint, own, rtol=1e-5, atol=1e-5)
