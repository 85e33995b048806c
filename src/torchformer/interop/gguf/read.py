"""from_gguf: a GGUF file (llama.cpp, Ollama) -> a torchformer model.

The whole file is checked before anything is built or read: the container (container.py), the
architecture and the config its metadata implies (archs.py -> the family's config_from_hf), then
every tensor the model needs against the file (present, shaped as the config says, nothing left
over). Names go ours -> Hugging Face (the family's key map, on the meta-device model) -> GGUF
(gguf's TensorNameMap, the converter's own table). Loading then reads each tensor once: Q4_0,
Q8_0, Q6_K and Q4_K projections become quantized modules holding the file's numbers
(weights.QUANTIZED_LINEARS), a token table in one of those types stays mapped and is dequantized a
looked-up row at a time (table.py), the rest are floats in ``dtype``.
"""

from __future__ import annotations

import logging
import os
from collections import Counter

import torch
from torch import Tensor, nn

from ...configs import ModelConfig
from ...fast.formats import prepare
from ...host_memory import trim
from ...models.build import QUANT_LINEARS
from ...models.quantize import Quantization, targets
from ...models.saving import build_meta, materialize, unique_state
from ...nn.quant import QuantLinear
from ..hf import FAMILIES
from .archs import AUX_TENSORS, EXPERT, JOINED, arch_of, gguf_name, hf_config, name_table, row_transforms
from .container import FLOAT_TYPES, GGUFFile, open_gguf
from .table import ROWS, MappedTable, mapped_rows
from .weights import QUANTIZED_LINEARS, assembled, float_tensor, mapped_view, raw_rows

logger = logging.getLogger(__name__)


def _plan(path: str | os.PathLike) -> tuple[GGUFFile, dict, object, ModelConfig]:
    f = open_gguf(path, vocabulary=False)  # the weights' load never reads the tokenizer's arrays
    hf = hf_config(f)
    family = FAMILIES[hf["model_type"]]
    try:
        cfg = family.config_from_hf(hf)
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{f.path}: its metadata does not make a valid {hf['model_type']} config: {err}") from None
    _check_sizes(f, cfg)
    return f, hf, family, cfg


def _check_sizes(f: GGUFFile, cfg: ModelConfig) -> None:
    """Block count and widths against the tensors, before a model of that size is built."""
    blocks = {int(n.split(".")[1]) for n in f.tensors if n.startswith("blk.")}
    held = max(blocks, default=-1) + 1
    problems = []
    if held != cfg.n_layers:
        problems.append(f"block_count={cfg.n_layers} but the file holds blocks 0..{held - 1}")
    if "token_embd.weight" in f.tensors and f.torch_shape("token_embd.weight") != (cfg.vocab_size, cfg.d_model):
        problems.append(
            f"token_embd.weight is {f.torch_shape('token_embd.weight')}, the metadata says "
            f"(vocab_size, embedding_length) = {(cfg.vocab_size, cfg.d_model)}"
        )
    if problems:
        raise ValueError(f"{f.path}: metadata contradicts the tensors: {'; '.join(problems)}")


def config_from_gguf(path: str | os.PathLike) -> ModelConfig:
    """The ModelConfig of a GGUF file (metadata and tensor headers only; no weights read)."""
    return _plan(path)[3]


def from_gguf(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    quantized: bool = True,
):
    """A torchformer model with the weights of the GGUF file ``path``, in eval mode.

    F32/F16/BF16 tensors load as floats in ``dtype`` (default float32, the precision llama.cpp
    computes in on a CPU); Q4_0 / Q8_0 / Q6_K / Q4_K projections load into Int4Linear / Int8Linear
    (group 32; Q6_K: 16) / Int4MinLinear (the file's numbers, no float copy); other quantized types
    are dequantized to ``dtype`` at load (logged). A token table of those four types (or Q5_0) stays
    mapped from the file and is dequantized as rows are looked up (table.py). quantized=False
    dequantizes those too (a float model, e.g. to write a Hugging Face folder). Any problem with the
    file is one ValueError before a weight is read.
    """
    if not isinstance(quantized, bool):
        raise TypeError(f"quantized={quantized!r}: must be True or False")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype={dtype!r}: must be a floating torch.dtype (float32, bfloat16, float16)")
    f, hf, family, cfg = _plan(path)
    model = build_meta(cfg, f.path)
    keymap = family.keymap(cfg, None)
    ours = unique_state(model)
    theirs = keymap.to_theirs(ours).tensors  # HF name -> meta tensor (the shapes a folder would hold)
    names, experts, joined = _gguf_names(f, theirs)
    undo = row_transforms(arch_of(f)[0], hf, to_gguf=False)

    def rows(hf_name: str, mapped: bool = False) -> Tensor:
        g = names[hf_name]
        raw = undo.get(g.split(".")[-2], lambda t: t)((mapped_view if mapped else raw_rows)(f, g))
        return raw[experts[hf_name]] if hf_name in experts else raw  # one expert's rows of the stacked tensor

    def tensor(hf_name: str) -> Tensor:
        if hf_name in joined:  # joined in float32, then the model's dtype
            parts, join = joined[hf_name]
            whole = join(*(float_tensor(f, p, raw_rows(f, p), torch.float32, f.torch_shape(p)) for p in parts))
            return whole.reshape(theirs[hf_name].shape).to(dtype)
        return float_tensor(f, names[hf_name], rows(hf_name), dtype, tuple(theirs[hf_name].shape))

    keep = quantized
    quantized = _quantized_modules(f, model, keymap, names, rows, dtype, set(experts)) if keep else {}
    if keep:  # after the head: a tied one is made from the table's bytes first
        quantized.update(_mapped_table(f, model, keymap, names, dtype))
    rest = [n for n in theirs if n not in quantized]
    state = keymap.to_ours(rest, tensor).tensors
    assert set(state) | {k for ks in quantized.values() for k in ks} == set(ours), "a tensor was left unloaded"
    model.load_state_dict(state, strict=False, assign=True)
    model = materialize(model, cfg, device).to(device)
    _log_dequantized(f, names, quantized)
    if quantized:
        _record_quantization(model)
        prepare(model)  # the CPU kernels' panels where they run (fast/formats.py)
    trim()  # the heap pages the load's temporaries freed go back to the system
    return model


def _gguf_names(f: GGUFFile, theirs: dict[str, Tensor]):
    """(HF name -> GGUF name, HF name of one expert -> its index in the GGUF tensor stacking all
    experts, HF name -> (GGUF parts, join) for tensors stored split: archs.JOINED) for every tensor
    the model needs; missing, mis-shaped and unknown tensors all named in one ValueError."""
    arch_name, _ = arch_of(f)
    table = name_table(arch_name, f.require(f"{arch_name}.block_count"))
    names, experts, joined, problems = {}, {}, {}, []
    for hf_name, meta in theirs.items():
        one = EXPERT.fullmatch(hf_name)  # llama.cpp's converter stacks the experts: (n_experts, out, in)
        g = gguf_name(table, f"{one[1]}.{one[3]}.weight" if one else hf_name)
        shape = f.torch_shape(g) if g in f.tensors else None
        kind = g.split(".")[-2] if g else None
        if shape is None and kind in JOINED:  # stored as parts (DeepSeek's kv_b as k_b and v_b)
            kinds, join = JOINED[kind]
            parts = tuple(g.replace(f".{kind}.", f".{k}.") for k in kinds)
            if all(p in f.tensors for p in parts):
                joined[hf_name] = (parts, join)
                shape = tuple(join(*(torch.empty(f.torch_shape(p), device="meta") for p in parts)).shape)
        if one and shape is not None:  # compare one expert's slice; an index past the stack never matches
            experts[hf_name] = int(one[2])
            shape = shape[1:] if experts[hf_name] < shape[0] else f"{shape}, holding no expert {one[2]}"
        if g is None or shape is None:
            problems.append(f"missing tensor {g or hf_name!r}")
        elif _squeezed(shape) != _squeezed(tuple(meta.shape)):
            problems.append(f"tensor {g!r} has shape {shape} (PyTorch order), the metadata implies {tuple(meta.shape)}")
        if hf_name not in joined:
            names[hf_name] = g
    used = {*names.values(), *(p for parts, _ in joined.values() for p in parts)}
    unknown = sorted(set(f.tensors) - used - set(AUX_TENSORS))
    if unknown:
        problems.append(f"tensors this architecture does not have: {unknown}")
    if problems:
        raise ValueError(f"{f.path} does not fit its metadata:\n  - " + "\n  - ".join(problems))
    return names, experts, joined


def _squeezed(shape) -> tuple:
    """A shape without its size-1 dimensions: llama.cpp's quantizer writes Qwen2-MoE's (1, d) shared
    gate as (d,), the same numbers (loading reshapes to the model's shape)."""
    return tuple(n for n in shape if n != 1) if isinstance(shape, tuple) else shape


def _quantized_modules(f, model: nn.Module, keymap, names, rows, dtype, experts: set) -> dict[str, tuple[str, ...]]:
    """Swap each projection stored in a type of weights.QUANTIZED_LINEARS (and renamed as is by
    the key map) for the quantized module over the file's numbers. Returns HF name -> the state
    keys of ours it filled."""
    done: dict[str, tuple[str, ...]] = {}
    for name, lin in targets(model, lm_head=True):
        weight = f"{name}.weight"
        plain = keymap.to_theirs({weight: lin.weight})
        hf_name = next(iter(plain.tensors), None)
        if len(plain.tensors) != 1 or plain.tensors[hf_name] is not lin.weight:
            continue  # fused or transformed by the key map: loaded as floats
        tied = hf_name not in names and name == "lm_head"
        if tied:  # the head reads the input embedding's tensor
            hf_name = _tied_source(model, keymap, lin)
        if hf_name not in names or hf_name in experts or f.type_name(names[hf_name]) not in QUANTIZED_LINEARS:
            continue  # an expert, a type loaded as floats, or a tied head whose table is float
        filled = (weight,)
        bias = None
        if lin.bias is not None:
            hf_bias = next(iter(keymap.to_theirs({f"{name}.bias": lin.bias}).tensors))
            shape = f.torch_shape(names[hf_bias])
            bias, filled = float_tensor(f, names[hf_bias], rows(hf_bias), dtype, shape), (weight, f"{name}.bias")
            done[hf_bias] = ()
        load = QUANTIZED_LINEARS[f.type_name(names[hf_name])][0]
        # Into the kernels' panels at once, a block of the file's rows at a time (weights.assembled):
        # holding every projection in the portable layout until the end held the model twice over
        # at the load's peak, and one whole tensor's copies its size twice over.
        module = assembled(load, rows(hf_name, mapped=True), tuple(lin.weight.shape), bias)
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, module)
        # A tied head gets its own module over the file's bytes, as tfm.quantize gives it its own
        # copy: a decode step reads the head as stored (a Q4_0 file's Q6_K table, 0.82 bytes a
        # weight) instead of the float table (4 in float32); the lookup reads the table's rows where
        # they lie (_mapped_table).
        if not tied:
            done[hf_name] = filled
    return done


def _mapped_table(f: GGUFFile, model: nn.Module, keymap, names, dtype) -> dict[str, tuple[str, ...]]:
    """The input token table as a MappedTable over the file's rows when they are of a type
    table.ROWS decodes and nothing else reads the table as floats (a float head tied to it). Returns
    {HF name: the state key it filled} or {}."""
    embed = getattr(model, "embed", None)
    tok = getattr(embed, "tok", None)
    if not isinstance(tok, nn.Embedding) or getattr(getattr(model, "lm_head", None), "weight", None) is tok.weight:
        return {}
    plain = keymap.to_theirs({"embed.tok.weight": tok.weight}).tensors
    hf_name = next(iter(plain), None)
    if len(plain) != 1 or plain[hf_name] is not tok.weight or hf_name not in names:
        return {}  # transformed by the key map, or not the file's own tensor: loaded as floats
    g = names[hf_name]
    if f.type_name(g) not in ROWS or f.torch_shape(g) != tuple(tok.weight.shape):
        return {}
    embed.tok = MappedTable(mapped_rows(f, g), f.type_name(g), tok.embedding_dim, dtype)
    return {hf_name: ("embed.tok.weight",)}


def _tied_source(model: nn.Module, keymap, head: nn.Linear) -> str | None:
    """The file's (HF) name of the tensor a tied head shares with the input embedding, or None."""
    for name, param in model.named_parameters(remove_duplicate=False):
        if param is head.weight and not name.startswith("lm_head."):
            plain = keymap.to_theirs({name: param}).tensors
            return next(iter(plain)) if len(plain) == 1 and next(iter(plain.values())) is param else None
    return None


def _log_dequantized(f: GGUFFile, names: dict[str, str], quantized: dict) -> None:
    kinds = Counter(f.type_name(g) for n, g in names.items() if n not in quantized)
    dequantized = {k: n for k, n in kinds.items() if k not in FLOAT_TYPES}
    if dequantized:
        logger.info(
            "%s: dequantized %s tensors at load (no torchformer module runs these types as stored)", f.path, dequantized
        )
    if quantized:
        kept = Counter(f.type_name(names[n]) for n, v in quantized.items() if v)
        logger.info("%s: projections loaded as stored, a token table mapped (Q4_0: Int4Linear, Q8_0 / Q5_0 / "
                    "Q6_K: Int8Linear group 32 / 32 / 16, run from 5 / 6 bits a weight for Q5_0 / Q6_K where the "
                    "kernels are built, Q4_K: Int4MinLinear): %s", f.path, dict(kept))  # fmt: skip


def _record_quantization(model: nn.Module) -> None:
    """model.quantization when every projection (and the head, or none of it) is of one scheme of
    tfm.quantize's (int4 or int8) and one group size: then tfm.save writes a checkpoint tfm.load
    rebuilds; a mix of schemes or groups (a Q4_0 file's Q6_K head: int8, group 16), Q4_K's
    Int4MinLinear, or quantized and float projections mixed stay unrecorded."""
    head = isinstance(getattr(model, "lm_head", None), QuantLinear)
    kinds = {(type(m).scheme_type(), m.group_size) for m in model.modules() if isinstance(m, QuantLinear)}
    names = {cls: name for name, cls in QUANT_LINEARS.items()}
    if len(kinds) == 1 and not targets(model, lm_head=head):  # targets lists the float projections left
        cls, group = next(iter(kinds))
        if cls in names:
            model.quantization = Quantization(names[cls], group, head)
