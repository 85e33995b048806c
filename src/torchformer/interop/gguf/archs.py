"""GGUF architectures as data: which Hugging Face family reads each, and how llama.cpp's
converter changed the tensors on the way in (so loading undoes exactly that).

``hf_config`` turns the ``{arch}.*`` metadata into the config.json dict the family's own
``config_from_hf`` reads, so GGUF adds no second config reader; tensor names go through gguf's
``TensorNameMap`` (the table llama.cpp's converter writes with) and the family's key map.

What the converter changes (llama.cpp convert_hf_to_gguf.py):
- ``llama``: q and k rows permuted from HF's half-split RoPE layout to Meta's interleaved one (its
  rope kernel for llama pairs 2i with 2i+1). We undo it (interleaved_to_half), so a loaded model has
  one layout whatever file it came from; Qwen, Gemma and Phi-3 files are not permuted (llama.cpp
  runs them with NeoX-style rope).
- ``gemma``, ``gemma2``: RMSNorm weights stored as 1 + w (llama.cpp's norm has no offset); we
  subtract 1 (exact in fp32 for weights near 1, and our norm adds the 1 back).
- ``gemma3``: as gemma2, plus per-head QK-norm (also stored 1 + w). The file has the full layers'
  RoPE (rope.freq_base and its scaling) and the sliding layers' base (rope.freq_base_swa, else
  llama.cpp's 10000, unscaled); the layer pattern is attention.sliding_window_pattern (a list, or
  n: every n-th layer full), else llama.cpp's 6; no window at all makes every layer full.
- ``gemma2``, ``gemma3``: the score scale is not in the file: llama.cpp uses head_dim ** -0.5,
  or (d_model / n_heads) ** -0.5 for the 27B alone, which it recognises by its layer count; we
  read it the same way (query_pre_attn_scalar), so the published models load as they run there.
- ``gptneox``: attn_qkv is [all q; all k; all v] where HF's query_key_value is head by head
  ([q_h; k_h; v_h]); we regroup the rows. Partial rotary from rope.dimension_count; the activation
  is not in the file: HF's "gelu" (Pythia's; llama.cpp runs the tanh form).
- ``olmo2``: nothing changed (output norms and full-width QK-norm map by name).
- ``qwen2moe``, ``qwen3moe``: each layer's experts stacked in one tensor per matrix (ffn_gate_exps:
  (n_experts, d_expert, d_model)); read.py takes one expert's rows from it (rows move whole, so
  quantized stacks slice too).
- ``phi3``: fused attn_qkv / ffn_up (gate; up) split by the phi3 key map; LongRoPE from the
  rope_factors_long/short tensors. llama.cpp picks the long factors when the context it was
  started with exceeds the original one, we (as transformers) when the sequence does: the same
  below the original length, which is what the tests cover.
- ``deepseek2`` (DeepSeek-V3; V2's softmax router is not our family's): MLA as MQA (head_count_kv 1;
  per-head sizes in the ``*_mla`` keys); ``kv_b_proj`` split into per-head ``attn_k_b`` (H, kv_rank,
  nope) and ``attn_v_b`` (H, v, kv_rank), joined back (JOINED); rotary pairs interleaved, unpermuted;
  HF's ``e_score_correction_bias`` renamed ``.bias`` before the table (NAME_FIXES): ``exp_probs_b``.
- Llama 3 RoPE scaling: not metadata but a ``rope_freqs`` tensor of per-frequency divisors; read
  as LongRoPE with those divisors for both lengths and attention factor 1 (the same frequencies).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..hf_kinds import FULL, SLIDING
from ..transforms import fuse_head_interleaved, half_to_interleaved, interleaved_to_half, split_head_interleaved
from .container import GGUFFile, gguf_module


@dataclass(frozen=True)
class Arch:
    model_type: str  # the interop family (interop/hf.py FAMILIES) that reads it
    permuted_qk: bool = False  # llama.cpp permuted q/k rows to the interleaved RoPE layout
    norm_plus_one: bool = False  # norms stored as 1 + w (Gemma)
    qkv_by_head: bool = False  # attn_qkv regrouped from [q; k; v] to HF's head-by-head layout (NeoX)
    fields: dict = field(default_factory=dict)  # {arch}.KEY -> config.json key, copied when present
    extra: Callable[[GGUFFile, str, dict], dict] | None = None  # config.json entries several keys make


def _gemma_scalar(layers_of_27b: int) -> Callable[[GGUFFile, str, dict], dict]:
    """query_pre_attn_scalar as llama.cpp derives it (its 27B: d_model / n_heads, else head_dim)."""

    def extra(f: GGUFFile, name: str, hf: dict) -> dict:
        big = hf["num_hidden_layers"] == layers_of_27b
        return {"query_pre_attn_scalar": hf["hidden_size"] // hf["num_attention_heads"] if big else hf["head_dim"]}

    return extra


def _gemma3(f: GGUFFile, name: str, hf: dict) -> dict:
    """Gemma 3's layer pattern and its two RoPEs, as llama.cpp's gemma3 graph applies them."""
    n, window = hf["num_hidden_layers"], f.get(f"{name}.attention.sliding_window", 0)
    pattern = f.get(f"{name}.attention.sliding_window_pattern", 6)
    if not window:
        sliding = [False] * n
    elif isinstance(pattern, list):
        sliding = [bool(p) for p in pattern]
    else:
        sliding = [pattern == 0 or i % pattern < pattern - 1 for i in range(n)]
    full = dict(hf["rope_parameters"])
    local = {"rope_type": "default", "rope_theta": f.get(f"{name}.rope.freq_base_swa", 10_000.0)}
    return {
        **_gemma_scalar(62)(f, name, hf),
        "sliding_window": window or None,
        "layer_types": [SLIDING if s else FULL for s in sliding],
        "rope_parameters": {FULL: full, SLIDING: local},
    }


def _no_windows(f: GGUFFile, name: str, hf: dict) -> dict:
    if f.get(f"{name}.attention.sliding_window", 0):
        raise ValueError(f"{f.path}: {name}.attention.sliding_window is set (OLMo 3); sliding windows are "
                         "supported for gemma2, gemma3, phi3 files")  # fmt: skip
    return {}


def _moe(norm_topk: bool, shared: bool) -> Callable[[GGUFFile, str, dict], dict]:
    """Qwen2-MoE / Qwen3-MoE experts: every layer routed (llama.cpp's graphs have no dense layers),
    top-k weights renormalised or not as the graph fixes it (norm_w: true for qwen3moe, false for
    qwen2moe), Qwen2-MoE's sigmoid-gated shared expert."""

    def extra(f: GGUFFile, arch: str, hf: dict) -> dict:
        out = {
            "num_experts": f.require(f"{arch}.expert_count"),
            "num_experts_per_tok": f.require(f"{arch}.expert_used_count"),
            "moe_intermediate_size": f.require(f"{arch}.expert_feed_forward_length"),
            "norm_topk_prob": norm_topk,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }
        if shared:
            out["shared_expert_intermediate_size"] = f.require(f"{arch}.expert_shared_feed_forward_length")
            out["qkv_bias"] = hf["attention_bias"]
        return out

    return extra


def _deepseek2(f: GGUFFile, arch: str, hf: dict) -> dict:
    """DeepSeek-V3's config.json from llama.cpp's deepseek2 keys (its MQA view undone)."""
    gating = f.get(f"{arch}.expert_gating_func", 1)  # llama.cpp: absent means V2's softmax
    if gating != 2:
        raise ValueError(f"{f.path}: {arch}.expert_gating_func={gating} (softmax: DeepSeek-V2); only 2 (sigmoid, "
                         "DeepSeek-V3) is supported")  # fmt: skip
    rope = f.require(f"{arch}.rope.dimension_count")
    out = {
        "num_key_value_heads": hf["num_attention_heads"],
        "kv_lora_rank": f.require(f"{arch}.attention.kv_lora_rank"),
        "q_lora_rank": f.get(f"{arch}.attention.q_lora_rank"),
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": f.require(f"{arch}.attention.key_length_mla") - rope,
        "v_head_dim": f.require(f"{arch}.attention.value_length_mla"),
        "rope_interleave": True,
        "first_k_dense_replace": f.get(f"{arch}.leading_dense_block_count", 0),
        "n_routed_experts": f.require(f"{arch}.expert_count"),
        "num_experts_per_tok": f.require(f"{arch}.expert_used_count"),
        "moe_intermediate_size": f.require(f"{arch}.expert_feed_forward_length"),
        "n_shared_experts": f.get(f"{arch}.expert_shared_count", 0),
        "routed_scaling_factor": f.get(f"{arch}.expert_weights_scale", 1.0),
        "norm_topk_prob": f.get(f"{arch}.expert_weights_norm", False),
        "n_group": f.get(f"{arch}.expert_group_count", 1),
        "topk_group": f.get(f"{arch}.expert_group_used_count", 1),
    }
    log_mul = f.get(f"{arch}.rope.scaling.yarn_log_mul")
    if log_mul is not None:  # the converter writes 0.1 * mscale_all_dim (its [TAG_DEEPSEEK2_YARN_LOG_MUL_FIX])
        out["rope_parameters"] = {**hf["rope_parameters"], "mscale_all_dim": log_mul / 0.1, "mscale": log_mul / 0.1}
    return out


def _join_kv_b(k_b: Tensor, v_b: Tensor) -> Tensor:
    """(H, kv_rank, nope) and (H, v, kv_rank) -> HF's kv_b_proj (H * (nope + v), kv_rank)."""
    return torch.cat([k_b.transpose(1, 2), v_b], dim=1).flatten(0, 1)


ARCHS: dict[str, Arch] = {
    "llama": Arch("llama", permuted_qk=True),
    "qwen2": Arch("qwen2"),
    "qwen3": Arch("qwen3"),
    "gemma": Arch("gemma", norm_plus_one=True),
    # windows alternate from layer 0 in llama.cpp as in transformers' default layer_types.
    "gemma2": Arch(
        "gemma2",
        norm_plus_one=True,
        fields={
            "attn_logit_softcapping": "attn_logit_softcapping",
            "final_logit_softcapping": "final_logit_softcapping",
            "attention.sliding_window": "sliding_window",
        },
        extra=_gemma_scalar(46),
    ),
    "gemma3": Arch(
        "gemma3_text", norm_plus_one=True, fields={"final_logit_softcapping": "final_logit_softcapping"}, extra=_gemma3
    ),
    "phi3": Arch("phi3", fields={"attention.sliding_window": "sliding_window"}),  # 0: none (the converter's)
    "gptneox": Arch(
        "gpt_neox",
        qkv_by_head=True,
        fields={"use_parallel_residual": "use_parallel_residual", "attention.layer_norm_epsilon": "layer_norm_eps"},
        extra=lambda f, name, hf: {"hidden_act": "gelu"},
    ),
    "olmo2": Arch("olmo2", extra=_no_windows),
    "qwen2moe": Arch("qwen2_moe", extra=_moe(norm_topk=False, shared=True)),
    "qwen3moe": Arch("qwen3_moe", extra=_moe(norm_topk=True, shared=False)),
    "deepseek2": Arch("deepseek_v3", extra=_deepseek2),
}
# GGUF tensor kind -> (the kinds the converter stores it as, how they join back into it)
JOINED: dict[str, tuple[tuple[str, ...], Callable[..., Tensor]]] = {"attn_kv_b": (("attn_k_b", "attn_v_b"), _join_kv_b)}
NAME_FIXES = (("e_score_correction_bias", "e_score_correction.bias"),)  # the converter's renames before its table
NORMS = ("attn_norm", "ffn_norm", "post_attention_norm", "post_ffw_norm", "output_norm", "attn_q_norm", "attn_k_norm")
SCALINGS = ("none", "linear", "yarn")  # {arch}.rope.scaling.type values read (Llama 3's is a tensor)
AUX_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")  # config, not weights
EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(\w+)\.weight")  # one expert's HF matrix: prefix, index, leaf


def arch_of(f: GGUFFile) -> tuple[str, Arch]:
    name = f.require("general.architecture")
    if name not in ARCHS:
        raise ValueError(f"{f.path}: general.architecture={name!r} is not supported; supported: {list(ARCHS)}")
    return name, ARCHS[name]


def hf_config(f: GGUFFile) -> dict:
    """The config.json a Hugging Face folder of this model would have (the fields families read)."""
    name, arch = arch_of(f)
    key = lambda k, default=None: f.get(f"{name}.{k}", default)  # noqa: E731
    n_heads = f.require(f"{name}.attention.head_count")
    d = f.require(f"{name}.embedding_length")
    vocab = key("vocab_size") or f.length("tokenizer.ggml.tokens") or f.torch_shape("token_embd.weight")[0]
    hf = {
        "model_type": arch.model_type,
        "vocab_size": vocab,
        "hidden_size": d,
        "intermediate_size": f.require(f"{name}.feed_forward_length"),
        "num_hidden_layers": f.require(f"{name}.block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": key("attention.head_count_kv", n_heads),
        "head_dim": key("attention.key_length", d // n_heads),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", 1e-5),
        "max_position_embeddings": key("context_length", 2048),
        "tie_word_embeddings": "output.weight" not in f.tensors,
        "attention_bias": any(f"blk.0.{t}.bias" in f.tensors for t in ("attn_q", "attn_qkv")),
        "rope_parameters": {"rope_theta": key("rope.freq_base", 10000.0), **_rope_scaling(f, name)},
        **{t: f.get(f"tokenizer.ggml.{t}") for t in ("bos_token_id", "eos_token_id", "pad_token_id")},
        **{theirs: f.get(f"{name}.{ours}") for ours, theirs in arch.fields.items() if f"{name}.{ours}" in f.meta},
    }
    hf["partial_rotary_factor"] = key("rope.dimension_count", hf["head_dim"]) / hf["head_dim"]
    hf["rope_parameters"]["partial_rotary_factor"] = hf["partial_rotary_factor"]  # where NeoX's reader looks
    if hf.get("sliding_window") == 0:
        hf["sliding_window"] = None
    return {**hf, **(arch.extra(f, name, hf) if arch.extra else {})}


def _rope_scaling(f: GGUFFile, name: str) -> dict:
    kind = f.get(f"{name}.rope.scaling.type", "none")
    if kind not in SCALINGS:
        raise ValueError(f"{f.path}: {name}.rope.scaling.type={kind!r} is not supported; supported: {list(SCALINGS)}")
    factor = f.get(f"{name}.rope.scaling.factor")
    original = f.get(f"{name}.rope.scaling.original_context_length")
    if "rope_factors_long.weight" in f.tensors:  # Phi-3's LongRoPE: both factor lists as tensors
        factors = {k: [float(x) for x in f.tensors[f"rope_factors_{k}.weight"].data] for k in ("long", "short")}
        return {"rope_type": "longrope", "short_factor": factors["short"], "long_factor": factors["long"],
                "attention_factor": f.get(f"{name}.rope.scaling.attn_factor"),
                "original_max_position_embeddings": original}  # fmt: skip
    if "rope_freqs.weight" in f.tensors:  # Llama 3 (and any per-frequency table): exactly these divisors
        freqs = [float(x) for x in f.tensors["rope_freqs.weight"].data]
        return {
            "rope_type": "longrope",
            "short_factor": freqs,
            "long_factor": freqs,
            "attention_factor": 1.0,
            "original_max_position_embeddings": f.get(f"{name}.context_length", 2048),
        }
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
    return {"rope_type": "default"}


def gguf_name(table, hf_name: str) -> str | None:
    """An HF tensor name's GGUF name (None: the architecture has no such tensor)."""
    for theirs, fixed in NAME_FIXES:
        hf_name = hf_name.replace(theirs, fixed)
    return table.get_name(hf_name, try_suffixes=(".weight", ".bias"))


def name_table(arch_name: str, n_layers: int):
    """gguf's TensorNameMap for the architecture: HF tensor name -> GGUF name (the converter's table)."""
    gguf = gguf_module()
    arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch_name)
    return gguf.get_tensor_name_map(arch, n_layers)


def row_transforms(arch_name: str, hf: dict, to_gguf: bool) -> dict[str, Callable[[Tensor], Tensor]]:
    """GGUF tensor kind (``attn_q`` of ``blk.0.attn_q.weight``) -> the converter's change to it
    (to_gguf) or its undoing. Row permutations move whole rows, so they apply to the rows of
    quantized blocks too."""
    arch, out = ARCHS[arch_name], {}
    if arch.permuted_qk:
        for leaf, n in (("attn_q", hf["num_attention_heads"]), ("attn_k", hf["num_key_value_heads"])):
            out[leaf] = (
                (lambda t, n=n: half_to_interleaved(t, n)) if to_gguf else (lambda t, n=n: interleaved_to_half(t, n))
            )
    if arch.qkv_by_head:  # GGUF [q; k; v] <-> HF [q_h; k_h; v_h] per head
        n = hf["num_attention_heads"]
        out["attn_qkv"] = (
            (lambda t: torch.cat(split_head_interleaved(t, n)))
            if to_gguf
            else (lambda t: fuse_head_interleaved(list(t.chunk(3)), n))
        )
    if arch.norm_plus_one:
        out.update({leaf: (lambda t: t + 1) if to_gguf else (lambda t: t - 1) for leaf in NORMS})
    return out
