"""Issue 27 item 2: tool calls (``tools``, ``tool_choice``, ``parallel_tool_calls``), through the
real `openai` client against a real server. The model is conftest's random tiny decoder with a
Qwen-style chat template written here (it renders ``tools``, an assistant's ``tool_calls`` and
``tool`` messages): under ``required`` or a named function the grammar makes every answer a
call whose arguments validate with `jsonschema`; the same requests under ``auto`` (the model
free) give no call at all (the control: only the constraint makes them valid). The parsers of
the three formats and their streaming are tested on their own in test_tool_formats.py; here
each format is enforced end to end. Bad tool fields are 400s naming the field, and the engine
then serves a good request."""

from __future__ import annotations

import dataclasses
import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
import torch

import torchformer as tfm
from tests.serve.conftest import NAME, client, httpx, serving, tiny_config, train_tokenizer
from torchformer.serve.chat import ChatTemplate
from torchformer.serve.tool_formats import detect, parse

# A Qwen2.5-style template (written for this test): tools in a system turn, calls in <tool_call>
# blocks with the arguments as JSON, tool results in <tool_response> blocks.
QWEN_STYLE = """\
{%- if tools %}<|system|>You may call one or more functions. Their signatures:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
For each call, return <tool_call>{"name": <name>, "arguments": <args-json-object>}</tool_call>
{%- endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}<|assistant|>{{ m.content or '' }}
{%- for call in m.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}
{%- elif m.role == 'tool' %}<|user|><tool_response>
{{ m.content }}
</tool_response>
{%- else %}<|{{ m.role }}|>{{ m.content }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|>{% endif %}"""
LLAMA_STYLE = (
    "{{- bos_token }}{%- if tools is not none %}Environment: ipython\n{%- endif %}"
    "{%- for m in messages %}{%- if m.tool_calls %}<|python_tag|>{{ m.tool_calls[0].function | tojson }}"
    "{%- else %}{{ m.content }}{%- endif %}<|eot_id|>{%- endfor %}"
)
MISTRAL_STYLE = (
    "{%- for m in messages %}{%- if m.tool_calls %}[TOOL_CALLS]{{ m.tool_calls | tojson }}{%- endif %}{%- endfor %}"
)

PARAMETERS = {
    "get_weather": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"],
    },
    "add": {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "minimum": -9, "maximum": 99},
            "b": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["a", "b"],
    },
    "tag_items": {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"type": "string", "pattern": "^[a-z]{1,4}$"},
                "minItems": 1,
                "maxItems": 3,
            },
            "urgent": {"type": "boolean"},
        },
        "required": ["tags"],
    },  # fmt: skip
    "move": {
        "type": "object",
        "properties": {
            "to": {
                "type": "object",
                "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}, "y": {"enum": [1, 2, 3]}},
                "required": ["x", "y"],
            }
        },
        "required": ["to"],
    },
}
TOOLS = [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in PARAMETERS.items()]
MAX_TOKENS = 160
USER = [{"role": "user", "content": "the quick brown fox"}]


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


@pytest.fixture(scope="module")
def tools_dir(tmp_path_factory):
    """conftest's tiny decoder (room for the tools in the prompt; an end token, so that after a
    call under parallel_tool_calls the model may stop or go on) with the Qwen-style template."""
    folder, tok = tmp_path_factory.mktemp("tools"), train_tokenizer()
    torch.manual_seed(0)
    cfg = dataclasses.replace(
        tiny_config(tok.get_vocab_size()), max_seq_len=2048, eos_token_id=tok.token_to_id("<|eos|>")
    )
    tfm.save(tfm.build_model(cfg).eval(), folder)
    tok.save(str(folder / "tokenizer.json"))
    config = {"chat_template": QWEN_STYLE, "eos_token": "<|eos|>", "bos_token": ""}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def served(tools_dir):
    with serving(tools_dir, tfm.load(tools_dir).eval(), slots=4, max_queue=64) as (engine, url):
        yield engine, url


def ask(url: str, messages=USER, seed: int | None = 0, **options):
    sampling = {"temperature": 0} if seed is None else {"seed": seed, "temperature": 1.0}
    options = {"tools": TOOLS, "max_tokens": MAX_TOKENS, **sampling, **options}
    return client(url, timeout=120).chat.completions.create(model=NAME, messages=messages, **options)


def check_calls(choice, allowed=PARAMETERS) -> list:
    """The choice is tool calls only, each of an allowed function with arguments that validate."""
    assert choice.finish_reason == "tool_calls", choice.message
    calls = choice.message.tool_calls
    assert calls and not choice.message.content  # null (a stream's accumulated content: "")
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and len(call.id) > 10
        jsonschema.validate(json.loads(call.function.arguments), allowed[call.function.name])
    assert len({c.id for c in calls}) == len(calls)
    return calls


def test_format_is_found_from_the_template():
    assert detect(QWEN_STYLE) == "hermes" and detect(LLAMA_STYLE) == "llama3" and detect(MISTRAL_STYLE) == "mistral"
    assert detect("{{ messages[0].content }}") == "hermes" and detect(None) == "hermes"


def test_the_template_renders_tools_calls_and_tool_results():
    from torchformer.serve.protocol import messages

    turns = messages(
        [
            *USER,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 0.5}'}}
                ],
            },  # fmt: skip
            {"role": "tool", "tool_call_id": "call_1", "content": "1.5"},
        ]
    )
    text = ChatTemplate(QWEN_STYLE).render(turns, TOOLS)
    assert text.startswith("<|system|>You may call") and text.count('"name": "') == len(TOOLS) + 1
    assert '{"name": "add", "arguments": {"a": 1, "b": 0.5}}' in text  # the arguments as an object
    assert "<tool_response>\n1.5\n</tool_response>" in text and text.endswith("<|assistant|>")
    assert "<tools>" not in ChatTemplate(QWEN_STYLE).render(turns[:1], None)


def test_a_folders_tool_use_template_renders_requests_with_tools(tmp_path):
    from torchformer.serve.chat import load_chat_template

    named = [{"name": "default", "template": "D{{ tools }}"}, {"name": "tool_use", "template": "T{{ tools | length }}"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    chat = load_chat_template(tmp_path)
    assert chat.render(USER, TOOLS) == "T4" and chat.render(USER, None) == "DNone"


# --- end to end ---------------------------------------------------------------------------------
def test_required_and_named_calls_validate_and_free_answers_hold_none(served):
    """Under required / named, every answer is calls whose arguments validate; the same prompts
    and seeds under auto (no constraint) give no call: only the grammar makes them valid."""
    _, url = served
    prompts = ["the quick brown fox", "héllo wörld"]
    choices = ["required", *(named(n) for n in PARAMETERS)]
    cases = [(p, c, s) for p in prompts for c in choices for s in (None, 3)]
    one = {"parallel_tool_calls": False}
    with ThreadPoolExecutor(4) as pool:
        forced = list(pool.map(lambda c: ask(url, [{"role": "user", "content": c[0]}], c[2], tool_choice=c[1], **one),
                               cases))  # fmt: skip
        free = list(
            pool.map(
                lambda c: ask(url, [{"role": "user", "content": c[0]}], c[2], tool_choice="auto", max_tokens=60), cases
            )
        )
    for (_, choice, _), answer in zip(cases, forced):
        calls = check_calls(answer.choices[0])
        assert len(calls) == 1
        if choice != "required":
            assert calls[0].function.name == choice["function"]["name"]
    for answer in free:
        assert answer.choices[0].message.tool_calls is None and answer.choices[0].finish_reason != "tool_calls"
        assert not parse(answer.choices[0].message.content, "hermes")[1]


def test_parallel_calls_under_required(served):
    """parallel_tool_calls (the default): after each call the model may stop or write another."""
    _, url = served
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda s: ask(url, seed=s, tool_choice="required", max_tokens=500), range(8)))
    done = [a.choices[0] for a in answers if a.choices[0].finish_reason != "length"]
    assert len(done) >= 4, [a.choices[0].finish_reason for a in answers]
    counts = [len(check_calls(choice)) for choice in done]
    assert max(counts) >= 2, counts


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("first", ["required", "named", "auto"])
def test_round_trip_call_tool_result_answer(served, tools_dir, first, stream):
    """Call (required / named / auto) -> the tool's result -> an answer (auto: the model is free),
    streamed or not; the second prompt holds the call and the result as the template writes them."""
    _, url = served
    choice = {"required": "required", "named": named("move"), "auto": "auto"}[first]
    c = client(url)
    options = {"model": NAME, "tools": TOOLS, "max_tokens": MAX_TOKENS, "seed": 1, "temperature": 1.0}
    options["parallel_tool_calls"] = False
    if stream:  # the openai client's own accumulation of delta.tool_calls
        with c.chat.completions.stream(messages=USER, tool_choice=choice, **options) as events:
            answer = events.get_final_completion()
    else:
        answer = c.chat.completions.create(messages=USER, tool_choice=choice, **options)
    if first == "auto":  # a random model writes no call: the turn is plain content, as without tools
        message = answer.choices[0].message
        assert message.tool_calls in (None, []) and message.content
        calls = [{"id": "call_given", "type": "function", "function": {"name": "add", "arguments": '{"a":1,"b":0}'}}]
    else:
        found = check_calls(answer.choices[0])
        assert first != "named" or {f.function.name for f in found} == {"move"}
        calls = [{"id": f.id, "type": "function", "function": f.function.model_dump()} for f in found]
    turns = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": calls},
        *({"role": "tool", "tool_call_id": f["id"], "content": "sunny, 21 C"} for f in calls),
    ]
    final = c.chat.completions.create(
        messages=turns, tool_choice="auto", extra_body={"return_token_ids": True}, **options
    )
    assert final.choices[0].message.tool_calls is None and final.choices[0].finish_reason in ("stop", "length")
    prompt = tfm.load_tokenizer(tools_dir).decode(final.prompt_token_ids, skip_special_tokens=False)
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt
    assert json.dumps({"name": calls[0]["function"]["name"]})[1:-1] in prompt


def test_a_streamed_call_arrives_as_tool_call_deltas(served):
    _, url = served
    one = {"parallel_tool_calls": False}
    chunks = list(ask(url, seed=2, tool_choice=named("add"), stream=True, **one))
    deltas = [d for ch in chunks for d in (ch.choices[0].delta.tool_calls or []) if ch.choices]
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == "add"
    arguments = "".join(d.function.arguments or "" for d in deltas)
    jsonschema.validate(json.loads(arguments), PARAMETERS["add"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not any(ch.choices[0].delta.content for ch in chunks if ch.choices)  # the call is not content too
    whole = ask(url, seed=2, tool_choice=named("add"), **one)
    assert whole.choices[0].message.tool_calls[0].function.arguments == arguments  # the same tokens either way


def test_tool_choice_none_renders_no_tools(served):
    _, url = served
    answer = ask(url, seed=None, tool_choice="none", extra_body={"return_token_ids": True})
    assert answer.choices[0].message.tool_calls is None
    answer_without = client(url).chat.completions.create(
        model=NAME, messages=USER, max_tokens=MAX_TOKENS, temperature=0, extra_body={"return_token_ids": True}
    )
    assert answer.prompt_token_ids == answer_without.prompt_token_ids
    assert answer.choices[0].message.content == answer_without.choices[0].message.content


@pytest.mark.parametrize("fmt", ["llama3", "mistral", "hermes"])
def test_each_format_is_enforced_and_parsed(tools_dir, fmt):
    """--tool-call-format: the grammar writes that family's syntax, and its parser reads it back."""
    with serving(tools_dir, tfm.load(tools_dir).eval(), slots=2, app={"tool_call_format": fmt}) as (_, url):
        raw = ask(url, seed=5, tool_choice=named("get_weather"), parallel_tool_calls=False,
                  extra_body={"return_token_ids": True})  # fmt: skip
        for seed in (6, 7):
            check_calls(ask(url, seed=seed, tool_choice="required", parallel_tool_calls=False).choices[0])
    calls = check_calls(raw.choices[0])
    text = tfm.load_tokenizer(tools_dir).decode(raw.choices[0].token_ids)
    start = {"hermes": '<tool_call>\n{"name": "get_weather"', "llama3": '{"name": "get_weather", "parameters": ',
             "mistral": '[TOOL_CALLS][{"name": "get_weather"'}[fmt]  # fmt: skip
    assert text.startswith(start) and [c.name for c in parse(text, fmt)[1]] == [calls[0].function.name]


BAD = [
    ({"tools": [{"type": "function", "function": {"parameters": PARAMETERS["add"]}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters"),  # fmt: skip
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0]"),
    ({"tools": TOOLS[:1] * 2}, "tools"),
    ({"tools": "add"}, "tools"),
    ({"tools": TOOLS, "tool_choice": named("divide")}, "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"s": {"type": "string", "pattern": "(("}}}}}], "tool_choice": "required"},
     "tools"),  # fmt: skip
    ({"messages": [*USER, {"role": "tool", "content": "1"}]}, "messages[1].tool_call_id"),
    ({"messages": [*USER, {"role": "user", "content": "1", "tool_call_id": "x"}]}, "messages[1].tool_call_id"),
    ({"messages": [*USER, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
      "function": {"name": "add", "arguments": "{a: 1}"}}]}]}, "messages[1].tool_calls[0].function.arguments"),
    ({"messages": [*USER, {"role": "user", "content": "x", "tool_calls": []}]}, "messages[1].tool_calls"),
]  # fmt: skip


@pytest.mark.parametrize(("extra", "param"), BAD, ids=[p for _, p in BAD])
def test_bad_tool_fields_are_400_naming_the_field_and_the_engine_goes_on(served, extra, param):
    engine, url = served
    body = {"model": NAME, "messages": USER, "max_tokens": 4, **extra}
    answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
    error = answer.json()["error"]
    assert answer.status_code == 400 and error["type"] == "invalid_request_error", error
    assert error["param"] == param and error["message"].startswith(param + ": "), error
    check_calls(ask(url, seed=1, tool_choice="required", parallel_tool_calls=False).choices[0])
    assert engine.healthy
