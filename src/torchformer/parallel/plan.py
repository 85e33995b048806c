"""The tensor-parallel plan of a model, derived from its config once for every family.

Megatron-LM's split (Shoeybi et al. 2019, section 3): in each block the q/k/v projections are
split by output columns, so every rank owns whole heads, and the output projection by input
rows, so one all-reduce per sublayer rebuilds the residual stream; the MLP alike (gate/up
columns, down rows). The token table is split by vocabulary rows (each rank looks up the ids it
owns, the others add zeros) and the LM head by vocabulary columns: training keeps the logits
sharded into the loss (loss_parallel), inference gathers them for sampling.

What is not split, and why:
- Norms, positions, routers: replicated (a few vectors per layer). Sequence parallelism for the
  norms (Korthikanti et al. 2022) saves activation memory on GPUs with long sequences; it is not
  in this plan yet, so every rank holds the full (B, T, D) residual stream.
- Mixture-of-experts MLPs, latent attention (MLA), per-head score biases (ALiBi, T5 relative)
  and QK-norm over the full width (OLMo 2): refused with a clear error ("not yet"). Expert
  parallelism is the natural split for MoE and is left for its own issue.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from ..models.build import MLPS
from ..nn.mlp import GatedMLP


@dataclass(frozen=True)
class TPPlan:
    """Module-path patterns (relative to the model) -> ParallelStyle, for parallelize_module."""

    styles: dict[str, ParallelStyle]
    tp: int
    heads: int  # query heads per rank
    kv_heads: int  # K/V heads per rank (the cache is sharded by these)


def check_tp(config, tp: int) -> None:
    """Refuse a TP degree the config cannot be split by, before any work. ValueError names the
    config field, its value and the degree."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp={tp!r}: must be an integer >= 1")
    a = config.attention
    refusals = [
        (config.moe is not None, "model.moe (mixture-of-experts)", "expert parallelism is not built yet"),
        (config.mla is not None, "model.mla (latent attention)", "its shared latent is not split yet"),
        (type(config.positions).__name__ in ("ALiBi", "RelativeBias"),
         f"model.positions={type(config.positions).__name__}", "per-head score biases are not split yet"),
        (a.qk_norm == "width", "attention.qk_norm='width'", "a norm over all heads' features needs them all"),
    ]  # fmt: skip
    if tp == 1:
        return
    for refused, what, why in refusals:
        if refused:
            raise ValueError(f"tp={tp}: {what} cannot be tensor-parallel ({why}); use tp=1")
    split = [("attention.n_heads", a.n_heads), ("attention.n_kv_heads", a.kv_heads)]
    for field, value in split:  # whole heads per rank
        if value % tp:
            raise ValueError(
                f"tp={tp} does not divide {field}={value} (heads={a.n_heads}, kv heads={a.kv_heads}); "
                "pick a tp that divides both"
            )
    d_ff = getattr(config, "d_ff", None)
    if d_ff is not None and d_ff % tp:
        raise ValueError(f"tp={tp} does not divide d_ff={d_ff} (the MLP's hidden width); pick one that does")


def _block_styles(prefix: str, cross: bool, gated: bool) -> dict[str, ParallelStyle]:
    styles: dict[str, ParallelStyle] = {}
    for attn in ("attn", "cross_attn") if cross else ("attn",):
        for proj in ("q_proj", "k_proj", "v_proj"):
            styles[f"{prefix}.{attn}.{proj}"] = ColwiseParallel()  # whole heads per rank
        styles[f"{prefix}.{attn}.o_proj"] = RowwiseParallel()  # partial sums -> all-reduce
    if gated:  # GatedMLP (SwiGLU, GeGLU): gate and up split alike, so act(gate) * up stays elementwise
        styles[f"{prefix}.mlp.gate"] = ColwiseParallel()
    styles[f"{prefix}.mlp.up"] = ColwiseParallel()
    styles[f"{prefix}.mlp.down"] = RowwiseParallel()
    return styles


def _table(path: str) -> dict[str, ParallelStyle]:
    # Vocabulary rows: each rank looks up the ids it owns; the partial rows are summed.
    return {path: RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())}


def tp_plan(config, tp: int, *, loss_parallel: bool = False) -> TPPlan:
    """The plan for a model built from ``config`` at TP degree ``tp``. loss_parallel: the LM head's
    logits stay sharded by vocabulary (a DTensor, for the training loss); otherwise each rank gets
    the full logits (B, T, V) to sample from."""
    check_tp(config, tp)
    head = (
        ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
        if loss_parallel
        else ColwiseParallel(output_layouts=Replicate())
    )
    # (stack path, has cross-attention); the decoder-only model's blocks are under "stack"
    stacks = {"decoder": [("stack", False)], "encoder": [("stack", False)],
              "encoder_decoder": [("encoder", False), ("decoder", True)]}[config.arch]  # fmt: skip
    styles: dict[str, ParallelStyle] = {}
    for name, cross in stacks:
        styles.update(_block_styles(f"{name}.blocks.*", cross, MLPS[config.block.mlp][0] is GatedMLP))
    # The encoder's token table stays whole: its tied MLM head (Encoder.mlm_logits) reads all of it.
    if config.arch == "decoder":
        styles.update(_table("embed.tok"))
        styles["lm_head"] = head
    elif config.arch == "encoder_decoder":
        styles.update(_table("src_embed.tok"))
        if not config.share_embeddings:
            styles.update(_table("tgt_embed.tok"))
        styles["lm_head"] = head
    a = config.attention
    return TPPlan(styles=styles, tp=tp, heads=a.n_heads // tp, kv_heads=a.kv_heads // tp)
