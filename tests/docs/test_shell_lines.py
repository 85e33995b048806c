"""The reading of bash blocks into resident `torchformer` calls (tests/docs/shell_lines.py): a line
goes to the resident process only where bash would run exactly those argv lists."""

from __future__ import annotations

import pytest

from tests.docs.shell_lines import plan

CKPT = "CKPT=runs/x\n"


@pytest.mark.parametrize(
    ("code", "argvs"),
    [
        ("torchformer plan llama3-8b   # a comment $HOME | x\n", [["plan", "llama3-8b"]]),
        ("torchformer generate a --prompt \"ROMEO: hi\" --text 'it''s'\n",
         [["generate", "a", "--prompt", "ROMEO: hi", "--text", "its"]]),
        ("torchformer train \"train.log_to=[tensorboard]\" a#b --x=''\n",
         [["train", "train.log_to=[tensorboard]", "a#b", "--x="]]),
        ("torchformer plan a && torchformer verify b\n", [["plan", "a"], ["verify", "b"]]),
        ("torchformer plan a&&torchformer verify b\n", [["plan", "a"], ["verify", "b"]]),
        (CKPT + "torchformer generate $CKPT --draft ${CKPT}/y \"$CKPT z\"\n",
         [["generate", "runs/x", "--draft", "runs/x/y", "runs/x z"]]),
    ],
)  # fmt: skip
def test_plain_lines_become_argv_lists(code, argvs):
    steps = plan(code)
    assert [argv for step in steps for argv in step.argvs] == argvs
    assert all(step.argvs for step in steps)  # no line left to bash


@pytest.mark.parametrize(
    "line",
    [
        "torchformer plan a > out.txt",
        "torchformer plan a 2>&1",
        "torchformer plan a | head",
        "torchformer plan a; ls",
        "torchformer plan a || true",
        "torchformer plan *.gguf",
        "torchformer plan ~/x",
        "torchformer plan `cat name`",
        'torchformer plan "$(cat name)"',
        "torchformer plan $UNSET",
        "torchformer plan ${CKPT:-x}",
        "torchformer plan a\\ b",
        "torchformer plan {a,b}",
        "torchformer plan a && ls",
        "python -m torchformer.cli.main plan a",
    ],
)
def test_lines_that_need_a_shell_run_in_bash(line):
    steps = plan(line + "\n")
    assert steps is not None and [(s.line, s.argvs) for s in steps] == [(line, [])]


@pytest.mark.parametrize(
    "code",
    [
        "cd runs\ntorchformer plan a\n",
        "export TORCHFORMER_DEBUG=1\ntorchformer plan a\n",
        "set +e\ntorchformer plan a\n",
        "cat > x <<'EOF'\ntorchformer plan a\nEOF\n",
        "for p in a b; do\ntorchformer plan $p\ndone\n",
        "if true; then\ntorchformer plan a\nfi\n",
        "ls \\\n  x\ntorchformer plan a\n",
        "ls &&\ntorchformer plan a\n",
        "echo 'a\ntorchformer plan a\n'\n",
        "CKPT=$(ls)\ntorchformer plan $CKPT\n",
        "A=1; ls\ntorchformer plan a\n",
        "source env.sh\ntorchformer plan a\n",
        "sleep 1 &\ntorchformer plan a\n",
        "torchformer plan a &\n",  # a background job: refused outright
        "torchformer plan $(cat name)\n",  # a subshell: refused outright
        "TORCHFORMER_DEBUG=1 torchformer plan a\n",  # an assignment (here a prefix): refused outright
    ],
)
def test_blocks_whose_lines_change_the_shell_run_whole(code):
    assert plan(code) is None


def test_other_lines_run_alone_with_the_assignments_before_them():
    steps = plan("ls runs  # listing\nCKPT=runs/x\ncmp $CKPT/a $CKPT/b && echo same\ntorchformer plan $CKPT\n")
    assert [(s.prelude, s.line, s.argvs) for s in steps] == [
        ("", "ls runs  # listing", []),
        (CKPT, "cmp $CKPT/a $CKPT/b && echo same", []),
        ("", "torchformer plan $CKPT", [["plan", "runs/x"]]),
    ]
