"""`torchformer serve` as a user runs it: a subprocess on 127.0.0.1 port 0 (the port is read from
uvicorn's log), /health until ready, one completion with the openai client, then terminated
(killed if it does not stop) so no process or port is left behind."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time

import pytest

from tests import zygote
from tests.serve.conftest import client, httpx

pytestmark = pytest.mark.slow


def start(args: list[str], env: dict | None = None) -> tuple[zygote.Popen, list[str]]:
    """`torchformer serve ARGS` in a child process (forked from the zygote: tests/zygote.py), its
    output lines collected as they come."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = zygote.Popen(
        [sys.executable, "-m", "torchformer.cli.main", "serve", *args, "--port", "0", "--log-level", "info"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    return proc, lines


def port_of(proc, lines, timeout=60.0) -> int:
    end = time.monotonic() + timeout
    while time.monotonic() < end and proc.poll() is None:
        for line in list(lines):
            found = re.search(r"running on http://127\.0\.0\.1:(\d+)", line)
            if found:
                return int(found.group(1))
        time.sleep(0.05)
    raise AssertionError("the server did not start:\n" + "".join(lines))


def ready(proc, lines, timeout=60.0) -> str:
    """The server's URL once /health answers 200 (the model has loaded)."""
    url = f"http://127.0.0.1:{port_of(proc, lines)}"
    end = time.monotonic() + timeout
    while httpx.get(f"{url}/health").status_code != 200:
        assert time.monotonic() < end and proc.poll() is None, "".join(lines)
        time.sleep(0.05)
    return url


def stop(proc) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


def test_serve_a_checkpoint_folder(model_dir):
    proc, lines = start([str(model_dir), "--slots", "2", "--served-model-name", "mine", "--api-key", "k"])
    try:
        url = ready(proc, lines)
        out = client(url, api_key="k").chat.completions.create(
            model="mine", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        (choice,) = out.choices
        assert out.model == "mine" and choice.finish_reason == "length" and choice.message.role == "assistant"
        assert choice.message.content and out.usage.completion_tokens == 3 and out.usage.prompt_tokens > 0
    finally:
        stop(proc)
    # SIGTERM is a graceful stop: uvicorn shuts down and the process exits 0 (serve/lifecycle.py),
    # not -SIGTERM, nor -SIGKILL from stop()'s fallback.
    assert proc.returncode == 0 and "Finished server process" in "".join(lines), "".join(lines)
    said = [line for line in lines if "max-model-len" in line and "INFO torchformer.serve:" in line]
    assert len(said) == 1 and "max-model-len 96: the model's max_seq_len (cache 2 slots x 96" in said[0], said


def test_max_model_len_and_dtype_are_said_at_start_up_and_enforced(model_dir):
    """--max-model-len caps prompt + max_tokens (the 400 over-long requests always got), /v1/models
    says it (vLLM's max_model_len), and --dtype bfloat16 sizes the cache in bf16."""
    proc, lines = start([str(model_dir), "--slots", "2", "--served-model-name", "mine", "--max-model-len", "64",
                         "--dtype", "bfloat16"])  # fmt: skip
    try:
        url = ready(proc, lines)
        said = [line for line in lines if "max-model-len 64: from --max-model-len" in line]
        assert said and "cache 2 slots x 64 positions" in said[0] and "bfloat16" in said[0], "".join(lines)
        assert "the model allows 96" in said[0]
        (card,) = httpx.get(f"{url}/v1/models").json()["data"]
        assert card["id"] == "mine" and card["max_model_len"] == 64
        over = httpx.post(f"{url}/v1/completions", json={"model": "mine", "prompt": [1] * 60, "max_tokens": 5})
        error = over.json()["error"]
        assert over.status_code == 400 and error["code"] == "context_length_exceeded", over.text
        assert "maximum context length is 64 tokens" in error["message"] and "65 tokens" in error["message"]
        out = client(url).completions.create(model="mine", prompt="the quick", max_tokens=3)
        assert out.usage.completion_tokens == 3
    finally:
        stop(proc)


def test_serve_a_preset_says_token_ids_only():
    proc, lines = start(["llama-tiny", "--slots", "1"])
    try:
        url = ready(proc, lines)
        out = client(url).completions.create(model="llama-tiny", prompt=[1, 2, 3], max_tokens=2, temperature=0)
        assert len(out.choices[0].text.split()) == 2
    finally:
        stop(proc)
    assert any("token ids only" in line for line in lines)


def test_bad_model_is_a_clear_error():
    result = zygote.run(
        [sys.executable, "-m", "torchformer.cli.main", "serve", "no-such-model"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "neither a folder" in result.stderr


def test_quantize_loads_through_tfm_quantize():
    import torchformer as tfm
    from torchformer.cli.serve import loader

    for scheme in ("int8", "int4"):
        model = loader("llama-tiny", scheme, 0)()
        assert model.quantization.scheme == scheme
    plain = loader("llama-tiny", None, 0)()
    assert isinstance(plain, tfm.DecoderLM) and getattr(plain, "quantization", None) is None
