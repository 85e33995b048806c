"""Issue 31: training with tensor parallelism. Two steps under TP=2 (2 processes) give the single
process's parameters within 1e-5 (the same global batch; the loss summed over vocabulary-sharded
logits, never gathered). FSDP(2) x TP(2) against one process is in test_dcp.py."""

import pytest
import torch
from safetensors.torch import load_file

from torchformer.training.train import train

from ..training.tiny import tiny_recipe, words_text
from .cases import train_recipe

pytestmark = pytest.mark.xdist_group("parallel")


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("single")
    return {k: v.detach() for k, v in train(train_recipe(tmp, "single")).model.state_dict().items()}


# FSDP(2) x TP(2) (4 processes) against one process: test_dcp.py (its run saves sharded checkpoints).
def test_a_tensor_parallel_step_equals_the_single_process_step(launched, single):
    ranks = [r["train"] for r in launched["ranks"]]  # dist.strategy tp, dist.tp 2: run by conftest.py's launch
    assert [r["status"] for r in ranks] == [0, 0]
    assert [r["stdout"].count("done: step 2") for r in ranks] == [1, 0]  # rank 0 alone reports
    saved = load_file(str(launched["tmp"] / "run" / "model.safetensors"))
    assert saved.keys() == {k for k in single if k in saved} and len(saved) > 10
    # Two AdamW steps at lr 3e-3 move every weight by ~1e-3, so an untrained or half-trained copy fails.
    for name, tensor in saved.items():
        torch.testing.assert_close(tensor, single[name], atol=1e-5, rtol=0, msg=name)


@pytest.mark.parametrize(
    ("strategy", "tp", "world", "match"),
    [
        ("tp", 2, 1, r"dist.strategy='tp' needs several processes: launch with torchrun --nproc_per_node N"),
        ("tp", 3, 4, r"dist.tp=3: with dist.strategy 'tp' every rank is in the TP group \(tp = world = 4\)"),
        ("fsdp+tp", 3, 4, r"dist.tp=3: 'fsdp\+tp' needs 2 <= tp < world=4 with tp dividing the world"),
        ("fsdp+tp", 4, 4, r"dist.tp=4: 'fsdp\+tp' needs 2 <= tp < world=4"),
        ("ddp", 2, 2, r"dist.tp=2 needs dist.strategy 'tp' or 'fsdp\+tp', not 'ddp'"),
        ("tp", 0, 2, r"dist.tp=0: must be an integer >= 1"),
        ("pp", 1, 2, r"dist.strategy='pp': must be one of \['ddp', 'fsdp', 'tp', 'fsdp\+tp'\]"),
    ],
)
def test_a_layout_the_launch_cannot_make_is_refused_before_any_work(strategy, tp, world, match):
    from torchformer.training.distributed import check_layout

    with pytest.raises(ValueError, match=match):
        check_layout(strategy, tp, world)


@pytest.mark.parametrize(
    ("sections", "match"),
    [
        ({"dist": {"strategy": "tp", "tp": 2}, "train": {"label_smoothing": 0.1}}, r"train.label_smoothing=0.1 is not"),
        ({"dist": {"checkpoint": "whole"}}, r"dist.checkpoint='whole': must be one of \['full', 'sharded'\]"),
        ({"dist": {"checkpoint": "sharded"}, "finetune": {"lora": {"rank": 4}}}, r"not supported with finetune.lora"),
    ],
)
def test_what_tp_training_does_not_cover_yet_is_refused(tmp_path, sections, match):
    from torchformer.training.recipe import check

    (tmp_path / "corpus.txt").write_text(words_text(10))
    with pytest.raises(ValueError, match=match):
        check(tiny_recipe(tmp_path / "run", tmp_path / "corpus.txt", **sections))
