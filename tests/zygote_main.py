"""The zygote (started by tests/zygote.py): one Python process that imports torch, dynamo and
torchformer once, then forks a child per request that runs ``python -m MODULE ARGS`` or
``python -c CODE ARGS`` as a fresh interpreter would. A child costs what its command does, not the
~2.5 s of CPU that importing torch and dynamo costs every new interpreter.

Protocol, on the unix SOCK_SEQPACKET socket named by argv[1]: a client connects and sends one
JSON message ``{"argv", "cwd", "env", "setsid", "unbuffered"}`` with three file descriptors (the
child's stdin, stdout, stderr); the zygote answers ``{"pid": N}`` at once and ``{"returncode": R}``
(as subprocess gives it: -signal for a killed child) when the child has ended. A client that hangs
up before that gets its child SIGKILLed. The zygote ends, killing its children, when its stdin
closes (its test process ended).

What a child starts from is what a fresh interpreter starts from: no command has run in the zygote
(no torch op: libgomp's threads are created by the first parallel region, never here), the signal
dispositions are Python's start-up ones, and each child sets its own cwd, environment, argv,
sys.path[0] and PYTHONPATH's entries, standard streams and torch's thread count
(``OMP_NUM_THREADS``, read by OpenMP when torch loads, is applied with ``torch.set_num_threads``).
Variables that take effect only when a module is imported (``PYTHON*``, ``TORCHINDUCTOR_*``, ...)
are fixed per zygote: tests/zygote.py starts one zygote per set of them.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import sys

if __name__ == "__main__":  # a script's folder leads sys.path: tests/'s modules must not shadow others
    sys.path[0] = os.getcwd()  # the zygote's own folder (tests/zygote.py starts it there)

# What every torchformer command imports first (training runs import dynamo through the optimizer).
import torch  # noqa: E402
import torch._dynamo  # noqa: E402, F401

import torchformer.cli.main  # noqa: E402, F401

MAX_MESSAGE = 1 << 20
# Blocked across the fork and the child's set-up: a signal sent as soon as the pid is known would
# otherwise be lost (Python drops the signals it has noted but not yet handled in a forked child).
HELD = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2}


def streams(unbuffered: bool) -> None:
    """sys.stdin / stdout / stderr over fds 0-2 as the interpreter makes them: stdout block-buffered
    unless a terminal, stderr line-buffered, both write-through under PYTHONUNBUFFERED."""
    import io

    def text(fd: int, mode: str, line: bool) -> io.TextIOWrapper:
        raw = io.FileIO(fd, mode, closefd=False)
        if mode == "rb":
            buffered = io.BufferedReader(raw)
        else:
            buffered = raw if unbuffered else io.BufferedWriter(raw)
        return io.TextIOWrapper(buffered, encoding="utf-8", errors="backslashreplace" if fd == 2 else "strict",
                                line_buffering=line, write_through=unbuffered)  # fmt: skip

    sys.stdin = sys.__stdin__ = text(0, "rb", False)
    sys.stdout = sys.__stdout__ = text(1, "wb", os.isatty(1))
    sys.stderr = sys.__stderr__ = text(2, "wb", True)


def exit_code(code: object) -> int:
    """The status the interpreter exits with for ``SystemExit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def run(request: dict) -> None:
    """The command, as ``python ARGV...`` runs it."""
    import runpy
    import types

    flag, target, *args = request["argv"]
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[1:1] = [os.path.abspath(p) for p in extra]
    if flag == "-m":
        sys.argv = [target, *args]  # runpy puts the module's file in argv[0]
        sys.path[0] = os.getcwd()
        sys.modules.pop(target, None)  # imported here already; a fresh interpreter runs it once, as __main__
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:  # "-c"
        sys.argv = ["-c", *args]
        sys.path[0] = ""
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        exec(compile(target, "<string>", "exec"), main.__dict__)


def child(request: dict, fds: list[int], keep_closed: list) -> None:
    """In the forked child: become the command, then exit as the interpreter would. Never returns."""
    code, interrupted = 1, False
    try:
        for thing in keep_closed:  # the zygote's sockets and selector, and its other children's pidfds
            os.close(thing) if isinstance(thing, int) else thing.close()
        if request["setsid"]:
            os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        streams(request["unbuffered"])
        threads = request["env"].get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0:  # else torch's own default, as the zygote started without it
            torch.set_num_threads(int(threads))
        try:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD)
            run(request)
            code = 0
        except SystemExit as stop:
            code = exit_code(stop.code)
        except BaseException as error:
            import traceback

            tb = error.__traceback__  # from the command's first frame on, as the interpreter shows it
            while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
                tb = tb.tb_next
            traceback.print_exception(type(error), error, tb)
            code = 1
            interrupted = isinstance(error, KeyboardInterrupt)
        import atexit
        import threading

        threading._shutdown()  # what interpreter shutdown does first: join non-daemon threads
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a closed or broken stream: the interpreter ignores it too
                stream.flush()
        if interrupted:  # the interpreter's way: it ends itself with SIGINT, so its parent sees -SIGINT
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        os._exit(code & 0xFF)


def main() -> None:
    """Waits, without polling, on its stdin, the socket, each client's connection and each child's
    pidfd (readable once the child has ended)."""
    path = sys.argv[1]
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, ("listen", None))
    selector.register(sys.stdin, selectors.EVENT_READ, ("stdin", None))
    children: dict[int, tuple[socket.socket, int]] = {}  # pid -> (its client's connection, its pidfd)
    print("ready", flush=True)
    while True:
        for key, _ in selector.select():
            kind, pid = key.data  # what is ready, and the child it is about
            if kind == "stdin":
                if not os.read(sys.stdin.fileno(), 4096):  # the test process is gone: so are we
                    for pid in children:
                        os.kill(pid, signal.SIGKILL)
                    os._exit(0)  # nothing to tidy: no interpreter teardown (~1 s of CPU with torch loaded)
            elif kind == "listen":
                conn, _ = listener.accept()
                message, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE, 3)
                if not message or len(fds) != 3:
                    for fd in fds:
                        os.close(fd)
                    conn.close()
                    continue
                request = json.loads(message)
                signal.pthread_sigmask(signal.SIG_BLOCK, HELD)
                pid = os.fork()
                if pid == 0:
                    child(request, fds, [listener, selector, conn, *(x for pair in children.values() for x in pair)])
                signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD)
                for fd in fds:
                    os.close(fd)
                conn.send(json.dumps({"pid": pid}).encode())
                children[pid] = conn, os.pidfd_open(pid)
                selector.register(conn, selectors.EVENT_READ, ("client", pid))
                selector.register(children[pid][1], selectors.EVENT_READ, ("ended", pid))
            elif kind == "client":  # the client hung up before its child ended: the child goes too
                if not key.fileobj.recv(64):
                    os.kill(pid, signal.SIGKILL)
                    selector.unregister(key.fileobj)
            else:  # a child has ended
                conn, pidfd = children.pop(pid)
                _, status = os.waitpid(pid, 0)
                with contextlib.suppress(OSError):  # its client may be gone
                    conn.send(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode())
                with contextlib.suppress(KeyError):  # unregistered when its client hung up
                    selector.unregister(conn)
                conn.close()
                selector.unregister(pidfd)
                os.close(pidfd)


if __name__ == "__main__":
    main()
