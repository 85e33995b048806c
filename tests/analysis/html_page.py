"""Helpers for the explorer tests: read the data block back out of a page, record a grid row."""

from __future__ import annotations

import base64
import json
import re

import numpy as np
import torch

from tests.grid import build, forward, source
from torchformer.analysis import record_attention

DATA_BLOCK = re.compile(r'<script type="application/json" id="tf-data">(.*?)</script>', re.DOTALL)


def page_data(html: str) -> dict:
    """The page's embedded JSON, with every layer's weights decoded to a (H, T, S) tensor."""
    (blob,) = DATA_BLOCK.findall(html)
    data = json.loads(blob)
    for group in data["groups"]:
        for layer in group["layers"]:
            T, S = len(group["queries"]), len(group["keys"])
            flat = np.frombuffer(base64.b64decode(layer["weights"]), dtype="<f4")
            layer["w"] = torch.from_numpy(flat.copy()).view(len(layer["heads"]), T, S)
    return data


def padded_recording(v: dict, T: int = 9):
    """Grid row ``v`` run on a batch of two where row 1 is padded (decoders on the left, the rest
    on the right); returns (model, recording, ids, mask)."""
    model = build(v)
    ids = torch.randint(0, model.config.vocab_size, (2, T))
    mask = torch.ones_like(ids)
    if v["arch"] == "decoder":
        mask[1, :3] = 0
    else:
        mask[1, -2:] = 0
    with torch.no_grad(), record_attention(model) as rec:
        forward(model, ids, mask)
    return model, rec, ids, mask


def labels(ids: torch.Tensor, prefix: str = "t") -> list[str]:
    return [f"{prefix}{i}" for i in ids.tolist()]


def page_args(v: dict, ids: torch.Tensor, mask: torch.Tensor, b: int) -> dict:
    """to_html's arguments for row b of ``padded_recording``: the grid's encoder-decoder rows pad
    the target (the source is the grid's fixed unpadded one)."""
    if v["arch"] == "encoder_decoder":
        return {"tokens": labels(source(2)[b], "s"), "target_tokens": labels(ids[b]), "target_mask": mask[b]}
    return {"tokens": labels(ids[b]), "mask": mask[b]}
