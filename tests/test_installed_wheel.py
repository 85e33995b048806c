"""The package as a user installs it, not as the checkout runs it (issue 11).

Builds the sdist and, from it, the wheel (`python -m build`, so a file missing from the sdist
fails here), installs the wheel with pip into a fresh virtual environment, and from a folder
outside the checkout runs what the README promises: first with the core dependencies only, then
with the training extras. The dependencies pip finds there are the ones the wheel's own metadata
asks for, linked from this environment (wheel_deps.py): pip checks each requirement with
--no-index but unpacks no torch, and one the wheel forgot is as absent as in a user's venv.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

import torchformer

from .wheel_deps import closure, link, wheel_requires

ROOT = Path(__file__).resolve().parents[1]
SKIP = shutil.ignore_patterns(
    ".git", ".venv", "runs", "build", "dist", "__pycache__", "*.egg-info", ".*_cache", ".cache", "site"
)

# One worker: the module's built wheel and venv are made once, not once per xdist worker.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("installed_wheel")]


def run(cmd: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["OMP_NUM_THREADS"] = "2"
    # The library paths: a fresh venv would build the CPU kernels (~1-2 min) for these runs; the
    # wheel carrying their sources is checked by name (test_sdist_and_wheel_carry_the_package_data).
    env["TORCHFORMER_NATIVE"] = "0"
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, f"{result.args}\nstdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"
    return result.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=SKIP)  # build from a copy: no build/ or egg-info in the checkout
    ok(run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(tmp / "dist"), str(src)], tmp))
    (wheel,) = (tmp / "dist").glob("torchformer-*.whl")
    (sdist,) = (tmp / "dist").glob("torchformer-*.tar.gz")
    env_dir = tmp / "venv"
    venv.EnvBuilder().create(env_dir)  # no pip inside: this environment's pip installs into it (--python)
    (site,) = (env_dir / "lib").glob("python3*/site-packages")
    deps = site / "wheel-deps.pth"  # one folder a line: the core set now, the extras' set later
    deps.write_text(f"{link(closure(wheel_requires(wheel)), tmp / 'core')}\n")
    # --no-index, and --find-links only the folder of the built files: what a requirement needs is
    # in the linked folders or nowhere (no pip config: not in the machine's wheel folder either).
    pip = ["env", "-u", "PIP_FIND_LINKS", f"PIP_CONFIG_FILE={os.devnull}", sys.executable, "-m", "pip",
           "--python", str(env_dir / "bin" / "python"), "install", "-q", "--no-index",
           "--find-links", str(tmp / "dist"), "-c", str(ROOT / "constraints.txt")]  # fmt: skip
    ok(run([*pip, str(wheel)], tmp))
    work = tmp / "work"  # outside the checkout: nothing there to import or read recipes from
    work.mkdir()
    return {"bin": env_dir / "bin", "pip": pip, "wheel": wheel, "sdist": sdist, "work": work, "deps": deps, "tmp": tmp}


def test_sdist_and_wheel_carry_the_package_data(installed):
    import tarfile
    import zipfile

    names = set(zipfile.ZipFile(installed["wheel"]).namelist())
    for name in ("torchformer/py.typed", *(f"torchformer/recipes/{r}.yaml" for r in ("shakespeare-char", "reverse"))):
        assert name in names
    csrc = Path(torchformer.__file__).parent / "fast" / "csrc"  # the kernels' sources and headers
    kernels = {f"torchformer/fast/csrc/{p.name}" for p in csrc.iterdir() if p.is_file()}
    assert {"torchformer/fast/csrc/wide.h", "torchformer/fast/csrc/quantized_kernels.inc"} <= kernels <= names
    with tarfile.open(installed["sdist"]) as tar:
        members = {m.split("/", 1)[1] for m in tar.getnames() if "/" in m}
    wanted = {"pyproject.toml", "README.md", "LICENSE", "constraints.txt", "src/torchformer/recipes/reverse.yaml"}
    assert wanted | {"tests/test_installed_wheel.py"} <= members


def test_core_install_imports_runs_and_names_missing_extras(installed):
    py, tf, work = str(installed["bin"] / "python"), str(installed["bin"] / "torchformer"), installed["work"]
    code = (
        "import importlib.util, torch, torchformer as tfm\n"
        "assert importlib.util.find_spec('yaml') is None and importlib.util.find_spec('tokenizers') is None\n"
        f"assert tfm.__file__.startswith({str(installed['bin'].parent)!r}), tfm.__file__\n"
        "m = tfm.build_model(tfm.presets.get('llama-tiny')).eval()\n"
        "print(tuple(m(torch.randint(0, 100, (2, 7))).shape), tfm.__version__)\n"
    )
    assert ok(run([py, "-c", code], work)).split() == ["(2,", "7,", "256)", torchformer.__version__]
    assert ok(run([tf, "--version"], work)).strip() == f"torchformer {torchformer.__version__}"
    assert "llama3-8b: decoder, 32 layers" in ok(run([tf, "plan", "llama3-8b"], work))
    missing = run([tf, "train", "train.steps=1"], work)
    assert missing.returncode == 2 and "pip install 'torchformer[train]'" in missing.stderr, missing.stderr


def test_with_extras_the_default_run_and_reverse_demo_work(installed):
    # Runs after the core-only test (file order): add the extras the README's install line names.
    extras = ("train", "shakespeare", "viz")
    with installed["deps"].open("a") as pth:
        pth.write(f"{link(closure(wheel_requires(installed['wheel']), extras), installed['tmp'] / 'extras')}\n")
    ok(run([*installed["pip"], f"{installed['wheel']}[{','.join(extras)}]"], installed["work"]))
    tf, work = str(installed["bin"] / "torchformer"), installed["work"]
    out = ok(run([tf, "train", "train.steps=3", "train.eval_every=3", "train.eval_batches=1",
                  "train.sample_chars=20", "train.out_dir=runs/default"], work))  # fmt: skip
    assert "done: step 3" in out
    assert (work / "runs/default/model.safetensors").is_file() and (work / "runs/default/tokenizer.json").is_file()
    out = ok(run([tf, "demo", "reverse", "train.steps=3", "train.eval_every=3", "data.synthetic.n_train=256",
                  "data.synthetic.n_val=16", "train.out_dir=runs/reverse"], work))  # fmt: skip
    assert "held-out exact match" in out and "cross-attention" in out
