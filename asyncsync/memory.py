"""Process-wide memory settings: large freed buffers back to the operating system (glibc's
malloc), and the startup objects out of the garbage collector's way
(:func:`freeze_startup_objects`).

Every publish and every apply allocates bucket-sized temporaries (compare masks, positions,
gathered values, decoded patches) in worker threads. glibc serves allocations above its *mmap
threshold* with ``mmap`` and returns them on ``free``; but the threshold is dynamic: freeing
such a chunk raises it to that chunk's size (up to 32 MiB), after which same-sized buffers come
from the per-thread arenas and stay resident after ``free``. Measured in the benchmark
(BENCHMARKS.md), that retention costs ~0.5x the model's bytes of RSS in the publisher and
~0.3x in the receiver. Fixing the threshold (which also switches the dynamic adjustment off)
keeps every buffer of ``threshold`` bytes or more out of the arenas.

:func:`release_large_buffers` does that once per process; the publisher and the receiver agent
call it when they open. Set ``ASYNCSYNC_MALLOPT=0`` to leave malloc alone (an application with
its own allocator policy). Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import os
import sys

__all__ = ["DEFAULT_THRESHOLD", "freeze_startup_objects", "release_large_buffers"]

logger = logging.getLogger(__name__)

DEFAULT_THRESHOLD = 1 << 20
_M_MMAP_THRESHOLD = -3  # glibc malloc.h
_applied: int | None = None


def release_large_buffers(threshold: int = DEFAULT_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes; True when it is in effect."""
    global _applied
    if _applied is not None:
        return _applied == threshold
    if os.environ.get("ASYNCSYNC_MALLOPT", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and other libcs have no mallopt
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    if mallopt(_M_MMAP_THRESHOLD, int(threshold)) != 1:
        logger.debug("mallopt(M_MMAP_THRESHOLD, %d) was refused", threshold)
        return False
    _applied = threshold
    logger.debug("malloc: buffers of %d bytes or more are returned to the OS on free", threshold)
    return True


def freeze_startup_objects() -> None:
    """Collect once, then exempt every object alive now from the cyclic garbage collector's
    later passes (``gc.freeze``): a process that runs a receiver has ~200,000 of them after
    its imports (torch's alone), and each full collection walked them all again (~90 ms
    here) while a version of thousands of tensors triggered one or two. Called by the
    processes a receiver owns (the ``receiver`` command, the Ray receiver actor, the bench's
    receiving children) once their agent is open; not by the publisher, which runs in the
    trainer's process. Objects alive now are never collected afterwards, so call it once."""
    gc.collect()
    gc.freeze()
