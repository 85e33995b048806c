"""Issue 31: ``torchrun --nproc_per_node 2 -m torchformer.cli.main generate MODEL --tp 2``: each
rank reads its slice of model.safetensors; the greedy tokens printed (by rank 0 alone) are the
single process's. ``--tp`` without torchrun (generate or serve), or with what it does not combine
with, is refused."""

import pytest

import torchformer as tfm
from torchformer.cli.main import main

from .tp_worker import GRID, build

pytestmark = pytest.mark.xdist_group("parallel")


def test_generate_tp_2_prints_the_single_process_tokens(launched):
    ranks = [r["generate"] for r in launched["ranks"]]  # run by conftest.py's launch
    assert [r["status"] for r in ranks] == [0, 0]
    assert ranks[0]["stdout"].strip() == ",".join(map(str, launched["want"]))
    assert ranks[1]["stdout"] == ""  # printed once: rank 0 alone


def refusal(argv: list[str], capsys) -> str:
    """The one-line error ``torchformer ARGV`` ends with (exit status 2), run in this process: the
    checks come before any process group, model or server (a subprocess would only add its start-up)."""
    assert main(argv) == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_tp_without_torchrun_is_refused(command, monkeypatch, capsys):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    extra = ["--ids", "1,2"] if command == "generate" else []
    message = "--tp 2 needs 2 processes, one per shard: launch with torchrun --nproc_per_node 2 (this launch has "
    message += "WORLD_SIZE=1)"
    assert message in refusal([command, "shakespeare-char", "--tp", "2", *extra], capsys)


def test_what_serve_tp_cannot_serve_is_refused(tmp_path, monkeypatch, capsys):
    tfm.save(build(GRID["gqa-swiglu-untied-bias"], 0), tmp_path / "decoder")
    tfm.save(build(GRID["encoder"], 0), tmp_path / "encoder")
    decoder = str(tmp_path / "decoder")
    monkeypatch.setenv("WORLD_SIZE", "2")
    cases = [
        ([decoder, "--compile"], "--tp 2 with --compile: not supported yet"),
        ([decoder, "--quantize", "int8"], "--tp 2 with --quantize: not supported yet"),
        (["shakespeare-char"], "--tp 2: MODEL is a preset model; tensor parallelism loads a torchformer folder"),
        ([str(tmp_path / "encoder")], "--tp 2: serve splits decoder-only models (generation), not 'encoder'"),
    ]
    for args, message in cases:
        assert message in refusal(["serve", *args, "--tp", "2"], capsys), args
    monkeypatch.setenv("WORLD_SIZE", "3")
    message = "tp=3 does not divide attention.n_heads=4 (heads=4, kv heads=2)"
    assert message in refusal(["serve", decoder, "--tp", "3"], capsys)


def test_what_tp_does_not_combine_with_is_refused(monkeypatch):
    from torchformer.parallel.session import check_generate

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"--tp 2 with --draft: not supported yet"):
        check_generate(2, draft="m", prompt_lookup=None, quantize=None, compile=False)
    with pytest.raises(ValueError, match=r"--tp 2 with --compile: not supported yet"):
        check_generate(2, draft=None, prompt_lookup=None, quantize=None, compile=True)
