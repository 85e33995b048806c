import os

import pytest
import torch

# Two cores: keep torch from oversubscribing when pytest runs beside other work.
torch.set_num_threads(int(os.environ.get("TORCHFORMER_TEST_THREADS", "2")))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
