"""Data: the Shakespeare corpus and its by-play split, tokenizers (fast path == HF tokenizer),
sources (file, folder, JSONL, TSV), the memory-mapped cache, and batches."""

import json

import numpy as np
import pytest
import torch

from torchformer.training import corpus as shakespeare
from torchformer.training.batches import LMBatches, PairBatches
from torchformer.training.data import prepare, read_pairs, read_text
from torchformer.training.tokenizers import build_tokenizer, load_text_tokenizer

TEXT = "Now is the winter of our discontent\nMade glorious summer — by this sun of York;\n"


def test_markup_is_stripped_to_dialogue():
    md = (
        "# A Play\n\n## ACT I\n\n### SCENE I. A street.\n\n_Enter ROMEO and\nJULIET_\n\n"
        "**ROMEO**  \nBut soft! __\\[Aside]_ what light  \nthrough yonder \\--window breaks?  \n\n\n"
        "**JULIET**  \nAy me!  \n\n_Exit_\n"
    )
    assert (
        shakespeare.dialogue(md) == "ROMEO\nBut soft! what light\nthrough yonder --window breaks?\n\nJULIET\nAy me!\n"
    )


def test_split_is_by_play_and_disjoint():
    plays = shakespeare.play_files()
    assert len(plays) == 38
    held = [name for i, (name, _) in enumerate(plays) if i % 10 == 5]
    assert len(held) == 4
    train, val = shakespeare.shakespeare()
    assert 0.08 < len(val) / (len(train) + len(val)) < 0.15
    assert "\n#" not in train and "**" not in train and "_Enter" not in train
    first_line_of_held_out = shakespeare.dialogue(dict(plays)[held[0]]).splitlines()[1]
    assert first_line_of_held_out in val and first_line_of_held_out not in train


@pytest.mark.parametrize("kind", ["char", "byte", "bpe"])
def test_tokenizers_agree_with_their_hf_json(kind):
    tok = build_tokenizer(kind, TEXT * 20, vocab_size=300)
    ids = tok.encode(TEXT)
    assert ids.tolist() == tok.hf.encode(TEXT).ids
    assert tok.decode(ids) == TEXT
    again = load_text_tokenizer(kind, tok.to_json())
    assert again.encode(TEXT).tolist() == ids.tolist() and again.vocab_size == tok.vocab_size
    assert {tok.pad_id, tok.bos_id, tok.eos_id, tok.mask_id}.isdisjoint(set(ids.tolist()))
    if kind == "byte":
        assert ids.tolist() == list(TEXT.encode())


def test_text_sources(tmp_path):
    (tmp_path / "one.txt").write_text(TEXT)
    train, val = read_text(str(tmp_path / "one.txt"))
    assert train + val == TEXT  # few documents: cut at 90%
    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(20):
        (folder / f"{i:02d}.txt").write_text(f"doc {i}\n")
    train, val = read_text(str(folder))
    assert val == "doc 5\n\ndoc 15\n" and "doc 5\n" not in train.split("\n\n")
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": f"line {i}"}) for i in range(3)))
    assert "".join(read_text(str(jsonl))) == "line 0\nline 1\nline 2"
    jsonl.write_text('{"txt": 1}\n')
    with pytest.raises(ValueError, match=r"t.jsonl:1: needs a string field 'text'"):
        read_text(str(jsonl))


def test_pair_sources(tmp_path):
    tsv = tmp_path / "p.tsv"
    tsv.write_text("".join(f"src {i}\ttgt {i}\n" for i in range(20)))
    train, val = read_pairs(str(tsv), {})
    assert len(train) == 18 and val == [("src 5", "tgt 5"), ("src 15", "tgt 15")]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text("\n".join(json.dumps({"source": f"a{i}", "target": f"b{i}"}) for i in range(3)))
    assert read_pairs(str(jsonl), {}) == ([("a0", "b0"), ("a1", "b1")], [("a2", "b2")])
    tsv.write_text("only one column\n")
    with pytest.raises(ValueError, match="exactly 2 tab-separated columns"):
        read_pairs(str(tsv), {})


def test_cache_is_built_once_and_memory_mapped(tmp_path, corpus):
    spec = {"source": str(corpus), "task": "lm", "tokenizer": "char", "bpe_vocab_size": 0, "synthetic": {}}
    first = prepare(spec, tmp_path / "cache")
    stamp = (tmp_path / "cache" / "train.bin").stat().st_mtime_ns
    second = prepare(spec, tmp_path / "cache")
    assert (tmp_path / "cache" / "train.bin").stat().st_mtime_ns == stamp
    assert isinstance(second.train, np.memmap) and np.array_equal(first.train, second.train)
    assert first.tokenizer.decode(second.train[:200]) == corpus.read_text()[:200]
    corpus.write_text(corpus.read_text() + "more\n")  # changed source: rebuilt
    third = prepare(spec, tmp_path / "cache")
    assert len(third.train) + len(third.val) > len(first.train) + len(first.val)


def test_batches_depend_only_on_seed_and_step():
    tokens = np.arange(1000) % 50
    a = LMBatches(tokens, tokens, batch_size=4, seq_len=8, seed=1)
    b = LMBatches(tokens, tokens, batch_size=4, seq_len=8, seed=1)
    b.batch(0), b.batch(1)  # draws in between change nothing
    assert all(torch.equal(a.batch(7)[k], b.batch(7)[k]) for k in ("ids", "labels"))
    batch = a.batch(3)
    assert torch.equal(batch["ids"][:, 1:], batch["labels"][:, :-1])
    pairs = [(np.array([5] * n), np.array([6] * (n + 1))) for n in range(1, 41)]
    p = PairBatches(pairs, pairs, batch_size=8, seed=0, pad=0, bos=1, eos=2)
    seen = [p.batch(s) for s in range(5)]  # one epoch: every pair exactly once
    lengths = sorted(int(m.sum()) - 1 for b in seen for m in b["src_mask"])
    assert lengths == list(range(1, 41))
    for b in seen:  # length-bucketed: rows of a batch have similar lengths
        n = b["src_mask"].sum(1)
        assert int(n.max() - n.min()) <= 7
        assert b["tgt"][0, 0] == 1 and (b["labels"] == 2).sum() == 8
