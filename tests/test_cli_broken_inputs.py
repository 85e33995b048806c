"""Issue 26: every broken input the hostile tester found, run through the real CLI (`main(argv)`) in
a child process. Each case must exit 2 with one line on stderr that names the file or argument, print
no traceback, and leave the folder it ran in byte for byte as it was (nothing written, nothing deleted).

The inputs are made per case from one tiny good checkpoint, its Hugging Face export and a tiny
training recipe (built once per module); each case then breaks its own copy in one way. One child
process runs every case in turn (issue 33: a child per case cost ~3 s of imports each, 36 of them),
each in its own folder as working directory with its own stderr (file descriptor 2 itself, so a
write that bypasses sys.stderr is seen too) and its own time limit.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import torchformer as tfm
from torchformer.training.tokenizers import build_tokenizer

# One child process runs every case; the group keeps its tests on one xdist worker (so one child).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("cli_broken_inputs")]

TEXT = "to be or not to be that is the question\n" * 8
RECIPE = """name: tiny
model: {preset: shakespeare-char, d_model: 16, n_layers: 1, max_seq_len: 32, attention: {n_heads: 2}}
data: {source: data.txt, task: lm, tokenizer: char, seq_len: 8}
schedule: {name: constant, warmup: 0}
train: {steps: 1, batch_size: 2, eval_every: 1, eval_batches: 1, log_every: 1, out_dir: run, device: cpu}
"""
INIT_RECIPE = RECIPE.replace(RECIPE.splitlines()[1], "model: {init: good}")
TIMEOUT_S = 60  # a case that hangs (the 1e6-layer config ran > 90 s, the alias bomb 25 s) fails here


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """good/ (a torchformer checkpoint with tokenizer.json), hf/ (its Hugging Face export),
    data.txt, tiny.yaml (a recipe) and init.yaml (the same, fine-tuning good/)."""
    root = tmp_path_factory.mktemp("good")
    tok = build_tokenizer("char", TEXT)
    cfg = tfm.presets.get("llama-tiny")
    cfg = cfg.replace(vocab_size=tok.vocab_size, d_model=16, n_layers=2, max_seq_len=32,
                      attention=cfg.attention.__class__(n_heads=2, n_kv_heads=1))  # fmt: skip
    torch.manual_seed(0)
    model = tfm.build_model(cfg)
    tfm.save(model, root / "good", extra_files={"tokenizer.json": tok.to_json()})
    tfm.to_hf(model, root / "hf", tokenizer=tok.to_json())
    (root / "data.txt").write_text(TEXT)
    (root / "tiny.yaml").write_text(RECIPE)
    (root / "init.yaml").write_text(INIT_RECIPE)
    return root


def tree(folder: Path) -> dict[str, str]:
    """Every path under folder (hidden ones too) -> a hash of its bytes ('dir' for folders)."""
    out = {}
    for p in sorted(folder.rglob("*")):
        rel = str(p.relative_to(folder))
        out[rel] = "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


# -- ways to break a copy of the inputs: each gets the case folder, returns nothing ----------------


def weights(raw: bytes):
    return lambda d: (d / "good" / "model.safetensors").write_bytes(raw)


def truncated(d: Path) -> None:
    file = d / "good" / "model.safetensors"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def header(meta: dict, payload: bytes = b""):
    blob = json.dumps(meta).encode()
    return weights(struct.pack("<Q", len(blob)) + blob + payload)


def pickled(d: Path) -> None:
    with open(d / "good" / "model.safetensors", "wb") as f:
        pickle.dump({"w": [1.0, 2.0]}, f)


def edit_json(folder: str, **changes):
    def edit(d: Path) -> None:
        file = d / folder / "config.json"
        file.write_text(json.dumps({**json.loads(file.read_text()), **changes}))

    return edit


def write(rel: str, content: str | bytes):
    def put(d: Path) -> None:
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_bytes(content if isinstance(content, bytes) else content.encode())

    return put


def both(*edits):
    return lambda d: [edit(d) for edit in edits]


def index(entry: str):
    """hf/ sharded: model.safetensors.index.json whose weight_map points one tensor at ``entry``."""

    def shard(d: Path) -> None:
        from safetensors import safe_open

        folder = d / "hf"

        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            keys = list(f.keys())  # noqa: SIM118
        (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
        weight_map = {k: "model-00001-of-00001.safetensors" for k in keys}
        weight_map[keys[0]] = entry
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))

    return shard


ALIAS_BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [{', '.join(['*' + p] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi")
)
GEN = ["generate", "good", "--ids", "1,2", "--max-new-tokens", "2"]
TRAIN = ["train", "--recipe", "tiny.yaml"]

# id -> (how to break the inputs, argv, text the one error line must contain)
CASES = {
    # 1. convert --out replaces only an empty folder or a model folder torchformer wrote
    "1-out-holds-other-files": (write("out/notes.txt", "mine"), ["convert", "--from-hf", "hf", "--out", "out"],
                                "--force"),
    "1-to-hf-out-holds-other-files": (write("out/notes.txt", "mine"), ["convert", "--to-hf", "good", "--out", "out"],
                                      "--force"),
    "1-out-is-the-source": (None, ["convert", "--from-hf", "hf", "--out", "hf"], "hf"),
    "1-out-inside-the-source": (None, ["convert", "--from-hf", "hf", "--out", "hf/sub"], "hf/sub"),
    "1-source-inside-out": (both(write("top/x", ""), lambda d: shutil.move(d / "hf", d / "top" / "hf")),
                            ["convert", "--from-hf", "top/hf", "--out", "top"], "top"),
    "1-out-is-a-file": (write("out.txt", "mine"), ["convert", "--from-hf", "hf", "--out", "out.txt"], "out.txt"),
    # 7. broken native checkpoints, from every command that loads one
    "7-truncated": (truncated, GEN, "good/model.safetensors"),
    "7-empty": (weights(b""), GEN, "good/model.safetensors"),
    "7-header-2^62": (weights(struct.pack("<Q", 2**62) + b"{}"), GEN, "good/model.safetensors"),
    "7-huge-tensor": (header({"w": {"dtype": "F32", "shape": [10**6, 10**6], "data_offsets": [0, 4 * 10**12]}}),
                      GEN, "good/model.safetensors"),
    "7-shape-vs-offsets": (header({"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 8]}}, b"\0" * 8),
                           GEN, "good/model.safetensors"),
    "7-pickle": (pickled, GEN, "good/model.safetensors"),
    "7-eval": (truncated, ["eval", "good", "--data", "data.txt", "--no-progress"], "good/model.safetensors"),
    "7-embed": (truncated, ["embed", "good", "--text", "hi"], "good/model.safetensors"),
    "7-convert-to-hf": (truncated, ["convert", "--to-hf", "good", "--out", "out"], "good/model.safetensors"),
    "7-train-init": (truncated, ["train", "--recipe", "init.yaml"], "good/model.safetensors"),
    # 8. absurd sizes and types, caught before anything is allocated
    "8-n_layers-1e6-over-2": (edit_json("good", n_layers=10**6), GEN, "n_layers=1000000"),
    "8-n_layers-1e9": (edit_json("good", n_layers=10**9), GEN, "n_layers=1000000000"),
    "8-d_model-1e9": (edit_json("good", d_model=10**9), GEN, "d_model=1000000000"),
    "8-hf-layers-a-string": (edit_json("hf", num_hidden_layers="4"), ["generate", "hf", "--ids", "1"],
                             "num_hidden_layers='4'"),
    "8-hf-layers-1e6": (edit_json("hf", num_hidden_layers=10**6), ["generate", "hf", "--ids", "1"], "1000000"),
    "8-train-n_layers-1e9": (None, [*TRAIN, "model.n_layers=1000000000"], "model"),
    # 9. unreadable files are named
    "9-config-not-json": (write("good/config.json", "{oops"), GEN, "good/config.json"),
    "9-config-a-list": (write("good/config.json", "[1, 2]"), GEN, "good/config.json"),
    "9-hf-config-not-json": (write("hf/config.json", "not json"), ["convert", "--from-hf", "hf", "--out", "o"],
                             "hf/config.json"),
    "9-hf-config-a-list": (write("hf/config.json", "[]"), ["convert", "--from-hf", "hf", "--out", "o"],
                           "hf/config.json"),
    "9-tokenizer-not-json": (write("good/tokenizer.json", "{not json"), ["generate", "good", "--prompt", "to be"],
                             "good/tokenizer.json"),
    "9-recipe-python-tag": (write("tiny.yaml", "name: !!python/object/apply:os.system ['true']\n"), TRAIN,
                            "tiny.yaml"),
    "9-recipe-malformed": (write("tiny.yaml", "model: {preset: [unclosed\n"), TRAIN, "tiny.yaml"),
    "9-recipe-binary": (write("tiny.yaml", b"\xc5\x00\xff" * 50), TRAIN, "tiny.yaml"),
    "9-recipe-alias-bomb": (write("tiny.yaml", ALIAS_BOMB), TRAIN, "tiny.yaml"),
    # 10. a shard index may not point outside its folder
    "10-index-escapes": (index("../../../../etc/passwd"), ["convert", "--from-hf", "hf", "--out", "o"],
                         "../../../../etc/passwd"),
    "10-index-absolute": (index("/etc/passwd"), ["convert", "--from-hf", "hf", "--out", "o"], "/etc/passwd"),
    # 11. a run refused on bad input leaves no <out_dir>/data behind
    "11-batch-larger-than-data": (None, [*TRAIN, "train.batch_size=100000"], "batch_size"),
    "11-bad-resume": (None, [*TRAIN, "--resume", "nowhere"], "nowhere"),
    # issue 25: a context the model was not built for is refused before the weights load
    "25-max-model-len-over-the-model": (None, ["serve", "good", "--max-model-len", "33"], "--max-model-len 33"),
}  # fmt: skip


# Runs each [folder, argv, environment changes] of sys.argv[1] through main() in turn, writes
# [exit status, seconds] a line to sys.argv[2], and each line's stderr to sys.argv[3]/<i>.txt. A line
# that raises prints the traceback there and gets status "raised"; one still running after its limit
# gets "hung" (Hung is no OSError, which main() would report as a user error). A serve line that were
# not refused would start the engine: here that raises.
CHILD = textwrap.dedent(
    """
    import json, os, signal, sys, time, traceback
    from torchformer.cli.main import main
    from torchformer.serve import engine

    class Hung(BaseException):
        pass

    def hung(signum, frame):
        raise Hung()

    def started(self):
        raise RuntimeError("the server started")

    engine.Engine.start = started
    signal.signal(signal.SIGALRM, hung)
    lines, results, errs, limit = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
    saved = os.dup(2)
    with open(results, "w") as out:
        for i, (folder, argv, env) in enumerate(lines):
            os.chdir(folder)
            os.environ.pop("TORCHFORMER_DEBUG", None)
            os.environ.update(env)
            with open(os.path.join(errs, f"{i}.txt"), "w") as err:
                sys.stderr.flush()
                os.dup2(err.fileno(), 2)
                t0 = time.perf_counter()
                signal.alarm(limit)
                try:
                    code = main(argv)
                except SystemExit as exit:
                    code = exit.code
                except Hung:
                    code = "hung"
                except BaseException:
                    code = "raised"
                    traceback.print_exc()
                finally:
                    signal.alarm(0)
                took = time.perf_counter() - t0
                sys.stderr.flush()
                os.dup2(saved, 2)
            out.write(json.dumps([code, took]) + "\\n")
            out.flush()
    """
)
DEBUG_LINES = {"--debug": ([*GEN, "--debug"], {}), "TORCHFORMER_DEBUG=1": (GEN, {"TORCHFORMER_DEBUG": "1"})}


@pytest.fixture(scope="module")
def outcomes(base, tmp_path_factory) -> dict[str, tuple[Path, dict, object, str, float]]:
    """case -> (its folder, the folder's tree before, exit status, stderr, seconds): every CASES line,
    then every DEBUG_LINES one (on a truncated checkpoint), each in its own copy of base, all in one
    child process."""
    runs = {case: (breaks, argv, {}) for case, (breaks, argv, _) in CASES.items()}
    runs |= {name: (truncated, argv, env) for name, (argv, env) in DEBUG_LINES.items()}
    folders, befores, lines = {}, {}, []
    for case, (breaks, argv, env) in runs.items():
        folder = tmp_path_factory.mktemp("case")
        shutil.copytree(base, folder, dirs_exist_ok=True)
        if breaks is not None:
            breaks(folder)
        folders[case], befores[case] = folder, tree(folder)
        lines.append([str(folder), argv, env])
    logs = tmp_path_factory.mktemp("stderr")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env.pop("TORCHFORMER_DEBUG", None)
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(lines), str(logs / "results.jsonl"), str(logs),
                           str(TIMEOUT_S // 2)], env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S * 5)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line) for line in (logs / "results.jsonl").read_text().splitlines()]
    assert len(results) == len(runs), done.stderr[-3000:]
    return {case: (folders[case], befores[case], code, (logs / f"{i}.txt").read_text(), took)
            for i, (case, (code, took)) in enumerate(zip(runs, results))}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_broken_input_is_one_line_and_changes_nothing(case, outcomes):
    argv, needle = CASES[case][1:]
    folder, before, returncode, stderr, took = outcomes[case]
    lines = stderr.strip().splitlines()
    assert "Traceback" not in stderr, stderr[-3000:]
    assert returncode == 2, (returncode, stderr[-3000:])
    assert len(lines) == 1, stderr
    assert lines[0].startswith(f"torchformer {argv[0]}: error: ") and needle in lines[0], lines[0]
    assert tree(folder) == before, "the failed command changed the folder"
    assert took < TIMEOUT_S / 2, f"took {took:.0f} s"


@pytest.mark.parametrize("how", list(DEBUG_LINES))
def test_debug_shows_the_traceback(how, outcomes):
    """--debug (or TORCHFORMER_DEBUG=1) is how a developer sees where a user error was raised: the
    error leaves main() (a console script prints its traceback and exits 1) instead of one line."""
    _, _, returncode, stderr, _ = outcomes[how]
    assert returncode == "raised" and "Traceback" in stderr, (returncode, stderr)
    assert "good/model.safetensors" in stderr
