"""``python -m tests.parallel.die_in_dcp STEP RANK <torchformer args>`` (under torchrun): rank RANK
is killed (SIGKILL) right after its shard of step STEP's sharded checkpoint is on disk, before the
checkpoint's metadata is written and the folder published: a rank dying mid-checkpoint."""

import os
import signal
import sys

from torch.distributed.checkpoint import filesystem

from torchformer.cli.main import main

STEP, RANK = int(sys.argv[1]), int(sys.argv[2])
real = filesystem.FileSystemWriter.write_data


def write_data(self, plan, planner):
    written = real(self, plan, planner)
    if f"step_{STEP:06d}" in str(self.path) and int(os.environ["RANK"]) == RANK:
        written.wait()  # this rank's shard file is complete
        os.kill(os.getpid(), signal.SIGKILL)
    return written


filesystem.FileSystemWriter.write_data = write_data
sys.argv = ["torchformer", *sys.argv[3:]]
sys.exit(main())
