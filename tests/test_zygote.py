"""The zygote the suite forks its child processes from (tests/zygote.py) against what it stands for,
a fresh interpreter (``subprocess``): the same exit statuses, output, argv, cwd, sys.path[0],
environment and thread count; signals and kills reach the child, even at once; a child whose client
hangs up, or whose test process dies, does not outlive it. And the rank launcher built on it
(tests/parallel/launch.py ``ranks``): torchrun's environment, a rendezvous, distinct string-hash
seeds, and one failed rank ends the others."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests import zygote
from tests.parallel.launch import ROOT, _stat, ranks

pytestmark = pytest.mark.xdist_group("zygote")  # one worker: its zygotes start once

PY = sys.executable
COMMANDS = {
    "exit-3": [PY, "-c", "import sys; print('out'); sys.exit(3)"],
    "exit-message": [PY, "-c", "import sys; sys.exit('a message')"],
    "exit-minus-1": [PY, "-c", "import sys; sys.exit(-1)"],
    "uncaught": [PY, "-c", "def f():\n    raise ValueError('boom')\nf()"],
    "sigkill-self": [PY, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"],
    "keyboard-interrupt": [PY, "-c", "raise KeyboardInterrupt"],
    "argv-cwd-env-path": [PY, "-c", "import os, sys; print(sys.argv, os.getcwd(), os.environ['PROBE'], sys.path[:1])",
                          "a", "b c"],  # fmt: skip
    "module": [PY, "-m", "torchformer.cli.main", "--version"],
    "module-main": [PY, "-m", "tests.zygote_probe_main", "x"],
    "stderr-and-stdout": [PY, "-c", "import sys; print('to err', file=sys.stderr); print('to out')"],
}


@pytest.fixture(scope="module")
def probe_module(tmp_path_factory):
    """A module for ``-m`` that prints its __name__, argv[0]'s file name and sys.path[0]."""
    folder = tmp_path_factory.mktemp("probe")
    (folder / "tests").mkdir()
    (folder / "tests" / "zygote_probe_main.py").write_text(
        "import os, sys\nprint(__name__, os.path.basename(sys.argv[0]), sys.argv[1:], sys.path[0] == os.getcwd())\n"
    )
    return folder


@pytest.mark.parametrize("name", list(COMMANDS))
def test_a_forked_child_ends_and_speaks_as_a_fresh_interpreter(name, tmp_path, probe_module):
    env = {**os.environ, "PROBE": "seen", "OMP_NUM_THREADS": "1"}
    cwd = probe_module if name == "module-main" else tmp_path
    fresh = subprocess.run(COMMANDS[name], capture_output=True, text=True, env=env, cwd=cwd, timeout=60)
    forked = zygote.run(COMMANDS[name], capture_output=True, text=True, env=env, cwd=cwd, timeout=60)
    assert forked.returncode == fresh.returncode, (forked, fresh)
    assert forked.stdout == fresh.stdout
    assert forked.stderr == fresh.stderr
    if name == "uncaught":  # the traceback starts at the command, as the interpreter's does
        assert fresh.stderr.startswith("Traceback") and 'File "<string>", line 3' in fresh.stderr
    if name == "module-main":
        assert fresh.stdout.split() == ["__main__", "zygote_probe_main.py", "['x']", "True"]


def test_the_thread_count_follows_omp_num_threads_per_child():
    cmd = [PY, "-c", "import torch; print(torch.get_num_threads())"]
    for threads in ("1", "2"):
        env = {**os.environ, "OMP_NUM_THREADS": threads}
        assert zygote.run(cmd, capture_output=True, text=True, env=env).stdout.strip() == threads
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    fresh = subprocess.run(cmd, capture_output=True, text=True, env=env).stdout
    assert zygote.run(cmd, capture_output=True, text=True, env=env).stdout == fresh


def test_input_goes_in_and_unbuffered_output_comes_out_as_it_is_written():
    done = zygote.run([PY, "-c", "print(input()[::-1])"], input="zygote\n", capture_output=True, text=True)
    assert done.stdout == "etogyz\n"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = zygote.Popen([PY, "-c", "import time; print('first'); time.sleep(60)"], stdout=subprocess.PIPE, env=env,
                        text=True)  # fmt: skip
    try:
        assert proc.stdout.readline() == "first\n"  # while the child still sleeps
        assert proc.poll() is None
    finally:
        proc.kill()
    assert proc.wait(10) == -signal.SIGKILL


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_a_signal_sent_as_soon_as_the_pid_is_known_is_not_lost(sig):
    proc = zygote.Popen([PY, "-c", "import time; time.sleep(60)"], stderr=subprocess.DEVNULL)
    proc.send_signal(sig)
    assert proc.wait(20) == -sig


def test_a_new_session_is_its_own_process_group_and_the_default_is_not():
    alone = zygote.Popen([PY, "-c", "import time; time.sleep(60)"], start_new_session=True)
    shared = zygote.Popen([PY, "-c", "import time; time.sleep(60)"])
    try:
        assert os.getpgid(alone.pid) == alone.pid and os.getsid(alone.pid) == alone.pid
        assert os.getpgid(shared.pid) != shared.pid
        os.killpg(alone.pid, signal.SIGKILL)  # what the resume tests do to a run
        assert alone.wait(10) == -signal.SIGKILL and shared.poll() is None
    finally:
        shared.kill()
        shared.wait(10)


def test_slots_get_interpreters_of_their_own():
    cmd = [PY, "-c", "print(hash('torchformer'))"]
    seeds = {zygote.run(cmd, capture_output=True, text=True, slot=s).stdout for s in (0, 1)}
    assert len(seeds) == 2  # as two fresh interpreters (PYTHONHASHSEED unset: random)


def test_only_variables_read_at_start_up_pick_another_zygote():
    """A variable the interpreter, torch or inductor read as they start (a hash seed, inductor's
    settings, the loader's path) needs a zygote started with it; one a command reads when it runs,
    or that a child applies itself, does not (so the suite starts few zygotes)."""
    base = {"HOME": "/root", "PATH": "/usr/bin", "OMP_WAIT_POLICY": "PASSIVE"}
    key = zygote.import_key(base)
    for name, value in [("PYTHONHASHSEED", "7"), ("TORCHINDUCTOR_FREEZING", "1"), ("TORCH_LOGS", "dynamo"),
                        ("LD_PRELOAD", "x.so"), ("OMP_WAIT_POLICY", "ACTIVE"), ("PYTHONMALLOC", "malloc")]:  # fmt: skip
        assert zygote.import_key({**base, name: value}) != key, name
    for name, value in [("OMP_NUM_THREADS", "1"), ("PYTHONUNBUFFERED", "1"), ("PYTHONPATH", "/x"),
                        ("TORCHFORMER_NATIVE", "0"), ("TORCHELASTIC_RUN_ID", "a"), ("KMP_BLOCKTIME", "0"),
                        ("TORCHINDUCTOR_CACHE_DIR", "/c"), ("TORCH_EXTENSIONS_DIR", "/e"), ("RANK", "1")]:  # fmt: skip
        assert zygote.import_key({**base, name: value}) == key, name


def gone(pid: int, within: float = 10) -> bool:
    end = time.monotonic() + within
    while _stat(pid) is not None and time.monotonic() < end:
        time.sleep(0.05)
    return _stat(pid) is None


def test_a_child_whose_client_hangs_up_is_killed():
    proc = zygote.Popen([PY, "-c", "import time; time.sleep(60)"])
    proc.conn.close()  # as when the client process dies
    assert gone(proc.pid)


def test_neither_zygotes_nor_children_outlive_the_test_process(tmp_path):
    """A test process's zygotes end with it (atexit closes their input; a killed test process
    closes it too), killing the children still running; their socket folders are removed."""
    client = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from tests import zygote
        proc = zygote.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        (one,) = zygote._ZYGOTES.values()
        print(proc.pid, one.proc.pid, one.folder, flush=True)
        """
    )
    done = subprocess.run([PY, "-c", client], capture_output=True, text=True, timeout=120)
    child, parent, folder = done.stdout.split()
    assert gone(int(child)) and gone(int(parent)) and not Path(folder).exists()


def test_what_is_not_an_interpreter_command_is_refused_before_any_fork():
    with pytest.raises(ValueError, match=r"a zygote runs \[sys.executable, '-m' or '-c', ...\], not \['ls'"):
        zygote.Popen(["ls", "-l", "/"])


def test_ranks_get_torchruns_environment_meet_and_differ_in_hash_seed():
    done = ranks(2, "tests.parallel.rank_probe", timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = sorted((json.loads(line) for line in done.stdout.splitlines()), key=lambda r: r["rank"])
    assert [(r["rank"], r["world"], r["sum"]) for r in rows] == [(0, 2, 1), (1, 2, 1)]
    assert rows[0]["hash"] != rows[1]["hash"]


def test_a_failed_rank_ends_the_others_and_the_launch_fails():
    began = time.monotonic()
    done = ranks(2, "tests.parallel.rank_probe", "1", timeout=120)
    assert done.returncode == 1 and time.monotonic() - began < 60, done.stderr[-3000:]
    assert done.stdout == ""  # rank 0 never got past its barrier
