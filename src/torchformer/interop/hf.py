"""from_hf / to_hf: Hugging Face model folders <-> torchformer models, exact to the last bit of
each tensor. Nothing is downloaded: both take local folders.

Loading: config.json -> ModelConfig (unsupported settings raise), build the model on the meta
device (no memory), convert its names and shapes to the HF side with the family's key map and
check the checkpoint's headers against them (missing, mis-shaped and unexpected tensors are
named), then read each tensor once, convert it and assign it: a model costs one copy of its
weights, and a bad checkpoint fails before anything is loaded. As in transformers, tensors that
need no conversion stay memory-mapped from the file until written to; torchformer's writers
replace folders by rename, never truncating a file a live model still maps.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import warnings
from pathlib import Path

import torch
from torch import nn

from ..atomic import write_folder
from ..configs import ModelConfig, RoPE
from ..models.saving import build_meta, check_fits, materialize, read_json, unique_state
from ..nn.quant import QuantLinear
from . import (
    hf_bart,
    hf_bert,
    hf_deepseek,
    hf_distilbert,
    hf_gemma,
    hf_gpt2,
    hf_llama,
    hf_mixtral,
    hf_neox,
    hf_phi,
    hf_phi3,
    hf_qwen3,
    hf_qwen3_moe,
    hf_roberta,
    hf_t5,
)
from .family import Family
from .hf_config import check_sizes, config_dtype
from .reader import SafetensorsFolder

# The order is the preference: to_hf writes the first family a config round-trips through.
# Experts first; the Llama-layout families with an axis Llama lacks (QK-norm, NoPE, Gemma's
# norms) before Llama, which reproduces every config Phi-3 and SmolLM3 do without their rules.
ORDER = (hf_mixtral, hf_qwen3_moe, hf_deepseek, hf_qwen3, hf_gemma, hf_llama, hf_gpt2, hf_bert, hf_bart, hf_neox,
         hf_phi, hf_phi3, hf_t5, hf_roberta, hf_distilbert)  # fmt: skip
FAMILIES: dict[str, Family] = {f.model_type: f for module in ORDER for f in module.FAMILIES}
PAIRINGS = ("half", "interleaved")
logger = logging.getLogger(__name__)


def read_hf_config(path: str | os.PathLike) -> dict:
    """config.json of a local HF folder, with a clear error for hub ids and non-HF folders."""
    folder = Path(path)
    if not folder.is_dir():
        hint = " It looks like a hub id: download it first, then pass the folder." if "/" in str(path) else ""
        raise FileNotFoundError(f"{str(path)!r} is not a local folder; nothing is downloaded.{hint}")
    file = folder / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{folder} has no config.json: not a Hugging Face model folder")
    hf = read_json(file)
    if hf.get("model_type") not in FAMILIES:
        raise ValueError(f"model_type={hf.get('model_type')!r} in {file} is not supported; supported: {list(FAMILIES)}")
    check_sizes(hf, file)
    return hf


def config_from_hf(path: str | os.PathLike, *, rope_pairing: str = "half") -> ModelConfig:
    """The ModelConfig of a local HF folder (reads config.json only)."""
    return _configs(path, rope_pairing)[1]


def _configs(path: str | os.PathLike, rope_pairing: str) -> tuple[dict, ModelConfig]:
    if rope_pairing not in PAIRINGS:
        raise ValueError(f"rope_pairing={rope_pairing!r}: must be one of {list(PAIRINGS)}")
    hf = read_hf_config(path)
    try:
        cfg = FAMILIES[hf["model_type"]].config_from_hf(hf)
    except KeyError as missing:  # a required key (hidden_size, d_model, ...) the family cannot default
        needs = f"which model_type={hf['model_type']!r} needs"
        raise ValueError(f"config.json of {path} lacks {missing}, {needs}") from None
    except (TypeError, AttributeError) as err:  # a value of the wrong kind (a list where a number goes, ...)
        raise ValueError(f"{Path(path) / 'config.json'}: a setting has the wrong type ({err})") from None
    except ValueError as err:  # an unsupported setting or a value our config refuses: say which file
        raise ValueError(f"{Path(path) / 'config.json'}: {err}") from None
    if rope_pairing != "half":
        if not isinstance(cfg.positions, RoPE):
            raise ValueError(f"rope_pairing={rope_pairing!r} applies to RoPE models; {hf['model_type']} has none")
        cfg = cfg.replace(positions=dataclasses.replace(cfg.positions, pairing=rope_pairing))  # keeps scaling
    return hf, cfg


def from_hf(
    path: str | os.PathLike,
    *,
    rope_pairing: str = "half",
    strict: bool = True,
    dtype: torch.dtype | str | None = None,
    device: str | torch.device = "cpu",
) -> nn.Module:
    """A torchformer model with the weights of the HF folder ``path`` (config.json plus
    model.safetensors or a sharded model.safetensors.index.json), in eval mode.

    rope_pairing "interleaved" permutes q/k rows so the model rotates Meta-style pairs (same
    logits). strict=False drops tensors no rule knows instead of raising. dtype None keeps the
    stored dtypes; a torch.dtype converts each tensor as it is read; "config" converts to the
    dtype config.json names (``dtype``, or ``torch_dtype`` before transformers 5).
    """
    hf, cfg = _configs(path, rope_pairing)
    family = FAMILIES[hf["model_type"]]
    dtype = config_dtype(hf) if dtype == "config" else dtype
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype={dtype!r}: must be None, a torch.dtype or 'config'")
    reader = SafetensorsFolder(Path(path), device=str(device))
    check_fits(cfg, reader.shapes, Path(path) / "config.json", Path(path))  # before building: 1e6 layers take minutes
    model = build_meta(cfg, Path(path) / "config.json")
    ours = unique_state(model)
    keymap = family.keymap(cfg, reader.names)
    expected = keymap.to_theirs(ours)
    assert not expected.unmatched and not expected.missing, expected  # the key map covers the model
    check_tensors(Path(path), reader.shapes, expected.tensors, family, cfg, strict)
    convert = (lambda t: t) if dtype is None else (lambda t: t.to(dtype))
    state = keymap.to_ours(list(expected.tensors), lambda name: convert(reader.get(name))).tensors
    assert set(state) == set(ours), sorted(set(state) ^ set(ours))
    model.load_state_dict(state, strict=False, assign=True)
    model = materialize(model, cfg, device)
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()]), "a tensor was left unloaded"
    return model


def check_tensors(folder: Path, found: dict, expected: dict, family: Family, cfg: ModelConfig, strict: bool):
    """Missing, mis-shaped and (when strict) unexpected tensors, all named in one ValueError."""
    want = {name: tuple(t.shape) for name, t in expected.items()}
    for alias, target in family.aliases(cfg).items():
        if target in want:
            want.setdefault(alias, want[target])
    problems = []
    missing = sorted(set(expected) - set(found))
    if missing:
        problems.append(f"missing tensors: {missing}")
    for name in sorted(set(found) & set(want)):
        if found[name] != want[name]:
            problems.append(f"tensor {name!r} has shape {found[name]} in the file, the config implies {want[name]}")
    ignored = [re.compile(p) for p in family.ignored]
    unexpected = sorted(n for n in set(found) - set(want) if not any(p.fullmatch(n) for p in ignored))
    if unexpected and strict:
        problems.append(f"unexpected tensors (pass strict=False to drop them): {unexpected}")
    if problems:
        lines = "\n  - ".join(problems)
        raise ValueError(f"{folder} does not fit its config.json:\n  - {lines}")
    if unexpected:
        warnings.warn(f"{folder}: dropped tensors no rule knows (strict=False): {unexpected}", stacklevel=3)
    dropped = sorted(set(found) - set(want) - set(unexpected))
    if dropped:
        logger.info("%s: skipped tensors torchformer does not use: %s", folder, dropped)


def to_hf(
    model: nn.Module,
    out_dir: str | os.PathLike,
    *,
    model_type: str | None = None,
    tokenizer: str | None = None,
    force: bool = False,
) -> Path:
    """Write ``model`` as a folder transformers' ``AutoModel*.from_pretrained`` loads: config.json,
    model.safetensors and generation_config.json (where the family has one). The family is
    inferred from the config (model_type forces one). tokenizer: tokenizer.json text to add.
    The folder is written beside ``out_dir`` and renamed into place; an existing folder is replaced
    only when it is empty or holds just these files (force=True: any folder). Returns the path.
    """
    cfg = getattr(model, "config", None)
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"to_hf needs a torchformer model (built by build_model), got {type(model).__name__}")
    check_unquantized(model)
    model_type = pick_model_type(cfg, model_type)
    family = FAMILIES[model_type]
    state = family.keymap(cfg).to_theirs(unique_state(model))
    assert not state.unmatched and not state.missing, state
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    hf_config, generation = family.config_to_hf(cfg, dtype)
    files = {"config.json": json.dumps(hf_config, indent=2)}
    if generation is not None:
        files["generation_config.json"] = json.dumps({k: v for k, v in generation.items() if v is not None}, indent=2)
    if tokenizer is not None:
        files["tokenizer.json"] = tokenizer
    tensors = {name: t.detach().contiguous() for name, t in state.tensors.items()}
    again = ("generation_config.json", "tokenizer.json")  # an earlier export's, with or without them
    return write_folder(out_dir, tensors={"model.safetensors": tensors}, texts=files, replaces=again, force=force)


def check_unquantized(model: nn.Module) -> None:
    """An HF folder holds float weights: a tfm.quantize'd model has integer buffers and scales under
    other names, which no transformers loader reads without an extra quantization package."""
    q = getattr(model, "quantization", None)
    if q is None and not any(isinstance(m, QuantLinear) for m in model.modules()):
        return
    what = "its linears are quantized" if q is None else f"scheme={q.scheme!r}, group_size={q.group_size}"
    raise ValueError(
        f"model is quantized ({what}): Hugging Face export needs the unquantized weights; "
        "export the float model (the checkpoint or HF folder it was quantized from) instead"
    )


def pick_model_type(cfg: ModelConfig, model_type: str | None) -> str:
    if model_type is not None:
        if model_type not in FAMILIES:
            raise ValueError(f"model_type={model_type!r}: supported are {list(FAMILIES)}")
        problems = FAMILIES[model_type].unfit(cfg)
        if problems:
            raise ValueError(f"this model cannot be written as {model_type}: {'; '.join(problems)}")
        return model_type
    reasons: dict[tuple[str, ...], list[str]] = {}  # the same reasons said once for the families they share
    for name, family in FAMILIES.items():
        problems = family.unfit(cfg)
        if not problems:
            return name
        reasons.setdefault(tuple(problems), []).append(name)
    lines = "\n  - ".join(f"{'/'.join(names)}: {'; '.join(why)}" for why, names in reasons.items())
    raise ValueError(f"no Hugging Face family fits this model's config:\n  - {lines}")
