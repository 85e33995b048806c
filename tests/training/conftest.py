import pytest
import torch

from .tiny import words_text


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(words_text(400))
    return path


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny models: one thread beats two (no OpenMP barriers), and the suite shares the machine.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
