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
