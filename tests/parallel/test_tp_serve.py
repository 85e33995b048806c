"""Issue 31: ``torchrun --nproc_per_node 2 -m torchformer.cli.main serve MODEL --tp 2``. Rank 0
serves HTTP and schedules; rank 1 runs every step on its shard (serve/tp.py). Concurrent
completions (streamed and not, n=2 choices copied from one prefilled row, an echoed prompt's
logprobs, a sampled one, then a prompt that reuses a cached prefix) answer what a single-process
server of the same model answers: the same tokens, logprobs within 1e-4. SIGTERM to torchrun
stops every process it started."""

from __future__ import annotations

import dataclasses
import json
import signal
import threading

import pytest
import torch

import torchformer as tfm
from tests.decoding import assert_varied, varied_case
from tests.serve.conftest import Running, httpx, make_engine
from tests.serve.test_cli import ready
from torchformer.serve.app import create_app

from .launch import spawn, stop_session
from .tp_worker import GRID, V, build

pytestmark = pytest.mark.xdist_group("parallel")


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """(folder, model, prompt): a saved model whose greedy continuation of ``prompt`` is varied."""
    cfg = dataclasses.replace(GRID["gqa-swiglu-untied-bias"], init_std=0.5)
    candidates = torch.randint(0, V, (12, 5), generator=torch.Generator().manual_seed(2))
    model, prompt = varied_case(lambda s: build(cfg, s), candidates, 16, 8, seeds=range(6))
    folder = tmp_path_factory.mktemp("tp-serve") / "model"
    tfm.save(model, folder)
    return folder, model, prompt[0].tolist()


def bodies(prompt: list[int]) -> list[dict]:
    """Requests sent together: each exercises one step rank 0 announces (serve/tp.py)."""
    g = torch.Generator().manual_seed(5)
    rand = lambda n: torch.randint(0, V, (n,), generator=g).tolist()  # noqa: E731
    plain = {"return_token_ids": True, "temperature": 0}
    return [
        {"prompt": prompt, "max_tokens": 16, "stream": True, **plain},
        {"prompt": rand(20), "max_tokens": 12, **plain},
        {"prompt": rand(9), "max_tokens": 10, "n": 2, **plain},  # the second choice's row is a copy
        {"prompt": rand(7), "max_tokens": 6, "echo": True, "logprobs": 2, "stream": True, **plain},  # the head
        {"prompt": rand(6), "max_tokens": 10, "return_token_ids": True, "temperature": 0.9, "seed": 3},
    ]


def ask(url: str, body: dict) -> dict:
    """{choice index: its text, token ids, logprobs and finish reason, a stream's chunks joined}."""
    body = {"model": "m", **body}
    if not body.get("stream"):
        answer = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert answer.status_code == 200, answer.text
        return joined([answer.json()]) | {"usage": answer.json()["usage"]}
    chunks = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as answer:
        assert answer.status_code == 200
        for line in answer.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return joined(chunks)


def joined(chunks: list[dict]) -> dict:
    out: dict = {}
    for chunk in chunks:
        for c in chunk.get("choices", []):
            row = out.setdefault(c["index"], {"text": "", "ids": [], "logprobs": [], "top": [], "finish": None})
            row["text"] += c.get("text") or ""
            row["ids"] += c.get("token_ids") or []
            lp = c.get("logprobs") or {}
            row["logprobs"] += lp.get("token_logprobs") or []
            row["top"] += lp.get("top_logprobs") or []
            row["finish"] = c.get("finish_reason") or row["finish"]
    return out


def together(url: str, requests: list[dict]) -> list[dict]:
    """The answers to ``requests`` sent at once (one thread each)."""
    answers: list = [None] * len(requests)

    def one(i):
        try:
            answers[i] = ask(url, requests[i])
        except BaseException as err:  # noqa: BLE001 - re-raised below, on the test's thread
            answers[i] = err

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    for a in answers:
        if isinstance(a, BaseException) or a is None:
            raise AssertionError(f"a request failed: {a!r}")
    return answers


def same(got, want, path="answer"):
    """Equal, floats within 1e-4 (the ranks' partial sums add in another order)."""
    if isinstance(want, float) and isinstance(got, float):
        assert abs(got - want) <= 1e-4, f"{path}: {got} != {want}"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), f"{path}: {got} != {want}"
        for k in want:
            same(got[k], want[k], f"{path}[{k!r}]")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), f"{path}: {got} != {want}"
        for i, (g, w) in enumerate(zip(got, want)):
            same(g, w, f"{path}[{i}]")
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


def both(single: str, split: str, requests: list[dict]) -> tuple[list, list]:
    return together(single, requests), together(split, requests)


def test_serve_tp_2_answers_what_one_process_answers(case):
    folder, model, prompt = case
    engine = make_engine(model, None, slots=4)
    running = Running(create_app(engine, "m", None))
    proc, lines = spawn(2, "torchformer.cli.main", "serve", str(folder), "--tp", "2", "--slots", "4",
                        "--served-model-name", "m", "--port", "0", "--log-level", "info")  # fmt: skip
    try:
        url = ready(proc, lines, timeout=180)
        requests = bodies(prompt)
        want, got = both(running.url, url, requests)
        assert_varied(want[0][0]["ids"], 8)  # a degenerate continuation would prove little
        assert 1 in want[2] and want[3][0]["logprobs"][1] is not None  # two choices; the prompt scored
        for i, (g, w) in enumerate(zip(got, want)):
            same({k: v for k, v in g.items() if k != "usage"}, {k: v for k, v in w.items() if k != "usage"},
                 f"request {i}")  # fmt: skip
        # Then one request, and a prompt that continues it: its row holds the first 24 tokens, only
        # the rest is prefilled (prefix caching: a prefill at an offset).
        (w,), (g,) = both(running.url, url, [requests[1]])
        again = {**requests[1], "prompt": requests[1]["prompt"] + w[0]["ids"][:4], "max_tokens": 8}
        (w,), (g,) = both(running.url, url, [again])
        assert g["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16, g["usage"]
        same(g, w, "the prompt with a cached prefix")
    finally:
        running.stop()
        engine.stop()
        took = stop_session(proc, signal.SIGTERM)
    log = "".join(lines)
    assert "Finished server process" in log, log[-3000:]  # rank 0 shut down gracefully
    # torchrun itself ends with a traceback of the SIGTERM it got (SignalException); the ranks end cleanly.
    assert " ERROR " not in log and log.count("Traceback") == 1 and "SignalException: Process" in log, log[-3000:]
    assert took < 30, f"{took:.1f} s to stop"
