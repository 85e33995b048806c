"""Issue 27's lm-evaluation-harness proof: its ``local-completions`` backend run against the
server (prompt logprobs through ``echo`` + ``logprobs``) gives the loglikelihoods its ``hf``
backend computes on the same Hugging Face folder, within 1e-4 (fp32), on a tiny multiple-choice
task whose data ships beside this file (lm_eval_task/). The folder is a random Llama built with
transformers from a config and a byte-level BPE tokenizer trained here: nothing is downloaded."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

import torchformer as tfm
from tests.serve.conftest import NAME, llama_folder, serving

TASK = "torchformer_tiny_choice"
TASK_DIR = Path(__file__).with_name("lm_eval_task")


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    return llama_folder(tmp_path_factory.mktemp("hf_llama"), 256)


@pytest.fixture
def task_manager(tmp_path):
    """The shipped task, its data path made absolute (datasets resolves it from the working dir)."""
    from lm_eval.tasks import TaskManager

    text = (TASK_DIR / "tiny_choice.yaml").read_text()
    (tmp_path / "tiny_choice.yaml").write_text(text.replace("DATA", str(TASK_DIR / "tiny_choice.jsonl")))
    return TaskManager(include_path=str(tmp_path), include_defaults=False)  # not its ~10k tasks: seconds


def loglikelihoods(model: str, model_args: str, task_manager) -> dict:
    """{(doc_id, choice): loglikelihood} of every request of the task, and its accuracy."""
    from lm_eval import simple_evaluate

    out = simple_evaluate(
        model=model, model_args=model_args, tasks=[TASK], task_manager=task_manager, batch_size=1, log_samples=True
    )
    found = {}
    for sample in out["samples"][TASK]:
        for k, resp in enumerate(sample["resps"]):
            found[sample["doc_id"], k] = resp[0][0]
    return found, out["results"][TASK]["acc,none"]


def test_local_completions_against_the_server_equals_the_hf_backend(hf_folder, task_manager, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("OPENAI_API_KEY", "none")
    want, want_acc = loglikelihoods("hf", f"pretrained={hf_folder},dtype=float32,device=cpu", task_manager)
    with serving(hf_folder, tfm.load_any(str(hf_folder)).eval(), slots=2) as (engine, url):
        args = (
            f"model={NAME},base_url={url}/v1/completions,tokenizer_backend=huggingface,tokenizer={hf_folder},"
            "tokenized_requests=True,num_concurrent=1,max_retries=1,timeout=60"
        )
        got, got_acc = loglikelihoods("local-completions", args, task_manager)
        assert engine.metrics is not None
    assert len(want) == 14 and set(got) == set(want)
    for key, value in want.items():
        assert math.isfinite(value) and abs(got[key] - value) < 1e-4, (key, got[key], value)
    assert got_acc == want_acc
    # The check can fail: the choices' loglikelihoods are not all alike (the model is not uniform).
    assert max(want.values()) - min(want.values()) > 1.0
