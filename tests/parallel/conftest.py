"""The one launch (of 2 ranks) most tests of tests/parallel read (tp_worker.py: the TP grid, ``generate
--tp 2``, a TP=2 training run). Session-scoped: their tests share xdist_group("parallel"), so one
worker runs them all and launches once."""

from __future__ import annotations

import json

import pytest

from .cases import generate_case, train_recipe
from .launch import ranks


@pytest.fixture(scope="session")
def launched(tmp_path_factory):
    """{"tmp": the folder of the run, "ids", "want": the generate case, "ranks": what each rank recorded}."""
    tmp = tmp_path_factory.mktemp("tp-launch")
    ids, want = generate_case(tmp / "model")
    (tmp / "recipe.json").write_text(json.dumps(train_recipe(tmp, "run", strategy="tp", tp=2).to_dict()))
    out = tmp / "rows.json"
    args = ["--generate", str(tmp / "model"), ids, "--train", str(tmp / "recipe.json")]
    proc = ranks(2, "tests.parallel.tp_worker", str(out), *args, timeout=400)
    assert proc.returncode == 0, (
        "\n".join(line for line in proc.stderr.splitlines() if "rank0]" in line)[-4000:] or (proc.stderr[-4000:])
    )
    recorded = [json.loads(out.with_name(f"{out.name}.{r}").read_text()) for r in range(2)]
    return {"tmp": tmp, "ids": ids, "want": want, "ranks": recorded}
