import sys

import pytest

from torchformer import extras
from torchformer.cli.main import main


def test_missing_extra_names_the_extra_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "yaml", None)  # import yaml now raises ModuleNotFoundError
    with pytest.raises(extras.MissingExtra, match=r"pip install 'torchformer\[train\]'"):
        extras.require("yaml")
    with pytest.raises(extras.MissingExtra, match=r"torchformer\[hf\]"):
        extras.require("yaml", extra="hf")


def test_other_import_errors_are_not_disguised(monkeypatch):
    monkeypatch.setitem(sys.modules, "not_an_extra_module", None)
    with pytest.raises(ModuleNotFoundError) as err:
        extras.require("not_an_extra_module")
    assert not isinstance(err.value, extras.MissingExtra)


def test_cli_reports_a_missing_extra_without_a_traceback(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "yaml", None)
    assert main(["train", "train.steps=1"]) == 2
    assert "pip install 'torchformer[train]'" in capsys.readouterr().err


def test_version_flag(capsys):
    import torchformer

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"torchformer {torchformer.__version__}"


def test_serve_without_its_extra_names_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "uvicorn", None)
    for name in [n for n in sys.modules if n.startswith("torchformer.serve")]:
        monkeypatch.delitem(sys.modules, name)  # imported by an earlier test in this worker: import anew
    assert main(["serve", "llama-tiny"]) == 2
    assert "pip install 'torchformer[serve]'" in capsys.readouterr().err
