import pytest

from .tiny import words_text


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(words_text(400))
    return path
