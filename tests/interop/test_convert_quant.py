"""`torchformer convert --from-hf ... --quantize int8|int4` (issue 13): the saved checkpoint loads as
the HF model quantized in memory, bit for bit."""

import torch

import torchformer as tfm
from torchformer.cli.main import main
from torchformer.interop import from_hf


def test_convert_from_hf_quantized(hf_model, tmp_path, capsys):
    folder, _ = hf_model("llama")
    for scheme, extra in (("int8", []), ("int4", ["--group-size", "16"])):
        out = tmp_path / scheme
        assert main(["convert", "--from-hf", str(folder), "--out", str(out), "--quantize", scheme, *extra]) == 0
        assert f"{scheme} weights" in capsys.readouterr().out
        loaded = tfm.load(out)
        expected = tfm.quantize(from_hf(folder), scheme, group_size=16 if extra else None)
        assert loaded.quantization == expected.quantization
        for key, tensor in expected.state_dict().items():
            assert torch.equal(loaded.state_dict()[key], tensor), key
    assert main(["convert", "--to-hf", str(tmp_path / "int8"), "--out", str(tmp_path / "x"), "--quantize", "int8"]) == 2
    assert "--quantize int8 works with --from-hf" in capsys.readouterr().err
