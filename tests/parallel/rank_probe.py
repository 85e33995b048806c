"""``python -m tests.parallel.rank_probe [FAIL_RANK]`` on several ranks (tests/test_zygote.py): each
rank joins the process group (env:// rendezvous, gloo), all-reduces its rank and prints one JSON
line; rank FAIL_RANK instead exits 3 at once while the others wait in a barrier forever."""

import json
import os
import sys

import torch
import torch.distributed as dist

rank = int(os.environ["RANK"])
if len(sys.argv) > 1 and rank == int(sys.argv[1]):
    sys.exit(3)
dist.init_process_group("gloo")
if len(sys.argv) > 1:
    dist.barrier()  # never passes: a rank is missing
total = torch.tensor([rank])
dist.all_reduce(total)
row = {"rank": rank, "world": dist.get_world_size(), "sum": int(total), "hash": hash("rank_probe"), "pid": os.getpid()}
sys.stdout.write(json.dumps(row) + "\n")  # one write: the ranks share the pipe (print writes the newline apart)
sys.stdout.flush()
dist.destroy_process_group()
