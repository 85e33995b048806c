"""Running lm-evaluation-harness tasks on a torchformer-loadable model: ``evaluate_tasks`` (what
``torchformer eval MODEL --tasks T`` calls) and lm-eval's own command line with the ``torchformer``
backend registered:

    python -m torchformer.evaluation.lm_eval_run --model torchformer --model_args pretrained=DIR --tasks T

lm-eval 0.4.13 (the newest release) finds model backends only in its own source tree; the
``lm_eval.models`` entry point in pyproject is what its plugin guide names for the releases after
it, where plain ``lm_eval --model torchformer`` then works with no extra step.
"""

from __future__ import annotations

import difflib
import os
import sys

from ..extras import require


def task_manager(include_path: str | os.PathLike | None = None, *, defaults: bool = True):
    """lm-eval's task index: its own tasks (``defaults``) plus the YAML files under ``include_path``."""
    require("lm_eval")
    from lm_eval.tasks import TaskManager

    if include_path is not None and not os.path.isdir(include_path):
        raise ValueError(f"--include-path {str(include_path)!r}: no such folder (of lm-eval task YAML files)")
    return TaskManager(include_path=None if include_path is None else str(include_path), include_defaults=defaults)


def task_manager_for(names: list[str], include_path: str | os.PathLike | None = None):
    """The index ``names`` need. Indexing lm-eval's own ~14k task files takes ~8-10 s, so when the
    folder alone defines every name as a task, its index is enough: what a run loads is the same
    (a folder's task overrides lm-eval's of that name either way). Patterns (``mmlu_*``), groups
    and tags, which may gather lm-eval's own tasks, and names the folder lacks take the whole index."""
    if include_path is not None and names and not any(set(n) & set("*?[") for n in names):
        own = task_manager(include_path, defaults=False)
        if set(names) <= set(own.all_subtasks):
            return own
    return task_manager(include_path)


def check_tasks(names: list[str], manager) -> list[str]:
    """``names`` as lm-eval resolves them (tasks, groups, tags); ValueError naming each unknown one
    with the closest known names, before any model is loaded."""
    if not names or any(not n.strip() for n in names):
        raise ValueError(f"--tasks {','.join(names)!r}: give one or more lm-eval task names, comma-separated")
    known = manager.all_tasks
    unknown = [n for n in names if not manager.match_tasks([n])]
    if unknown:
        hints = "; ".join(f"{n!r}: did you mean {difflib.get_close_matches(n, known, n=3) or 'nothing close'}"
                          for n in unknown)  # fmt: skip
        raise ValueError(f"--tasks: no lm-eval task named {hints} (`lm-eval ls tasks` lists all {len(known)})")
    return manager.match_tasks(names)


def evaluate_tasks(
    model: str,
    tasks: list[str],
    *,
    include_path: str | None = None,
    num_fewshot: int | None = None,
    limit: int | float | None = None,
    batch_size: int = 1,
    dtype: str | None = None,
    quantize: str | None = None,
    group_size: int | None = None,
    log_samples: bool = False,
) -> dict:
    """lm-eval's results dict for ``tasks`` on ``model`` (anything ``tfm.load_any`` opens). Task
    names are checked first: a misspelt one costs no model load."""
    manager = task_manager_for(tasks, include_path)
    names = check_tasks(tasks, manager)
    from lm_eval import simple_evaluate

    from .lm_eval_backend import TorchformerLM

    lm = TorchformerLM(model, dtype=dtype, quantize=quantize, group_size=group_size, batch_size=batch_size)
    return simple_evaluate(model=lm, tasks=names, task_manager=manager, num_fewshot=num_fewshot, limit=limit,
                           log_samples=log_samples)  # fmt: skip


def main() -> None:
    """lm-eval's command line, with ``--model torchformer`` available."""
    require("lm_eval")
    from lm_eval.__main__ import cli_evaluate

    from .lm_eval_backend import register

    register()
    cli_evaluate()


if __name__ == "__main__":
    sys.exit(main())
