"""A tensor-parallel inference process under torchrun: the checks of a launch, the process group,
the mesh, the split model, and what every rank must agree on (the sampling seed; for a server,
each step rank 0 announces).

Every rank runs the same generation steps on its shard (the same prompt, the same sampled tokens:
one seed drawn by rank 0 and broadcast); only rank 0 prints, and only rank 0 serves HTTP
(serve/tp.py: the other ranks run each step rank 0 announces).
"""

from __future__ import annotations

import atexit
import os
import random
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .apply import tp_mesh
from .load import check_launch, load_split
from .plan import check_tp


def check_generate(tp: int, *, draft, prompt_lookup, quantize, compile: bool) -> None:
    """What ``generate --tp`` does not combine with yet, refused before any work."""
    check_launch(tp)
    for flag, value in (("--draft", draft), ("--prompt-lookup", prompt_lookup), ("--quantize", quantize),
                        ("--compile", compile or None)):  # fmt: skip
        if value is not None:
            raise ValueError(f"--tp {tp} with {flag}: not supported yet (tensor parallelism splits float weights "
                             "and runs the plain decode step); drop one of them")  # fmt: skip


def check_serve(tp: int, *, kind: str, config, quantize, compile: bool) -> None:
    """What ``serve --tp`` does not combine with yet, refused before any work (``kind``: what
    loading.model_kind says of MODEL; ``config``: its ModelConfig)."""
    check_launch(tp)
    for flag, value in (("--quantize", quantize), ("--compile", compile or None)):
        if value is not None:
            raise ValueError(f"--tp {tp} with {flag}: not supported yet (tensor parallelism splits float weights "
                             "and runs the plain decode step); drop one of them")  # fmt: skip
    if kind != "torchformer":
        raise ValueError(
            f"--tp {tp}: MODEL is a {kind} model; tensor parallelism loads a torchformer folder (config.json + "
            "model.safetensors), each rank reading its slice: convert it first (torchformer convert)"
        )
    if config.arch != "decoder":
        raise ValueError(f"--tp {tp}: serve splits decoder-only models (generation), not {config.arch!r}; "
                         "serve this one without --tp")  # fmt: skip
    check_tp(config, tp)


@dataclass
class TPSession:
    rank: int
    mesh: DeviceMesh

    @classmethod
    def start(cls, tp: int, timeout: float | None = None) -> TPSession:
        """Join torchrun's process group (NCCL on CUDA, gloo on CPU) and make the 1-D TP mesh.
        ``timeout``: seconds a collective waits for a rank before it fails (torch's default: 10 or 30
        minutes)."""
        check_launch(tp)
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if not dist.is_initialized():
            wait = {} if timeout is None else {"timeout": timedelta(seconds=timeout)}
            dist.init_process_group("nccl" if cuda else "gloo", **wait)
            atexit.register(dist.destroy_process_group)
        return cls(rank=dist.get_rank(), mesh=tp_mesh("cuda" if cuda else "cpu", tp))

    def load(self, path: str, dtype: torch.dtype | None):
        return load_split(path, self.mesh, dtype=dtype)

    def seed(self, seed: int | None) -> int:
        """The sampling seed every rank uses: the given one, or one rank 0 draws."""
        box = [seed if seed is not None else random.SystemRandom().randrange(2**31)]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def announce(self, header: tuple, tensor: torch.Tensor | None = None) -> None:
        """Rank 0: send ``header`` (small Python values) and, if given, ``tensor`` to every rank."""
        dist.broadcast_object_list([header], src=0)
        if tensor is not None:
            dist.broadcast(tensor.contiguous(), src=0)

    def receive(self) -> tuple:
        """Ranks > 0: the next header rank 0 announces."""
        box = [None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def receive_tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Ranks > 0: the tensor that came with the last header (its shape and dtype say which)."""
        out = torch.empty(shape, dtype=dtype, device=self.mesh.device_type)
        dist.broadcast(out, src=0)
        return out
