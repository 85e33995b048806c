"""The layouts several families share, each written once: the Llama trunk (its config.json keys
and tensor names, the q/k row permutation), RoPE and per-layer settings as rules, stacked experts
and dense-or-expert layers, and BERT's encoder. The families reference these; none imports another.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ..configs import LayerKind, ModelConfig, RoPE
from ..models.kinds import resolve_kinds
from .family import OMIT, Family, Field, Rule
from .hf_config import ACTIVATIONS, HF_ACTIVATIONS
from .hf_kinds import FULL, SLIDING, kind_fields, layer_types, per_layer, windows_to_hf
from .hf_rope import rope_from_hf, rope_to_hf, rope_unfit
from .keymap import KeyMap, renamed, rule
from .keymap import Rule as KeyRule
from .transforms import half_to_interleaved, interleaved_to_half

L, H = "stack.blocks.{i}", "model.layers.{i}"  # our layer prefix, the Llama layout's
ROTARY_BUFFER = r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq"  # a buffer old checkpoints saved
PAIRINGS = ("half", "interleaved")
LLAMA_NORMS = (("attn_norm", "input_layernorm"), ("mlp_norm", "post_attention_layernorm"))
SWIGLU_NAMES = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


def heads(hf: dict[str, Any]) -> int:
    return hf["num_attention_heads"]


def head_width(hf: dict[str, Any]) -> int:
    return hf["hidden_size"] // hf["num_attention_heads"]


def only_if_not_derived(value: int | None, hf: dict[str, Any]) -> int | None:
    """head_dim as stored where it differs from hidden_size / heads; None (derived) otherwise."""
    return value if value and value * hf["num_attention_heads"] != hf["hidden_size"] else None


def activation(key: str, ours: str = "block.mlp") -> Field:
    """An HF activation name (transformers' ACT2FN key) <-> our block.mlp word."""
    return Field(key, ours, None, read=ACTIVATIONS, write=HF_ACTIVATIONS)


def dropouts(key: str, *paths: str) -> tuple[Field, ...]:
    """One config.json dropout rate for several of ours (default: the residual and embedding ones)."""
    return tuple(Field(key, path, 0.0) for path in paths or ("block.dropout", "dropout"))


def tied(table: str, *heads: str) -> Callable[[ModelConfig], dict[str, str]]:
    """aliases(cfg): the head saved as a copy of the embedding table, when tied."""
    return lambda cfg: {h: table for h in heads or ("lm_head.weight",)} if cfg.tie_embeddings else {}


# -- the Llama trunk: pre-norm RMSNorm, RoPE, GQA, SwiGLU --------------------------------------
def shape(width: str, layers: str, heads: str, d_ff: str | None = None) -> tuple[Field, ...]:
    """The width, depth, head count (and MLP width) under a family's config.json names."""
    fields = (Field(width, "d_model"), Field(layers, "n_layers"), Field(heads, "attention.n_heads"))
    return fields + ((Field(d_ff, "block.d_ff"),) if d_ff else ())


SHAPE = shape("hidden_size", "num_hidden_layers", "num_attention_heads")  # as Llama's (most families)
D_FF = Field("intermediate_size", "block.d_ff")


def llama_fields(eps: float, tied_default: bool = False, head_dim: Field | None = None) -> tuple[Field, ...]:
    """The config.json keys of the Llama layout (Llama, Mistral, Qwen2/3, SmolLM3, OLMo 2, Gemma,
    Phi-3, Mixtral, Qwen-MoE); transformers' defaults for eps and tying differ by family."""
    return (
        *SHAPE,
        Field("num_key_value_heads", "attention.n_kv_heads", heads, empty=True),
        head_dim or Field("head_dim", "attention.head_dim", head_width, empty=True),
        D_FF,
        Field("rms_norm_eps", "block.norm_eps", eps),
        Field("attention_dropout", "attention.dropout", 0.0),
        Field("tie_word_embeddings", "tie_embeddings", tied_default),
    )


DERIVED_HEAD_DIM = Field("head_dim", "attention.head_dim", None, read=only_if_not_derived)
# Phi-3, Phi: head_dim written only where it differs from hidden_size / heads (older configs lack it)
SPARSE_HEAD_DIM = Field(
    "head_dim",
    "attention.head_dim",
    None,
    read=only_if_not_derived,
    write=lambda v, cfg: OMIT if v * cfg.attention.n_heads == cfg.d_model else v,
)
SWIGLU = Field("hidden_act", "block.mlp", "silu", read={"silu": "swiglu"})
LLAMA_FIXED = {"arch": "decoder", "block.norm": "rmsnorm", "block.norm_placement": "pre"}


def llama_family(model_type: str, architecture: str, *fields: Field, eps: float = 1e-6, **changes: Any) -> Family:
    """A Family of the Llama layout: the trunk's keys (``llama_fields``; ``tied_default``,
    ``head_dim`` and ``mlp`` pass through), pre-RMSNorm, tensor names, old rotary buffers, the tied
    head; ``fields`` and ``changes`` (``fixed`` adds to the trunk's) are the family's own."""
    trunk = llama_fields(eps, changes.pop("tied_default", False), changes.pop("head_dim", None))
    return Family(
        model_type=model_type,
        architecture=architecture,
        fields=(*trunk, changes.pop("mlp", SWIGLU), *fields),
        keys=changes.pop("keys", lambda cfg, names: KeyMap(llama_rules(cfg))),
        fixed={**LLAMA_FIXED, **changes.pop("fixed", {})},
        # the key map permutes q/k for an interleaved model (or refuses: QK-norm, fused qkv)
        **{"ignored": (ROTARY_BUFFER,), "aliases": tied("model.embed_tokens.weight"), "pairings": PAIRINGS, **changes},
    )


def permuted(ours: str, theirs: str, n_heads: int, pairing: str) -> KeyRule:
    """A q or k projection (or QK-norm) HF stores half-split: permuted for an interleaved model."""
    if pairing != "interleaved":
        return rule(ours, theirs)
    return rule(
        ours,
        theirs,
        lambda ts: [half_to_interleaved(ts[0], n_heads)],
        lambda ts: [interleaved_to_half(ts[0], n_heads)],
    )


def trunk_ends() -> list[KeyRule]:
    """The Llama layout's embeddings, final norm and head."""
    return [
        rule("embed.tok.weight", "model.embed_tokens.weight"),
        rule("stack.final_norm.weight", "model.norm.weight"),
        rule("lm_head.weight", "lm_head.weight"),
    ]


def llama_rules(cfg: ModelConfig, norms=LLAMA_NORMS, extra=(), mlp: bool = True) -> list[KeyRule]:
    """Embeddings, final norm, head and each layer's attention and norms (and SwiGLU MLP)."""
    out = trunk_ends()
    pairing = cfg.positions.pairing if isinstance(cfg.positions, RoPE) else "half"
    for proj, n in (("q_proj", cfg.attention.n_heads), ("k_proj", cfg.n_kv_heads)):
        out += [permuted(f"{L}.attn.{proj}.{s}", f"{H}.self_attn.{proj}.{s}", n, pairing) for s in ("weight", "bias")]
    pairs = [("attn.v_proj", "self_attn.v_proj"), ("attn.o_proj", "self_attn.o_proj"), *norms, *extra]
    pairs += [(f"mlp.{ours}", f"mlp.{theirs}") for ours, theirs in SWIGLU_NAMES.items()] if mlp else []
    return out + renamed((f"{L}.{ours}", f"{H}.{theirs}") for ours, theirs in pairs)


# -- RoPE and per-layer settings ---------------------------------------------------------------
def needs_rope(cfg: ModelConfig) -> list[str]:
    if not isinstance(cfg.positions, RoPE):
        return [f"positions={cfg.positions!r} (needs RoPE)"]
    return rope_unfit(cfg)


def rope_rule(whole: bool = True, prepare: Callable[[dict], dict] | None = None) -> Rule:
    """positions and max_seq_len from rope_parameters (hf_rope.py); ``whole``: the family rotates
    whole heads (HF Llama ignores partial_rotary_factor for plain RoPE and cannot run it scaled)."""

    def read(hf: dict[str, Any], values: dict[str, Any], problems: list[str]) -> None:
        rope, values["max_seq_len"] = rope_from_hf(prepare(hf) if prepare else hf, problems)
        if whole and rope.fraction != 1:
            problems.append(f"partial_rotary_factor={rope.fraction!r}: {hf['model_type']} rotates whole heads (1.0)")
        values["positions"] = rope

    return Rule("rope", read, lambda cfg, out: out.update(rope_to_hf(cfg)), needs_rope)


def layers_rule(layers: Callable, write: Callable | None = None, check: Callable | None = None) -> Rule:
    """Per-layer windows and RoPEs: ``layers(hf, rope, problems)`` gives each layer's (window,
    RoPE or None); equal layers share a kind, and a model whose layers are alike has none."""

    def read(hf: dict[str, Any], values: dict[str, Any], problems: list[str]) -> None:
        rope = values["positions"]
        windows, ropes = layers(hf, rope, problems)
        k = kind_fields(windows, ropes, rope.get(FULL) if isinstance(rope, dict) else rope)  # Gemma 3: one per type
        values.update({"attention.sliding_window": k["window"], "positions": k["positions"]})
        values.update(layer_kinds=k["layer_kinds"], kinds=k["kinds"])

    return Rule("per-layer windows", read, write, check)


def one_window(cfg: ModelConfig) -> list[str]:
    problems: list[str] = []
    windows_to_hf(cfg, problems)
    return problems


def sliding_windows(hf: dict[str, Any], types: list[str]) -> list[int | None]:
    """The window of each layer type: config.json's sliding_window where it says sliding."""
    on = hf.get("use_sliding_window", True)
    return [hf.get("sliding_window") if t == SLIDING and on else None for t in types]


def qwen_windows(hf: dict[str, Any], rope: RoPE, problems: list[str]) -> tuple[list, list]:
    """Qwen2/3: layer_types, by default sliding from max_window_layers up."""
    n = hf["num_hidden_layers"]
    default = [SLIDING if i >= hf.get("max_window_layers", n) else FULL for i in range(n)]
    return sliding_windows(hf, layer_types(hf, n, default, problems)), [rope] * n


def write_windows(cfg: ModelConfig, out: dict[str, Any], max_window_layers: bool = True) -> None:
    types, window = windows_to_hf(cfg, [])
    out.update(use_sliding_window=window is not None, sliding_window=window, layer_types=types)
    if max_window_layers:
        out["max_window_layers"] = types.index(SLIDING) if SLIDING in types else cfg.n_layers


def own_ropes(cfg: ModelConfig) -> list[str]:
    if cfg.layer_kinds is not None and any(k.rope != cfg.positions for k in per_layer(cfg)):
        return ["a layer kind with its own RoPE or NoPE (smollm3, gemma3_text have them)"]
    return []


# -- experts -------------------------------------------------------------------------------------
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")  # the families' spellings
DENSE, SPARSE = LayerKind(name="dense", mlp="dense"), LayerKind(name="moe", mlp="moe")


def expert_count(key: str) -> Field:
    """The expert count, read under any family's spelling; none at all: ``key`` is missing."""

    def default(hf: dict[str, Any]) -> int:
        found = next((hf[k] for k in EXPERT_KEYS if hf.get(k)), None)
        if found is None:
            raise KeyError(key)
        return found

    return Field(key, "moe.n_experts", default, empty=True)


def needs_moe(cfg: ModelConfig) -> list[str]:
    return [] if cfg.moe is not None else ["needs moe (experts)"]


def stack_experts(tensors: list[Tensor]) -> list[Tensor]:
    """E per-expert matrices (F, D) -> one batched (E, F, D)."""
    return [torch.stack(tensors)]


def unstack_experts(tensors: list[Tensor]) -> list[Tensor]:
    """(E, F, D) -> E matrices (F, D), each with its own storage (safetensors refuses shared)."""
    return [t.clone() for t in tensors[0].unbind(0)]


def expert_rules(n_experts: int, ours: str, theirs: str, names: dict[str, str]) -> list[KeyRule]:
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


def dense_layers(cfg: ModelConfig) -> list[int]:
    kinds, index = resolve_kinds(cfg, cfg.n_layers)
    return [i for i, k in enumerate(index) if kinds[k].mlp == "dense"]


def dense_rule(dense: Callable[[dict[str, Any]], list[bool]], write: Callable) -> Rule:
    """Layers whose MLP is dense (True) or experts (False) as layer kinds; none if all are experts."""

    def read(hf: dict[str, Any], values: dict[str, Any], problems: list[str]) -> None:
        flags = dense(hf)
        if any(flags):
            names = tuple("dense" if d else "moe" for d in flags)
            values.update(layer_kinds=names, kinds=tuple(k for k in (DENSE, SPARSE) if k.name in names))

    return Rule("dense layers", read, write, needs_moe)


# -- BERT's encoder (BERT, RoBERTa, XLM-R) ------------------------------------------------------
BERT_FIELDS = (
    *SHAPE,
    D_FF,
    activation("hidden_act"),
    Field("type_vocab_size", "n_token_types", 2),
    Field("layer_norm_eps", "block.norm_eps", 1e-12),
    *dropouts("hidden_dropout_prob"),
    Field("attention_probs_dropout_prob", "attention.dropout", 0.0),
)
POST_LN_ENCODER = {
    "arch": "encoder",
    "attention.bias": True,
    "block.norm": "layernorm",
    "block.norm_placement": "post",
    "block.bias": True,
    "embed_norm": True,
}
BERT_ONLY = {"position_embedding_type": "absolute", "is_decoder": False, "add_cross_attention": False}


def body_prefix(prefix: str, hf_names: list[str] | None) -> str:
    """``prefix`` when the checkpoint is a task model (``bert.``, ``roberta.``, ...), else ""."""
    return prefix if hf_names is not None and f"{prefix}embeddings.word_embeddings.weight" in hf_names else ""


def bert_rules(p: str) -> list[KeyRule]:
    """BERT's layout under the body prefix ``p`` (RoBERTa and XLM-R use it as it is)."""
    B, E = f"{p}encoder.layer.{{i}}", f"{p}embeddings"
    pairs = [("embed.tok", f"{E}.word_embeddings"), ("embed.absolute", f"{E}.position_embeddings"),
             ("embed.token_types", f"{E}.token_type_embeddings"), ("embed.norm", f"{E}.LayerNorm")]  # fmt: skip
    sub = [("attn.q_proj", "attention.self.query"), ("attn.k_proj", "attention.self.key"),
           ("attn.v_proj", "attention.self.value"), ("attn.o_proj", "attention.output.dense"),
           ("attn_norm", "attention.output.LayerNorm"), ("mlp.up", "intermediate.dense"),
           ("mlp.down", "output.dense"), ("mlp_norm", "output.LayerNorm")]  # fmt: skip
    return renamed(pairs + [(f"{L}.{ours}", f"{B}.{theirs}") for ours, theirs in sub])
