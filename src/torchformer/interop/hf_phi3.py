"""Phi-3 (and Phi-4-mini): the Llama layout (pre-RMSNorm, RoPE, GQA, SwiGLU, no biases) with
fused projections: ``qkv_proj`` is [Q; K; V] along its rows (n_heads, then n_kv_heads, then
n_kv_heads heads of head_dim) and ``gate_up_proj`` is [gate; up]; the transforms split and fuse
them. RoPE may be longrope (the 128k checkpoints: short/long factor lists chosen by the current
length) and partial (Phi-4-mini partial_rotary_factor 0.75); hf_rope.py reads and writes it.
``sliding_window`` (Phi-3-mini-4k: 2047) applies to every layer.
"""

from __future__ import annotations

from typing import Any

from ..config import AttentionConfig, LongRoPE, ModelConfig, RoPE
from .hf_config import common_out, swiglu_block, token_ids, unsupported
from .hf_rope import rope_from_hf, rope_to_hf, rope_unfit
from .keymap import KeyMap, renamed, rule
from .transforms import fuse_rows, split_rows

MODEL_TYPES = ("phi3",)
IGNORED = (r"model\.layers\.\d+\.self_attn\.rotary_emb\.(inv_freq|long_inv_freq)",)


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    problems: list[str] = []
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf.get('hidden_act')!r}: only 'silu' (SwiGLU) is supported")
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    if params.get("rope_type", params.get("type")) in ("su", "yarn"):  # Phi-3's early names for longrope
        params["rope_type"] = "longrope"
    if "original_max_position_embeddings" in hf:  # Phi-3 keeps it at the top level
        params.setdefault("original_max_position_embeddings", hf["original_max_position_embeddings"])
    rope, max_len = rope_from_hf(dict(hf, rope_parameters=params), problems)
    if rope.scaling is not None and not isinstance(rope.scaling, LongRoPE):
        problems.append(f"rope_parameters.rope_type={params.get('rope_type')!r}: Phi-3 has 'default' or 'longrope'")
    unsupported("phi3", problems)
    d, n_heads, vocab = hf["hidden_size"], hf["num_attention_heads"], hf["vocab_size"]
    return ModelConfig(
        arch="decoder",
        vocab_size=vocab,
        d_model=d,
        n_layers=hf["num_hidden_layers"],
        max_seq_len=max_len,
        attention=AttentionConfig(
            n_heads=n_heads,
            n_kv_heads=hf.get("num_key_value_heads") or n_heads,
            head_dim=hf.get("head_dim") if hf.get("head_dim", d // n_heads) != d // n_heads else None,
            dropout=hf.get("attention_dropout", 0.0),
            sliding_window=hf.get("sliding_window"),
        ),
        block=swiglu_block(hf, 1e-5, dropout=hf.get("resid_pdrop", 0.0)),
        positions=rope,
        tie_embeddings=hf.get("tie_word_embeddings", False),
        dropout=hf.get("embd_pdrop", 0.0),
        **token_ids(hf, vocab),
    )


def unfit(cfg: ModelConfig) -> list[str]:
    """Why ``cfg`` cannot be written as a Phi-3 checkpoint (empty when it can)."""
    a, b, pos = cfg.attention, cfg.block, cfg.positions
    rules = [
        (cfg.arch == "decoder", f"arch={cfg.arch!r} (needs 'decoder')"),
        (b.norm == "rmsnorm" and b.norm_placement == "pre", "needs pre-norm RMSNorm"),
        (b.mlp == "swiglu", f"block.mlp={b.mlp!r} (needs 'swiglu')"),
        (not (a.bias or a.o_bias or b.bias), "has no biases"),
        (isinstance(pos, RoPE) and pos.pairing == "half", f"positions={pos!r} (needs half-split RoPE)"),
        (
            not isinstance(pos, RoPE) or pos.scaling is None or isinstance(pos.scaling, LongRoPE),
            "RoPE scaling must be none or longrope",
        ),
        (a.scale is None and a.softcap is None, "no attention scale or soft-cap"),
        (cfg.has_final_norm, "needs a final norm"),
        (not (cfg.embed_scale or cfg.embed_norm or cfg.final_logits_bias), "no embed_scale/embed_norm/logits bias"),
    ]
    return [why for ok, why in rules if not ok] + (rope_unfit(cfg) if isinstance(pos, RoPE) else [])


def config_to_hf(cfg: ModelConfig, dtype: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    a, b = cfg.attention, cfg.block
    out = common_out(cfg, dtype, "phi3", "Phi3ForCausalLM")
    rope = rope_to_hf(cfg)
    params = rope["rope_parameters"]
    params["partial_rotary_factor"] = cfg.positions.fraction
    out.update(
        hidden_size=cfg.d_model,
        intermediate_size=cfg.d_ff,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=a.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        hidden_act="silu",
        rms_norm_eps=b.norm_eps,
        attention_dropout=a.dropout,
        resid_pdrop=b.dropout,
        embd_pdrop=cfg.dropout,
        sliding_window=a.sliding_window,
        original_max_position_embeddings=params.get("original_max_position_embeddings", cfg.max_seq_len),
        **rope,
    )
    if cfg.head_dim * a.n_heads != cfg.d_model:
        out["head_dim"] = cfg.head_dim
    # Phi3Config defaults pad_token_id to 32000, which a small vocabulary does not have.
    out.setdefault("pad_token_id", None)
    generation = {k: v for k, v in out.items() if k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    return out, generation


def aliases(cfg: ModelConfig) -> dict[str, str]:
    return {"lm_head.weight": "model.embed_tokens.weight"} if cfg.tie_embeddings else {}


def keymap(cfg: ModelConfig, hf_names: list[str] | None = None) -> KeyMap:
    if isinstance(cfg.positions, RoPE) and cfg.positions.pairing != "half":
        raise ValueError("rope_pairing='interleaved' is not supported for phi3 (fused qkv_proj, half-split rotary)")
    L, H = "stack.blocks.{i}", "model.layers.{i}"
    e, f = cfg.head_dim, cfg.d_ff
    qkv = [cfg.attention.n_heads * e, cfg.n_kv_heads * e, cfg.n_kv_heads * e]
    rules = [
        rule("embed.tok.weight", "model.embed_tokens.weight"),
        rule("stack.final_norm.weight", "model.norm.weight"),
        rule("lm_head.weight", "lm_head.weight"),
        rule(
            tuple(f"{L}.attn.{p}_proj.weight" for p in "qkv"),
            f"{H}.self_attn.qkv_proj.weight",
            lambda ts: split_rows(ts[0], qkv),
            lambda ts: [fuse_rows(ts)],
        ),
        rule(
            (f"{L}.mlp.gate.weight", f"{L}.mlp.up.weight"),
            f"{H}.mlp.gate_up_proj.weight",
            lambda ts: split_rows(ts[0], [f, f]),
            lambda ts: [fuse_rows(ts)],
        ),
    ]
    pairs = [
        (f"{L}.attn.o_proj", f"{H}.self_attn.o_proj"),
        (f"{L}.attn_norm", f"{H}.input_layernorm"),
        (f"{L}.mlp_norm", f"{H}.post_attention_layernorm"),
        (f"{L}.mlp.down", f"{H}.mlp.down_proj"),
    ]
    return KeyMap(rules + renamed(pairs, ("weight",)))
