"""GPT-2: pre-LN LayerNorm with biases, learned positions, gelu-tanh ("gelu_new"), tied head.

HF keeps OpenAI's Conv1D weights, (in, out), so every matrix is transposed, and q|k|v are one
fused ``c_attn`` split along its output dimension. GPT2LMHeadModel checkpoints prefix the body
with ``transformer.``; GPT2Model ones (like the original ``gpt2`` upload) do not.
"""

from __future__ import annotations

from typing import Any

from ..config import AttentionConfig, BlockConfig, Learned, ModelConfig
from .hf_config import HF_ACTIVATIONS, activation, biased_layernorm_rules, common_out, token_ids, unsupported
from .keymap import KeyMap, renamed, rule
from .transforms import fuse_rows, split_rows, transpose

MODEL_TYPES = ("gpt2",)
# Causal-mask buffers older transformers saved; they follow from the config.
IGNORED = (r"(transformer\.)?h\.\d+\.attn\.(masked_)?bias",)


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    problems: list[str] = []
    mlp = activation(hf, "activation_function", problems)
    if not hf.get("scale_attn_weights", True):
        problems.append("scale_attn_weights=False: scores are always scaled by 1/sqrt(head_dim)")
    if hf.get("scale_attn_by_inverse_layer_idx", False):
        problems.append("scale_attn_by_inverse_layer_idx=True is not supported")
    if hf.get("add_cross_attention", False):
        problems.append("add_cross_attention=True is not supported")
    unsupported("gpt2", problems)
    d, vocab = hf["n_embd"], hf["vocab_size"]
    return ModelConfig(
        arch="decoder",
        vocab_size=vocab,
        d_model=d,
        n_layers=hf["n_layer"],
        max_seq_len=hf.get("n_positions", 1024),
        attention=AttentionConfig(n_heads=hf["n_head"], bias=True, dropout=hf.get("attn_pdrop", 0.0)),
        block=BlockConfig(
            norm="layernorm",
            norm_eps=hf.get("layer_norm_epsilon", 1e-5),
            norm_placement="pre",
            mlp=mlp,
            d_ff=hf.get("n_inner") or 4 * d,
            bias=True,
            dropout=hf.get("resid_pdrop", 0.0),
        ),
        positions=Learned(),
        tie_embeddings=hf.get("tie_word_embeddings", True),
        dropout=hf.get("embd_pdrop", 0.0),
        **token_ids(hf, vocab),
    )


def unfit(cfg: ModelConfig) -> list[str]:
    a = cfg.attention
    rules = [
        (cfg.arch == "decoder", f"arch={cfg.arch!r} (needs 'decoder')"),
        (isinstance(cfg.positions, Learned) and cfg.positions.offset == 0, "needs Learned() positions"),
        (a.sliding_window is None, "has no sliding window"),
        (cfg.has_final_norm, "needs a final norm"),
        (not (cfg.embed_scale or cfg.embed_norm or cfg.final_logits_bias), "no embed_scale/embed_norm/logits bias"),
    ]
    rules += biased_layernorm_rules(cfg, "pre")
    return [why for ok, why in rules if not ok]


def config_to_hf(cfg: ModelConfig, dtype: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    out = common_out(cfg, dtype, "gpt2", "GPT2LMHeadModel")
    out.update(
        n_embd=cfg.d_model,
        n_layer=cfg.n_layers,
        n_head=cfg.attention.n_heads,
        n_positions=cfg.max_seq_len,
        n_inner=cfg.d_ff,
        activation_function=HF_ACTIVATIONS[cfg.block.mlp],
        layer_norm_epsilon=cfg.block.norm_eps,
        attn_pdrop=cfg.attention.dropout,
        resid_pdrop=cfg.block.dropout,
        embd_pdrop=cfg.dropout,
        scale_attn_weights=True,
    )
    generation = {k: v for k, v in out.items() if k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    return out, generation


def aliases(cfg: ModelConfig) -> dict[str, str]:
    return {"lm_head.weight": "transformer.wte.weight"} if cfg.tie_embeddings else {}


def keymap(cfg: ModelConfig, hf_names: list[str] | None = None) -> KeyMap:
    body = "" if hf_names is not None and "wte.weight" in hf_names else "transformer."
    L, H = "stack.blocks.{i}", f"{body}h.{{i}}"
    d = cfg.d_model
    qkv = tuple(f"{L}.attn.{p}_proj" for p in "qkv")
    rules = [
        rule("embed.tok.weight", f"{body}wte.weight"),
        rule("embed.absolute.weight", f"{body}wpe.weight"),
        rule("lm_head.weight", "lm_head.weight"),
        rule(
            tuple(f"{n}.weight" for n in qkv),
            f"{H}.attn.c_attn.weight",
            lambda ts: split_rows(transpose(ts[0]), [d, d, d]),
            lambda ts: [transpose(fuse_rows(ts))],
        ),
        rule(
            tuple(f"{n}.bias" for n in qkv),
            f"{H}.attn.c_attn.bias",
            lambda ts: split_rows(ts[0], [d, d, d]),
            lambda ts: [fuse_rows(ts)],
        ),
    ]
    conv1d = [("attn.o_proj", "attn.c_proj"), ("mlp.up", "mlp.c_fc"), ("mlp.down", "mlp.c_proj")]
    for ours, theirs in conv1d:
        both = lambda ts: [transpose(ts[0])]  # noqa: E731
        rules.append(rule(f"{L}.{ours}.weight", f"{H}.{theirs}.weight", both, both))
        rules.append(rule(f"{L}.{ours}.bias", f"{H}.{theirs}.bias"))
    norms = [(f"{L}.attn_norm", f"{H}.ln_1"), (f"{L}.mlp_norm", f"{H}.ln_2"), ("stack.final_norm", f"{body}ln_f")]
    return KeyMap(rules + renamed(norms))
