"""The resident `torchformer` process of a docs page (tests/docs/resident.py) answers like the
console script: exit status, stdout and stderr of each call apart, each call's own environment,
and a call past its time limit is killed."""

from __future__ import annotations

import time

import pytest

from tests.docs.resident import Resident
from tests.docs.test_examples import env

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("docs")]


def test_calls_answer_like_the_console_script(tmp_path):
    from torchformer import __version__

    resident = Resident(tmp_path / "resident.log")
    try:
        version = resident.run(["--version"], tmp_path, env(), timeout=300)  # argparse's SystemExit(0)
        assert (version.returncode, version.stdout, version.stderr) == (0, f"torchformer {__version__}\n", "")
        debug = resident.run(["plan", "no-such-preset"], tmp_path, {**env(), "TORCHFORMER_DEBUG": "1"}, timeout=120)
        assert debug.returncode == 1 and "Traceback" in debug.stderr  # uncaught, as the interpreter shows it
        bad = resident.run(["plan", "no-such-preset"], tmp_path, env(), timeout=120)  # main() returns 2
        assert (bad.returncode, bad.stdout) == (2, "")  # the previous call's environment is gone
        assert bad.stderr.startswith("torchformer plan: error: ") and "'no-such-preset'" in bad.stderr
        unknown = resident.run(["no-such-command"], tmp_path, env(), timeout=120)  # parser.error: SystemExit(2)
        assert unknown.returncode == 2 and "unknown command 'no-such-command'" in unknown.stderr
        assert unknown.stdout == ""  # each call's output is its own
        proc, started = resident.proc, time.monotonic()
        with pytest.raises(TimeoutError, match="no answer in 0.2 s"):
            resident.run(["verify", "llama3-8b"], tmp_path, env(), timeout=0.2)
        assert proc.poll() is not None and resident.proc is None  # killed, not left running
        assert time.monotonic() - started < 20
    finally:
        resident.close()
