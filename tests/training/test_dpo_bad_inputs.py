"""Issue 30, bad input: each refused with one clear error naming the field, the value and what is
allowed, before any tensor work, and nothing written."""

from __future__ import annotations

import json

import pytest

from torchformer.training import recipe as recipes
from torchformer.training.recipe_files import apply_overrides, read_file
from torchformer.training.train import train

GOOD = {"prompt": "cab:", "chosen": "abc", "rejected": "bca"}


def _load(*overrides):
    return recipes.from_dict(apply_overrides(read_file("dpo-tiny"), list(overrides)))


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["preference.loss_type=sigmod"], r"preference.loss_type='sigmod': must be one of \['hinge', 'ipo', 'robust', "
                                          r"'sigmoid'\]"),
        (["preference.beta=0"], r"preference.beta=0: must be a number > 0"),
        (["preference.beta=-0.1"], r"preference.beta=-0.1: must be a number > 0"),
        (["preference.label_smoothing=0.5"], r"preference.label_smoothing=0.5: must be a number >= 0.0 and < 0.5"),
        (["preference.loss_type=hinge", "preference.label_smoothing=0.1"],
         r"label_smoothing=0.1 with loss_type='hinge': label smoothing applies to loss_type \['robust', 'sigmoid'\]"),
        (["preference.gamma=1.0"], r"unknown key\(s\) \['preference.gamma'\] for train.objective='dpo'; allowed: "
                                   r"\['beta', 'label_smoothing', 'loss_type'\]"),
        (["train.objective=kto"], r"train.objective='kto': must be one of \['dpo', 'orpo', 'simpo'\]"),
        (["train.objective=null"], r"recipe section preference=\{'beta': 0.1\} needs train.objective"),
        (["train.objective=simpo", "preference.gamma=-1"], r"preference.gamma=-1: must be a number >= 0"),
        (["finetune.reference=llama-tiny"], r"finetune.reference='llama-tiny' is a preset, a model with random "
                                            r"weights"),
    ],
)  # fmt: skip
def test_bad_settings_are_refused_at_recipe_load(overrides, message):
    with pytest.raises(ValueError, match=message):
        _load(*overrides)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["data.pack=true"], r"data.pack=true: not supported with train.objective='dpo' yet"),
        (["dist.strategy=fsdp"], r"dist.strategy='fsdp': not supported with train.objective='dpo' yet; use ddp"),
        (["train.label_smoothing=0.1"], r"train.label_smoothing=0.1: a token-loss setting; with "
                                        r"train.objective='dpo' use preference.label_smoothing"),
        (["data.instruct=true"], r"data.instruct=true: train.objective='dpo' reads preference pairs"),
        (["data.task=mlm"], r"train.objective='dpo': needs data.task 'lm'"),
    ],
)  # fmt: skip
def test_unsupported_combinations_are_refused_before_any_work(tmp_path, overrides, message):
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=message):
        train(_load(*overrides, f"train.out_dir={out}"))
    assert not out.exists()


@pytest.mark.parametrize(
    "row,message",
    [
        ({"prompt": "x:", "rejected": "b"}, r"p.jsonl:3: missing 'chosen'; each line needs"),
        ({"prompt": "x:", "chosen": "a"}, r"p.jsonl:3: missing 'rejected'; each line needs"),
        ({"prompt": "x:", "chosen": "ab", "rejected": "ab"}, r"p.jsonl:3: 'chosen' and 'rejected' are the same "
                                                             r"text \('ab'\): nothing to prefer"),
        ({"chosen": "a", "rejected": "b"}, r"p.jsonl:3: needs exactly one of 'prompt' and 'messages'"),
        ({"prompt": "x:", "chosen": 7, "rejected": "b"}, r"p.jsonl:3: 'chosen' must be a non-empty string or one "
                                                         r"assistant message, got 7"),
        ({"prompt": "x:", "chosen": [{"role": "user", "content": "a"}], "rejected": "b"},
         r"p.jsonl:3: 'chosen' as a message must have role 'assistant', got 'user'"),
        ({"messages": [{"role": "user"}], "chosen": "a", "rejected": "b"},
         r"p.jsonl:3: each message in 'messages' needs string fields 'role' and 'content'"),
    ],
)  # fmt: skip
def test_bad_preference_rows_are_named_by_line_before_any_work(tmp_path, row, message):
    source = tmp_path / "p.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in (GOOD, GOOD, row, GOOD)))
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=message):
        train(_load(f"data.source={source}", f"train.out_dir={out}"))
    assert not out.exists()


def test_moe_model_is_refused_before_training(tmp_path):
    """A mixture-of-experts policy: its router losses are not part of the preference objectives yet."""
    out = tmp_path / "run"
    raw = apply_overrides(read_file("dpo-tiny"), [f"train.out_dir={out}", "train.device=cpu"])
    raw["model"] = {"preset": "moe-tiny", "max_seq_len": 32}
    with pytest.raises(ValueError, match=r"mixture-of-experts models are not supported with preference objectives"):
        train(recipes.from_dict(raw))
    assert not out.exists()
