"""Issue 30's lm-evaluation-harness proof: ``--model torchformer`` gives the numbers lm-eval's own
``hf`` backend gives on the same Hugging Face folder (within 1e-4, fp32) for all three request
types, on tasks whose data ships beside this file (lm_eval_tasks/: multiple choice ->
loglikelihood, a perplexity task -> loglikelihood_rolling over several windows, greedy
generate_until with stop sequences). The folder is a random Llama built with transformers from a
config and a byte-level BPE tokenizer trained here: nothing is downloaded. The same model as a
torchformer checkpoint and as a GGUF file gives the same numbers too."""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from pathlib import Path

import pytest

import torchformer as tfm
from tests import zygote
from tests.serve.conftest import llama_folder, train_tokenizer
from torchformer.loading import load_tokenizer

TASKS = ["tfm_choice", "tfm_rolling", "tfm_generate"]
TASK_DIR = Path(__file__).with_name("lm_eval_tasks")
MAX_LEN = 64  # the model's positions: the long rolling text spans several windows
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    return llama_folder(tmp_path_factory.mktemp("hf_llama"), MAX_LEN, f16_exact=True)


@pytest.fixture(scope="module")
def include_path(tmp_path_factory):
    """The shipped tasks with their data paths made absolute (datasets resolves them from the cwd)."""
    folder = tmp_path_factory.mktemp("tasks")
    for f in TASK_DIR.glob("*.yaml"):
        (folder / f.name).write_text(f.read_text().replace("DATA", str(TASK_DIR)))
    return folder


@pytest.fixture(scope="module", autouse=True)
def offline():
    old = {k: os.environ.get(k) for k in OFFLINE}
    os.environ.update(OFFLINE)
    yield
    for k, v in old.items():
        os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def run(model: str, model_args: str, include_path, tasks=TASKS, batch_size=1) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from torchformer.evaluation.lm_eval_backend import register

    register()
    manager = TaskManager(include_path=str(include_path), include_defaults=False)  # not its ~10k tasks: seconds
    return simple_evaluate(model=model, model_args=model_args, tasks=tasks, task_manager=manager,
                           batch_size=batch_size, log_samples=True)  # fmt: skip


def responses(out: dict) -> dict:
    """{(task, doc_id, k): the k-th response}: (loglikelihood, is_greedy), a total, or a text."""
    found = {}
    for task, samples in out["samples"].items():
        for sample in samples:
            for k, resp in enumerate(sample["resps"]):
                found[task, sample["doc_id"], k] = resp[0]
    return found


@pytest.fixture(scope="module")
def want(hf_folder, include_path):
    return run("hf", f"pretrained={hf_folder},dtype=float32,device=cpu", include_path)


def assert_same(got: dict, want: dict) -> None:
    a, b = responses(got), responses(want)
    assert set(a) == set(b) and len(b) == 14 + 3 + 4
    for key, value in b.items():
        if isinstance(value, str):
            assert a[key] == value, key
        elif isinstance(value, list | tuple):  # loglikelihood: (logprob, is_greedy)
            assert abs(a[key][0] - value[0]) < 1e-4 and a[key][1] == value[1], (key, a[key], value)
        else:  # loglikelihood_rolling: the text's total
            assert math.isfinite(value) and abs(a[key] - value) < 1e-4, (key, a[key], value)
    for task in TASKS:
        for metric, value in want["results"][task].items():
            if isinstance(value, float) and math.isfinite(value):
                # perplexities are exp(-mean log-prob): compared relatively
                assert got["results"][task][metric] == pytest.approx(value, rel=1e-4, abs=1e-4), (task, metric)


def test_torchformer_backend_equals_the_hf_backend(hf_folder, include_path, want):
    got = run("torchformer", f"pretrained={hf_folder},dtype=float32", include_path, batch_size=3)  # batched
    assert_same(got, want)
    # The checks can fail: the choices' loglikelihoods differ, the long text spans several windows,
    # and greedy decoding wrote text (cut at a stop sequence) for some prompts.
    lls = [v[0] for k, v in responses(want).items() if k[0] == "tfm_choice"]
    assert max(lls) - min(lls) > 1.0
    long_text = [json.loads(line)["text"] for line in (TASK_DIR / "rolling.jsonl").read_text().splitlines()][1]
    assert len(train_tokenizer().encode(long_text).ids) > 2 * MAX_LEN
    texts = [v for k, v in responses(want).items() if k[0] == "tfm_generate"]
    assert any(texts) and not any("\n" in t or "." in t for t in texts)


@pytest.mark.parametrize("kind", ["checkpoint", "gguf"])
def test_a_checkpoint_and_a_gguf_file_give_the_same_numbers(hf_folder, include_path, want, tmp_path, kind):
    model = tfm.load_any(str(hf_folder))
    if kind == "checkpoint":
        path = tmp_path / "ckpt"
        tfm.save(model, path, extra_files={"tokenizer.json": (hf_folder / "tokenizer.json").read_text()})
    else:
        path = tmp_path / "model.gguf"
        tfm.to_gguf(model, path, tokenizer=load_tokenizer(hf_folder))
    got = run("torchformer", f"pretrained={path}", include_path, batch_size=2)
    assert_same(got, want)


def test_int8_quantized_runs_and_stays_close(hf_folder, include_path, want):
    got = run("torchformer", f"pretrained={hf_folder},quantize=int8", include_path, tasks=["tfm_choice"])
    assert "int8" in got["config"]["model_quantization"]  # get_model_info, merged into lm-eval's config
    a, b = responses(got), responses(want)
    diffs = [abs(a[k][0] - b[k][0]) for k in a]
    assert max(diffs) < 0.5 and max(diffs) > 0  # weight rounding moves the numbers a little, not far


@pytest.fixture(scope="module")
def one_index(include_path):
    """`torchformer eval --tasks`'s task index, counted: ``asked`` says how many times the command
    asked for the whole index (lm-eval's ~13k tasks plus ``include_path``). What it gets is a stand-in,
    the folder's own index: indexing lm-eval's tasks costs ~8 s of CPU (issue 33) and what these
    tests check (which index the command asked for, the one-line error naming an unknown task and
    the nearest known one) does not depend on them. lm-eval's own command line (a child, below)
    runs with the whole index, and test_a_folder_that_defines_every_task_is_indexed_alone checks
    which index each kind of name takes."""
    from torchformer.evaluation import lm_eval_run

    real, built = lm_eval_run.task_manager, []

    def task_manager(path=None, *, defaults=True):
        if not (defaults and path is not None and Path(path) == include_path):
            return real(path, defaults=defaults)
        task_manager.asked += 1
        if not built:
            built.append(real(path, defaults=False))
        return built[0]

    task_manager.asked = 0
    return task_manager


def test_torchformer_eval_tasks_prints_lm_evals_metrics(hf_folder, include_path, want, capsys, one_index, monkeypatch):
    from torchformer.cli.main import main
    from torchformer.evaluation import lm_eval_run

    monkeypatch.setattr(lm_eval_run, "task_manager", one_index)
    asked = one_index.asked
    argv = ["eval", str(hf_folder), "--tasks", "tfm_choice,tfm_generate", "--include-path", str(include_path)]
    assert main([*argv, "--batch-size", "4"]) == 0
    assert one_index.asked == asked  # the folder defines both tasks: lm-eval's own ~13k were not asked for
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(out["tasks"]) == {"tfm_choice", "tfm_generate"}
    assert out["tasks"]["tfm_choice"]["acc,none"] == pytest.approx(want["results"]["tfm_choice"]["acc,none"])
    assert out["tasks"]["tfm_generate"]["exact_match,none"] == want["results"]["tfm_generate"]["exact_match,none"]


def test_lm_evals_own_command_line_runs_the_torchformer_backend(hf_folder, include_path, tmp_path, want):
    cmd = [sys.executable, "-m", "torchformer.evaluation.lm_eval_run", "--model", "torchformer", "--model_args",
           f"pretrained={hf_folder}", "--tasks", "tfm_choice", "--include_path", str(include_path),
           "--output_path", str(tmp_path / "out")]  # fmt: skip
    done = zygote.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, **OFFLINE})
    assert done.returncode == 0, done.stderr[-2000:]
    (results,) = (tmp_path / "out").rglob("results_*.json")
    acc = json.loads(results.read_text())["results"]["tfm_choice"]["acc,none"]
    assert acc == pytest.approx(want["results"]["tfm_choice"]["acc,none"])


def test_an_unknown_task_is_one_error_before_the_model_loads(hf_folder, include_path, monkeypatch, capsys, one_index):
    from torchformer.cli import eval as eval_cli
    from torchformer.cli.main import main
    from torchformer.evaluation import lm_eval_run

    # Patched where the command looks it up (and after importing it): patching `loading.load_any` before
    # the command's first import would leave the fake in cli/eval.py for every later test in the worker.
    monkeypatch.setattr(eval_cli, "load_any", lambda *a, **k: pytest.fail("the model was loaded"))
    monkeypatch.setattr(lm_eval_run, "task_manager", one_index)
    asked = one_index.asked
    argv = ["eval", str(hf_folder), "--tasks", "tfm_choise,tfm_generate", "--include-path", str(include_path)]
    assert main(argv) == 2
    assert one_index.asked == asked + 1  # not in the folder: the whole index names it unknown
    err = capsys.readouterr().err
    assert "no lm-eval task named 'tfm_choise'" in err and "tfm_choice" in err and err.count("\n") == 1


def test_a_folder_that_defines_every_task_is_indexed_alone(include_path, monkeypatch, tmp_path):
    """task_manager_for: lm-eval's own tasks are indexed only when a name may need them."""
    import lm_eval.tasks

    from torchformer.evaluation import lm_eval_run

    real, built = lm_eval.tasks.TaskManager, []

    def spy(include_path=None, include_defaults=True, **kw):  # the whole index stands in as "whole"
        built.append(include_defaults)
        return "whole" if include_defaults else real(include_path=include_path, include_defaults=False, **kw)

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", spy)
    own = lm_eval_run.task_manager_for(["tfm_choice", "tfm_generate"], include_path)
    assert built == [False] and {"tfm_choice", "tfm_generate"} <= set(own.all_subtasks)
    folder = tmp_path / "tasks"
    shutil.copytree(include_path, folder)
    (folder / "tfm_all.yaml").write_text("group: tfm_all\ntask:\n  - tfm_choice\n")  # a group may gather any task
    for names, indexed in [(["tfm_*"], [True]), (["tfm_choice", "hellaswag"], [False, True]),
                           (["tfm_all"], [False, True]), (["tfm_choice"], [False])]:  # fmt: skip
        built.clear()
        got = lm_eval_run.task_manager_for(names, folder)
        assert built == indexed and (got == "whole") == indexed[-1], names


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ("dtype=float32,bogus=1", r"\['bogus'\]: unknown to the torchformer backend"),
        ("batch_size=auto", r"batch_size='auto': must be a whole number >= 1"),
        ("max_gen_toks=0", r"max_gen_toks=0: must be a whole number >= 1"),
    ],
)
def test_bad_model_args_are_named(hf_folder, args, message):
    from torchformer.evaluation.lm_eval_backend import TorchformerLM

    with pytest.raises(ValueError, match=message):
        TorchformerLM.create_from_arg_string(f"pretrained={hf_folder},{args}")


def test_data_and_tasks_are_one_or_the_other(hf_folder, capsys):
    from torchformer.cli.main import main

    assert main(["eval", str(hf_folder)]) == 2
    assert "give either --data FILE" in capsys.readouterr().err


def test_without_lm_eval_the_error_names_the_extra(monkeypatch):
    from torchformer.extras import MissingExtra

    monkeypatch.delitem(sys.modules, "torchformer.evaluation.lm_eval_backend", raising=False)
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval -> ModuleNotFoundError
    with pytest.raises(MissingExtra, match=r"torchformer\[eval\]"):
        import torchformer.evaluation.lm_eval_backend  # noqa: F401
