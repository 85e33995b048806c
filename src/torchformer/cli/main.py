"""`torchformer <command>`: the dispatcher. Each command lives in its own module exposing
``add_arguments(parser)`` and ``run(args) -> int``; the docstring of ``run`` is the command's help.
Modules are imported only when their command runs, so `torchformer plan` never imports training.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from .._version import __version__
from ..extras import MissingExtra

COMMANDS = {
    "train": "torchformer.cli.train",
    "generate": "torchformer.cli.generate",
    "plan": "torchformer.cli.plan",
    "attention": "torchformer.cli.attention",
    "verify": "torchformer.cli.verify",
    "convert": "torchformer.cli.convert",
    "demo": "torchformer.cli.demo",
    "serve": "torchformer.cli.serve",
    "eval": "torchformer.cli.eval",
    "embed": "torchformer.cli.embed",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="torchformer", description="The Transformer, all three shapes.")
    parser.add_argument("command", choices=sorted(COMMANDS), help="what to do")
    parser.add_argument("--version", action="version", version=f"torchformer {__version__}")
    if not argv or argv[0] in ("-h", "--help", "--version"):
        if argv and argv[0] == "--version":
            parser.parse_args(argv)  # prints the version and exits 0
        parser.print_help()
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        parser.error(f"unknown command {argv[0]!r}; choose from {sorted(COMMANDS)}")
    module = importlib.import_module(COMMANDS[argv[0]])
    sub = argparse.ArgumentParser(
        prog=f"torchformer {argv[0]}",
        description=(module.run.__doc__ or "").strip(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    module.add_arguments(sub)
    args = sub.parse_args(argv[1:])
    try:
        return int(module.run(args) or 0)
    except (ValueError, TypeError, FileNotFoundError, MissingExtra) as err:
        # User errors are raised with a teaching message at the boundary: show it, no traceback.
        print(f"torchformer {argv[0]}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
