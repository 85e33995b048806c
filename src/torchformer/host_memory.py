"""Keep freed host memory inside the process (Linux/glibc), so CPU training stops page-faulting.

glibc serves every allocation above its mmap threshold (128 KiB, adapting up to 32 MiB) with a
fresh ``mmap`` and returns it to the kernel on free. A CPU training step allocates and frees its
activations, logits and gradients (hundreds of MB) every step, so every step the kernel hands out
and zeroes the same pages again: ~76,000 minor page faults and ~0.2 s of system time per step for
the 6-layer, d_model 384 benchmark model, about a tenth of the step. CUDA's caching allocator
avoids the same cost on GPUs by never returning memory; this does the same for glibc's heap:
no mmap for large blocks, no trimming of the heap top, and the heap grown 64 MiB at a time.

The cost: the process keeps its peak memory until it exits. It changes the whole process, so
only the training entry points call it (``train.keep_host_memory``, default on) and the
train-step benchmark (for every system alike), never a model's forward.

``available_bytes`` is the other question about host memory: how much this process may still
take (``torchformer serve`` sizes its KV cache by it). ``huge_page_memory`` is the third: memory a
decode step streams, in 2 MiB pages. ``zeroed_pages`` (a KV cache's memory) and ``in_own_arena`` (a
load's temporaries) keep inference's large blocks out of the heap generation allocates from.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import os
import sys

# mallopt(3) parameter numbers, from glibc's malloc.h.
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX = -1, -2, -4
TOP_PAD = 64 << 20  # bytes requested from the kernel beyond each heap growth
NEVER = 2**31 - 1  # mallopt takes an int: the largest trim threshold it accepts

_applied = False


@functools.cache
def libc() -> ctypes.CDLL:
    """The C library, loaded once (OSError where there is none to load)."""
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to reuse freed memory instead of unmapping it. Returns True when it
    applied (Linux with glibc), False elsewhere (macOS, Windows, musl): a no-op, never an error."""
    global _applied
    if _applied:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = libc().mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success; musl and other libcs do not have it (AttributeError above).
    _applied = all(mallopt(param, value) == 1 for param, value in
                   ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, NEVER), (M_TOP_PAD, TOP_PAD)))  # fmt: skip
    return _applied


# --- how much memory this process may still take -------------------------------------------------
# /proc/meminfo's MemAvailable is the machine's; a container's cgroup may allow less. cgroup v2 and
# v1 files, in that order; "max" (v2) or a huge number (v1) means no limit.
CGROUP_FILES = (
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory.stat"),
    (
        "/sys/fs/cgroup/memory/memory.limit_in_bytes",
        "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        "/sys/fs/cgroup/memory/memory.stat",
    ),
)


def available_bytes() -> int | None:
    """Bytes this process can still allocate without swapping or meeting its container's limit:
    the smaller of the machine's MemAvailable and what the cgroup limit leaves. None where
    neither can be read (not Linux): callers then cannot check memory and should say so."""
    known = [n for n in (_meminfo_available(), _cgroup_left()) if n is not None]
    return min(known) if known else None


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_left() -> int | None:
    for limit_file, usage_file, stat_file in CGROUP_FILES:
        try:
            with open(limit_file) as f:
                limit = f.read().strip()
            with open(usage_file) as f:
                usage = int(f.read())
        except (OSError, ValueError):
            continue
        if limit == "max" or int(limit) >= 1 << 60:
            return None
        # The usage counts the page cache, which the kernel drops before it refuses memory.
        return max(0, int(limit) - usage + _inactive_file(stat_file))
    return None


def _inactive_file(stat_file: str) -> int:
    try:
        with open(stat_file) as f:
            stats = dict(line.split() for line in f if line.count(" ") == 1)
    except (OSError, ValueError):
        return 0
    value = stats.get("total_inactive_file", stats.get("inactive_file", "0"))
    return int(value) if value.isdigit() else 0


# --- giving back the pages of a mapped weights file -------------------------------------------------
MADV_DONTNEED = 4  # madvise(2), Linux
PAGE = 4096


def release_mapped(tensor, mappings: list[tuple[int, int]] | None = None) -> int:
    """Drop ``tensor``'s pages from this process's resident set when its storage lies in a mapping
    of a file (safetensors weights are memory-mapped); returns the bytes released (0 elsewhere:
    heap memory, other platforms). A loader that has quantized a mapped weight calls it so the
    float bytes it read stop counting towards the process: the pages stay in the page cache and a
    later read faults them back in from the file, unchanged.

    Only for tensors nothing has written since they were mapped: the mapping is private, so a
    written page would revert to the file's bytes. The loaders call it on weights they have just
    read, before the model reaches the caller. ``mappings``: ``file_mappings()`` read once for many
    calls."""
    if tensor.is_contiguous():  # a block of rows of a mapped matrix: its own bytes only
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
    else:
        storage = tensor.untyped_storage()
        start, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    return release_mapped_range(start, end, mappings)


def in_file_mapping(tensor, mappings: list[tuple[int, int]] | None = None) -> bool:
    """Whether ``tensor``'s bytes lie in a mapping of a file (a weight a loader memory-mapped);
    ``mappings``: ``file_mappings()`` read once for many tensors."""
    start = tensor.data_ptr()
    return _in_file_mapping(start, start + tensor.numel() * tensor.element_size(), mappings)


def file_mappings() -> list[tuple[int, int]]:
    """The [low, high) address ranges of this process's mappings of regular files (/proc/self/maps;
    none where it cannot be read)."""
    return mappings_where(lambda fields: len(fields) == 6 and fields[5].startswith("/") and fields[4] != "0")


def anonymous_mappings() -> list[tuple[int, int]]:
    """The [low, high) address ranges of this process's anonymous mappings (no file, not the heap
    or stack: huge-page arenas, large blocks malloc mapped), from /proc/self/maps (none where it
    cannot be read)."""
    return mappings_where(lambda fields: len(fields) == 5)


def mappings_where(keep) -> list[tuple[int, int]]:
    """The [low, high) ranges of /proc/self/maps' lines whose whitespace-split fields ``keep``
    takes (none where it cannot be read)."""
    found = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if keep(fields):
                    low, high = (int(x, 16) for x in fields[0].split("-"))
                    found.append((low, high))
    except (OSError, ValueError):
        pass
    return found


def release_consumed(tensor, mappings: list[tuple[int, int]]) -> int:
    """Give back the whole pages of contiguous ``tensor``'s bytes where they lie in one of the
    anonymous ``mappings`` (``anonymous_mappings()``); they read as zeros after. Only for bytes
    their owner has copied elsewhere and drops (a relayout: fast/panels.py ``to_stream``), so that
    the copy and the original are never both whole. Returns the bytes given back."""
    start = tensor.data_ptr()
    return release_range(start, start + tensor.numel() * tensor.element_size(), mappings)


def release_mapped_range(start: int, end: int, mappings: list[tuple[int, int]] | None = None) -> int:
    """release_mapped for the bytes [start, end) of this process's memory (a numpy view of a mapped
    file: the GGUF reader's tensors); the same conditions."""
    return release_range(start, end, file_mappings() if mappings is None else mappings)


def release_range(start: int, end: int, within: list[tuple[int, int]]) -> int:
    """``MADV_DONTNEED`` over the whole pages inside [start, end) where that lies in one of the
    ranges ``within``; the bytes given back (0 elsewhere, and off Linux)."""
    first, last = -(-start // PAGE) * PAGE, end // PAGE * PAGE  # whole pages inside the range only
    if last <= first or not sys.platform.startswith("linux") or not inside_one(start, end, within):
        return 0
    return last - first if madvise()(first, last - first, MADV_DONTNEED) == 0 else 0


@functools.cache
def madvise():
    """madvise(2) through ctypes, its arguments declared once (OSError / AttributeError where the C
    library has none)."""
    call = libc().madvise
    call.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return call


def trim() -> bool:
    """Give the heap's free pages back to the kernel (glibc ``malloc_trim``): after a quantizing
    load, the blocks its temporaries freed stay in glibc's free lists (measured: ~390 MB held
    after quantizing the Llama-3.2-1B shape to int8). True where it ran (Linux with glibc)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        malloc_trim = libc().malloc_trim
        malloc_trim.argtypes, malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
        malloc_trim(0)
    except (OSError, AttributeError):
        return False
    return True


def _in_file_mapping(start: int, end: int, mappings: list[tuple[int, int]] | None = None) -> bool:
    """Whether [start, end) lies inside one mapping of a regular file (``file_mappings``)."""
    return inside_one(start, end, file_mappings() if mappings is None else mappings)


def inside_one(start: int, end: int, ranges: list[tuple[int, int]]) -> bool:
    """Whether [start, end) lies inside one of the [low, high) ``ranges``."""
    return any(low <= start and end <= high for low, high in ranges)


# --- memory a decode step streams, in transparent huge pages ----------------------------------------
# A batch-1 decode step reads every weight once, front to back. In 4 KiB pages that is a TLB miss
# every 4 KiB; in 2 MiB pages one every 2 MiB. Measured on this project's AVX-512 EPYC (2 threads, a
# compiled row sum over 800 MB, 10 interleaved rounds): 30.7 GB/s in 4 KiB pages, 35.5 GB/s in huge
# pages (1.16x); the Llama-3.2-1B shape in int4 g64 decoded 1.05x faster (per-round median, 8
# rounds in one process) with 498 of its 695 MB of panels moved into huge pages. The machines'
# transparent huge pages are "madvise": memory gets them only where asked, before first touch.
MADV_HUGEPAGE = 14  # madvise(2), Linux
HUGE_PAGE = 2 << 20


def huge_pages_wanted() -> bool:
    """Whether to back streamed weights with huge pages: Linux, and ``TORCHFORMER_HUGE_PAGES`` not
    0 (read at each allocation: a switch for measurements and a way out)."""
    return sys.platform.startswith("linux") and os.environ.get("TORCHFORMER_HUGE_PAGES", "1").strip() != "0"


def huge_page_memory(nbytes: int) -> tuple[mmap.mmap, int] | None:
    """Fresh zero-filled anonymous memory for ``nbytes`` starting at a HUGE_PAGE boundary: (the
    mapping, the offset of that boundary in it), its whole huge pages advised as transparent huge
    pages (``MADV_HUGEPAGE``) before anything touches them, so the kernel backs them with 2 MiB
    pages as they are first written; a tail of less than a huge page keeps 4 KiB pages (no page is
    rounded up past the data, nothing resident is wasted). None where that cannot be had: fewer
    than HUGE_PAGE bytes, ``huge_pages_wanted`` false, or a failed mapping."""
    if nbytes < HUGE_PAGE or not huge_pages_wanted():
        return None
    mapping = anonymous_pages(nbytes + HUGE_PAGE)
    if mapping is None:
        return None
    try:
        start = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
        advise = madvise()
    except (OSError, ValueError, AttributeError):
        return None
    offset = -start % HUGE_PAGE
    advise(start + offset, nbytes // HUGE_PAGE * HUGE_PAGE, MADV_HUGEPAGE)  # advice: a refusal costs nothing
    return mapping, offset


# --- memory outside glibc's heap --------------------------------------------------------------------
# glibc serves blocks below its mmap threshold (which rises to 32 MiB once such a block is freed)
# from one heap that shrinks only from its top. A KV cache is tens of MiB of such blocks, allocated
# per generate call and freed at its end: the next call's activations split the hole it leaves and
# its own cache then grows the heap again, so the heap (resident once touched) creeps call after
# call. Measured (the Llama-3.2-1B shape's Q4_0 GGUF file, compiled, the engines benchmark's calls:
# batch 1, batch 8, a 512-token prefill, four rounds in one process; peak RSS beyond the weights
# held and the largest cache): 349-388 MiB with the cache in the heap, 296-329 in mappings of its
# own; 227-228 with the load's arena apart too (``in_own_arena``).
OWN_MAPPING = 1 << 20  # bytes from which a cache tensor gets a mapping of its own


def zeroed_pages(nbytes: int) -> mmap.mmap | None:
    """A fresh anonymous mapping of ``nbytes`` zero bytes: the kernel hands out a page only when it
    is first touched and takes them all back when the mapping is freed, never through the heap.
    None below OWN_MAPPING (a mapping a page or two long wastes what it rounds up) or where the
    system refuses one."""
    return None if nbytes < OWN_MAPPING else anonymous_pages(nbytes)


def anonymous_pages(nbytes: int) -> mmap.mmap | None:
    """A fresh private anonymous mapping of ``nbytes`` zero bytes (``huge_page_memory``'s and
    ``zeroed_pages``'), or None where the system refuses one. Private where the system says so:
    Python's default on POSIX is a shared mapping, which a forked child writes through to its
    parent's memory."""
    private = {"flags": mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS} if hasattr(mmap, "MAP_ANONYMOUS") else {}
    try:
        return mmap.mmap(-1, nbytes, **private)
    except (OSError, ValueError):
        return None


# --- a load's own arena -----------------------------------------------------------------------------
# glibc gives each thread an arena of its own. A load that converts as it reads (quantizing, a GGUF
# file's blocks into panels) frees hundreds of MB of temporaries between the small tensors and
# objects it keeps, which pin the heap's top: the free space stays in the heap, and generation's
# allocations land all over it, touching pages the trim after the load had given back (the same
# benchmark: the heap 87 MiB after import, 176-452 after the Q4_0 file's load, 191-311 after four
# rounds). Run on a thread of its own, the load's temporaries go to that thread's arena instead.
# The thread ends with the load: a thread kept alive would keep its OpenMP workers too, and libgomp
# lets idle workers sleep (~50 us to wake, every parallel region) once a process has more OpenMP
# threads than CPUs (RESULTS.md, the 1B serving table's notes).


def in_own_arena(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` run on a thread of its own, which ends with it; its result returned
    and its exception raised here. The caller's thread-local state does not travel: a caller passes
    what ``fn`` needs (torch's grad mode, its default device) as arguments."""
    import threading

    done: dict = {}

    def run() -> None:
        try:
            done["value"] = fn(*args, **kwargs)
        except BaseException as error:  # re-raised on the caller's thread, traceback and all
            done["error"] = error

    thread = threading.Thread(target=run, name="torchformer-load", daemon=True)
    thread.start()
    thread.join()
    if "error" in done:
        raise done["error"]
    return done["value"]
