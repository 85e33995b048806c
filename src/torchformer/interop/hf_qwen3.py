"""Qwen3, SmolLM3 and OLMo 2: the Llama layout (RMSNorm, RoPE, GQA, SwiGLU) with one twist each.

- qwen3: per-head RMSNorm on q and k before RoPE (q_norm/k_norm of head_dim entries), explicit
  head_dim, per-layer sliding windows through layer_types (use_sliding_window).
- smollm3: NoPE on the layers ``no_rope_layers`` marks 0 (every 4th by default): a layer kind with
  rope None; sliding windows only on NoPE layers (layer_types).
- olmo2: no norm before the sublayers; a norm on each sublayer's output before the residual add
  (post_attention_layernorm, post_feedforward_layernorm: placement "output"), and RMSNorm over
  the whole q and k width (q_norm of n_heads * head_dim entries).
"""

from __future__ import annotations

from typing import Any

from ..config import AttentionConfig, BlockConfig, ModelConfig, RoPE
from .hf_config import common_out, decoder_sizes, token_ids, unsupported
from .hf_kinds import FULL, SLIDING, kind_fields, layer_types, per_layer, windows_to_hf
from .hf_llama import IGNORED, LLAMA_NORMS, layer_keymap, sliding_windows  # noqa: F401 (IGNORED: the family's)
from .hf_rope import rope_from_hf, rope_to_hf, rope_unfit
from .keymap import KeyMap

MODEL_TYPES = ("qwen3", "smollm3", "olmo2")
ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "smollm3": "SmolLM3ForCausalLM", "olmo2": "Olmo2ForCausalLM"}
QK_NORM = {"qwen3": "head", "smollm3": None, "olmo2": "width"}
PLACEMENT = {"qwen3": "pre", "smollm3": "pre", "olmo2": "output"}
TIED = {"qwen3": False, "smollm3": True, "olmo2": False}  # transformers' defaults when absent


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    model_type, problems = hf["model_type"], []
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf.get('hidden_act')!r}: only 'silu' (SwiGLU) is supported")
    rope, max_len = rope_from_hf(hf, problems)
    if rope.fraction != 1:
        problems.append(f"partial_rotary_factor={rope.fraction!r}: {model_type} rotates whole heads (1.0)")
    n = hf["num_hidden_layers"]
    windows, ropes = _layers(hf, model_type, n, rope, problems)
    unsupported(model_type, problems)
    kinds = kind_fields(windows, ropes, rope)
    d, n_heads = hf["hidden_size"], hf["num_attention_heads"]
    return ModelConfig(
        arch="decoder",
        vocab_size=hf["vocab_size"],
        d_model=d,
        n_layers=n,
        max_seq_len=max_len,
        attention=AttentionConfig(
            n_heads=n_heads,
            n_kv_heads=hf.get("num_key_value_heads") or n_heads,
            head_dim=hf.get("head_dim") or d // n_heads,
            bias=hf.get("attention_bias", False),
            dropout=hf.get("attention_dropout", 0.0),
            sliding_window=kinds["window"],
            qk_norm=QK_NORM[model_type],
        ),
        block=BlockConfig(
            norm="rmsnorm",
            norm_eps=hf.get("rms_norm_eps", 1e-5 if model_type == "olmo2" else 1e-6),
            norm_placement=PLACEMENT[model_type],
            mlp="swiglu",
            d_ff=hf["intermediate_size"],
            bias=model_type == "smollm3" and hf.get("mlp_bias", False),
        ),
        positions=kinds["positions"],
        tie_embeddings=hf.get("tie_word_embeddings", TIED[model_type]),
        layer_kinds=kinds["layer_kinds"],
        kinds=kinds["kinds"],
        **token_ids(hf, hf["vocab_size"]),
    )


def _layers(hf, model_type: str, n: int, rope: RoPE, problems: list[str]) -> tuple[list, list]:
    """Each layer's (window, RoPE or None) as transformers builds them."""
    if model_type == "olmo2":
        return [None] * n, [rope] * n
    if model_type == "qwen3":
        default = [SLIDING if i >= hf.get("max_window_layers", n) else FULL for i in range(n)]
        return sliding_windows(hf, layer_types(hf, n, default, problems)), [rope] * n
    interval = hf.get("no_rope_layer_interval", 4)
    uses = hf.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)]
    if len(uses) != n:
        problems.append(f"no_rope_layers={uses}: must have num_hidden_layers={n} entries")
        uses = [1] * n
    default = [SLIDING if hf.get("use_sliding_window") and not u else FULL for u in uses]
    types = layer_types(hf, n, default, problems)
    return sliding_windows({**hf, "use_sliding_window": hf.get("use_sliding_window", False)}, types), [
        rope if u else None for u in uses
    ]


def model_type_for(cfg: ModelConfig) -> str:
    if cfg.block.norm_placement == "output":
        return "olmo2"
    return "qwen3" if cfg.attention.qk_norm == "head" else "smollm3"


def unfit(cfg: ModelConfig) -> list[str]:
    """Why ``cfg`` cannot be written as a Qwen3 / SmolLM3 / OLMo 2 checkpoint (empty when it can)."""
    b, a, model_type = cfg.block, cfg.attention, model_type_for(cfg)
    layers = per_layer(cfg)
    nope = any(k.rope is None for k in layers)
    problems: list[str] = []
    windows_to_hf(cfg, problems)
    rules = [
        (cfg.arch == "decoder", f"arch={cfg.arch!r} (needs 'decoder')"),
        (b.norm == "rmsnorm" and b.norm_placement == PLACEMENT[model_type], "needs RMSNorm, pre (or output: olmo2)"),
        (b.mlp == "swiglu", f"block.mlp={b.mlp!r} (needs 'swiglu')"),
        (isinstance(cfg.positions, RoPE) and cfg.positions.fraction == 1, "needs full-width RoPE positions"),
        (a.qk_norm == QK_NORM[model_type], f"{model_type} needs attention.qk_norm={QK_NORM[model_type]!r}"),
        (model_type == "smollm3" or not nope, f"{model_type} has no NoPE layers"),
        (model_type != "smollm3" or nope, "smollm3 needs NoPE layers (qwen3/llama otherwise)"),
        (all(k.rope in (None, cfg.positions) for k in layers), "one RoPE for all rotating layers"),
        (model_type != "olmo2" or all(k.sliding_window is None for k in layers), "olmo2 has no sliding window"),
        (
            model_type != "smollm3" or all(k.sliding_window is None or k.rope is None for k in layers),
            "smollm3 windows only NoPE layers",
        ),  # fmt: skip
        (cfg.has_final_norm and not (cfg.embed_scale or cfg.embed_norm or cfg.final_logits_bias), "plain embeddings"),
        (a.bias == a.o_bias and (model_type == "smollm3" or not b.bias), "attention_bias covers q/k/v/o; no MLP bias"),
        (
            a.softcap is None and a.scale is None and cfg.final_softcap is None and cfg.head_scale is None,
            "no soft-caps or scale overrides",
        ),  # fmt: skip
    ]
    rope = rope_unfit(cfg) if isinstance(cfg.positions, RoPE) else []
    return [why for ok, why in rules if not ok] + problems + rope


def config_to_hf(cfg: ModelConfig, dtype: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    model_type, a = model_type_for(cfg), cfg.attention
    out = common_out(cfg, dtype, model_type, ARCHITECTURES[model_type])
    out.update(
        **decoder_sizes(cfg),
        hidden_act="silu",
        attention_bias=a.bias,
        **rope_to_hf(cfg),
    )
    if model_type != "olmo2":
        types, window = windows_to_hf(cfg, [])
        out.update(use_sliding_window=window is not None, sliding_window=window, layer_types=types)
    if model_type == "qwen3":
        out.update(max_window_layers=types.index(SLIDING) if SLIDING in types else cfg.n_layers)
    if model_type == "smollm3":
        out.update(no_rope_layers=[int(k.rope is not None) for k in per_layer(cfg)], mlp_bias=cfg.block.bias)
    generation = {k: v for k, v in out.items() if k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    return out, generation


def aliases(cfg: ModelConfig) -> dict[str, str]:
    return {"lm_head.weight": "model.embed_tokens.weight"} if cfg.tie_embeddings else {}


def keymap(cfg: ModelConfig, hf_names: list[str] | None = None) -> KeyMap:
    qk = {
        "head": (("attn.q_norm.norm", "self_attn.q_norm"), ("attn.k_norm.norm", "self_attn.k_norm")),
        "width": (("attn.q_norm", "self_attn.q_norm"), ("attn.k_norm", "self_attn.k_norm")),
        None: (),
    }[cfg.attention.qk_norm]
    if cfg.attention.qk_norm is not None and cfg.positions.pairing != "half":
        raise ValueError("rope_pairing='interleaved' is not supported with QK-norm (the norm weights would permute)")
    olmo = (("attn_out_norm", "post_attention_layernorm"), ("mlp_out_norm", "post_feedforward_layernorm"))
    return layer_keymap(cfg, olmo if cfg.block.norm_placement == "output" else LLAMA_NORMS, qk)
