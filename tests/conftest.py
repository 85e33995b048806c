import os

# Idle OpenMP threads sleep instead of spinning (libgomp reads this when torch loads; children
# inherit it). It changes no thread count or work split, so runs stay as deterministic as before;
# under the suite's load (two workers, children at 2 threads) spinning threads starve the threads
# they wait for: an encoder-decoder training child took 29-40 s of CPU spinning, 8-9 s passive.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Inductor compiles in the process that asks, without its pool of compile workers: each pool is new
# interpreters importing torch (~2 s of CPU each), started in every process that compiles (a
# worker, a forked server) and stopped at its exit (~1 s); the suite's graphs are small, and the
# kernels are the same.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# No compiled decode steps kept between tests (fast/step_cache.py): each test compiles what it
# checks, and nothing is written to the home folder; tests/fast/test_step_cache.py turns it on.
os.environ.setdefault("TORCHFORMER_STEP_CACHE", "0")

import gc  # noqa: E402
import signal  # noqa: E402

import pytest  # noqa: E402

try:  # pytest >= 9 keeps a node's id as a NodeId in item._id
    from _pytest.nodeid import NodeId
except ImportError:  # older pytest reads item._nodeid, where xdist writes its group suffix
    NodeId = None


def runs_tests(config) -> bool:
    """False in pytest-xdist's controller: it hands the tests to its workers and imports no torch
    (~1.5 s before the workers start)."""
    return bool(os.environ.get("PYTEST_XDIST_WORKER")) or not getattr(config.option, "numprocesses", None)


def pytest_configure(config):
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        # Started by a script as a background job (`make test &`), which a shell without job control
        # starts with SIGINT ignored: every interpreter the tests start would inherit that, install no
        # KeyboardInterrupt and outlive the SIGINT a test sends it (tests/test_zygote.py's did).
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if runs_tests(config):
        # The cyclic collector less often (defaults 700, 10, 10): with torch, dynamo and transformers
        # loaded a full collection walks ~0.4 s of objects, and the defaults ran 25 of them in two
        # minutes of tests (9% of the CPU); these thresholds ran 7, for the same peak memory (1.68 GB
        # against 1.66). Only the test processes: the children they start keep Python's defaults.
        gc.set_threshold(5000, 20, 100)
        import torch

        # One thread by default: the test models are tiny, and on a busy 2-core machine two OpenMP threads
        # spin-wait on each other (measured: the causality tests took 82 s with 2 threads, 3.5 s with 1).
        torch.set_num_threads(int(os.environ.get("TORCHFORMER_TEST_THREADS", "1")))


@pytest.fixture(autouse=True)
def _seed():
    import torch

    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _threads():
    """Every test starts at the suite's thread count: the serve CLI, run in-process, leaves its
    calling thread at one (cli/serve.py ``http_thread_serial``)."""
    import torch

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
    no-op once built, as `make install` leaves them, or with TORCHFORMER_NATIVE=0): each worker
    asks before its first test, one builds while the other waits on the build's lock. A test that
    met the build first waited on it under the lock: a server under test answered /health 503 past
    its 60 s readiness limit."""
    if runs_tests(session.config):
        from torchformer.fast import native

        native.kernels()


@pytest.fixture
def aot_eager(monkeypatch):
    """torch.compile through dynamo + AOT autograd ("aot_eager") instead of inductor; yields the list
    of graphs compiled, so a test proves its compiled path ran (a compile=True that were ignored
    would compile none). For tests of graph capture, guards and recompiles rather than inductor's
    kernels (those: generation/test_compile.py): a cold inductor compile costs 10-60 s of CPU, this
    one a second or two."""
    import torch

    from torchformer.generation import steps
    from torchformer.nn import flex

    compile_, graphs = torch.compile, []
    aot = torch._dynamo.lookup_backend("aot_eager")

    def counting(gm, example_inputs):
        graphs.append(gm)
        return aot(gm, example_inputs)

    monkeypatch.setattr(steps, "_COMPILED", {})  # compiled step functions made under another backend
    monkeypatch.setenv("TORCHFORMER_AOT_STEP", "0")  # dynamo's step: AOTInductor has no backend to swap
    def compile_aot(fn, options=None, **kw):  # inductor's options (C++ host code) mean nothing here
        return compile_(fn, backend=counting, **kw)

    monkeypatch.setattr(torch, "compile", compile_aot)
    flex._compiled_kernel.cache_clear()  # flex's kernel is compiled once per process: not under
    torch._dynamo.reset()  # this backend for later tests, nor inductor's in here
    yield graphs
    flex._compiled_kernel.cache_clear()
    torch._dynamo.reset()


class EagerLoader:
    """AOTInductor's loader API over an exported program run eagerly (its unlifted module): the
    constants it is given replace the module's own, as the C++ loader points at them."""

    def __init__(self, program) -> None:
        self.module = program.module()
        self.names = [n for n, _ in self.module.named_parameters()] + [n for n, _ in self.module.named_buffers()]
        self.bound = 0

    def get_constant_fqns(self) -> list[str]:
        return list(self.names)

    def load_constants(self, tensors, use_inactive, check_full_update, user_managed) -> None:
        assert check_full_update and user_managed and set(tensors) == set(self.names)
        for name, t in tensors.items():
            owner, _, leaf = name.rpartition(".")
            held = self.module.get_submodule(owner)
            table = held._parameters if leaf in held._parameters else held._buffers
            table[leaf] = t
        self.bound += 1

    def run(self, tensors):
        out = self.module(*tensors)
        return [out]


@pytest.fixture
def exported_eager(monkeypatch):
    """Decode steps compiled ahead (fast/exported.py) with the exported program run eagerly instead
    of AOTInductor's library: the export, the binding and the inputs are the same, for seconds per
    model instead of a cold C++ compile. Yields the loaders made."""
    from torchformer.fast import exported

    made = []

    def eager(program, path=None):
        made.append(EagerLoader(program))
        return made[-1]

    monkeypatch.setenv("TORCHFORMER_AOT_STEP", "1")
    monkeypatch.setattr(exported, "package", eager)
    yield made


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """The interpreter's teardown collects whatever the process still holds: seconds of CPU in a
    worker that ran half the suite, and the last worker's exit is on the suite's clock. Frozen after
    pytest's own last collection (unraisable exceptions), it is left to the process's end."""
    gc.freeze()
