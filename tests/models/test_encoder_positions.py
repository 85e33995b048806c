"""encoder_positions: "counted" numbers a row's real tokens (RoBERTa), "columns" its columns (BERT).
Right padding: both give the same outputs on real tokens; left padding: counted == the row alone."""

from __future__ import annotations

import pytest
import torch

import torchformer as tfm

from .. import grid

ROWS = grid.variants(("encoder",))[:3]


def both(v):
    counted = grid.build(v, encoder_positions="counted", positions=tfm.Learned(offset=2))
    columns = grid.build(v, encoder_positions="columns", positions=tfm.Learned(offset=2))
    columns.load_state_dict(counted.state_dict())
    return counted, columns


@pytest.mark.parametrize("v", **grid.params(ROWS))
@torch.no_grad()
def test_counted_equals_columns_on_right_padding_and_the_row_alone_on_left_padding(v):
    counted, columns = both(v)
    ids = torch.randint(0, grid.VOCAB, (2, 12))
    right = torch.ones_like(ids)
    right[1, 8:] = 0
    real = right.bool()
    assert torch.equal(counted(ids, attention_mask=right)[real], columns(ids, attention_mask=right)[real])
    left = right.flip(1)  # row 1: 4 pads, then 8 tokens
    alone = counted(ids[1:, 4:])
    assert (counted(ids, attention_mask=left)[1, 4:] - alone[0]).abs().max() < 1e-5
    assert (columns(ids, attention_mask=left)[1, 4:] - alone[0]).abs().max() > 1e-3  # columns shift


def test_encoder_positions_is_checked_and_round_trips():
    cfg = tfm.presets.get("roberta-base")
    assert tfm.ModelConfig.from_dict(cfg.to_dict()) == cfg and cfg.encoder_positions == "counted"
    with pytest.raises(ValueError, match="encoder_positions='tokens'.*one of"):
        cfg.replace(encoder_positions="tokens")
    with pytest.raises(ValueError, match="encoder_positions='counted': only for arch='encoder'"):
        tfm.presets.get("llama-tiny", encoder_positions="counted")
