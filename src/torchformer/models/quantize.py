"""``tfm.quantize``: weight-only int8 / int4 for a built or loaded model, in place.

Which modules: every projection in the blocks (q/k/v/o of self- and cross-attention, the MLP's
up/gate/down) and, unless ``lm_head=False``, the output head. Embedding tables, norms and position
tables stay as they are (they are a small share of the bytes a decode step reads and the
embedding is read one row per token). A tied head gets its own quantized copy; the input table
stays float. The scheme is recorded on the model (``model.quantization``) so ``tfm.save`` can write
it into config.json and ``tfm.load`` can rebuild the same modules.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from torch import nn

from ..fast.formats import prepare, quantizer
from ..host_memory import release_mapped as release_mapped_pages
from ..host_memory import trim
from ..nn.head import LMHead
from ..nn.quant import QuantLinear
from .build import QUANT_LINEARS

DEFAULT_GROUP_SIZE = 64


@dataclass(frozen=True)
class Quantization:
    """What ``quantize`` did; saved as the "quantization" entry of config.json."""

    scheme: str  # a key of models.build.QUANT_LINEARS
    group_size: int | None  # int4's group; int8's, or None for one scale per output row
    lm_head: bool

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw) -> Quantization:
        if not isinstance(raw, dict) or set(raw) != {"scheme", "group_size", "lm_head"}:
            raise ValueError(f"config.json quantization={raw!r}: must hold exactly scheme, group_size, lm_head")
        return cls(**raw)


def targets(model: nn.Module, lm_head: bool) -> list[tuple[str, nn.Linear]]:
    """(name, module) of the linears ``quantize`` replaces."""
    stacks = ("stack.", "encoder.", "decoder.")
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and (name.startswith(stacks) or (lm_head and name == "lm_head"))
        and not name.endswith(".attn.kv_up")  # MLA's absorbed decode multiplies by this weight itself
        and type(m) is not LMHead  # a soft-capped / scaled head (Gemma 2, T5) stays float: it keeps its formula
    ]


def check(model: nn.Module, scheme, group_size, lm_head) -> Quantization:
    """Every argument, before any tensor work."""
    from .decoder import DecoderLM
    from .encoder import Encoder
    from .encoder_decoder import EncoderDecoder

    if not isinstance(model, DecoderLM | Encoder | EncoderDecoder):
        raise TypeError(f"model must be a torchformer DecoderLM, Encoder or EncoderDecoder, got {type(model).__name__}")
    if getattr(model, "quantization", None) is not None or any(isinstance(m, QuantLinear) for m in model.modules()):
        raise ValueError(
            f"model is already quantized ({getattr(model, 'quantization', None)}); quantize the float model once"
        )
    if scheme not in QUANT_LINEARS:
        raise ValueError(f"scheme={scheme!r}: must be one of {sorted(QUANT_LINEARS)}")
    if not isinstance(lm_head, bool):
        raise TypeError(f"lm_head={lm_head!r}: must be True or False")
    if scheme == "int8" and group_size is None:
        return Quantization("int8", None, lm_head)  # one scale per output row
    group_size = DEFAULT_GROUP_SIZE if group_size is None else group_size
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2 or group_size % 2:
        raise ValueError(f"group_size={group_size!r}: must be an even integer >= 2 (e.g. 32, 64, 128)")
    for name, m in targets(model, lm_head):
        if m.in_features % group_size:
            raise ValueError(
                f"group_size={group_size} does not divide in_features={m.in_features} of {name}; "
                "choose a group size that divides every projection's input width"
            )
    return Quantization(scheme, group_size, lm_head)


def quantize(
    model: nn.Module,
    scheme: str = "int8",
    *,
    group_size: int | None = None,
    lm_head: bool = True,
    release_mapped: bool = False,
):
    """Replace ``model``'s projections by weight-only quantized linears; returns the model (eval).

    scheme "int8": symmetric, one scale per output row, or per ``group_size`` inputs when given
    (32: GGUF's Q8_0). "int4": symmetric, two weights per byte, one scale per ``group_size``
    inputs (default 64). See ``torchformer.nn.quant``. On a CPU with
    the project's kernels the modules hold their weights in the kernels' panels
    (``torchformer.fast.formats``); their state dict is the same.

    release_mapped is the loaders' (``tfm.load_any(..., quantize=...)``): each float weight read
    from a memory-mapped file gives its pages back once quantized (``host_memory.release_mapped``),
    so a quantizing load holds the integer model, not the float one too. Only for a model nothing
    has written since it was loaded.
    """
    q = check(model, scheme, group_size, lm_head)
    make = quantizer(QUANT_LINEARS[q.scheme])  # into the CPU kernels' panels where they run (fast/formats.py)
    on_block = release_mapped_pages if release_mapped else None
    for name, lin in targets(model, q.lm_head):
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, make(lin, q.group_size, on_block))
        if release_mapped:
            trim()  # and the freed temporaries' heap pages, so the peak stays the integer model
    model.quantization = q
    prepare(model)  # the bf16 linears left (fast/formats.py)
    return model.eval()
