"""Llama, Mistral and Qwen2: one layout (pre-RMSNorm, RoPE, GQA, SwiGLU) with three switches:
Llama's attention_bias/mlp_bias, Mistral's sliding window, Qwen2's q/k/v bias without an o bias.

RoPE base, scaling (linear, dynamic, llama3, yarn, longrope) and max_position_embeddings are read
and written by hf_rope.py; partial rotary is refused (HF Llama rotates whole heads).
HF stores q/k rows in the half-split RoPE layout; loading with pairing "interleaved" permutes
them (n_heads rows for q, n_kv_heads for k), and exporting permutes them back. Qwen2's
``use_sliding_window`` + ``max_window_layers`` (or ``layer_types``) may window only some layers:
those become layer kinds (hf_kinds.py). ``layer_keymap`` is shared by the Llama-layout families
with other norms (hf_qwen3.py, hf_gemma.py).
"""

from __future__ import annotations

from typing import Any

from ..config import AttentionConfig, ModelConfig, RoPE
from .hf_config import common_out, decoder_sizes, swiglu_block, token_ids, unsupported
from .hf_kinds import SLIDING, kind_fields, layer_types, per_layer, windows_to_hf
from .hf_rope import rope_from_hf, rope_to_hf, rope_unfit
from .keymap import KeyMap, renamed, rule
from .transforms import half_to_interleaved, interleaved_to_half

MODEL_TYPES = ("llama", "mistral", "qwen2")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
IGNORED = (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",)  # a buffer old checkpoints saved


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    model_type, problems = hf["model_type"], []
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf.get('hidden_act')!r}: only 'silu' (SwiGLU) is supported")
    rope, max_len = rope_from_hf(hf, problems)
    if rope.fraction != 1:  # HF Llama ignores it for plain RoPE and cannot run it scaled
        problems.append(f"partial_rotary_factor={rope.fraction!r}: {model_type} rotates whole heads (1.0)")
    windows = _windows(hf, model_type, problems)
    unsupported(model_type, problems)
    kinds = kind_fields(windows, [rope] * len(windows), rope)
    d, n_heads = hf["hidden_size"], hf["num_attention_heads"]
    qkv_bias = {"llama": hf.get("attention_bias", False), "mistral": False, "qwen2": True}[model_type]
    return ModelConfig(
        arch="decoder",
        vocab_size=hf["vocab_size"],
        d_model=d,
        n_layers=hf["num_hidden_layers"],
        max_seq_len=max_len,
        attention=AttentionConfig(
            n_heads=n_heads,
            n_kv_heads=hf.get("num_key_value_heads") or n_heads,
            head_dim=hf.get("head_dim") or d // n_heads,
            bias=qkv_bias,
            out_bias=qkv_bias and model_type == "llama",
            dropout=hf.get("attention_dropout", 0.0),
            sliding_window=kinds["window"],
        ),
        block=swiglu_block(hf, 1e-6, bias=model_type == "llama" and hf.get("mlp_bias", False)),
        positions=rope,
        tie_embeddings=hf.get("tie_word_embeddings", False),
        layer_kinds=kinds["layer_kinds"],
        kinds=kinds["kinds"],
        **token_ids(hf, hf["vocab_size"]),
    )


def _windows(hf: dict[str, Any], model_type: str, problems: list[str]) -> list[int | None]:
    """Each layer's window: Mistral's on all; Qwen2's on the layer_types marked sliding (default:
    layers from max_window_layers up) when use_sliding_window; none otherwise."""
    n = hf["num_hidden_layers"]
    if model_type == "mistral":
        return [hf.get("sliding_window")] * n
    if model_type != "qwen2" or not hf.get("use_sliding_window", False):
        return [None] * n
    default = [SLIDING if i >= hf.get("max_window_layers", n) else "full_attention" for i in range(n)]
    return sliding_windows(hf, layer_types(hf, n, default, problems))


def sliding_windows(hf: dict[str, Any], types: list[str]) -> list[int | None]:
    """The window of each layer type: config.json's sliding_window where it says sliding."""
    on = hf.get("use_sliding_window", True)
    return [hf.get("sliding_window") if t == SLIDING and on else None for t in types]


def model_type_for(cfg: ModelConfig) -> str:
    a = cfg.attention
    if (a.bias and not a.o_bias) or cfg.layer_kinds is not None:
        return "qwen2"  # per-layer windows: only Qwen2's layer_types says them
    return "mistral" if a.sliding_window is not None else "llama"


def unfit(cfg: ModelConfig) -> list[str]:
    """Why ``cfg`` cannot be written as a Llama/Mistral/Qwen2 checkpoint (empty when it can)."""
    b, a, model_type = cfg.block, cfg.attention, model_type_for(cfg)
    rules = [
        (cfg.arch == "decoder", f"arch={cfg.arch!r} (needs 'decoder')"),
        (b.norm == "rmsnorm" and b.norm_placement == "pre", "needs pre-norm RMSNorm"),
        (b.mlp == "swiglu", f"block.mlp={b.mlp!r} (needs 'swiglu')"),
        (isinstance(cfg.positions, RoPE), f"positions={cfg.positions!r} (needs RoPE)"),
        (not isinstance(cfg.positions, RoPE) or cfg.positions.fraction == 1, "needs full-width RoPE (fraction 1.0)"),
        (cfg.has_final_norm, "needs a final norm"),
        (not (cfg.embed_scale or cfg.embed_norm or cfg.final_logits_bias), "no embed_scale/embed_norm/logits bias"),
        (not (a.o_bias and not a.bias), "an output bias needs q/k/v biases too"),
        (model_type == "llama" or not b.bias, f"{model_type} has no MLP bias"),
        (model_type != "mistral" or not a.bias, "mistral has no attention bias"),
        (model_type != "qwen2" or (a.bias and not a.o_bias), "per-layer windows need Qwen2's q/k/v-only biases"),
    ]
    return [why for ok, why in rules if not ok] + plain_llama_unfit(cfg) + rope_unfit(cfg)


def plain_llama_unfit(cfg: ModelConfig) -> list[str]:
    """The axes the Llama layout has none of (QK-norm, soft-caps, scales, RoPE per layer)."""
    a, problems = cfg.attention, []
    rules = [
        (a.qk_norm is None, f"attention.qk_norm={a.qk_norm!r} (qwen3, olmo2, gemma3_text have it)"),
        (a.softcap is None and cfg.final_softcap is None, "no soft-capping (gemma2 has it)"),
        (a.scale is None and cfg.head_scale is None, "no attention.scale / head_scale override"),
    ]
    if cfg.layer_kinds is not None:
        windows_to_hf(cfg, problems)
        if any(k.rope != cfg.positions for k in per_layer(cfg)):
            problems.append("a layer kind with its own RoPE or NoPE (smollm3, gemma3_text have them)")
    return [why for ok, why in rules if not ok] + problems


def config_to_hf(cfg: ModelConfig, dtype: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    model_type, a = model_type_for(cfg), cfg.attention
    out = common_out(cfg, dtype, model_type, ARCHITECTURES[model_type])
    out.update(
        **decoder_sizes(cfg),
        hidden_act="silu",
        **rope_to_hf(cfg),  # rope_theta (read by transformers 4.x), rope_parameters, max_position_embeddings
    )
    if model_type == "llama":
        out.update(attention_bias=a.bias, mlp_bias=cfg.block.bias)
    elif model_type == "mistral":
        out.update(sliding_window=a.sliding_window)
    else:
        types, window = windows_to_hf(cfg, [])
        out.update(
            use_sliding_window=window is not None,
            sliding_window=window,
            max_window_layers=types.index(SLIDING) if SLIDING in types else cfg.n_layers,
            layer_types=types,
        )
    generation = {k: v for k, v in out.items() if k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    return out, generation


def aliases(cfg: ModelConfig) -> dict[str, str]:
    """Tensors a checkpoint may carry as copies of another (a tied head saved twice)."""
    return {"lm_head.weight": "model.embed_tokens.weight"} if cfg.tie_embeddings else {}


LLAMA_NORMS = (("attn_norm", "input_layernorm"), ("mlp_norm", "post_attention_layernorm"))


def keymap(cfg: ModelConfig, hf_names: list[str] | None = None) -> KeyMap:
    return layer_keymap(cfg, LLAMA_NORMS)


def layer_keymap(cfg: ModelConfig, norms: tuple[tuple[str, str], ...], extra: tuple = ()) -> KeyMap:
    """The Llama layout with the family's per-layer norms (ours, theirs) and extra pairs."""
    L, H = "stack.blocks.{i}", "model.layers.{i}"
    rules = [
        rule("embed.tok.weight", "model.embed_tokens.weight"),
        rule("stack.final_norm.weight", "model.norm.weight"),
        rule("lm_head.weight", "lm_head.weight"),
    ]
    for proj, n in (("q_proj", cfg.attention.n_heads), ("k_proj", cfg.n_kv_heads)):
        for s in ("weight", "bias"):
            if cfg.positions.pairing == "interleaved":
                ours = lambda ts, n=n: [half_to_interleaved(ts[0], n)]  # noqa: E731
                theirs = lambda ts, n=n: [interleaved_to_half(ts[0], n)]  # noqa: E731
                rules.append(rule(f"{L}.attn.{proj}.{s}", f"{H}.self_attn.{proj}.{s}", ours, theirs))
            else:
                rules.append(rule(f"{L}.attn.{proj}.{s}", f"{H}.self_attn.{proj}.{s}"))
    pairs = [
        ("attn.v_proj", "self_attn.v_proj"),
        ("attn.o_proj", "self_attn.o_proj"),
        *norms,
        *extra,
        ("mlp.gate", "mlp.gate_proj"),
        ("mlp.up", "mlp.up_proj"),
        ("mlp.down", "mlp.down_proj"),
    ]
    return KeyMap(rules + renamed((f"{L}.{ours}", f"{H}.{theirs}") for ours, theirs in pairs))
