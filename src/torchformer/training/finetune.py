"""Fine-tuning's recipe words, checked and loaded: which model to start from (``model.init``),
its tokenizer, the LoRA targets and the quantized base (``finetune.*``), DPO's reference. The
plan train() consults (what trains, what a checkpoint holds, what the run folder gets at the
end) is built from them once: plan.py.

model.init: a torchformer checkpoint folder, a Hugging Face folder or a preset, read through the
one resolver (loading.py). Its config and weights are the start; its tokenizer.json tokenizes the
data. The recipe's model section may change only what leaves the weights meaningful: dropout,
the attention backend, and max_seq_len downwards (a learned position table is cut to fit);
anything else would not fit the pretrained tensors and is refused, naming what is allowed.

finetune.lora: LoRA adapters (lora/) on the named modules; everything else is frozen, so the
optimizer holds only adapter state and checkpoints hold only adapter tensors plus a reference to
the base (state.json's ``finetune`` entry); resume rebuilds the base from model.init and loads the adapters.

finetune.quantize (int8 | int4, with finetune.group_size for int4): QLoRA, the adapters train
over a frozen weight-only quantized base (models/quantize.py). Checkpoints record the scheme beside
the base reference, and a resume whose recipe would rebuild another base is refused.

finetune.reference (train.objective=dpo): the frozen model whose log-probabilities DPO compares
against; by default the model as it starts (with LoRA, the base with the adapters switched off).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from .. import lora
from ..configs import ModelConfig
from ..loading import TOKENIZER_FILE, load_any, load_tokenizer, model_config, model_kind
from ..models.build import QUANT_LINEARS, build_model
from ..models.quantize import DEFAULT_GROUP_SIZE, quantize
from ..models.saving import read_config

# Model fields a recipe may change on top of model.init, and why they are safe.
SAFE = {
    "init": "the model to start from",
    "dropout": "regularisation only",
    "attention.dropout": "regularisation only",
    "block.dropout": "regularisation only",
    "attention.backend": "the same attention computed by another kernel",
    "max_seq_len": "downwards only: a shorter context (learned positions are cut)",
}


def _flat(spec: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in spec.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def check_init(model_spec: dict) -> None:
    """Recipe-time checks of a model section that names ``init`` (nothing is loaded here)."""
    init = model_spec["init"]
    if not isinstance(init, str) or not init:
        raise ValueError(f"model.init={init!r}: must be a folder path or a preset name")
    try:
        model_kind(init)
    except ValueError as err:
        raise ValueError(f"model.init={init!r}: {err}") from None
    bad = sorted(k for k in _flat(model_spec) if k not in SAFE)
    if bad:
        allowed = "; ".join(f"{k} ({why})" for k, why in SAFE.items())
        raise ValueError(
            f"model.{bad[0]} cannot change when starting from model.init (the pretrained weights "
            f"fix it; changed: {bad}). Allowed: {allowed}"
        )


def check_reference(reference) -> None:
    """finetune.reference names a model as model.init does (recipe time; nothing is loaded)."""
    if not isinstance(reference, str) or not reference:
        raise ValueError(f"finetune.reference={reference!r}: must be a folder path or a preset name")
    try:
        kind = model_kind(reference)
    except ValueError as err:
        raise ValueError(f"finetune.reference={reference!r}: {err}") from None
    if kind == "preset":
        raise ValueError(
            f"finetune.reference={reference!r} is a preset, a model with random weights: name a trained "
            "checkpoint or Hugging Face folder (leave it out to use the model as it starts)"
        )


def load_reference(recipe, device: torch.device, vocab_size: int) -> nn.Module | None:
    """The frozen model finetune.reference names, in eval mode; None when it names none. Its
    vocabulary must be the policy's: DPO compares log-probabilities of the same token ids."""
    name = recipe.finetune.reference
    if name is None:
        return None
    cfg = model_config(name)
    if cfg.vocab_size != vocab_size:
        raise ValueError(
            f"finetune.reference={name!r} has vocab_size {cfg.vocab_size}, the model being trained {vocab_size}: "
            "the reference must share the policy's vocabulary (DPO compares log-probabilities of the same tokens)"
        )
    ours, theirs = init_tokenizer(recipe), _tokenizer_text(name)
    if ours is not None and theirs is not None and json.loads(ours) != json.loads(theirs):
        raise ValueError(
            f"finetune.reference={name!r} has another tokenizer than model.init={init_of(recipe)!r}: the same "
            "token ids would mean other text; use a reference trained with model.init's tokenizer"
        )
    return load_any(name, device=str(device)).eval().requires_grad_(False)


def _tokenizer_text(name: str) -> str | None:
    file = Path(name) / TOKENIZER_FILE
    return file.read_text(encoding="utf-8") if file.is_file() else None


def check_quantize(scheme, group_size, lora_spec) -> int | None:
    """finetune.quantize / group_size as words and combinations (recipe time; widths: ``check``).
    Returns the group size to record: int4's default made explicit, so a checkpoint names it."""
    if scheme is not None and scheme not in QUANT_LINEARS:
        raise ValueError(f"finetune.quantize={scheme!r}: must be one of {sorted(QUANT_LINEARS)}, or absent (float)")
    if scheme is not None and lora_spec is None:
        raise ValueError(
            f"finetune.quantize={scheme!r} needs finetune.lora: a quantized base is frozen (its weights are "
            "integer buffers no optimizer can update), so only LoRA adapters over it can train"
        )
    if group_size is not None and scheme != "int4":
        raise ValueError(
            f"finetune.group_size={group_size!r} with finetune.quantize={scheme!r}: a group size is for int4 "
            "only (int8 keeps one scale per output row)"
        )
    return DEFAULT_GROUP_SIZE if scheme == "int4" and group_size is None else group_size


def check(recipe) -> None:
    """Before any work: a quantized model.init trains only adapters; the LoRA targets exist in the
    model (built on the meta device, no weights)."""
    spec = recipe.finetune.lora
    init = init_of(recipe)
    reference = recipe.finetune.reference
    sizes = [model_config(m).vocab_size for m in (reference, init)] if None not in (reference, init) else [0, 0]
    if sizes[0] != sizes[1]:  # DPO compares log-probabilities of the same token ids
        raise ValueError(
            f"finetune.reference={reference!r} has vocab_size {sizes[0]}, model.init={init!r} {sizes[1]}: the "
            "reference must share the policy's vocabulary"
        )
    quantization = read_config(init)[1] if init is not None and model_kind(init) == "torchformer" else None
    if spec is None and quantization is not None:
        raise ValueError(
            f"model.init={init!r} is weight-only quantized (scheme={quantization.scheme!r}): its integer "
            "weights cannot be trained; add finetune.lora (adapters train, the quantized base stays frozen) "
            "or start from the float checkpoint"
        )
    if quantization is not None and recipe.finetune.quantize is not None:
        raise ValueError(
            f"finetune.quantize={recipe.finetune.quantize!r}: model.init={init!r} is already quantized "
            f"(scheme={quantization.scheme!r}); leave finetune.quantize out to train adapters over it as it is"
        )
    if spec is None:
        return
    if init is None:
        cfg = recipe.model_config(8, {})
    else:
        cfg = model_config(init)  # a checkpoint's, an HF folder's or a .gguf file's
    with torch.device("meta"):
        model = build_model(cfg)
        quantize_base(model, recipe.finetune.quantize, recipe.finetune.group_size)  # group_size must divide widths
        lora.apply(model, rank=spec.rank, alpha=spec.alpha, targets=spec.targets, dropout=spec.dropout)


def init_of(recipe) -> str | None:
    """model.init, or None for a model built from scratch (a preset init is a from-scratch build)."""
    init = recipe.model.get("init")
    return None if init is None or model_kind(init) == "preset" else init


def init_tokenizer(recipe) -> str | None:
    """The tokenizer.json text of model.init (the data must be tokenized with it), or None."""
    init = init_of(recipe)
    if init is None:
        return None
    if model_kind(init) == "gguf":  # the tokenizer its metadata describes
        return load_tokenizer(init).to_str()
    file = Path(init) / TOKENIZER_FILE
    if not file.is_file():
        raise FileNotFoundError(
            f"model.init={init!r} has no {TOKENIZER_FILE}: the data cannot be tokenized as "
            "the model was trained; add the model's tokenizer.json to the folder"
        )
    return file.read_text(encoding="utf-8")


def load_init(recipe, device: torch.device, vocab_size: int) -> nn.Module | None:
    """The model.init model with the recipe's safe changes, on ``device``; None without init."""
    init = init_of(recipe)
    if init is None:
        return None
    base = load_any(init, device=str(device))
    cfg = base.config
    changes = _flat({k: v for k, v in recipe.model.items() if k != "init"})
    if changes.get("max_seq_len", cfg.max_seq_len) > cfg.max_seq_len:
        raise ValueError(
            f"model.max_seq_len={changes['max_seq_len']}: model.init has {cfg.max_seq_len}; "
            "it can only go down (positions beyond it were never trained)"
        )
    if vocab_size > cfg.vocab_size:
        raise ValueError(f"the tokenizer has {vocab_size} tokens, model.init's vocab_size is {cfg.vocab_size}")
    raw = cfg.to_dict()
    for key, value in changes.items():
        node, *path, last = [raw, *key.split(".")]
        for part in path:
            node = node[part]
        node[last] = value
    new_cfg = ModelConfig.from_dict(raw)
    if new_cfg == cfg:
        return base.train()
    model = build_model(new_cfg).to(device)
    q = getattr(base, "quantization", None)
    if q is not None:  # the same integer modules as the base, so its state dict fits (LoRA over them)
        quantize(model, q.scheme, group_size=q.group_size, lm_head=q.lm_head)
    state = base.state_dict()
    for name, t in model.state_dict().items():  # a shorter max_seq_len: cut position tables
        if state[name].shape != t.shape and state[name].shape[1:] == t.shape[1:]:
            state[name] = state[name][: t.shape[0]]
    model.load_state_dict(state)
    return model.train()


def quantize_base(model: nn.Module, scheme: str | None, group_size: int | None) -> None:
    """finetune.quantize: QLoRA (Dettmers et al. 2023), adapters train in float over a frozen
    weight-only int8 / int4 base. The block projections are quantized; the head stays float, as
    in QLoRA practice (transformers' bitsandbytes loading keeps lm_head unquantized)."""
    if scheme is None:
        return
    try:
        quantize(model, scheme, group_size=group_size, lm_head=False)
    except ValueError as err:
        raise ValueError(f"finetune.quantize={scheme!r} (group_size={group_size!r}): {err}") from None
