"""GPT-2: pre-LN LayerNorm with biases, learned positions, gelu-tanh ("gelu_new"), tied head.

HF keeps OpenAI's Conv1D weights, (in, out), so every matrix is transposed, and q|k|v are one
fused ``c_attn`` split along its output dimension. GPT2LMHeadModel checkpoints prefix the body
with ``transformer.``; GPT2Model ones (like the original ``gpt2`` upload) do not.
"""

from __future__ import annotations

from ..configs import Learned
from .family import Family, Field
from .keymap import KeyMap, renamed, rule
from .layouts import activation, shape, tied
from .transforms import fuse_rows, split_rows, transpose


def keymap(cfg, hf_names=None) -> KeyMap:
    body = "" if hf_names is not None and "wte.weight" in hf_names else "transformer."
    L, H = "stack.blocks.{i}", f"{body}h.{{i}}"
    d = cfg.d_model
    qkv = tuple(f"{L}.attn.{p}_proj" for p in "qkv")
    rules = [
        rule("embed.tok.weight", f"{body}wte.weight"),
        rule("embed.absolute.weight", f"{body}wpe.weight"),
        rule("lm_head.weight", "lm_head.weight"),
        rule(tuple(f"{n}.weight" for n in qkv), f"{H}.attn.c_attn.weight",
             lambda ts: split_rows(transpose(ts[0]), [d, d, d]), lambda ts: [transpose(fuse_rows(ts))]),
        rule(tuple(f"{n}.bias" for n in qkv), f"{H}.attn.c_attn.bias",
             lambda ts: split_rows(ts[0], [d, d, d]), lambda ts: [fuse_rows(ts)]),
    ]  # fmt: skip
    both = lambda ts: [transpose(ts[0])]  # noqa: E731
    for ours, theirs in (("attn.o_proj", "attn.c_proj"), ("mlp.up", "mlp.c_fc"), ("mlp.down", "mlp.c_proj")):
        rules += [rule(f"{L}.{ours}.weight", f"{H}.{theirs}.weight", both, both),
                  rule(f"{L}.{ours}.bias", f"{H}.{theirs}.bias")]  # fmt: skip
    norms = [(f"{L}.attn_norm", f"{H}.ln_1"), (f"{L}.mlp_norm", f"{H}.ln_2"), ("stack.final_norm", f"{body}ln_f")]
    return KeyMap(rules + renamed(norms))


GPT2 = Family(
    model_type="gpt2",
    architecture="GPT2LMHeadModel",
    fields=(
        *shape("n_embd", "n_layer", "n_head"),
        Field("n_positions", "max_seq_len", 1024),
        Field("n_inner", "block.d_ff", lambda hf: 4 * hf["n_embd"], empty=True),
        activation("activation_function"),
        Field("layer_norm_epsilon", "block.norm_eps", 1e-5),
        Field("attn_pdrop", "attention.dropout", 0.0),
        Field("resid_pdrop", "block.dropout", 0.0),
        Field("embd_pdrop", "dropout", 0.0),
        Field("tie_word_embeddings", "tie_embeddings", True),
    ),
    keys=keymap,
    fixed={
        "arch": "decoder",
        "attention.bias": True,
        "block.norm": "layernorm",
        "block.norm_placement": "pre",
        "block.bias": True,
        "positions": Learned(),
    },  # fmt: skip
    written={"scale_attn_weights": True},
    only={"scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "add_cross_attention": False},
    ignored=(r"(transformer\.)?h\.\d+\.attn\.(masked_)?bias",),  # causal-mask buffers older transformers saved
    aliases=tied("transformer.wte.weight"),
)
FAMILIES = (GPT2,)
