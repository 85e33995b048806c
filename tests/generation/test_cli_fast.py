"""`torchformer generate --quantize / --draft / --prompt-lookup` (issue 13): the same tokens as the
library calls, the acceptance rate under --verbose, one-line errors."""

import pytest
import torch

import torchformer as tfm
from torchformer.cli.main import main


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    cfg = tfm.presets.get("llama-tiny", vocab_size=61, n_layers=2, max_seq_len=64)
    torch.manual_seed(0)
    target = tfm.build_model(cfg).eval()
    draft = tfm.build_model(cfg.replace(n_layers=1)).eval()
    root = tmp_path_factory.mktemp("fast")
    tfm.save(target, root / "target")
    tfm.save(draft, root / "draft")
    return root, target, draft


IDS = [3, 9, 4, 3, 9, 4, 3]


def printed(capsys, argv) -> list[int]:
    assert main(argv) == 0
    return [int(t) for t in capsys.readouterr().out.strip().split(",")]


def test_quantize_draft_and_prompt_lookup_match_the_library(folders, capsys):
    root, target, draft = folders
    base = ["generate", str(root / "target"), "--ids", ",".join(map(str, IDS)), "--max-new-tokens", "12"]
    ids = torch.tensor([IDS])
    plain = tfm.generate(target, ids, max_new_tokens=12)[0].tolist()
    assert printed(capsys, [*base, "--draft", str(root / "draft"), "--num-draft-tokens", "3"]) == plain
    assert printed(capsys, [*base, "--prompt-lookup", "2"]) == plain
    q = tfm.quantize(tfm.load(root / "target"), "int4", group_size=32)
    assert (
        printed(capsys, [*base, "--quantize", "int4", "--group-size", "32"])
        == tfm.generate(q, ids, max_new_tokens=12)[0].tolist()
    )
    q8 = tfm.quantize(tfm.load(root / "target"), "int8")
    assert printed(capsys, [*base, "--quantize", "int8"]) == tfm.generate(q8, ids, max_new_tokens=12)[0].tolist()
    assert main([*base, "--prompt-lookup", "3", "--verbose"]) == 0
    err = capsys.readouterr().err
    assert "guessed tokens accepted" in err and "target forwards" in err


def test_bad_flags_are_one_line_errors(folders, capsys):
    root, _, _ = folders
    base = ["generate", str(root / "target"), "--ids", "1,2,3", "--max-new-tokens", "8"]
    assert main([*base, "--group-size", "32"]) == 2
    assert "--group-size=32 needs --quantize int4" in capsys.readouterr().err
    assert main([*base, "--quantize", "int4", "--group-size", "24"]) == 2
    assert "group_size=24 does not divide in_features=128" in capsys.readouterr().err
    assert main([*base, "--prompt-lookup", "0"]) == 2
    assert "prompt_lookup_num_tokens=0" in capsys.readouterr().err
    assert main([*base, "--num-draft-tokens", "2"]) == 2
    assert "num_draft_tokens=2 needs draft_model" in capsys.readouterr().err
