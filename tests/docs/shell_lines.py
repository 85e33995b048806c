"""Which lines of a page's bash block can run in the page's resident `torchformer` process
(tests/docs/resident.py) instead of a bash child of their own, read as bash would read them.

A block is read line by line into steps. A `torchformer ARGS...` line (or `A && B` of such lines)
whose words need no shell (no redirection, pipe, glob, command substitution, escape; `$NAME` only
for a variable the block set to a plain word earlier) becomes its argv lists. A plain assignment
`NAME=word` is remembered. Any other line runs in bash, alone, after the remembered assignments.
Where a line could change the shell's state for the lines after it (cd, export, set, a heredoc,
a loop, a continued line, a background job, ...), the block as a whole runs in bash (``None``):
lines read one at a time would then not mean what they mean in the block.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

WORD = re.compile(r"[\w./:,@%+=-]+")  # a value bash expands to itself, unquoted, as one word
ASSIGNMENT = re.compile(r"([A-Za-z_]\w*)=(.*)")
NAME = re.compile(r"[A-Za-z_]\w*")
SPECIAL = set("$`\\|;&<>(){}*?[]~!")  # unquoted: the shell would act on them
IN_DOUBLE = set("$`\\!")  # inside "...": the shell would still act on them
# Words after which the rest of the block depends on what this line did to the shell itself.
STATEFUL = {
    "cd", "pushd", "popd", "export", "unset", "set", "shopt", "source", ".", "alias", "unalias", "eval",
    "exec", "trap", "declare", "typeset", "local", "readonly", "ulimit", "umask", "hash", "read",
    "mapfile", "readarray", "let", "getopts", "wait", "jobs", "fg", "bg", "function", "enable",
    "if", "then", "else", "elif", "fi", "for", "while", "until", "do", "done", "case", "esac",
    "select", "{", "}", "(", ")", "((", "))", "&", "<<", "<<-", "<<<",
}  # fmt: skip


@dataclass
class Step:
    line: str
    argvs: list[list[str]] = field(default_factory=list)  # torchformer's arguments, one list a command
    prelude: str = ""  # for a bash step: the block's assignments so far, as bash lines


class NeedsShell(Exception):
    """The line is not a plain `torchformer` command."""


def words(line: str, variables: dict[str, str]) -> list[str]:
    """The words of ``line`` as bash splits them, with "&&" between commands; NeedsShell where
    bash would do more than split and unquote (or the line is not complete on its own)."""
    out: list[str] = []
    word: str | None = None  # None: between words ("" is an empty quoted word)
    quote = ""
    i = 0
    while i < len(line):
        c = line[i]
        if quote == "'":
            if c == "'":
                quote = ""
            else:
                word += c
        elif quote == '"':
            if c == '"':
                quote = ""
            elif c == "$":
                value, i = expand(line, i, variables)
                word += value
                continue
            elif c in IN_DOUBLE:
                raise NeedsShell(c)
            else:
                word += c
        elif c in " \t":
            if word is not None:
                out.append(word)
            word = None
        elif c == "#" and word is None:
            break  # a comment: the rest of the line is not read
        elif c in "'\"":
            quote, word = c, word or ""
        elif line.startswith("&&", i):
            if word is not None:
                out.append(word)
            out.append("&&")
            word, i = None, i + 2
            continue
        elif c == "$":
            value, i = expand(line, i, variables)
            word = (word or "") + value
            continue
        elif c in SPECIAL:
            raise NeedsShell(c)
        else:
            word = (word or "") + c
        i += 1
    if quote:
        raise NeedsShell("an unclosed quote")
    if word is not None:
        out.append(word)
    return out


def expand(line: str, i: int, variables: dict[str, str]) -> tuple[str, int]:
    """``$NAME`` / ``${NAME}`` at ``line[i]``: its value and the index after it, where NAME was set to a plain word."""
    braced = line.startswith("${", i)
    m = NAME.match(line, i + 1 + braced)
    if m is None or m.group() not in variables or (braced and not line.startswith("}", m.end())):
        raise NeedsShell(line[i:])
    return variables[m.group()], m.end() + braced


def commands(line: str, variables: dict[str, str]) -> list[list[str]]:
    """The argv lists of a line of `torchformer ...` commands joined by "&&"; NeedsShell otherwise."""
    out: list[list[str]] = [[]]
    for w in words(line, variables):
        if w == "&&":
            out.append([])
        else:
            out[-1].append(w)
    if not all(argv and argv[0] == "torchformer" for argv in out):
        raise NeedsShell(line)
    return [argv[1:] for argv in out]


def stateless(line: str) -> bool:
    """Whether ``line`` alone, in a bash of its own, does what it does in the block (it changes no
    shell state the later lines see and is complete on its own line)."""
    if line.rstrip().endswith("\\"):
        return False
    try:
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        tokens = list(lexer)
    except ValueError:  # an unclosed quote: the line goes on
        return False
    if tokens and tokens[-1] in ("&&", "||", "|"):
        return False  # the command goes on on the next line
    # An assignment anywhere (`A=1; cmd`, or a prefix `A=1 cmd`) is refused too: a prefix would be
    # fine, telling the two apart is not worth it here.
    return not any(t in STATEFUL or ASSIGNMENT.fullmatch(t) for t in tokens)


def plan(code: str) -> list[Step] | None:
    """The steps of a bash block, or None where it must run in bash as a whole."""
    steps: list[Step] = []
    variables: dict[str, str] = {}
    for line in code.splitlines():
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        try:
            steps.append(Step(line, argvs=commands(text, variables)))
            continue
        except NeedsShell:
            pass
        m = ASSIGNMENT.fullmatch(text.split(" #")[0].strip())
        if m and WORD.fullmatch(m.group(2)):
            variables[m.group(1)] = m.group(2)
            continue
        if not stateless(text):
            return None
        steps.append(Step(line, prelude="".join(f"{k}={v}\n" for k, v in variables.items())))
    return steps
