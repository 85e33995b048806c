"""A tensor-parallel inference process under torchrun: the checks of a launch, the process group,
the mesh, the split model, and what every rank must agree on (the sampling seed).

Every rank runs the same generation steps on its shard (the same prompt, the same sampled tokens:
one seed drawn by rank 0 and broadcast); only rank 0 prints.
"""

from __future__ import annotations

import atexit
import os
import random
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .apply import tp_mesh
from .load import check_launch, load_split


def check_generate(tp: int, *, draft, prompt_lookup, quantize, compile: bool) -> None:
    """What ``generate --tp`` does not combine with yet, refused before any work."""
    check_launch(tp)
    for flag, value in (("--draft", draft), ("--prompt-lookup", prompt_lookup), ("--quantize", quantize),
                        ("--compile", compile or None)):  # fmt: skip
        if value is not None:
            raise ValueError(f"--tp {tp} with {flag}: not supported yet (tensor parallelism splits float weights "
                             "and runs the plain decode step); drop one of them")  # fmt: skip


@dataclass
class TPSession:
    rank: int
    mesh: DeviceMesh

    @classmethod
    def start(cls, tp: int) -> TPSession:
        """Join torchrun's process group (NCCL on CUDA, gloo on CPU) and make the 1-D TP mesh."""
        check_launch(tp)
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if not dist.is_initialized():
            dist.init_process_group("nccl" if cuda else "gloo")
            atexit.register(dist.destroy_process_group)
        return cls(rank=dist.get_rank(), mesh=tp_mesh("cuda" if cuda else "cpu", tp))

    def load(self, path: str, dtype: torch.dtype | None):
        return load_split(path, self.mesh, dtype=dtype)

    def seed(self, seed: int | None) -> int:
        """The sampling seed every rank uses: the given one, or one rank 0 draws."""
        box = [seed if seed is not None else random.SystemRandom().randrange(2**31)]
        dist.broadcast_object_list(box, src=0)
        return box[0]
