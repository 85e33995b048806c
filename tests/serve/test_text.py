"""Stop strings on decoded text across token boundaries, held-back text, protocol checks and the
sandboxed chat template (units; the HTTP paths are in test_api / test_errors)."""

from __future__ import annotations

import json

import pytest

from tests.serve.conftest import train_tokenizer
from torchformer.serve.chat import load_chat_template
from torchformer.serve.protocol import APIError, chat_request, completion_request
from torchformer.serve.text import Texts, TextStream


class Chars:
    """A tokenizer whose tokens are given strings (so token boundaries are chosen by the test)."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.pieces[i] for i in ids)


def run(pieces: list[str], stop: tuple[str, ...]) -> tuple[list[str], bool, str]:
    stream = TextStream(Texts(Chars(pieces), len(pieces)), stop)
    released, stopped = [], False
    for i in range(len(pieces)):
        text, stopped = stream.add(i)
        released.append(text)
        if stopped:
            break
    return released, stopped, "".join(released) + stream.flush()


@pytest.mark.parametrize(
    ("pieces", "stop", "text", "stopped"),
    [
        (["ab", "c", "END", "x"], ("END",), "abc", True),  # stop as one token
        (["ab", "cE", "N", "Dx"], ("END",), "abc", True),  # stop spread over three tokens
        (["a", "EN", "b", "c"], ("END",), "aENbc", False),  # a prefix that does not complete is released
        (["xy", "zz", "q"], ("q", "yz"), "x", True),  # the earliest of several stops wins
        (["hello", " wor", "ld"], ("world",), "hello ", True),
    ],
)
def test_stop_strings_across_token_boundaries(pieces, stop, text, stopped):
    released, got_stopped, total = run(pieces, stop)
    assert (total, got_stopped) == (text, stopped)
    if stopped:  # everything before the stop was released by add(); flush has nothing left
        assert "".join(released) == text


def test_text_that_may_start_a_stop_string_is_held_back():
    released, _, _ = run(["ab", "cE", "N", "q"], ("END",))
    assert released == ["ab", "c", "", "ENq"]  # "E", then "EN", held until they cannot be "END"


def test_incomplete_utf8_is_held_back():
    tok = train_tokenizer()
    byte_ids = [tok.token_to_id(t) for t in ["Ã", "©"]]  # é as two byte-level tokens
    stream = TextStream(Texts(tok, tok.get_vocab_size()), ())
    assert stream.add(byte_ids[0]) == ("", False)  # half a character: nothing yet
    assert stream.add(byte_ids[1]) == ("é", False)


class Counting:
    """A tokenizer wrapper that records how many ids each decode call gets."""

    def __init__(self, tok) -> None:
        self.tok, self.sizes = tok, []

    def decode(self, ids, skip_special_tokens=True):
        self.sizes.append(len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def metaspace_tokenizer():
    """A SentencePiece-style tokenizer (Metaspace: "▁" for spaces, stripped at a sequence start)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    lines = ["the quick brown fox jumps over the lazy dog", "naïve café déjà vu, 日本語のテキスト"] * 50
    tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>"]))
    return tok


@pytest.mark.parametrize("kind", ["byte-level", "metaspace"])
def test_incremental_text_equals_decoding_everything_and_reads_short_windows(kind):
    tok = train_tokenizer() if kind == "byte-level" else metaspace_tokenizer()
    text = "the naïve café: déjà vu! 日本語のテキスト, over the lazy dog " * 20
    ids = tok.encode(text).ids
    if kind == "byte-level":  # split é and the CJK characters' bytes over separate tokens too
        ids = [tok.token_to_id(t) for t in "".join(tok.decode([i]) for i in ids[:5])] + ids
        ids = [i for i in ids if i is not None] + [tok.token_to_id("Ã"), tok.token_to_id("©")]
    counting = Counting(tok)
    stream = TextStream(Texts(counting, tok.get_vocab_size()), ())
    released = "".join(stream.add(i)[0] for i in ids) + stream.flush()
    assert released == tok.decode(ids, skip_special_tokens=True)
    assert len(ids) > 200 and max(counting.sizes) <= 8, "each token decodes a few ids, not the whole list"


def test_ids_only_without_tokenizer():
    texts = Texts(None, 10)
    assert texts.decode([3, 4]) == "3 4"
    assert texts.encode([1, 9]) == [1, 9]
    with pytest.raises(APIError, match="token ids only"):
        texts.encode("text")
    with pytest.raises(APIError, match="vocab_size=10"):
        texts.encode([10])


def test_request_checks():
    prompt, p = completion_request({"model": "m", "prompt": "x"}, "m")
    assert (prompt, p.max_tokens, p.sampling.temperature, p.stop, p.stream) == ("x", 16, 1.0, (), False)
    _, p = completion_request({"model": "m", "prompt": [[1, 2]], "top_k": -1, "temperature": 0, "stop": "s"}, "m")
    assert (p.sampling.top_k, p.sampling.greedy, p.stop) == (None, True, ("s",))
    _, p = chat_request({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, "m")
    assert p.max_tokens is None  # the rest of the context
    msgs, _ = chat_request(
        {
            "model": "m",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        },
        "m",
    )
    assert msgs == [{"role": "user", "content": "ab"}]
    for body, param in [
        ({"model": "m", "prompt": "x", "max_tokens": True}, "max_tokens"),
        ({"model": "m", "prompt": ""}, "prompt"),
        ({"model": "m", "prompt": "x", "stream": "yes"}, "stream"),
        ({"prompt": "x"}, "model"),
    ]:
        with pytest.raises(APIError) as err:
            completion_request(body, "m")
        assert err.value.param == param and err.value.status == 400
    with pytest.raises(APIError) as err:
        chat_request({"model": "m", "messages": [{"role": "user"}], "max_tokens": 2, "max_completion_tokens": 2}, "m")
    assert err.value.param == "max_tokens"
    with pytest.raises(APIError) as err:
        completion_request([1, 2], "m")
    assert err.value.status == 400


def write_config(folder, **config):
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def test_chat_template_sources(tmp_path):
    assert load_chat_template(tmp_path) is None and load_chat_template(None) is None
    write_config(tmp_path, chat_template="{{ bos_token }}{{ messages[0]['content'] }}|", bos_token={"content": "<s>"})
    assert load_chat_template(tmp_path).render([{"role": "user", "content": "hi"}]) == "<s>hi|"
    write_config(tmp_path, chat_template=[{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}])
    assert load_chat_template(tmp_path).render([]) == "D"
    (tmp_path / "chat_template.jinja").write_text("J{{ messages | length }}")  # the file wins, as in transformers
    assert load_chat_template(tmp_path).render([{"role": "user", "content": "x"}]) == "J1"


def test_chat_template_runs_sandboxed(tmp_path):
    write_config(tmp_path, chat_template="{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(APIError) as err:
        load_chat_template(tmp_path).render([])
    assert err.value.status == 400
    write_config(tmp_path, chat_template="{% set _ = messages.append({'role': 'x'}) %}{{ messages | length }}")
    with pytest.raises(APIError):
        load_chat_template(tmp_path).render([{"role": "user", "content": "x"}])
    write_config(tmp_path, chat_template="{{ raise_exception('only user messages') }}")
    with pytest.raises(APIError, match="only user messages"):
        load_chat_template(tmp_path).render([])
