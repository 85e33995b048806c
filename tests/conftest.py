import os

import pytest
import torch

# One thread by default: the test models are tiny, and on a busy 2-core machine two OpenMP threads
# spin-wait on each other (measured: the causality tests took 82 s with 2 threads, 3.5 s with 1).
torch.set_num_threads(int(os.environ.get("TORCHFORMER_TEST_THREADS", "1")))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
