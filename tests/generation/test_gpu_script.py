"""benchmarks/gpu.py exits 0 with one clear line where there is no CUDA device (issue 13)."""

import torch

from benchmarks import gpu


def test_gpu_check_is_skipped_cleanly_without_cuda(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu.main([]) == 0
    assert capsys.readouterr().out == "benchmarks.gpu: no CUDA: skipped\n"
    assert set(gpu.SECTIONS) == {"decode", "train", "attention", "paths", "tp"}
