"""Gemma, Gemma 2 and Gemma 3 (text): the Llama layout with Gemma's norms and scales.

All three: RMSNorm times (1 + weight) in fp32 ("rmsnorm_1p"), embeddings times sqrt(hidden_size)
rounded to the weights' dtype, gated tanh-GELU MLP, explicit head_dim, tied head.
- gemma2: four norms per layer (sandwich: post_attention_layernorm is on the attention output
  before the residual add), scores scaled by query_pre_attn_scalar ** -0.5, attention soft-cap
  (attn_logit_softcapping, 50) and final-logit soft-cap (final_logit_softcapping, 30), a sliding
  window on the layers layer_types marks (every other one by default).
- gemma3_text: as gemma2 plus per-head QK-norm, soft-caps off by default, 5 sliding : 1 full
  layers, and a RoPE per layer type (rope_parameters["sliding_attention"] base 10000,
  ["full_attention"] base 1e6, linear scaling on the larger models): two layer kinds.
"""

from __future__ import annotations

from typing import Any

from ..config import AttentionConfig, BlockConfig, ModelConfig, RoPE
from .hf_config import common_out, decoder_sizes, token_ids, unsupported
from .hf_kinds import FULL, SLIDING, kind_fields, layer_types, per_layer, ropes_by_type, windows_to_hf
from .hf_llama import IGNORED, LLAMA_NORMS, layer_keymap  # noqa: F401 (IGNORED: the family's)
from .hf_rope import rope_from_hf, rope_to_hf, rope_unfit
from .keymap import KeyMap

MODEL_TYPES = ("gemma", "gemma2", "gemma3_text")
ARCHITECTURES = {"gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
SOFTCAPS = {"gemma": (None, None), "gemma2": (50.0, 30.0), "gemma3_text": (None, None)}  # HF defaults
PATTERN = {"gemma2": 2, "gemma3_text": 6}  # default layer_types: every n-th layer full, others sliding
MLPS = {"gelu_pytorch_tanh": "geglu_tanh", "gelu_new": "geglu_tanh", "gelu": "geglu"}
SANDWICH = (
    ("attn_norm", "input_layernorm"),
    ("attn_out_norm", "post_attention_layernorm"),
    ("mlp_norm", "pre_feedforward_layernorm"),
    ("mlp_out_norm", "post_feedforward_layernorm"),
)


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    model_type, problems = hf["model_type"], []
    act_key = "hidden_act" if model_type == "gemma" else "hidden_activation"
    act = hf.get(act_key, "gelu_pytorch_tanh")
    if model_type == "gemma" and act == "gelu":  # transformers: a legacy value meaning the tanh form
        act = "gelu_pytorch_tanh"
    if act not in MLPS:
        problems.append(f"{act_key}={act!r}: supported are {sorted(MLPS)}")
    if hf.get("use_bidirectional_attention"):
        problems.append("use_bidirectional_attention=True: only causal Gemma is supported")
    n, d, n_heads = hf["num_hidden_layers"], hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or d // n_heads
    windows, ropes, full_rope, max_len = _layers(hf, model_type, n, problems)
    unsupported(model_type, problems)
    kinds = kind_fields(windows, ropes, full_rope)
    attn_cap, final_cap = (hf.get(k, v) for k, v in zip(("attn_logit_softcapping", "final_logit_softcapping"),
                                                            SOFTCAPS[model_type]))  # fmt: skip
    scalar = hf.get("query_pre_attn_scalar", head_dim) if model_type != "gemma" else head_dim
    return ModelConfig(
        arch="decoder",
        vocab_size=hf["vocab_size"],
        d_model=d,
        n_layers=n,
        max_seq_len=max_len,
        attention=AttentionConfig(
            n_heads=n_heads,
            n_kv_heads=hf.get("num_key_value_heads") or n_heads,
            head_dim=head_dim,
            bias=hf.get("attention_bias", False),
            dropout=hf.get("attention_dropout", 0.0) or 0.0,
            sliding_window=kinds["window"],
            scale=None if scalar == head_dim else scalar**-0.5,  # Gemma 2/3: query_pre_attn_scalar ** -0.5
            softcap=attn_cap,
            qk_norm="head" if model_type == "gemma3_text" else None,
        ),
        block=BlockConfig(
            norm="rmsnorm_1p",
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            norm_placement="pre" if model_type == "gemma" else "sandwich",
            mlp=MLPS.get(act, "geglu_tanh"),
            d_ff=hf["intermediate_size"],
        ),
        positions=kinds["positions"],
        tie_embeddings=hf.get("tie_word_embeddings", True),
        embed_scale=True,
        embed_scale_in_dtype=True,
        final_softcap=final_cap,
        layer_kinds=kinds["layer_kinds"],
        kinds=kinds["kinds"],
        **token_ids(hf, hf["vocab_size"]),
    )


def _layers(hf: dict[str, Any], model_type: str, n: int, problems: list[str]):
    """(each layer's window, each layer's RoPE, the full-attention RoPE, max_seq_len)."""
    if model_type == "gemma":
        rope, max_len = rope_from_hf(hf, problems)
        return [None] * n, [rope] * n, rope, max_len
    default = [FULL if (i + 1) % PATTERN[model_type] == 0 else SLIDING for i in range(n)]
    types = layer_types(hf, n, default, problems)
    windows = [hf.get("sliding_window", 4096) if t == SLIDING else None for t in types]
    if model_type == "gemma2":
        rope, max_len = rope_from_hf(hf, problems)
        return windows, [rope] * n, rope, max_len
    by_type = {}
    for t, theta in ((FULL, 1_000_000.0), (SLIDING, 10_000.0)):  # transformers' Gemma 3 defaults
        params = dict((hf.get("rope_parameters") or {}).get(t) or {"rope_type": "default"})
        params.setdefault("rope_theta", hf.get("rope_theta" if t == FULL else "rope_local_base_freq", theta))
        by_type[t], max_len = rope_from_hf({**hf, "rope_parameters": params}, problems)
    return windows, [by_type[t] for t in types], by_type[FULL], max_len


def model_type_for(cfg: ModelConfig) -> str:
    if cfg.block.norm_placement == "pre":
        return "gemma"
    return "gemma3_text" if cfg.attention.qk_norm == "head" else "gemma2"


def unfit(cfg: ModelConfig) -> list[str]:
    """Why ``cfg`` cannot be written as a Gemma / Gemma 2 / Gemma 3 checkpoint (empty when it can)."""
    b, a, model_type = cfg.block, cfg.attention, model_type_for(cfg)
    layers, problems = per_layer(cfg), []
    windows_to_hf(cfg, problems)
    ropes = ropes_by_type(cfg, problems) if model_type == "gemma3_text" else {}
    rules = [
        (cfg.arch == "decoder", f"arch={cfg.arch!r} (needs 'decoder')"),
        (b.norm == "rmsnorm_1p" and b.norm_placement in ("pre", "sandwich"), "needs rmsnorm_1p, pre or sandwich"),
        (b.mlp in ("geglu_tanh", "geglu") and not b.bias, f"block.mlp={b.mlp!r} (needs geglu_tanh or geglu)"),
        (cfg.embed_scale and cfg.embed_scale_in_dtype and not cfg.embed_norm, "needs Gemma's embedding scale"),
        (cfg.has_final_norm and not cfg.final_logits_bias and cfg.head_scale is None, "a plain head"),
        (a.bias == a.o_bias, "attention_bias covers q/k/v/o"),
        (a.qk_norm == ("head" if model_type == "gemma3_text" else None), f"{model_type}: qk_norm per head or none"),
        (
            model_type != "gemma" or (a.scale is None and a.softcap is None and cfg.final_softcap is None),
            "gemma has no soft-caps or attention scale",
        ),  # fmt: skip
        (model_type != "gemma" or all(k.sliding_window is None for k in layers), "gemma has no sliding window"),
        (all(isinstance(k.rope, RoPE) and k.rope.fraction == 1 for k in layers), "full-width RoPE on every layer"),
        (model_type == "gemma3_text" or all(k.rope == cfg.positions for k in layers), "one RoPE (gemma3 per type)"),
        (model_type != "gemma3_text" or ropes.get(FULL, cfg.positions) == cfg.positions, "positions = full RoPE"),
    ]
    return [why for ok, why in rules if not ok] + problems + rope_unfit(cfg)


def config_to_hf(cfg: ModelConfig, dtype: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    model_type, a = model_type_for(cfg), cfg.attention
    out = common_out(cfg, dtype, model_type, ARCHITECTURES[model_type])
    act = {"geglu_tanh": "gelu_pytorch_tanh", "geglu": "gelu"}[cfg.block.mlp]
    out.update(
        **decoder_sizes(cfg),
        attention_bias=a.bias,
        **rope_to_hf(cfg),
    )
    if model_type == "gemma":
        out.update(hidden_act=act)
    else:
        types, window = windows_to_hf(cfg, [])
        scalar = cfg.head_dim if a.scale is None else a.scale**-2
        out.update(
            hidden_activation=act,
            query_pre_attn_scalar=round(scalar) if abs(scalar - round(scalar)) < 1e-6 else scalar,
            attn_logit_softcapping=a.softcap,
            final_logit_softcapping=cfg.final_softcap,
            sliding_window=window or 4096,
            layer_types=types,
        )
    if model_type == "gemma3_text":
        ropes = ropes_by_type(cfg, [])
        out["rope_parameters"] = {t: rope_to_hf(cfg.replace(positions=r))["rope_parameters"] for t, r in ropes.items()}
    generation = {k: v for k, v in out.items() if k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    return out, generation


def aliases(cfg: ModelConfig) -> dict[str, str]:
    return {"lm_head.weight": "model.embed_tokens.weight"} if cfg.tie_embeddings else {}


def keymap(cfg: ModelConfig, hf_names: list[str] | None = None) -> KeyMap:
    qk = ()
    if cfg.attention.qk_norm == "head":
        if cfg.positions.pairing != "half":
            raise ValueError("rope_pairing='interleaved' is not supported with QK-norm (its weights would permute)")
        qk = (("attn.q_norm.norm", "self_attn.q_norm"), ("attn.k_norm.norm", "self_attn.k_norm"))
    return layer_keymap(cfg, LLAMA_NORMS if cfg.block.norm_placement == "pre" else SANDWICH, qk)
