"""build_model wiring: the right class per arch, ties, shared tables, residual placement, and the
DESIGN section 3 rule that no forward compares a string or reads the config."""

import ast
import math
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import torchformer as tfm
from torchformer.nn.block import parallel, parallel_shared, post_norm, pre_norm

from .. import grid

SRC = Path(tfm.__file__).parent


@pytest.mark.parametrize(
    ("arch", "cls"), [("decoder", tfm.DecoderLM), ("encoder", tfm.Encoder), ("encoder_decoder", tfm.EncoderDecoder)]
)
def test_build_returns_the_arch_class(arch, cls):
    assert type(grid.build(grid.variants((arch,))[0])) is cls


def test_ties_and_shared_tables():
    v = grid.variants(("encoder_decoder",))[0]
    m = grid.build(v, tie_embeddings=True, share_embeddings=True)
    assert m.lm_head.weight is m.tgt_embed.tok.weight is m.src_embed.tok.weight
    m = grid.build(v, tie_embeddings=True, share_embeddings=False)
    assert m.lm_head.weight is m.tgt_embed.tok.weight and m.src_embed.tok.weight is not m.tgt_embed.tok.weight
    m = grid.build(v, tie_embeddings=False, share_embeddings=True)
    assert m.lm_head.weight is not m.tgt_embed.tok.weight and m.src_embed.tok.weight is m.tgt_embed.tok.weight
    d = grid.build(grid.variants(("decoder",))[0], tie_embeddings=False)
    assert d.lm_head.weight is not d.embed.tok.weight


@pytest.mark.parametrize("placement", ["pre", "post", "parallel", "parallel_shared"])
def test_residual_placement_and_final_norm(placement):
    v = dict(grid.variants(("decoder",))[0], placement=placement)
    m = grid.build(v)
    wirings = {"pre": pre_norm, "post": post_norm, "parallel": parallel, "parallel_shared": parallel_shared}
    assert m.stack.blocks[0].residual is wirings[placement]
    assert isinstance(m.stack.final_norm, torch.nn.Identity) == (placement == "post")
    assert isinstance(m.stack.blocks[0].mlp_norm, torch.nn.Identity) == (placement == "parallel_shared")
    # pre: x + f(norm(x)); post: norm(x + f(x)) (tests/nn/test_residual.py covers the parallel forms)
    norm, f, x = torch.nn.LayerNorm(4), torch.tanh, torch.randn(3, 4)
    assert torch.equal(pre_norm(x, [(norm, f)]), x + f(norm(x)))
    assert torch.equal(post_norm(x, [(norm, f)]), norm(x + f(x)))


def test_encoder_token_types_and_embedding_norm():
    v = grid.variants(("encoder",))[0]
    m = grid.build(v, n_token_types=2, embed_norm=True)
    ids = torch.randint(0, grid.VOCAB, (2, 6))
    types = torch.tensor([[0, 0, 0, 1, 1, 1]] * 2)
    with torch.no_grad():
        torch.nn.init.normal_(m.embed.token_types.weight)
        a, b = m(ids), m(ids, token_type_ids=types)
    assert torch.equal(a, m(ids, token_type_ids=torch.zeros_like(ids)))
    assert (a - b).abs().max() > 1e-3
    assert m.embed.norm is not None


def test_position_shapes_are_equivalent():
    m = grid.build(grid.variants(("decoder",))[0])
    ids = torch.randint(0, grid.VOCAB, (2, 6))
    pos = torch.arange(3, 9)
    with torch.no_grad():
        a = m(ids, positions=pos)
        assert torch.equal(a, m(ids, positions=pos[None]))
        assert torch.equal(a, m(ids, positions=pos[None].expand(2, -1)))


FORWARD_FILES = [*sorted((SRC / "nn").glob("*.py")), SRC / "models" / "stack.py"]


@pytest.mark.parametrize("path", FORWARD_FILES, ids=lambda p: p.name)
def test_building_blocks_never_compare_strings_or_read_config(path):
    """DESIGN 3: after build, forwards never compare a string and never read ``config``."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            assert not any(isinstance(o, ast.Constant) and isinstance(o.value, str) for o in operands), (
                f"{path.name}:{node.lineno} compares a string"
            )
        if isinstance(node, ast.Attribute | ast.Name):
            name = node.attr if isinstance(node, ast.Attribute) else node.id
            assert name not in ("config", "cfg"), f"{path.name}:{node.lineno} reads the config"


@pytest.mark.parametrize("backend", ["math", "sdpa"])
def test_dropout_only_in_training(backend):
    v = dict(grid.variants(("decoder",))[0], backend=backend)
    changes = dict(dropout=0.2, attention={"dropout": 0.2}, block={"dropout": 0.2})
    model, plain = grid.build(v, **changes), grid.build(v)
    plain.load_state_dict(model.state_dict())
    ids = torch.randint(0, grid.VOCAB, (2, 8))
    with torch.no_grad():
        assert torch.equal(model(ids), plain(ids))  # eval: dropout is the identity
        model.train()
        a, b = model(ids), model(ids)
    assert (a - b).abs().max() > 1e-3


class Allocations(TorchDispatchMode):
    """Records (op, shape) of every tensor an op allocates: views and in-place results, which share
    an input's storage, are not new memory."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        storage = lambda t: t.untyped_storage().data_ptr()  # noqa: E731
        inputs = {storage(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        new = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and storage(t) not in inputs]
        self.made += [(str(func), tuple(t.shape)) for t in new]
        return out


@pytest.mark.parametrize("heads", ["gqa", "mqa"])
@pytest.mark.parametrize("backend", ["math", "sdpa"])
@torch.no_grad()
def test_gqa_never_copies_kv_heads(backend, heads):
    """GQA shares each K/V head across its group of query heads: in a prefill and a decode step no
    op allocates a K or V with all n_heads (repeat_interleave, expand + contiguous, a broadcast
    matmul), and the cache holds n_kv_heads."""
    model = grid.build(dict(grid.variants(("decoder",))[0], heads=heads, backend=backend, position="rope-half"))
    B, T, S, E = 2, 6, 17, grid.D_MODEL // grid.N_HEADS  # a cache of S slots: only K/V span S keys x E
    cache = model.new_cache(B, S - 1)
    ids = torch.randint(0, grid.VOCAB, (B, T + 1))
    with Allocations() as seen:
        model(ids[:, :T], positions=torch.arange(T), cache=cache)
        model(ids[:, T:], positions=torch.tensor([T]), cache=cache)
    # Scores are (B, H, T<=6, S): a tensor with S and B * n_heads * S * E elements is a full-heads K or V.
    full = [(op, shape) for op, shape in seen.made if S in shape and math.prod(shape) == B * grid.N_HEADS * S * E]
    assert not full, full
    assert {(layer.k.shape, layer.v.shape) for layer in cache.layers} == {((B, grid.KV_HEADS[heads], S, E),) * 2}


def test_mask_is_none_exactly_when_sdpa_is_causal_is_exact():
    v = dict(grid.variants(("decoder",))[0], position="rope-half")
    stack = grid.build(v).stack
    pos = torch.arange(5)[None].expand(2, -1)
    fast = stack.context(pos, None, None)
    assert fast.mask is None and fast.is_causal and fast.bias is None
    padded = stack.context(pos, torch.tensor([[0, 1, 1, 1, 1], [1] * 5]), None)
    assert padded.mask is not None and not padded.is_causal
    assert padded.mask[0, 0, 4].tolist() == [False, True, True, True, True]
    alibi = grid.build(dict(v, position="alibi")).stack.context(pos, None, None)
    assert alibi.mask is not None and alibi.bias is not None and not alibi.is_causal
    enc = grid.build(dict(v, arch="encoder")).stack.context(pos, None, None)
    assert enc.mask is None and not enc.is_causal
