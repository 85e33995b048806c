"""One `torchformer` process fed command lines one by one (tests/docs/resident_main.py runs them):
the docs pages' plain command lines (tests/docs/test_examples.py, one process for all pages) and
the README's (tests/test_front_door.py), so that torch's import is paid once, not once a line."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from tests import zygote

CHILD = Path(__file__).with_name("resident_main.py")


@dataclass
class Done:
    returncode: int
    stdout: str
    stderr: str


class Resident:
    """Started on the first call; ``close()`` ends it. ``log``: where its own stderr goes."""

    def __init__(self, log: Path) -> None:
        self.log = log
        self.proc: zygote.Popen | None = None
        self.replies: queue.Queue[str] = queue.Queue()

    def start(self, cwd: Path, env: dict[str, str]) -> zygote.Popen:
        scratch = self.log.with_name(f"{self.log.stem}-scratch")  # the call outputs, beside the log
        scratch.mkdir(exist_ok=True)
        script = (f"import runpy, sys; sys.argv = [{str(CHILD)!r}, {str(scratch)!r}]; "
                  f"runpy.run_path({str(CHILD)!r}, run_name='__main__')")  # as `python CHILD SCRATCH`  # fmt: skip
        with open(self.log, "w") as log:  # forked from the zygote (tests/zygote.py): no torch import of its own
            proc = zygote.Popen([sys.executable, "-c", script], cwd=cwd, env=env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=log, text=True)  # fmt: skip
        self.replies = queue.Queue()
        threading.Thread(target=self.read, args=(proc, self.replies), daemon=True).start()
        return proc

    @staticmethod
    def read(proc: zygote.Popen, replies: queue.Queue[str]) -> None:
        for line in proc.stdout:
            replies.put(line)
        replies.put("")  # end of output: the process has died

    def run(self, argv: list[str], cwd: Path, env: dict[str, str], timeout: float) -> Done:
        """`torchformer ARGV...` in ``cwd`` with ``env`` as os.environ (variables read when torch or
        torchformer is imported come from the first call's); the process is killed (and
        TimeoutError raised) past ``timeout`` s."""
        if self.proc is None:
            self.proc = self.start(cwd, env)
        self.proc.stdin.write(json.dumps({"argv": argv, "cwd": str(cwd), "env": env}) + "\n")
        self.proc.stdin.flush()
        try:
            reply = self.replies.get(timeout=timeout)
        except queue.Empty:
            self.close(kill=True)
            raise TimeoutError(f"torchformer {' '.join(argv)}: no answer in {timeout} s (killed)") from None
        if not reply:
            self.close(kill=True)
            raise RuntimeError(f"torchformer {' '.join(argv)}: the resident process died; its log:\n"
                               f"{self.log.read_text()[-3000:]}")  # fmt: skip
        answer = json.loads(reply)
        return Done(answer["code"], answer["stdout"], answer["stderr"])

    def close(self, kill: bool = False) -> None:
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        try:
            if kill:
                proc.kill()
            proc.stdin.close()  # the child's loop ends at end of input
            proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
