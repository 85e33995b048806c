"""The serve CLI's threads: the engine thread runs the model with the configured torch threads,
the HTTP thread with one (cli/serve.py ``http_thread_serial``: a second OpenMP team anywhere in the
process stops libgomp's workers from spinning between a step's parallel regions)."""

from __future__ import annotations

import torch

from tests.serve.conftest import client, run_serve_cli


def test_the_engine_thread_gets_the_threads_and_the_http_thread_one(model_dir, monkeypatch):
    got = {}

    def check(engine, url):
        got["http"] = torch.get_num_threads()  # the CLI's own thread, which serves HTTP
        got["engine"] = engine.calls.put(torch.get_num_threads).result(timeout=30)  # run on the engine thread
        got["text"] = client(url).completions.create(model="tiny", prompt="hello", max_tokens=4).choices[0].text

    torch.set_num_threads(2)  # tests/conftest.py restores the suite's count afterwards
    assert run_serve_cli([str(model_dir), "--served-model-name", "tiny", "--slots", "2"], monkeypatch, check) == 0
    assert got["http"] == 1 and got["engine"] == 2
    assert isinstance(got["text"], str)
