"""Mixtral: the Mistral layout (pre-RMSNorm, RoPE, GQA, optional sliding window) with every MLP
an expert MLP: a bias-free router ``block_sparse_moe.gate`` and ``num_local_experts`` SwiGLU
experts ``w1`` (gate), ``w3`` (up), ``w2`` (down), softmax then top-k then renormalised (Jiang
2024, eq. 1-2; transformers' MixtralTopKRouter).

On disk each expert has its own tensors (``experts.{e}.w1.weight`` (F, D) ...); torchformer holds
them batched (``experts.gate`` (E, F, D)); ``expert_rules`` stacks them at load and splits them at
save (the Qwen-MoE and DeepSeek maps use it with their names).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..config import AttentionConfig, ModelConfig, MoE, RoPE
from .hf_config import common_out, swiglu_block, token_ids, unsupported
from .hf_rope import rope_from_hf, rope_to_hf, rope_unfit
from .keymap import KeyMap, Rule, renamed, rule
from .transforms import half_to_interleaved, interleaved_to_half

MODEL_TYPES = ("mixtral",)
IGNORED = (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",)
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")  # the families' spellings


def stack_experts(tensors: list[Tensor]) -> list[Tensor]:
    """E per-expert matrices (F, D) -> one batched (E, F, D)."""
    return [torch.stack(tensors)]


def unstack_experts(tensors: list[Tensor]) -> list[Tensor]:
    """(E, F, D) -> E matrices (F, D), each with its own storage (safetensors refuses shared)."""
    return [t.clone() for t in tensors[0].unbind(0)]


def expert_rules(n_experts: int, ours: str, theirs: str, names: dict[str, str]) -> list[Rule]:
    """Batched ``{ours}.{gate|up|down}`` <-> ``{theirs}.{e}.{name}.weight`` for e < n_experts."""
    return [
        rule(
            f"{ours}.{part}",
            tuple(f"{theirs}.{e}.{name}.weight" for e in range(n_experts)),
            stack_experts,
            unstack_experts,
        )  # fmt: skip
        for part, name in names.items()
    ]


def n_experts_of(hf: dict[str, Any]) -> int | None:
    return next((hf[k] for k in EXPERT_KEYS if hf.get(k)), None)


def attention_rules(cfg: ModelConfig, L: str, H: str) -> list[Rule]:
    """q/k/v/o (weights and biases) and the two block norms of the Llama layout; q/k rows permuted
    for an interleaved-pairing model (HF stores the half-split layout)."""
    rules = []
    for proj, n in (("q_proj", cfg.attention.n_heads), ("k_proj", cfg.n_kv_heads)):
        for s in ("weight", "bias"):
            if cfg.positions.pairing == "interleaved":
                ours = lambda ts, n=n: [half_to_interleaved(ts[0], n)]  # noqa: E731
                theirs = lambda ts, n=n: [interleaved_to_half(ts[0], n)]  # noqa: E731
                rules.append(rule(f"{L}.attn.{proj}.{s}", f"{H}.self_attn.{proj}.{s}", ours, theirs))
            else:
                rules.append(rule(f"{L}.attn.{proj}.{s}", f"{H}.self_attn.{proj}.{s}"))
    pairs = [("attn.v_proj", "self_attn.v_proj"), ("attn.o_proj", "self_attn.o_proj"),
             ("attn_norm", "input_layernorm"), ("mlp_norm", "post_attention_layernorm")]  # fmt: skip
    return rules + renamed((f"{L}.{ours}", f"{H}.{theirs}") for ours, theirs in pairs)


def model_rules() -> list[Rule]:
    return [
        rule("embed.tok.weight", "model.embed_tokens.weight"),
        rule("stack.final_norm.weight", "model.norm.weight"),
        rule("lm_head.weight", "lm_head.weight"),
    ]


def head_dim_of(hf: dict[str, Any]) -> int | None:
    """An explicit head_dim only where it differs from hidden_size / heads (None: derived)."""
    d, n_heads = hf["hidden_size"], hf["num_attention_heads"]
    return hf["head_dim"] if hf.get("head_dim") and hf["head_dim"] * n_heads != d else None


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    problems: list[str] = []
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf.get('hidden_act')!r}: only 'silu' (SwiGLU experts) is supported")
    rope, max_len = rope_from_hf(hf, problems)
    n_experts = n_experts_of(hf)
    if n_experts is None:
        problems.append(f"num_local_experts={n_experts!r}: a Mixtral config needs the expert count")
    unsupported("mixtral", problems)
    d, n_heads = hf["hidden_size"], hf["num_attention_heads"]
    return ModelConfig(
        arch="decoder",
        vocab_size=hf["vocab_size"],
        d_model=d,
        n_layers=hf["num_hidden_layers"],
        max_seq_len=max_len,
        attention=AttentionConfig(
            n_heads=n_heads,
            n_kv_heads=hf.get("num_key_value_heads") or n_heads,
            head_dim=head_dim_of(hf),
            dropout=hf.get("attention_dropout", 0.0),
            sliding_window=hf.get("sliding_window"),
        ),
        block=swiglu_block(hf, 1e-5),
        positions=rope,
        tie_embeddings=hf.get("tie_word_embeddings", False),
        moe=MoE(n_experts=n_experts, top_k=hf.get("num_experts_per_tok", 2), router="softmax", renormalize=True),
        **token_ids(hf, hf["vocab_size"]),
    )


def llama_layout_unfit(cfg: ModelConfig) -> list[str]:
    """What the Llama-layout MoE families (Mixtral, Qwen-MoE) all need."""
    b, a = cfg.block, cfg.attention
    rules = [
        (cfg.arch == "decoder", f"arch={cfg.arch!r} (needs 'decoder')"),
        (b.norm == "rmsnorm" and b.norm_placement == "pre", "needs pre-norm RMSNorm"),
        (b.mlp == "swiglu" and not b.bias, f"block.mlp={b.mlp!r} (needs 'swiglu', no MLP bias)"),
        (isinstance(cfg.positions, RoPE) and cfg.positions.fraction == 1, "needs full-width RoPE"),
        (cfg.has_final_norm, "needs a final norm"),
        (not (cfg.embed_scale or cfg.embed_norm or cfg.final_logits_bias), "no embed_scale/embed_norm/logits bias"),
        (cfg.mla is None, "no latent attention (that is deepseek_v3)"),
        (cfg.moe is not None, "needs moe (experts)"),
        (a.softcap is None and a.scale is None, "no attention softcap/scale"),
    ]
    return [why for ok, why in rules if not ok] + rope_unfit(cfg)


def unfit(cfg: ModelConfig) -> list[str]:
    """Why ``cfg`` cannot be written as a Mixtral checkpoint (empty when it can)."""
    problems = llama_layout_unfit(cfg)
    m, a = cfg.moe, cfg.attention
    if m is not None:
        plain = m.router == "softmax" and m.renormalize and not m.score_bias and m.n_groups == 1
        rules = [
            (plain and m.routed_scale == 1, "needs a softmax router, renormalised, no bias/groups/scale"),
            (m.n_shared == 0, "Mixtral has no shared experts"),
            (m.d_expert is None, "experts as wide as block.d_ff (intermediate_size)"),
            (cfg.layer_kinds is None, "every layer the same (no layer_kinds)"),
            (not a.bias and not a.o_bias and a.qk_norm is None, "no attention biases or QK-norm"),
        ]
        problems += [why for ok, why in rules if not ok]
    return problems


def config_to_hf(cfg: ModelConfig, dtype: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    a = cfg.attention
    out = common_out(cfg, dtype, "mixtral", "MixtralForCausalLM")
    out.update(
        hidden_size=cfg.d_model,
        intermediate_size=cfg.d_ff,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=a.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        hidden_act="silu",
        rms_norm_eps=cfg.block.norm_eps,
        attention_dropout=a.dropout,
        sliding_window=a.sliding_window,
        num_local_experts=cfg.moe.n_experts,
        num_experts_per_tok=cfg.moe.top_k,
        **rope_to_hf(cfg),
    )
    return out, generation_fields(out)


def aliases(cfg: ModelConfig) -> dict[str, str]:
    """Tensors a checkpoint may carry as copies of another (a tied head saved twice)."""
    return {"lm_head.weight": "model.embed_tokens.weight"} if cfg.tie_embeddings else {}


def generation_fields(out: dict[str, Any]) -> dict[str, Any]:
    """generation_config.json: the token ids of config.json."""
    return {k: v for k, v in out.items() if k in ("bos_token_id", "eos_token_id", "pad_token_id")}


def keymap(cfg: ModelConfig, hf_names: list[str] | None = None) -> KeyMap:
    L, H = "stack.blocks.{i}", "model.layers.{i}"
    moe = f"{H}.block_sparse_moe"
    rules = model_rules() + attention_rules(cfg, L, H) + [rule(f"{L}.mlp.router.weight", f"{moe}.gate.weight")]
    names = {"gate": "w1", "up": "w3", "down": "w2"}
    rules += expert_rules(cfg.moe.n_experts, f"{L}.mlp.experts", f"{moe}.experts", names)
    return KeyMap(rules)
