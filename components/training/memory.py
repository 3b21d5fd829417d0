"""Host memory of a training process: its RSS now and at its peak, the malloc that serves it, and
the glibc fallback that keeps a long run's RSS flat.

    from components.training import memory
    memory.allocator()          # 'mimalloc' | 'jemalloc' | 'tcmalloc' | 'glibc' | 'system'
    trim = memory.HeapTrimmer(every=50)
    trim.after_step(step)       # glibc only: give the heap's free pages back every 50 steps
    memory.rss_mb(), memory.peak_rss_mb()

Why an allocator matters here: a CPU training step allocates activations whose sizes change with
every batch (dynamic padding, a different number of masked tokens per batch). glibc's malloc serves
the mid-sized ones from its heap and, once a large block has been freed, raises its mmap threshold,
so ever more of them land in the heap, whose free pages it rarely returns: RetroMAE on MiniLM grew
by 5-8 MB a step, without levelling off. The memory was free, not live: `malloc_trim(0)` gave it
back, pinning the mmap threshold (`mallopt`) stopped the growth at 1.5x the step time, and no tensor
is kept across steps (tests/test_memory.py holds that). mimalloc, jemalloc and tcmalloc all kept the
same run flat at the same speed or faster (bench/bench_allocator.py), so
`scripts/py`, which every dvc.yaml stage runs through, preloads mimalloc from the `cmeel-mimalloc`
wheel of the lock (`RR_ALLOCATOR` picks another, or `system`). A process started another way (a
test, a notebook, `python -m flows.<stage>`) keeps glibc, and the Trainer trims its heap every
`compute.malloc_trim_every` steps instead.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import logging
import os
import resource
import sys

log = logging.getLogger(__name__)

ALLOCATORS = ("mimalloc", "jemalloc", "tcmalloc")  # what scripts/py can preload, in its `auto` order


def rss_mb() -> float:
    """Resident set size of this process now, in MiB."""
    try:
        with open("/proc/self/statm") as f:  # Linux: cheap enough to read at every step
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        import psutil

        return psutil.Process().memory_info().rss / 2**20


def peak_rss_mb(children: bool = False) -> float:
    """The highest RSS this process reached, in MiB; with `children`, the larger of it and the
    largest waited-for child's (the torchrun ranks a stage flow launched)."""
    scale = 1 / 2**20 if sys.platform == "darwin" else 1 / 2**10  # ru_maxrss: bytes on macOS, KiB on Linux
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if children:
        peak = max(peak, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
    return peak * scale


def allocator() -> str:
    """The malloc serving this process: a preloaded one (read from the mapped libraries), else
    'glibc' on a glibc Linux, else 'system'."""
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return "system"
    for name in ALLOCATORS:
        if f"lib{name}" in maps:
            return name
    return "glibc" if _glibc() is not None else "system"


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):  # musl and others have no malloc_trim
        return None


class HeapTrimmer:
    """`after_step(step)`: every `every` steps, glibc's `malloc_trim(0)`, which returns the free
    pages of its heaps to the OS; a no-op under another allocator or with `every` 0. A trim costs
    milliseconds; the heap then grows back only to what the steps between two trims touch."""

    def __init__(self, every: int):
        self.enabled = every > 0 and allocator() == "glibc"
        self.every = every
        if self.enabled:
            _note_glibc(every)

    def after_step(self, step: int) -> None:
        if self.enabled and step % self.every == 0:
            _glibc().malloc_trim(0)


@functools.cache  # once per process, however many trainers it builds
def _note_glibc(every: int) -> None:
    log.info("malloc: glibc (no allocator preloaded; scripts/py preloads mimalloc); trimming its heap every %d steps "
             "(compute.malloc_trim_every) so RSS stays flat", every)


# ----------------------------------------------------------------------------------------------
# what a leak check counts (tests/test_memory.py, bench/bench_memory.py)
# ----------------------------------------------------------------------------------------------
def live_tensors() -> tuple[int, int]:
    """(tensors alive, of which part of an autograd graph) among the objects the GC tracks.

    A tensor with a `grad_fn` that outlives its step keeps the whole step's graph, and with it
    every saved activation, alive: the usual cause of a training loop's growing memory."""
    import torch  # here, not at the top: every stage flow imports this module for peak_rss_mb

    gc.collect()
    n = graphs = 0
    for obj in gc.get_objects():
        # type(), not isinstance: isinstance reads __class__, which proxies and deprecated
        # module attributes (torch.distributed.reduce_op) answer with an error or a warning
        if not issubclass(type(obj), torch.Tensor):
            continue
        n += 1
        graphs += obj.grad_fn is not None
    return n, graphs
