import os

# Idle OpenMP threads sleep instead of spinning (libgomp reads this when torch loads; children
# inherit it). It changes no thread count or work split, so runs stay as deterministic as before;
# under the suite's load (two workers, children at 2 threads) spinning threads starve the threads
# they wait for: an encoder-decoder training child took 29-40 s of CPU spinning, 8-9 s passive.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

try:  # pytest >= 9 keeps a node's id as a NodeId in item._id
    from _pytest.nodeid import NodeId
except ImportError:  # older pytest reads item._nodeid, where xdist writes its group suffix
    NodeId = None

# One thread by default: the test models are tiny, and on a busy 2-core machine two OpenMP threads
# spin-wait on each other (measured: the causality tests took 82 s with 2 threads, 3.5 s with 1).
torch.set_num_threads(int(os.environ.get("TORCHFORMER_TEST_THREADS", "1")))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _threads():
    """Every test starts at the suite's thread count: the serve CLI, run in-process, leaves its
    calling thread at one (cli/serve.py ``http_thread_serial``)."""
    count = torch.get_num_threads()
    yield
    if torch.get_num_threads() != count:
        torch.set_num_threads(count)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """`--dist loadgroup` groups by the "@group" suffix xdist 3.8 writes to item._nodeid, which
    pytest 9 no longer reads (a node's id is item._id): without this every test was a unit of its
    own, and a group's module or session fixture (the installed wheel, a DCP run, a straight
    training run) was built once on each worker."""
    if NodeId is None:
        return
    for item in items:
        tagged = getattr(item, "_nodeid", None)
        if tagged and tagged != item.nodeid:
            item._id = NodeId.parse(tagged)


def pytest_sessionstart(session):
    """Build the native CPU kernels once, before any test (fast/native.py; ~35-75 s on 2 cores, a
    no-op once built or with TORCHFORMER_NATIVE=0). A test that met the build first waited on it
    under the lock: a server under test answered /health 503 past its 60 s readiness limit."""
    from torchformer.fast import native

    native.kernels()


@pytest.fixture
def aot_eager(monkeypatch):
    """torch.compile through dynamo + AOT autograd ("aot_eager") instead of inductor; yields the list
    of graphs compiled, so a test proves its compiled path ran (a compile=True that were ignored
    would compile none). For tests of graph capture, guards and recompiles rather than inductor's
    kernels (those: generation/test_compile.py): a cold inductor compile costs 10-60 s of CPU, this
    one a second or two."""
    from torchformer.generation import steps
    from torchformer.nn import flex

    compile_, graphs = torch.compile, []
    aot = torch._dynamo.lookup_backend("aot_eager")

    def counting(gm, example_inputs):
        graphs.append(gm)
        return aot(gm, example_inputs)

    monkeypatch.setattr(steps, "_COMPILED", {})  # compiled step functions made under another backend
    def compile_aot(fn, options=None, **kw):  # inductor's options (C++ host code) mean nothing here
        return compile_(fn, backend=counting, **kw)

    monkeypatch.setattr(torch, "compile", compile_aot)
    flex._compiled_kernel.cache_clear()  # flex's kernel is compiled once per process: not under
    torch._dynamo.reset()  # this backend for later tests, nor inductor's in here
    yield graphs
    flex._compiled_kernel.cache_clear()
    torch._dynamo.reset()
