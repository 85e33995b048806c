"""The documentation site builds strictly, documents every public symbol, opens in a real browser
without console errors, and gives every section the README had a home (issue 32)."""

from __future__ import annotations

import contextlib
import doctest
import functools
import http.server
import importlib
import inspect
import pkgutil
import sys
import threading
from pathlib import Path

import pytest

import torchformer
from tests import zygote

ROOT = Path(__file__).resolve().parents[2]
# `mkdocs` as its console script runs it, forked from the zygote (tests/zygote.py): the site's
# CLI reference imports torchformer's command line, so torch, which the zygote has imported once.
MKDOCS = [sys.executable, "-m", "mkdocs"]

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("docs")]

# Every section of the README before it became the front door (issue 32), and the page that now holds
# it. A section that moves again must move here too; one that disappears fails.
HOMES = {
    "Two commands": "getting-started.md",
    "Install without cloning": "getting-started.md",
    "Quick start": "getting-started.md",
    "Variants": "concepts/shapes.md",
    "Attention: what runs where": "concepts/attention.md",
    "What the core tests prove": "concepts/proofs.md",
    "Bring your own checkpoint": "tutorials/convert.md",
    "Look inside": "tutorials/look-inside.md",
    "Generate": "tutorials/generate.md",
    "Serve": "tutorials/serve.md",
    "Train": "tutorials/train.md",
    "Fine-tune, evaluate, embed": "tutorials/finetune.md",
    "Where things live": "concepts/layout.md",
}
# A sentence of each, to show the content moved and not only the title.
CONTENT = {
    "Two commands": "Both create `.venv` with `python3 -m venv`",
    "Install without cloning": "The core install (`torch`, `safetensors`, `numpy`)",
    "Quick start": "model = tfm.build_model(cfg).eval()",
    "Variants": "Every choice is a field of a frozen, validated config",
    "Attention: what runs where": "Every mask and score bias is defined once",
    "What the core tests prove": "builds a pairwise covering array",
    "Bring your own checkpoint": "Local Hugging Face folders",
    "Look inside": "What a model costs, where it looks, and whether it is correct",
    "Generate": "One prefill forward fills the static KV cache",
    "Serve": "batching requests continuously over the",
    "Train": "runs a recipe: a YAML file with sections",
    "Fine-tune, evaluate, embed": "Start from a trained model instead of from scratch",
    "Where things live": "mirrors src/torchformer/",
}


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = zygote.run([*MKDOCS, "build", "--strict", "--site-dir", str(out)], cwd=ROOT, capture_output=True, text=True,
                      timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return out


def test_strict_build_has_every_page_search_and_figures(site):
    for page in ("index.html", "getting-started.html", "tutorials/train.html", "reference/python.html",
                 "reference/cli.html", "benchmarks.html", "search/search_index.json"):  # fmt: skip
        assert (site / page).is_file(), page
    for figure in ("loss-shakespeare-char.png", "attention-shakespeare-char.png", "attention-shakespeare-char.html"):
        assert (site / figure).is_file(), figure
    assert 'src="../loss-shakespeare-char.png"' in (site / "tutorials/train.html").read_text()
    assert 'src="../attention-shakespeare-char.png"' in (site / "tutorials/look-inside.html").read_text()


def test_reference_is_generated_for_every_public_symbol_and_command(site):
    from torchformer.cli.main import COMMANDS

    api = (site / "reference/python.html").read_text()
    for name in torchformer.__all__:
        if name != "__version__":
            assert f"tfm.{name}" in api, name
    cli = (site / "reference/cli.html").read_text()
    for command in COMMANDS:
        assert f'id="torchformer-{command}"' in cli, command
    assert "--max-new-tokens" in cli and "--slots" in cli  # flags come from the parsers themselves


def test_a_broken_link_fails_the_strict_build(tmp_path):
    """The strict build is not vacuous: a page linking to a missing page fails it."""
    import shutil

    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    (tmp_path / "src").symlink_to(ROOT / "src", target_is_directory=True)
    (tmp_path / "benchmarks").symlink_to(ROOT / "benchmarks", target_is_directory=True)
    page = tmp_path / "docs" / "concepts" / "layout.md"
    page.write_text(page.read_text() + "\n[gone](no-such-page.md)\n")
    done = zygote.run([*MKDOCS, "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=tmp_path,
                      capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode != 0 and "no-such-page.md" in done.stderr


def test_every_public_symbol_has_a_docstring():
    missing = []
    for name in torchformer.__all__:
        obj = getattr(torchformer, name)
        if isinstance(obj, str):
            continue
        if not (inspect.getdoc(obj) or "").strip():
            missing.append(name)
        if inspect.isclass(obj):  # and its public methods defined here
            for attr, member in vars(obj).items():
                if not attr.startswith("_") and inspect.isfunction(member) and not (member.__doc__ or "").strip():
                    missing.append(f"{name}.{attr}")
    assert not missing, f"public symbols without a docstring: {missing}"


def test_docstring_examples_are_doctests():
    finder, runner = doctest.DocTestFinder(), doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    examples = 0
    for info in pkgutil.walk_packages(torchformer.__path__, "torchformer."):
        if ".cli." in info.name or info.name.endswith(".__main__"):
            continue
        module = importlib.import_module(info.name)
        for test in finder.find(module):
            examples += len(test.examples)
            runner.run(test)
    assert examples >= 3, "the public functions' docstrings show no >>> example"
    assert runner.failures == 0, f"{runner.failures} docstring example(s) failed (run with -s to see them)"


def test_every_former_readme_section_has_a_home():
    docs = ROOT / "docs"
    for section, page in HOMES.items():
        assert CONTENT[section] in (docs / page).read_text(), f"README section {section!r} lost on its way to {page}"


def test_readme_is_the_front_door():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    assert "make demo" in readme and "make test" in readme and "make docs" in readme
    for page in set(HOMES.values()):
        assert f"docs/{page}" in readme, f"the README links no {page}"


@contextlib.contextmanager
def served(folder: Path):
    """``folder`` over HTTP on 127.0.0.1 (a free port), as `mkdocs serve` or any static server
    serves the built site; yields the base URL."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
    handler.log_message = lambda *a: None
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as httpd:
        thread = threading.Thread(target=httpd.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{httpd.server_address[1]}/"
        finally:
            httpd.shutdown()
            thread.join(10)


def page_log(driver, url: str) -> tuple[list[str], list[str]]:
    """Load ``url``; return (console errors, URLs requested outside ``url``'s origin)."""
    from tests.analysis.test_html_browser import WEB, load

    errors, requests = load(driver, url, settle=1.0)  # the search worker loads its index after the page
    host = url.split("/")[2]
    return errors, [r for r, _ in requests if r.split(":", 1)[0] in WEB and r.split("/")[2] != host]


def test_index_and_api_page_open_in_a_browser_without_console_errors(site, browser, tmp_path):
    with served(site) as base:
        for page in ("index.html", "reference/python.html"):
            errors, away = page_log(browser, base + page)
            assert errors == [], (page, errors)
            assert away == [], (page, away)  # offline: nothing leaves the machine
            shot = tmp_path / (page.replace("/", "-") + ".png")
            assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
            print(f"screenshot of {page}: {shot}")


def test_the_page_check_sees_errors_and_requests_off_the_machine(browser, tmp_path):
    """Not vacuous: a page with a script error and a remote image fails both checks."""
    (tmp_path / "bad.html").write_text('<img src="http://127.0.0.1:9/x.png"><script>throw new Error("boom")</script>')
    with served(tmp_path) as base:
        errors, away = page_log(browser, base + "bad.html")
    assert any("boom" in e for e in errors) and away == ["http://127.0.0.1:9/x.png"]
