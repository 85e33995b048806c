"""`torchformer <command>`: the dispatcher. Each command lives in its own module exposing
``add_arguments(parser)`` and ``run(args) -> int``; the docstring of ``run`` is the command's help.
Modules are imported only when their command runs, so `torchformer plan` never imports training.

A user error (a bad argument or input file) is one line on stderr and exit status 2; ``--debug``
(anywhere on the command line) or ``TORCHFORMER_DEBUG=1`` shows its traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import os
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
    "kernels": "torchformer.cli.kernels",
}
# OSError covers a path that is a folder, unreadable or missing (FileNotFoundError).
USER_ERRORS = (ValueError, TypeError, OSError, MissingExtra)
DEBUG_HELP = "show the traceback of an error (also: TORCHFORMER_DEBUG=1)"


def debugging(argv: list[str]) -> bool:
    return "--debug" in argv or os.environ.get("TORCHFORMER_DEBUG", "").strip() not in ("", "0")


def command_parser(name: str) -> argparse.ArgumentParser:
    """The parser of `torchformer NAME`: the command module's own arguments, its ``run`` docstring
    as the help text (also what the docs site's CLI reference is generated from)."""
    module = importlib.import_module(COMMANDS[name])
    sub = argparse.ArgumentParser(
        prog=f"torchformer {name}",
        description=(module.run.__doc__ or "").strip(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    module.add_arguments(sub)
    sub.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    return sub


def parse(name: str, argv: list[str]) -> argparse.Namespace:
    """`torchformer NAME argv...` parsed as users write it: options and positionals in any order
    (`train model.n_layers=6 --out runs/x train.steps=50` keeps both overrides; plain parse_args
    would refuse the second group as unrecognized)."""
    return command_parser(name).parse_intermixed_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    debug = debugging(argv)
    argv = [a for a in argv if a != "--debug"]
    parser = argparse.ArgumentParser(prog="torchformer", description="The Transformer, all three shapes.")
    parser.add_argument("command", choices=sorted(COMMANDS), help="what to do")
    parser.add_argument("--version", action="version", version=f"torchformer {__version__}")
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    if not argv or argv[0] in ("-h", "--help", "--version"):
        if argv and argv[0] == "--version":
            parser.parse_args(argv)  # prints the version and exits 0
        parser.print_help()
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        parser.error(f"unknown command {argv[0]!r}; choose from {sorted(COMMANDS)}")
    module = importlib.import_module(COMMANDS[argv[0]])
    args = parse(argv[0], argv[1:])
    try:
        return int(module.run(args) or 0)
    except USER_ERRORS as err:
        if debug:
            raise
        # User errors are raised with a teaching message at the boundary: show it, no traceback.
        print(f"torchformer {argv[0]}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
