"""The serve CLI's threads: the engine thread runs the model with the configured torch threads,
the HTTP thread with one (cli/serve.py ``http_thread_serial``: a second OpenMP team anywhere in the
process stops libgomp's workers from spinning between a step's parallel regions)."""

from __future__ import annotations

import argparse

import torch

from tests.serve.conftest import Running, client, wait_until


def test_the_engine_thread_gets_the_threads_and_the_http_thread_one(model_dir):
    from torchformer.cli import serve as cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args([str(model_dir), "--served-model-name", "tiny", "--slots", "2"])
    create_app, load_chat_template, engine_class, texts, _ = cli.server_modules()
    got = {}

    def serve(app, engine, **_):
        wait_until(lambda: engine.healthy or engine.error is not None, timeout=60, what="the engine to load")
        got["http"] = torch.get_num_threads()
        got["engine"] = engine.calls.put(torch.get_num_threads).result(timeout=30)  # run on the engine thread
        running = Running(app)
        try:
            answer = client(running.url).completions.create(model="tiny", prompt="hello", max_tokens=4)
            got["text"] = answer.choices[0].text
        finally:
            running.stop()

    torch.set_num_threads(2)  # tests/conftest.py restores the suite's count afterwards
    cli_modules = (create_app, load_chat_template, engine_class, texts, serve)
    original = cli.server_modules
    cli.server_modules = lambda: cli_modules
    try:
        assert cli.run(args) == 0
    finally:
        cli.server_modules = original
    assert got["http"] == 1 and got["engine"] == 2
    assert isinstance(got["text"], str)
