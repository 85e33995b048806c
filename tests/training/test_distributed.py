"""Issue 4, test 4: DDP (and FSDP2) on CPU with gloo, 2 processes with torchrun's environment
(tests/parallel/launch.py ``ranks``), give the weights of a single process with the same global batch
after 5 steps, within 1e-5."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from torchformer.training.train import train

from ..parallel.launch import ranks
from .tiny import tiny_recipe


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_processes_equal_one(tmp_path, corpus, strategy):
    def make(out):
        return tiny_recipe(
            out, corpus, train={"steps": 5, "batch_size": 8, "grad_accum": 2}, dist={"strategy": strategy}
        )

    single = train(make(tmp_path / "single"))
    recipe_file = tmp_path / "ddp.json"
    recipe_file.write_text(json.dumps(make(tmp_path / "ddp").to_dict()))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = ranks(2, "torchformer.cli.main", "train", "--recipe", str(recipe_file), timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("done: step 5") == 1  # rank 0 alone reports
    ddp = load_file(str(tmp_path / "ddp" / "model.safetensors"))
    ref = {k: v for k, v in single.model.state_dict().items() if k in ddp}
    assert ddp.keys() == ref.keys()
    for name, tensor in ddp.items():
        torch.testing.assert_close(tensor, ref[name], atol=1e-5, rtol=0, msg=name)


def test_teardown_keeps_its_barrier_for_the_main_thread_to_free(tmp_path):
    """The end-of-run barrier's Work stays referenced from Python after the group goes, so gloo's
    worker thread never frees it (and the works it waited on, whose tensors need the GIL) while
    the main thread joins that thread: the exit hang of a DDP run (training/distributed.py)."""
    import torch.distributed as dist

    from torchformer.training import distributed

    for _ in range(2):  # each run's teardown replaces the last one's
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
        before = list(distributed._LAST_BARRIER)
        assert distributed.teardown() is False
        assert not dist.is_initialized()
        (work,) = distributed._LAST_BARRIER
        assert work.is_completed() and all(work is not w for w in before)
        (tmp_path / "store").unlink(missing_ok=True)
