"""The resident `torchformer` of one docs page (started by tests/docs/resident.py as
``resident_main.py SCRATCH``, SCRATCH a folder for the calls' output files): reads one JSON
request a line on its stdin, ``{"argv": [...], "cwd": "...", "env": {...}}``, runs
``torchformer.cli.main.main(argv)`` as the console script would, and answers one JSON line,
``{"code": int, "stdout": str, "stderr": str}``, on its stdout.

Each call gets its own file descriptors 1 and 2 (so output from C code and threads is caught
too), its own cwd, environment and sys.argv, and the process state a fresh console script starts
from: torch's thread count, default dtype, determinism flag, grad mode and random
generator, the root logger, warning filters; dynamo's caches are dropped after a call.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import traceback
import warnings
from pathlib import Path

# The exit statuses of the interpreter, as the zygote (tests/zygote_main.py) makes them too.
sys.path[0] = str(Path(__file__).resolve().parents[1])
from zygote_main import exit_code  # noqa: E402

# The console script's sys.path[0] is the venv's bin folder, not this file's folder.
sys.path[0] = os.path.dirname(sys.executable)

import torch  # noqa: E402 (the state below is torch's pristine one, before any command ran)

from torchformer.cli.main import main  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(sys.executable), "torchformer")


class Fresh:
    """What a console script would start from, taken before the first call, put back before each."""

    def __init__(self) -> None:
        self.threads = torch.get_num_threads()
        self.dtype = torch.get_default_dtype()
        self.deterministic = (torch.are_deterministic_algorithms_enabled(),
                              torch.is_deterministic_algorithms_warn_only_enabled())  # fmt: skip
        self.seed = torch.initial_seed()
        self.root = (logging.root.level, list(logging.root.handlers))
        self.filters = list(warnings.filters)
        self.streams = (sys.stdout, sys.stderr)

    def restore(self, cwd: str, argv: list[str], env: dict[str, str]) -> None:
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        sys.argv = [SCRIPT, *argv]
        sys.stdout, sys.stderr = self.streams
        torch.set_num_threads(self.threads)
        torch.set_default_dtype(self.dtype)
        torch.use_deterministic_algorithms(self.deterministic[0], warn_only=self.deterministic[1])
        torch.set_grad_enabled(True)
        torch.manual_seed(self.seed)
        logging.root.setLevel(self.root[0])
        logging.root.handlers[:] = self.root[1]
        warnings.filters[:] = self.filters
        if "torch._dynamo" in sys.modules:
            torch._dynamo.reset()


def call(argv: list[str]) -> int:
    try:
        return exit_code(main(argv))
    except SystemExit as stop:
        return exit_code(stop.code)
    except BaseException:  # what the interpreter does with an uncaught exception
        traceback.print_exc()
        return 1


def captured(argv: list[str], scratch: str) -> dict:
    sys.stdout.flush()  # nothing written before the call lands in its output
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    paths = os.path.join(scratch, "stdout"), os.path.join(scratch, "stderr")
    try:
        for fd, path in zip((1, 2), paths, strict=True):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(target, fd)
            os.close(target)
        code = call(argv)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, copy in zip((1, 2), saved, strict=True):
            os.dup2(copy, fd)
            os.close(copy)
    out, err = (Path(p).read_text(encoding="utf-8", errors="replace") for p in paths)
    return {"code": code, "stdout": out, "stderr": err}


def serve(scratch: str) -> None:
    requests = os.fdopen(os.dup(0), "r", encoding="utf-8")
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # a command reading stdin reads nothing, as under bash -c with no input
    os.dup2(2, 1)  # stray output between calls goes to the log, never into the replies
    fresh = Fresh()
    for line in requests:
        request = json.loads(line)
        fresh.restore(request["cwd"], request["argv"], request["env"])
        replies.write(json.dumps(captured(request["argv"], scratch)) + "\n")
        replies.flush()


if __name__ == "__main__":
    serve(sys.argv[1])  # the caller's folder: a killed resident leaves nothing in /tmp
