"""mkdocs hooks: the pages that are generated from the code, never copied by hand.

A page asks for generated text with a marker line:

- ``<!-- generate: python-reference -->``: one mkdocstrings block per name of ``torchformer.__all__``
  (mkdocstrings renders each from its docstring and signature).
- ``<!-- generate: cli-reference -->``: every subcommand's ``--help`` and a table of its options,
  from the very argparse parser the CLI uses (``torchformer.cli.main.command_parser``).
- ``<!-- include: PATH -->``: the file at PATH (relative to the repository root), headings moved
  one level down (``benchmarks/RESULTS.md`` on the benchmarks page).
"""

from __future__ import annotations

import argparse
import inspect
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^<!-- (generate|include): (\S+) -->$", flags=re.MULTILINE)


def python_reference() -> str:
    import torchformer

    blocks = []
    for name in sorted(torchformer.__all__, key=str.lower):
        obj = getattr(torchformer, name)
        if isinstance(obj, str):  # __version__
            continue
        # Where the object is defined (a re-exported function may share its name with a module).
        where = obj.__name__ if inspect.ismodule(obj) else f"{obj.__module__}.{obj.__qualname__}"
        blocks.append(f"::: {where}\n    options:\n      heading: tfm.{name}\n")
    return "\n".join(blocks)


def option_rows(parser: argparse.ArgumentParser) -> list[str]:
    rows = ["| argument | default | what it does |", "|---|---|---|"]
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        name = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.dest}`"
        default = "" if action.default in (None, False, argparse.SUPPRESS) else f"`{action.default}`"
        text = (action.help or "").replace("|", "\\|").replace("\n", " ")
        rows.append(f"| {name} | {default} | {text} |")
    return rows


def cli_reference() -> str:
    from torchformer.cli.main import COMMANDS, command_parser

    parts = []
    for name in sorted(COMMANDS):
        parser = command_parser(name)
        parts += [f"## torchformer {name}", "", "```text", parser.format_help().rstrip(), "```", ""]
        parts += [*option_rows(parser), ""]
    return "\n".join(parts)


def include(path: str) -> str:
    text = (ROOT / path).read_text()
    return re.sub(r"^(#+) ", lambda m: "#" + m.group(1) + " ", text, flags=re.MULTILINE)


def expand(markdown: str) -> str:
    def one(match: re.Match) -> str:
        kind, what = match.groups()
        if kind == "include":
            return include(what)
        makers = {"python-reference": python_reference, "cli-reference": cli_reference}
        if what not in makers:
            raise ValueError(f"docs marker <!-- generate: {what} -->: choose one of {sorted(makers)}")
        return makers[what]()

    return MARKER.sub(one, markdown)


def on_page_markdown(markdown: str, page, config, files) -> str:  # mkdocs hook
    return expand(markdown)
