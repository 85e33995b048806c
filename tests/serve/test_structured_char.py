"""Issue 27's structured-output proof over a trained character-level model (the shakespeare-char
preset and char tokenizer, as `torchformer train` makes them), through the real `openai` client.

- A model trained here (a few seconds) on Shakespeare's plays with some JSON lines mixed in, so
  its character vocabulary holds JSON's punctuation: 108 schema-constrained requests (the shared
  schemas: objects, arrays, enums, nesting, required keys, bounded numbers, patterns; greedy and
  seeded) all validate with `jsonschema`; without the constraint the same prompts do not.
  With test_structured.py's 96 over a random BPE model: the issue's 200.
- The real shakespeare-char vocabulary (the plays' own characters: '"' and digits, no '{' or
  '['): a format that needs an object or an array is a 400 before any work; a string it can
  write is served; a pattern whose next character it lacks ('@') ends the request with a 400
  naming the field, streamed or not. Each 400 is followed by a good request on the same engine.
"""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
import torch

import torchformer as tfm
from tests.serve.conftest import NAME, client, httpx, serving
from tests.serve.schemas import SCHEMAS, schema_format, validates
from torchformer.training.data import read_text
from torchformer.training.tokenizers import build_tokenizer

PROMPTS = ["ROMEO:\n", "JULIET:\nO ", "First Citizen:\n", "KING HENRY:\nWhat ", "HAMLET:\nTo be", "\n"]
MAX_TOKENS = 200  # characters: the longest answer of the schemas is about 90


def plays() -> str:
    return read_text("shakespeare")[0][:120_000]


def json_lines(n: int) -> list[str]:
    """Records of the kind a scene summary might be, in JSON: every character JSON needs."""
    rng = random.Random(0)
    return [
        json.dumps({
            "speaker": rng.choice(["ROMEO", "JULIET", "HAMLET"]), "act": rng.randint(1, 5),
            "lines": [rng.randint(-9, 99) for _ in range(rng.randint(0, 3))], "ok": rng.random() < 0.5,
            "ratio": round(rng.random(), 2), "tag": "AB-12",
        })
        for _ in range(n)
    ]  # fmt: skip


def train_char_model(folder, text: str, steps: int) -> None:
    """The shakespeare-char preset (shrunk) trained on ``text`` with its char tokenizer, saved as
    `torchformer train` saves a run: model, config, tokenizer.json."""
    tok = build_tokenizer("char", text)
    torch.manual_seed(0)
    cfg = tfm.presets.get("shakespeare-char", vocab_size=tok.vocab_size, d_model=48, n_layers=2)
    model = tfm.build_model(cfg)
    ids = torch.from_numpy(tok.encode(text))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        start = torch.randint(0, len(ids) - 97, (16,), generator=g)
        batch = torch.stack([ids[s : s + 97] for s in start.tolist()])  # (16, 97)
        logits = model(batch[:, :-1])  # (16, 96, V)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10 - 0.8, "the model did not learn"  # it is trained
    tfm.save(model.eval(), folder)
    (folder / "tokenizer.json").write_text(tok.to_json())


@pytest.fixture(scope="module")
def char_dir(tmp_path_factory):
    folder, lines = tmp_path_factory.mktemp("char-json"), plays().splitlines()
    records = iter(json_lines(len(lines) // 40 + 1))
    text = "\n".join(line if i % 40 else f"{next(records)}\n{line}" for i, line in enumerate(lines))
    train_char_model(folder, text, steps=120)
    return folder


def complete(url: str, prompt: str, seed: int | None, fmt: dict | None, **extra):
    sampling = {"temperature": 0} if seed is None else {"seed": seed, "temperature": 1.0}
    body = {"extra_body": {"response_format": fmt}} if fmt is not None else {}
    options = {"max_tokens": MAX_TOKENS, **sampling, **body, **extra}
    return client(url, timeout=120).completions.create(model=NAME, prompt=prompt, **options)  # 8 at a time, loaded


def test_trained_char_model_constrained_outputs_validate_and_free_ones_do_not(char_dir):
    tok = tfm.load_tokenizer(char_dir)
    assert set('{}[]":,-.0123456789') <= set(tok.get_vocab()), "the vocabulary cannot write JSON"
    cases = [(name, p, seed) for name in SCHEMAS for p in PROMPTS for seed in (None, 7, 8)]
    assert len(cases) == 108
    with serving(char_dir, tfm.load(char_dir).eval(), slots=8, max_queue=128) as (engine, url):
        with ThreadPoolExecutor(8) as pool:
            constrained = list(pool.map(lambda c: complete(url, c[1], c[2], schema_format(c[0])), cases))
            free = list(pool.map(lambda c: complete(url, c[1], c[2], None, max_tokens=60), cases))
        assert engine.healthy
    for (name, prompt, seed), answer in zip(cases, constrained):
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", (name, prompt, seed, choice.text)
        jsonschema.validate(json.loads(choice.text), SCHEMAS[name])
    assert not any(validates(a.choices[0].text, SCHEMAS[n]) for (n, _, _), a in zip(cases, free))
    assert len({a.choices[0].text for a in constrained}) > 2 * len(SCHEMAS)  # the prompts and seeds matter


@pytest.fixture(scope="module")
def shakespeare_vocab(tmp_path_factory):
    """A shakespeare-char model over the plays' own characters (weights need no training here:
    what is tested is what the vocabulary can write)."""
    folder, text = tmp_path_factory.mktemp("shakespeare-char"), read_text("shakespeare")[0]
    tok = build_tokenizer("char", text)
    assert '"' in tok.chars and not set("{[") & set(tok.chars)
    torch.manual_seed(0)
    model = tfm.build_model(tfm.presets.get("shakespeare-char", vocab_size=tok.vocab_size, d_model=32, n_layers=1))
    tfm.save(model.eval(), folder)
    (folder / "tokenizer.json").write_text(tok.to_json())
    with serving(folder, tfm.load(folder).eval(), slots=4) as (engine, url):
        yield engine, url


def assert_serves(engine, url) -> None:
    """The engine is healthy and answers a writable format after a 400."""
    fmt = {"type": "json_schema", "json_schema": {"name": "who", "schema": {"enum": ["ROMEO", "JULIET"]}}}
    answer = complete(url, "ROMEO:\n", None, fmt)
    assert json.loads(answer.choices[0].text) in ("ROMEO", "JULIET") and answer.choices[0].finish_reason == "stop"
    assert engine.healthy


@pytest.mark.parametrize(
    "fmt",
    [
        {"type": "json_object"},
        schema_format("enum_and_bounded_integer"),  # an object
        schema_format("array_of_bounded_integers"),  # an array
    ],
)
def test_shakespeare_vocabulary_refuses_objects_and_arrays_before_any_work(shakespeare_vocab, fmt):
    engine, url = shakespeare_vocab
    body = {"model": NAME, "prompt": "ROMEO:\n", "max_tokens": 20, "response_format": fmt}
    before = engine.metrics.prompt_tokens
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    error = answer.json()["error"]
    assert answer.status_code == 400 and error["param"] == "response_format"
    assert "vocabulary cannot write" in error["message"]
    assert engine.metrics.prompt_tokens == before  # refused before the engine saw it
    assert_serves(engine, url)


@pytest.mark.parametrize("stream", [False, True])
def test_a_pattern_the_vocabulary_cannot_continue_is_a_400(shakespeare_vocab, stream):
    """'"' is writable, '@' is not: the grammar starts, then no token may come next."""
    engine, url = shakespeare_vocab
    fmt = {"type": "json_schema", "json_schema": {"name": "at", "schema": {"type": "string", "pattern": "^@[a-z]+$"}}}
    with pytest.raises(openai.BadRequestError if not stream else openai.APIError) as err:
        answer = complete(url, "ROMEO:\n", None, fmt, stream=stream)
        for _ in answer if stream else ():
            pass
    message = str(err.value)
    assert "response_format" in message and "cannot continue" in message and "'\"'" in message
    assert_serves(engine, url)
