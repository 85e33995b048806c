"""DistilBERT: BERT's post-LN encoder under its own names, without token types and without a
configurable eps (every LayerNorm is 1e-12). ``sinusoidal_pos_embds`` only changes how the
position table is initialised (HF saves it like a learned one), so both load as Learned().
Checkpoints are DistilBertModel (``embeddings.``) or a task model (``distilbert.``); the MLM
head (``vocab_transform``, ``vocab_layer_norm``, ``vocab_projector``) is dropped on load.
"""

from __future__ import annotations

from ..configs import Learned
from .family import Family, Field
from .keymap import KeyMap, renamed
from .layouts import POST_LN_ENCODER, activation, body_prefix, dropouts, shape


def keymap(cfg, hf_names=None) -> KeyMap:
    p = body_prefix("distilbert.", hf_names)
    L, H, E = "stack.blocks.{i}", f"{p}transformer.layer.{{i}}", f"{p}embeddings"
    pairs = [("embed.tok", f"{E}.word_embeddings"), ("embed.absolute", f"{E}.position_embeddings"),
             ("embed.norm", f"{E}.LayerNorm")]  # fmt: skip
    sub = [("attn.q_proj", "attention.q_lin"), ("attn.k_proj", "attention.k_lin"), ("attn.v_proj", "attention.v_lin"),
           ("attn.o_proj", "attention.out_lin"), ("attn_norm", "sa_layer_norm"), ("mlp.up", "ffn.lin1"),
           ("mlp.down", "ffn.lin2"), ("mlp_norm", "output_layer_norm")]  # fmt: skip
    return KeyMap(renamed(pairs + [(f"{L}.{ours}", f"{H}.{theirs}") for ours, theirs in sub]))


DISTILBERT = Family(
    model_type="distilbert",
    architecture="DistilBertModel",
    fields=(
        *shape("dim", "n_layers", "n_heads", "hidden_dim"),
        activation("activation"),
        Field("max_position_embeddings", "max_seq_len", 512),
        *dropouts("dropout"),
        Field("attention_dropout", "attention.dropout", 0.0),
    ),
    keys=keymap,
    fixed={**POST_LN_ENCODER, "block.norm_eps": 1e-12, "positions": Learned()},  # eps hard-coded in transformers
    written={"sinusoidal_pos_embds": False},
    ignored=(r"(distilbert\.)?embeddings\.position_ids", r"vocab_(transform|layer_norm|projector)\..*"),
    generation=None,
)
FAMILIES = (DISTILBERT,)
