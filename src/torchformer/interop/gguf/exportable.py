"""Which llama.cpp architecture writes a torchformer decoder, and the tensors it writes.

The Hugging Face family that fits the config (interop/hf.py's pick_model_type) names the layout
(the architecture that reads that family, archs.ARCHS backwards) and, through its key map, the HF
tensor names gguf's TensorNameMap turns into GGUF ones; archs.row_transforms redoes the
converter's changes (llama's q/k permutation, Gemma's 1 + w norms, NeoX's [q; k; v] rows), and
each MoE layer's experts are stacked into one tensor per matrix, (n_experts, out, in), as
llama.cpp's MoE graphs take them. One layout needs more than that:

- ``gpt2``: llama.cpp's gpt2 graph requires every bias, and `torchformer train`'s default
  (shakespeare-char) trains attention without them. Zero biases compute the same function, so a
  model that is GPT-2 but for its missing biases is written with zero ones. HF's GPT-2 keeps
  OpenAI's Conv1D (in, out) matrices: they are transposed back to llama.cpp's (out, in).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from ...configs import ModelConfig
from ...models.saving import build_meta, unique_state
from ..hf import FAMILIES, pick_model_type
from .archs import ARCHS, EXPERT, gguf_name, name_table, row_transforms

# model_type -> GGUF architecture: the one that reads it back, Mistral as llama (as the converter
# writes it; a sliding window does not read back and is refused), GPT-2 written only.
# DeepSeek (deepseek2) is read only: writing it needs kv_b split back into llama.cpp's k_b / v_b.
ARCH_OF = {
    **{a.model_type: name for name, a in ARCHS.items() if name != "deepseek2"},
    "mistral": "llama",
    "gpt2": "gpt2",
}
CONV1D = ("attn_qkv", "attn_output", "ffn_up", "ffn_down")  # gpt2's matrices HF stores (in, out)


@dataclasses.dataclass(frozen=True)
class Export:
    arch: str  # the GGUF architecture
    cfg: ModelConfig  # the config written (gpt2: with the zero biases)
    state: dict[str, Tensor]  # Hugging Face name -> tensor
    hf: dict | None  # the config.json the family's table writes (None: gpt2, written for llama.cpp only)


def export_plans(model: nn.Module) -> Iterator[Export]:
    """Each way ``model`` can be written, best first: every family that holds its config exactly
    and has a GGUF architecture, in interop/hf.py's order (several may: a Phi-3 with LongRoPE is a
    Llama config too, but only the phi3 graph runs LongRoPE; write_metadata's check decides), else
    GPT-2 with zero biases. ValueError naming the layouts when none fits."""
    cfg: ModelConfig = model.config
    state = unique_state(model)
    fitting = [t for t, family in FAMILIES.items() if not family.unfit(cfg)]
    for model_type in (t for t in fitting if t in ARCH_OF):
        family = FAMILIES[model_type]
        yield Export(
            ARCH_OF[model_type],
            cfg,
            family.keymap(cfg).to_theirs(state).tensors,
            family.config_to_hf(cfg, "float32")[0],
        )
    if any(t in ARCH_OF for t in fitting):
        return
    if fitting:
        raise ValueError(f"this model is a {fitting[0]}: GGUF export writes {sorted(ARCH_OF)} layouts")
    model_type, cfg, state = _zero_biased(cfg, state)
    yield Export("gpt2", cfg, FAMILIES[model_type].keymap(cfg).to_theirs(state).tensors, None)


def shapes(plan: Export) -> dict[str, tuple[int, ...]]:
    """GGUF name -> the shape written, without computing a tensor (on the meta device)."""
    meta = dataclasses.replace(plan, state={k: t.to("meta") for k, t in plan.state.items()})
    return {name: tuple(t.shape) for name, t in gguf_tensors(meta).items()}


def gguf_tensors(plan: Export) -> dict[str, Tensor]:
    """GGUF name -> the float32 tensor written (before the file's dtype), experts stacked."""
    cfg = plan.cfg
    heads = {"num_attention_heads": cfg.attention.n_heads, "num_key_value_heads": cfg.n_kv_heads}
    redo = {
        **(row_transforms(plan.arch, heads, to_gguf=True) if plan.arch in ARCHS else {}),
        **writer_transforms(plan.arch),
    }
    table = name_table(plan.arch, cfg.n_layers)
    out = {}
    for hf_name, tensor in _stack_experts(plan.state).items():
        name = gguf_name(table, hf_name)
        t = redo.get(name.split(".")[-2], lambda x: x)(tensor.detach().float())
        out[name] = t.flatten() if name.endswith("ffn_gate_inp_shexp.weight") else t  # (1, d): llama.cpp's (d,)
    return out


def _stack_experts(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """One expert's matrices (``...experts.3.gate_proj.weight``) -> one tensor per layer and matrix,
    in expert order, under the name gguf's TensorNameMap maps to ``ffn_gate_exps``."""
    out, stacks = {}, {}
    for name, t in state.items():
        one = EXPERT.fullmatch(name)
        if one is None:
            out[name] = t
        else:
            stacks.setdefault(f"{one[1]}.{one[3]}.weight", {})[int(one[2])] = t
    for name, by_index in stacks.items():
        out[name] = torch.stack([by_index[i] for i in range(len(by_index))])
    return out


def _zero_biased(cfg: ModelConfig, state: dict[str, Tensor]):
    """GPT-2 with zero biases where ``cfg`` has none; the original error when that is no GPT-2 either."""
    biased = cfg.replace(
        attention=dataclasses.replace(cfg.attention, bias=True, out_bias=None),
        block=dataclasses.replace(cfg.block, bias=True),
    )
    if not _is_gpt2(biased):
        pick_model_type(cfg, None)  # raises, naming why each family does not fit
    dtype = next(iter(state.values())).dtype
    meta = unique_state(build_meta(biased, "<to_gguf>"))
    return "gpt2", biased, {k: state[k] if k in state else torch.zeros(t.shape, dtype=dtype) for k, t in meta.items()}


def _is_gpt2(cfg: ModelConfig) -> bool:
    try:
        return pick_model_type(cfg, None) == "gpt2"
    except ValueError:
        return False


def writer_transforms(arch: str) -> dict:
    """GGUF tensor kind -> the change made on the way out, beyond archs.row_transforms."""
    if arch != "gpt2":
        return {}
    return {leaf: (lambda t: t.t() if t.dim() == 2 else t) for leaf in CONV1D}
