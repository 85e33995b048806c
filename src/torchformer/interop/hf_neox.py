"""GPT-NeoX (Pythia): pre-LN LayerNorm with biases, partial rotary, parallel residual, untied head.

Each layer computes x + attn(ln1 x) + mlp(ln2 x) (``use_parallel_residual``, the default; False is
the sequential pre-norm block). RoPE turns the first ``rotary_pct`` (transformers 5:
``rope_parameters.partial_rotary_factor``, default 0.25) of each head in the half-split layout.
``query_key_value`` fuses q, k and v head by head ([q_h; k_h; v_h] for every head h), which the
transforms split and fuse. The head is ``embed_out`` in published checkpoints; transformers 5
renames it to ``lm_head`` on load, and either name loads here.
"""

from __future__ import annotations

from typing import Any

from ..config import AttentionConfig, BlockConfig, ModelConfig, RoPE
from .hf_config import HF_ACTIVATIONS, activation, common_out, token_ids, unsupported
from .hf_rope import rope_from_hf, rope_to_hf, rope_unfit
from .keymap import KeyMap, renamed, rule
from .transforms import fuse_head_interleaved, split_head_interleaved

MODEL_TYPES = ("gpt_neox",)
# Causal-mask and rotary buffers older transformers saved; they follow from the config.
IGNORED = (r"gpt_neox\.layers\.\d+\.attention\.(bias|masked_bias|rotary_emb\.inv_freq)",)
PLACEMENTS = {True: "parallel", False: "pre"}  # use_parallel_residual -> block.norm_placement


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    problems: list[str] = []
    mlp = activation(hf, "hidden_act", problems)
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    # 4.x names: rotary_pct and rotary_emb_base; HF's default fraction for NeoX is 0.25, not 1.
    params.setdefault("partial_rotary_factor", hf.get("rotary_pct", 0.25))
    params.setdefault("rope_theta", hf.get("rotary_emb_base", 10000.0))
    rope, max_len = rope_from_hf(dict(hf, rope_parameters=params), problems)
    if hf.get("add_cross_attention", False):
        problems.append("add_cross_attention=True is not supported")
    unsupported("gpt_neox", problems)
    vocab, bias, dropout = hf["vocab_size"], hf.get("attention_bias", True), hf.get("hidden_dropout", 0.0)
    return ModelConfig(
        arch="decoder",
        vocab_size=vocab,
        d_model=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        max_seq_len=max_len,
        attention=AttentionConfig(
            n_heads=hf["num_attention_heads"], bias=bias, dropout=hf.get("attention_dropout", 0.0)
        ),
        block=BlockConfig(
            norm="layernorm",
            norm_eps=hf.get("layer_norm_eps", 1e-5),
            norm_placement=PLACEMENTS[bool(hf.get("use_parallel_residual", True))],
            mlp=mlp,
            d_ff=hf["intermediate_size"],
            bias=True,  # GPTNeoXMLP's linears always have biases
            dropout=dropout,
        ),
        positions=rope,
        tie_embeddings=hf.get("tie_word_embeddings", False),
        dropout=dropout,
        **token_ids(hf, vocab),
    )


def unfit(cfg: ModelConfig) -> list[str]:
    """Why ``cfg`` cannot be written as a GPT-NeoX checkpoint (empty when it can)."""
    a, b, pos = cfg.attention, cfg.block, cfg.positions
    rules = [
        (cfg.arch == "decoder", f"arch={cfg.arch!r} (needs 'decoder')"),
        (b.norm == "layernorm" and b.norm_bias, "needs LayerNorm with bias"),
        (b.norm_placement in PLACEMENTS.values(), f"block.norm_placement={b.norm_placement!r} (needs parallel/pre)"),
        (b.mlp in HF_ACTIVATIONS, f"block.mlp={b.mlp!r} (needs one of {sorted(HF_ACTIVATIONS)})"),
        (b.bias and a.bias == a.o_bias, "needs MLP biases, and q/k/v and output biases alike"),
        (isinstance(pos, RoPE) and pos.pairing == "half", f"positions={pos!r} (needs half-split RoPE)"),
        (cfg.n_kv_heads == a.n_heads and cfg.head_dim * a.n_heads == cfg.d_model, "needs n_heads * head_dim = d_model"),
        (a.sliding_window is None and a.scale is None and a.softcap is None, "no window, scale or soft-cap"),
        (cfg.has_final_norm, "needs a final norm"),
        (not (cfg.embed_scale or cfg.embed_norm or cfg.final_logits_bias), "no embed_scale/embed_norm/logits bias"),
    ]
    return [why for ok, why in rules if not ok] + (rope_unfit(cfg) if isinstance(pos, RoPE) else [])


def config_to_hf(cfg: ModelConfig, dtype: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    out = common_out(cfg, dtype, "gpt_neox", "GPTNeoXForCausalLM")
    rope = rope_to_hf(cfg)
    rope["rope_parameters"]["partial_rotary_factor"] = cfg.positions.fraction  # HF's default is 0.25
    out.update(
        hidden_size=cfg.d_model,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.attention.n_heads,
        intermediate_size=cfg.d_ff,
        hidden_act=HF_ACTIVATIONS[cfg.block.mlp],
        layer_norm_eps=cfg.block.norm_eps,
        use_parallel_residual=cfg.block.norm_placement == "parallel",
        attention_bias=cfg.attention.bias,
        attention_dropout=cfg.attention.dropout,
        hidden_dropout=cfg.block.dropout,
        rotary_pct=cfg.positions.fraction,  # read by transformers 4.x
        rotary_emb_base=cfg.positions.base,
        **rope,
    )
    generation = {k: v for k, v in out.items() if k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    return out, generation


def aliases(cfg: ModelConfig) -> dict[str, str]:
    tied = {name: "gpt_neox.embed_in.weight" for name in ("embed_out.weight", "lm_head.weight")}
    return tied if cfg.tie_embeddings else {}


def keymap(cfg: ModelConfig, hf_names: list[str] | None = None) -> KeyMap:
    if isinstance(cfg.positions, RoPE) and cfg.positions.pairing != "half":
        raise ValueError("rope_pairing='interleaved' is not supported for gpt_neox (partial half-split rotary)")
    head = "lm_head.weight" if hf_names is not None and "lm_head.weight" in hf_names else "embed_out.weight"
    L, H, n = "stack.blocks.{i}", "gpt_neox.layers.{i}", cfg.attention.n_heads
    qkv = tuple(f"{L}.attn.{p}_proj" for p in "qkv")
    rules = [
        rule("embed.tok.weight", "gpt_neox.embed_in.weight"),
        rule("lm_head.weight", head),
        *(
            rule(
                tuple(f"{name}.{s}" for name in qkv),
                f"{H}.attention.query_key_value.{s}",
                lambda ts: split_head_interleaved(ts[0], n),
                lambda ts: [fuse_head_interleaved(ts, n)],
            )
            for s in ("weight", "bias")
        ),
    ]
    pairs = [
        (f"{L}.attn.o_proj", f"{H}.attention.dense"),
        (f"{L}.attn_norm", f"{H}.input_layernorm"),
        (f"{L}.mlp_norm", f"{H}.post_attention_layernorm"),
        (f"{L}.mlp.up", f"{H}.mlp.dense_h_to_4h"),
        (f"{L}.mlp.down", f"{H}.mlp.dense_4h_to_h"),
        ("stack.final_norm", "gpt_neox.final_layer_norm"),
    ]
    return KeyMap(rules + renamed(pairs))
