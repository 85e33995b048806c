"""Issue 27 item 2, the tool-call formats on their own (no server): the parsers of hermes, llama3
and mistral text (parallel calls, broken text left as content, arguments kept as written), and
the call stream (call_stream.py): a call's head goes out once written and its arguments piece by
piece, joining to what the whole answer parses to; calls in another shape are held and parsed
whole. test_tools.py runs them through a server and the openai client."""

from __future__ import annotations

import json

import pytest

from torchformer.serve.call_stream import CallStream
from torchformer.serve.tool_formats import parse


def test_hermes_parses_calls_parallel_calls_and_leaves_broken_text_as_content():
    one = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 0.5}}\n</tool_call>'
    two = one + '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>'
    content, calls = parse(one, "hermes")
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1, "b": 0.5})]
    assert [c.name for c in parse(two, "hermes")[1]] == ["add", "get_weather"]
    assert parse("Let me check.\n" + one, "hermes")[0] == "Let me check."
    for broken in [
        '<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call>',  # not JSON
        '<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>',  # no name
        '<tool_call>\n{"name": "add", "arguments": [1]}\n</tool_call>',  # arguments not an object
        '<tool_call>\n{"name": "add", "arguments": {}}',  # never closed
        one + '\n<tool_call>{"name": "x"</tool_call>',  # one good, one broken: all left as text
        "just text",
    ]:
        assert parse(broken, "hermes") == (broken, [])


def test_llama3_parses_json_calls_with_or_without_python_tag():
    text = '{"name": "add", "parameters": {"a": 2, "b": 0}}'
    assert [(c.name, c.arguments) for c in parse(text, "llama3")[1]] == [("add", '{"a": 2, "b": 0}')]
    assert parse("<|python_tag|>" + text, "llama3")[1][0].name == "add"
    both = text + '; {"name": "move", "parameters": {"to": {"x": 1, "y": 2}}}'
    assert [c.name for c in parse(both, "llama3")[1]] == ["add", "move"]
    plain_json = ['{"name": "Bob", "age": 3}', '{"name": "add", "parameters": {"a": 2', 'x {"name": "add"}']
    for broken in [*plain_json, "The answer is {1}", text + " and"]:
        assert parse(broken, "llama3") == (broken, [])


def test_mistral_parses_a_list_of_calls_with_or_without_its_marker():
    calls = '[{"name": "add", "arguments": {"a": 3, "b": 1}}, {"name": "tag_items", "arguments": {"tags": ["x"]}}]'
    content, found = parse("ok [TOOL_CALLS]" + calls, "mistral")
    assert content == "ok" and [c.name for c in found] == ["add", "tag_items"]
    assert [c.name for c in parse(calls, "mistral")[1]] == ["add", "tag_items"]  # the special token dropped
    for broken in ["[TOOL_CALLS][{'name': 'add'}]", '[TOOL_CALLS][{"arguments": {}}]', "[1, 2]", "no calls here"]:
        assert parse(broken, "mistral") == (broken, [])


def streamed(fmt: str, text: str, size: int) -> tuple[str, list, list[int]]:
    """``text`` fed to a CallStream ``size`` characters at a time: (content, [(name, arguments)]
    as the openai client joins the deltas, the characters fed when each call's head went out)."""
    stream, content, calls, heads = CallStream(fmt), "", {}, []
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    for fed, piece in enumerate([*pieces, None]):
        sent, deltas = stream.feed(piece) if piece is not None else stream.end()
        content += sent
        for d in deltas:
            if "id" in d:
                calls[d["index"]] = [d["function"]["name"], ""]
                heads.append(min(len(text), (fed + 1) * size))
            calls[d["index"]][1] += d["function"]["arguments"]
    return content, [tuple(calls[k]) for k in sorted(calls)], heads


CALL_TEXTS = [
    ("hermes", 'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": "x}]\\"y"}}\n</tool_call>', "Sure.\n"),
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>\n'
               '{"name": "move", "arguments": {"to": {"x": [1, 2]}}}\n</tool_call>', ""),
    ("llama3", '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 0}}', ""),
    ("llama3", '{"name": "add", "parameters": {"a": 2, "b": 0}}; {"name": "move", "parameters": {"to": {"x": 1}}}', ""),
    ("mistral", 'Hm [TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 0}}]', "Hm "),
    ("mistral", '[{"name": "add", "arguments": {"a": 3}}, {"name": "tag_items", "arguments": {"tags": ["x"]}}]', ""),
]  # fmt: skip


@pytest.mark.parametrize(("fmt", "text", "content"), CALL_TEXTS)
def test_streamed_calls_go_out_as_written_and_join_to_the_parsed_calls(fmt, text, content):
    """Each call's head (id, name) goes out once written, before the answer ends, then its
    arguments piece by piece; joined, they are what the whole answer parses to."""
    want = [(c.name, c.arguments) for c in parse(text, fmt)[1]]
    for size in (1, 3, 7):  # markers and JSON split anywhere
        sent, calls, heads = streamed(fmt, text, size)
        assert sent == content and calls == want, size
        assert heads[0] < len(text), "the first call's name waited for the end"
        assert len(heads) == len(want)
    head, arguments = streamed(fmt, text, 1)[2][0], text.index(want[0][1])
    assert head <= arguments + 1  # the name before any of the arguments


@pytest.mark.parametrize(
    ("fmt", "text"),
    [
        ("hermes", '<tool_call>\n{"arguments": {"a": 1}, "name": "add"}\n</tool_call>'),  # name after arguments
        ("llama3", '{"parameters": {"a": 2}, "name": "add"}'),
        ("hermes", "the <tool fox jumps"),  # plain text that looked like a marker
        ("llama3", '{"name": "Bob", "age": 3}'),  # JSON that is not a call
        ("mistral", "[1, 2]"),
        ("hermes", '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1}"}\n</tool_call>'),  # arguments as a string
    ],
)
def test_calls_in_another_shape_are_held_and_parsed_whole(fmt, text):
    content, calls = parse(text, fmt)
    for size in (1, 4, len(text)):
        sent, got, _ = streamed(fmt, text, size)
        assert got == [(c.name, c.arguments) for c in calls] and sent.strip() == content.strip(), size
