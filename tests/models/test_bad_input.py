"""Bad inputs raise clear errors at the boundary, naming the argument, the value and the limit."""

import pytest
import torch

import torchformer as tfm

from .. import grid


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    return {arch: grid.build(grid.variants((arch,))[0]) for arch in ("decoder", "encoder", "encoder_decoder")}


def calls(models, ids):
    """One call per entry point that takes token ids."""
    dec, enc, s2s = models["decoder"], models["encoder"], models["encoder_decoder"]
    ok = torch.randint(0, grid.VOCAB, (2, 5))
    memory = s2s.encode(ok)
    return {
        "decoder": lambda: dec(ids),
        "encoder": lambda: enc(ids),
        "encoder_decoder.src": lambda: s2s(ids, ok),
        "encoder_decoder.tgt": lambda: s2s(ok, ids),
        "decode": lambda: s2s.decode(ids, memory),
    }


ENTRY_POINTS = ["decoder", "encoder", "encoder_decoder.src", "encoder_decoder.tgt", "decode"]


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize(
    "ids", [torch.rand(2, 5), torch.ones(2, 5, dtype=torch.bool), [[1, 2, 3]]], ids=["float", "bool", "list"]
)  # named ids: a random tensor's text would differ between xdist workers that seeded differently
def test_non_integer_ids_are_a_type_error(models, entry, ids):
    with pytest.raises(TypeError, match="ids"):
        calls(models, ids)[entry]()


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("bad", [grid.VOCAB, -1, 10_000])
def test_ids_outside_vocab_name_vocab_size(models, entry, bad):
    ids = torch.randint(0, grid.VOCAB, (2, 5))
    ids[1, 2] = bad
    with pytest.raises(ValueError, match=f"vocab_size={grid.VOCAB}"):
        calls(models, ids)[entry]()


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_too_long_names_max_seq_len(models, entry):
    ids = torch.randint(0, grid.VOCAB, (1, grid.MAX_LEN + 1))
    with pytest.raises(ValueError, match=f"max_seq_len={grid.MAX_LEN}") as err:
        calls(models, ids)[entry]()
    assert str(grid.MAX_LEN + 1) in str(err.value)


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_wrong_rank_or_empty_ids(models, entry):
    with pytest.raises(ValueError, match=r"shape \(batch, seq_len\)"):
        calls(models, torch.zeros(5, dtype=torch.long))[entry]()
    with pytest.raises(ValueError, match="empty"):
        calls(models, torch.zeros(2, 0, dtype=torch.long))[entry]()


def test_attention_mask_of_wrong_shape_names_both_shapes(models):
    ids = torch.randint(0, grid.VOCAB, (2, 5))
    bad = torch.ones(2, 4, dtype=torch.long)
    cases = [
        lambda: models["decoder"](ids, attention_mask=bad),
        lambda: models["encoder"](ids, attention_mask=bad),
        lambda: models["encoder_decoder"](ids, ids, src_mask=bad),
        lambda: models["encoder_decoder"](ids, ids, tgt_mask=bad),
    ]
    for call in cases:
        with pytest.raises(ValueError, match=r"\(2, 4\).*\(2, 5\)"):
            call()
    with pytest.raises(ValueError, match=r"token_type_ids.*\(2, 4\).*\(2, 5\)"):
        models["encoder"](ids, token_type_ids=bad)


def test_cache_too_small_is_a_value_error(models):
    dec, s2s = models["decoder"], models["encoder_decoder"]
    ids = torch.randint(0, grid.VOCAB, (2, 5))
    cache = dec.new_cache(2, 4)
    with pytest.raises(ValueError, match="max_len=4"):
        dec(ids, positions=torch.arange(5), cache=cache)
    cache = s2s.new_cache(2, 4, memory=s2s.encode(ids))
    with pytest.raises(ValueError, match="max_len=4"):
        s2s.decode(ids[:, :1], positions=torch.tensor([4]), cache=cache)


def test_other_cache_misuse(models):
    dec, s2s = models["decoder"], models["encoder_decoder"]
    ids = torch.randint(0, grid.VOCAB, (2, 3))
    with pytest.raises(ValueError, match="positions is required"):
        dec(ids, cache=dec.new_cache(2, 8))
    with pytest.raises(ValueError, match="batch_size=3"):
        dec(ids, positions=torch.arange(3), cache=dec.new_cache(3, 8))
    with pytest.raises(ValueError, match=f"max_seq_len={grid.MAX_LEN}"):
        dec.new_cache(2, grid.MAX_LEN + 1)
    with pytest.raises(ValueError, match="batch_size=0"):
        dec.new_cache(0, 8)
    with pytest.raises(ValueError, match=r"positions has shape \(4,\)"):
        dec(ids, positions=torch.arange(4))
    with pytest.raises(ValueError, match=r"positions has shape \(3, 3\).*\(2, 3\)"):
        dec(ids, positions=torch.arange(3).expand(3, -1))
    with pytest.raises(TypeError, match="positions must be integers"):
        dec(ids, positions=torch.arange(3.0))
    with pytest.raises(ValueError, match="outside"):
        dec(ids, positions=torch.tensor([0, 1, grid.MAX_LEN]))
    with pytest.raises(ValueError, match="decode needs memory"):
        s2s.decode(ids)
    with pytest.raises(ValueError, match="batch_size=2"):
        s2s.new_cache(2, 8, memory=s2s.encode(torch.randint(0, grid.VOCAB, (3, 4))))


def test_build_model_needs_a_config():
    with pytest.raises(TypeError, match="ModelConfig"):
        tfm.build_model({"vocab_size": 10})
