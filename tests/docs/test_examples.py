"""Every Python and shell block of the documentation site runs (issue 32: a snippet that no longer
runs is the most common doc bug). How a page is run: tests/docs/examples.py."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.docs.examples import pages, shrunk
from tests.docs.resident import Resident
from tests.docs.shell_lines import plan

VENV_BIN = Path(sys.executable).parent
SHRINK = "train.steps=3 train.eval_every=3 train.eval_batches=1"
NEEDS = {  # what a page may start from: the shrunk main jobs, run once per session
    "demo": (["demo", *SHRINK.split()], "runs/shakespeare-char"),
    "reverse": (["demo", "reverse", *SHRINK.split(), "data.synthetic.n_train=256", "data.synthetic.n_val=16"],
                "runs/reverse"),
}  # fmt: skip
ALL = pages()
# Pages whose bash blocks run as written, each `torchformer` line a process of its own, and why.
IN_BASH = {"concepts/reproducibility.md": "its claim is that two processes write the same bytes"}
LIMIT = 600  # s, for a block in bash or one command of the resident process

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("docs")]


def env() -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PATH=f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}")
    return out


@pytest.fixture(scope="session")
def resident(tmp_path_factory):
    """One resident `torchformer` for every page and the shrunk demo runs (tests/docs/resident.py):
    torch, torchformer and what the commands import (dynamo, matplotlib, transformers, ...) load
    once for the docs, not once a page (~4-8 s of CPU each); each call still starts from the state
    a fresh console script starts from."""
    one = Resident(tmp_path_factory.mktemp("docs-resident") / "resident.log")
    yield one
    one.close()


@pytest.fixture(scope="session")
def trained(tmp_path_factory, resident) -> dict[str, Path]:
    """The shrunk demo runs, made once, copied into the pages that need them."""
    made: dict[str, Path] = {}

    def get(what: str) -> Path:
        if what not in made:
            home = tmp_path_factory.mktemp(f"docs-{what}")
            argv, folder = NEEDS[what]
            done = resident.run(argv, home, env(), timeout=LIMIT)
            assert done.returncode == 0, done.stderr[-3000:]
            made[what] = home / folder
        return made[what]

    return get


class Server:
    """One `torchformer serve` line of a page, on a free port, for the rest of the page."""

    def __init__(self, code: str, cwd: Path) -> None:
        from tests.serve.test_cli import port_of

        line = next(line for line in code.splitlines() if line.strip().startswith("torchformer serve"))
        argv = ["bash", "-c", f"exec {line.split(' #')[0].strip()} --port 0 --log-level info"]
        self.proc = subprocess.Popen(argv, cwd=cwd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)  # fmt: skip
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()
        self.address = f"127.0.0.1:{port_of(self.proc, self.lines, timeout=300)}"

    def ready(self) -> None:
        from tests.serve.test_cli import ready

        ready(self.proc, self.lines, timeout=300)  # a first serve on a machine builds the CPU kernels

    def stop(self) -> None:
        from tests.serve.test_cli import stop

        stop(self.proc)


def check(where: str, code: str, done) -> None:
    assert done.returncode == 0, f"{where}\n{code}\nstdout:\n{done.stdout[-2000:]}\nstderr:\n{done.stderr[-3000:]}"
    assert "Traceback" not in done.stderr, f"{where}\n{done.stderr[-3000:]}"


def bash(code: str, cwd: Path):
    return subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=cwd, env=env(), capture_output=True,
                          text=True, timeout=LIMIT)  # fmt: skip


def run_shell_block(page, code: str, where: str, cwd: Path, resident: Resident) -> None:
    """A bash block: its plain `torchformer` lines in the page's resident process (tests/docs/shell_lines.py
    says which lines are plain), the others in bash; the whole block in bash where lines read one
    at a time would not mean what they mean in the block."""
    steps = None if page.name in IN_BASH else plan(code)
    if steps is None or not any(step.argvs for step in steps):
        check(where, code, bash(code, cwd))
        return
    for step in steps:
        if not step.argvs:
            check(where, step.line, bash(step.prelude + step.line, cwd))
        for argv in step.argvs:  # `A && B`: B runs once A succeeded (a failed A fails the block)
            check(where, step.line, resident.run(argv, cwd, env(), timeout=LIMIT))


@pytest.mark.parametrize("page", ALL, ids=[p.name for p in ALL])
def test_page_examples_run(page, tmp_path, monkeypatch, trained, aot_eager, resident):
    """Python blocks run in this process, torch.compile through dynamo + AOT autograd
    (tests/conftest.py's aot_eager: the example's call runs compiled, without a cold inductor
    compile of ~30 s of CPU; inductor's kernels: generation/test_compile.py); shell blocks in bash,
    their plain `torchformer` lines in the docs' resident process (tests/docs/resident.py)."""
    for what in sorted(page.needs):
        shutil.copytree(trained(what), tmp_path / NEEDS[what][1])
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__docs__"}
    server = None
    try:
        for block in page.blocks:
            if block.skip:
                continue
            where = f"{page.name}:{block.line}"
            code = shrunk(block.code, block.append)
            if server is not None:
                code = code.replace("127.0.0.1:8000", server.address)
            if block.setup:
                exec(compile(block.setup, f"{where} (setup)", "exec"), namespace)
            if block.server:
                server = Server(code, tmp_path)
                server.ready()
            elif block.lang == "python":
                exec(compile(code, where, "exec"), namespace)
            else:
                run_shell_block(page, code, where, tmp_path, resident)
    finally:
        if server is not None:
            server.stop()


def test_pages_have_examples_and_few_are_illustrative():
    blocks = [b for p in ALL for b in p.blocks]
    skipped = [b for b in blocks if b.skip]
    assert len(blocks) >= 28, len(blocks)  # the site has 30 today: a page that loses its examples fails
    assert all(re.search(r"\w{3,}", b.skip) for b in skipped)  # each says why
    assert len(skipped) <= max(3, len(blocks) // 10), [(b.line, b.skip) for b in skipped]


def test_the_runner_fails_a_broken_example(tmp_path, monkeypatch, trained, resident):
    """The runner is not vacuous: a page whose block fails, or whose shell command exits non-zero, fails."""
    from tests.docs.examples import read

    for body in ("```python\nassert 1 == 2\n```\n", "```bash\ntorchformer plan no-such-preset\n```\n"):
        page = tmp_path / "broken.md"
        page.write_text("# broken\n\n" + body)
        with pytest.raises(AssertionError):
            test_page_examples_run(read(page), tmp_path, monkeypatch, trained, [], resident)
