"""Child Python processes without paying torch's import each time: ``Popen`` and ``run`` take the
command lines the suite gives ``subprocess`` (``[sys.executable, "-m", MODULE, ...]`` or
``[sys.executable, "-c", CODE, ...]``) and fork them from a zygote that has imported torch, dynamo
and torchformer (tests/zygote_main.py says what a child starts from). The child is a real process
of its own: its pid can be signalled, SIGKILLed mid-write, put in a session of its own
(``start_new_session``), and it exits with the interpreter's status.

``slot`` picks one of several zygotes, each its own interpreter with its own string-hash seed:
processes that must not share one (two ranks of a job, two runs compared for equal bytes) take
different slots, as two fresh interpreters would differ. Environments that change what happens at
import time (``PYTHON*``, ``TORCHINDUCTOR_*``, ``LD_*``, ...) get a zygote of their own; a command
line that does not start with the test's own interpreter is refused.
"""

from __future__ import annotations

import atexit
import io
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

SERVER = Path(__file__).with_name("zygote_main.py")
START_LIMIT = 120  # s for a zygote to import torch and listen
# Variables read when the interpreter, torch or inductor start, not when a command runs (not
# KMP_*: Intel's OpenMP reads them, torch's CPU wheel loads GNU's; sklearn, joblib and inductor set
# them in the test process as they load) ...
AT_IMPORT = ("PYTHON", "TORCH", "LD_", "OMP_", "MKL_", "GOMP_", "CUDA")
# ... except these, applied per child (tests/zygote_main.py) or read by torch and torchformer only
# when a command calls for them (inductor sets TORCHINDUCTOR_CACHE_DIR itself on its first compile).
AT_RUN = ("PYTHONUNBUFFERED", "PYTHONPATH", "OMP_NUM_THREADS", "TORCHFORMER_", "TORCHELASTIC_",
          "TORCHINDUCTOR_CACHE_DIR", "TORCH_EXTENSIONS_DIR")  # fmt: skip


def import_key(env: dict[str, str]) -> tuple:
    """The variables of ``env`` a zygote must have been started with."""
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(AT_IMPORT) and not k.startswith(AT_RUN)))


class Zygote:
    """One zygote process: started at once, waited for at its first use (``address``), so that
    several start side by side."""

    def __init__(self, env: dict[str, str]) -> None:
        self.folder = tempfile.mkdtemp(prefix="zygote-")
        self.path, self.ready = os.path.join(self.folder, "socket"), False
        self.log = open(os.path.join(self.folder, "log"), "w+")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen([sys.executable, str(SERVER), self.path], env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, cwd=self.folder)  # fmt: skip

    def address(self) -> str:
        """Its socket's path, once it listens."""
        if not self.ready:
            said: list[bytes] = []
            reader = threading.Thread(target=lambda: said.append(self.proc.stdout.readline()), daemon=True)
            reader.start()
            reader.join(START_LIMIT)
            if said != [b"ready\n"]:
                self.log.seek(0)
                log = self.log.read()[-3000:]
                self.close()
                raise RuntimeError(f"the zygote did not start in {START_LIMIT} s: {log}")
            self.ready = True
        return self.path

    def hang_up(self) -> None:
        if not self.proc.stdin.closed:
            self.proc.stdin.close()  # it kills its children and exits at end of input

    def close(self) -> None:
        if self.proc.poll() is None:
            self.hang_up()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        for name in ("socket", "log"):
            Path(self.folder, name).unlink(missing_ok=True)
        os.rmdir(self.folder)


_ZYGOTES: dict[tuple, Zygote] = {}
_LOCK = threading.Lock()


def zygote(env: dict[str, str], slot: int) -> Zygote:
    key = (import_key(env), slot)
    with _LOCK:
        if key not in _ZYGOTES or _ZYGOTES[key].proc.poll() is not None:
            _ZYGOTES[key] = Zygote({k: v for k, v in env.items() if not k.startswith(AT_RUN)})
        return _ZYGOTES[key]


@atexit.register
def close_all() -> None:
    """Every zygote at once: each ends when its input closes."""
    zygotes = list(_ZYGOTES.values())
    _ZYGOTES.clear()
    for zygote in zygotes:
        zygote.hang_up()
    for zygote in zygotes:
        zygote.close()


def _command(cmd: list[str]) -> list[str]:
    if len(cmd) < 3 or cmd[0] != sys.executable or cmd[1] not in ("-m", "-c"):
        raise ValueError(f"a zygote runs [sys.executable, '-m' or '-c', ...], not {cmd[:3]}")
    return list(cmd[1:])


class Popen:
    """``subprocess.Popen`` for a forked child: pid, poll, wait, send_signal / terminate / kill,
    communicate, returncode and the stdin / stdout / stderr pipes (PIPE, DEVNULL, STDOUT for stderr,
    None to inherit, or an open file)."""

    def __init__(self, cmd: list[str], *, cwd=None, env=None, stdin=None, stdout=None, stderr=None,
                 text: bool = False, start_new_session: bool = False, slot: int = 0) -> None:  # fmt: skip
        self.args, self.returncode = cmd, None
        env = dict(os.environ if env is None else env)
        request = {"argv": _command(cmd), "cwd": str(cwd or os.getcwd()), "env": env, "setsid": start_new_session,
                   "unbuffered": bool(env.get("PYTHONUNBUFFERED"))}  # fmt: skip
        theirs: list[int] = []  # the child's ends, closed here once sent
        self.stdin, fd0 = self._end(stdin, 0, "wb", theirs)
        self.stdout, fd1 = self._end(stdout, 1, "rb", theirs)
        if stderr == subprocess.STDOUT:
            self.stderr, fd2 = None, fd1
        else:
            self.stderr, fd2 = self._end(stderr, 2, "rb", theirs)
        if text:
            self.stdin = self.stdin and io.TextIOWrapper(self.stdin, write_through=True)
            self.stdout = self.stdout and io.TextIOWrapper(self.stdout)
            self.stderr = self.stderr and io.TextIOWrapper(self.stderr)
        self.conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.conn.connect(zygote(env, slot).address())
            socket.send_fds(self.conn, [json.dumps(request).encode()], [fd0, fd1, fd2])
            self.pid = json.loads(self.conn.recv(4096))["pid"]
        finally:
            for fd in theirs:
                os.close(fd)

    @staticmethod
    def _end(how, fd: int, mode: str, theirs: list[int]):
        """(our end or None, the fd the child gets as ``fd``)."""
        if how == subprocess.PIPE:
            read, write = os.pipe()
            ours, child = (write, read) if mode == "wb" else (read, write)
            theirs.append(child)
            return open(ours, mode), child  # noqa: SIM115
        if how == subprocess.DEVNULL:
            child = os.open(os.devnull, os.O_RDWR)
            theirs.append(child)
            return None, child
        if how is None:
            return None, fd
        return None, how if isinstance(how, int) else how.fileno()

    def poll(self) -> int | None:
        if self.returncode is None:
            self.conn.setblocking(False)
            try:
                self._take(self.conn.recv(4096))
            except BlockingIOError:
                pass
            finally:
                if self.returncode is None:
                    self.conn.setblocking(True)
        return self.returncode

    def _take(self, message: bytes) -> None:
        if not message:
            raise RuntimeError(f"the zygote ended before pid {self.pid} did")
        self.returncode = json.loads(message)["returncode"]
        self.conn.close()

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.conn.settimeout(timeout)
            try:
                self._take(self.conn.recv(4096))
            except TimeoutError:
                raise subprocess.TimeoutExpired(self.args, timeout) from None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, input=None, timeout: float | None = None) -> tuple:
        """Feed ``input``, read stdout and stderr to their ends (threads, as Popen does where it
        cannot select), wait; on ``timeout`` raise TimeoutExpired and leave the child running."""
        if self.stdin is not None:
            if input:
                self.stdin.write(input)
            self.stdin.close()
        if not hasattr(self, "_readers"):
            self._got: dict[str, object] = {}
            self._readers = [
                threading.Thread(
                    target=lambda n=name, s=stream: self._got.__setitem__(n, s.read()), daemon=True
                )  # fmt: skip
                for name, stream in (("stdout", self.stdout), ("stderr", self.stderr))
                if stream
            ]
            for reader in self._readers:
                reader.start()
        for reader in self._readers:
            reader.join(timeout)
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(timeout)
        for stream in (self.stdout, self.stderr):
            if stream:
                stream.close()
        return self._got.get("stdout"), self._got.get("stderr")


def run(cmd: list[str], *, input=None, capture_output: bool = False, timeout: float | None = None, slot: int = 0,
        **kwargs) -> subprocess.CompletedProcess:  # fmt: skip
    """``subprocess.run`` for a forked child; past ``timeout`` the child is killed, then
    TimeoutExpired raised."""
    if capture_output:
        kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    proc = Popen(cmd, slot=slot, **kwargs)
    try:
        out, err = proc.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
