"""The variant grid every equivalence test runs over (DESIGN section 7).

A full product of the axes is 3*2*4*8*6*3*2*2 = 13824 models; a pairwise (all-pairs) covering array
takes every pair of values of every two axes at least once in 50 rows. Bugs that need one
setting or the interaction of two settings (e.g. RoPE x cache, ALiBi x GQA, post-norm x cross
attention) are then caught at a cost of tens of tiny models. The array is generated
deterministically by a greedy AETG-style construction, so a failing row has a stable id.

The ``bias`` axis also flips the head: bias rows are untied with a final logits bias, the others
tied. Other test folders import ``variants``, ``params`` (pytest ids), ``config``, ``build``,
``forward`` (one call for every arch) and ``output_logits`` from here.
"""

from __future__ import annotations

import dataclasses

import torch

import torchformer as tfm
from torchformer.configs import YaRN

from .covering import AXES, QUIRK_AXES, pairwise, quirk_id, quirk_variants, variant_id, variants  # noqa: F401

VOCAB, D_MODEL, N_HEADS, N_LAYERS, MAX_LEN = 97, 32, 4, 2, 64
KV_HEADS = {"mha": 4, "gqa": 2, "mqa": 1}
POSITIONS = {
    "sinusoidal": tfm.Sinusoidal,
    "learned": tfm.Learned,
    "rope-half": lambda: tfm.RoPE(pairing="half"),
    "rope-interleaved": lambda: tfm.RoPE(pairing="interleaved"),
    # Partial rotary (half of each 8-wide head) with a static scaling that bites at grid lengths.
    "rope-partial-yarn": lambda: tfm.RoPE(
        pairing="interleaved", fraction=0.5, scaling=YaRN(factor=4.0, original_max_seq_len=16)
    ),
    "alibi": tfm.ALiBi,
    # Few buckets and a short max distance so test sequences reach the log-spaced buckets.
    "relative_bias": lambda: tfm.RelativeBias(num_buckets=8, max_distance=20),
    "none": lambda: None,
}


def config(v: dict, **changes) -> tfm.ModelConfig:
    """The tiny ModelConfig (2 layers, width 32, 4 query heads of size 8) for grid row ``v``."""
    cfg = tfm.ModelConfig(
        arch=v["arch"],
        vocab_size=VOCAB,
        d_model=D_MODEL,
        n_layers=N_LAYERS,
        n_decoder_layers=N_LAYERS if v["arch"] == "encoder_decoder" else None,
        max_seq_len=MAX_LEN,
        attention=tfm.AttentionConfig(
            n_heads=N_HEADS, n_kv_heads=KV_HEADS[v["heads"]], bias=v["bias"], backend=v["backend"]
        ),
        block=tfm.BlockConfig(norm=v["norm"], norm_placement=v["placement"], mlp=v["mlp"], bias=v["bias"]),
        positions=POSITIONS[v["position"]](),
        tie_embeddings=not v["bias"],  # exercise both tied and untied heads across the grid
        final_logits_bias=v["bias"] and v["arch"] != "encoder",
    )
    return cfg.replace(**changes) if changes else cfg


def quirk_config(v: dict) -> tfm.ModelConfig:
    """A 2-layer SwiGLU model with the row's part-B settings. "kinds": layer 0 a windowed kind
    (decoders) with its own RoPE base, layer 1 NoPE (where the positions are RoPE or none)."""
    row = dict(arch=v["arch"], norm=v["norm"], placement=v["placement"], position=v["position"], mlp="swiglu",
               heads=v["heads"], backend=v["backend"], bias=False)  # fmt: skip
    cfg = config(row)
    rope = cfg.positions if isinstance(cfg.positions, tfm.RoPE) else None
    rotary = rope is not None or cfg.positions is None
    quirks = {
        "none": {},
        "qk-head": dict(attention={"qk_norm": "head"}),
        "qk-width": dict(attention={"qk_norm": "width"}),
        "softcaps": dict(attention={"softcap": 2.0}, embed_scale=True, embed_scale_in_dtype=True)
        | ({} if v["arch"] == "encoder" else dict(final_softcap=1.5, head_scale=0.5)),
        "kinds": dict(
            layer_kinds=("a", "b"),
            kinds={
                "a": tfm.LayerKind(
                    sliding_window=3 if v["arch"] == "decoder" else "inherit",
                    rope=dataclasses.replace(rope, base=100.0) if rope is not None else "inherit",
                ),
                "b": tfm.LayerKind(rope=None if rotary else "inherit"),
            },
        ),
    }
    return cfg.replace(**quirks[v["quirk"]])


def build(v: dict, seed: int = 0, *, sharp: bool = True, **changes) -> torch.nn.Module:
    """The grid row's model in eval mode, initialised from ``seed``.

    sharp: at init (std 0.02) attention is nearly uniform, so a wrong mask, rotation or bias moves
    the outputs by only ~1e-4. Larger q/k weights (std 0.3) and a random relative-bias table (zero
    at init) make the scores matter, so equivalence checks at 1e-5 have a wide margin to fail.
    """
    torch.manual_seed(seed)
    model = tfm.build_model(config(v, **changes)).eval()
    if sharp:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("q_proj.weight", "k_proj.weight")):
                    p.normal_(std=0.3)
                elif name.endswith("score_bias.weight"):
                    p.normal_(std=0.5)
    return model


def params(objs: list[dict]) -> dict:
    """pytest.mark.parametrize arguments for a list of grid rows."""
    return {"argvalues": objs, "ids": [variant_id(v) for v in objs]}


def source(batch: int, length: int = 9, seed: int = 1) -> torch.Tensor:
    """A fixed source sequence for encoder-decoder rows (B, S)."""
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def forward(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """One call for every arch: decoder logits, encoder hidden states, or encoder-decoder logits of
    ``ids`` as the target against a fixed source. ``mask`` is the attention_mask of ``ids``."""
    arch = model.config.arch
    if arch == "encoder_decoder":
        return model(source(ids.shape[0]), ids, tgt_mask=mask)
    return model(ids, attention_mask=mask)


def output_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """(B, T, V) for every arch (encoders through their tied MLM head)."""
    out = forward(model, ids)
    return model.mlm_logits(out) if model.config.arch == "encoder" else out
