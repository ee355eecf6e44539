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
call it when they open. Buffers below the threshold still come from the arenas, which keep
freed memory resident below a live chunk: :func:`trim_free_memory` gives it back, and the
agent calls it after each full apply (whole tensors decoded at once). Set
``ASYNCSYNC_MALLOPT=0`` to leave malloc alone (an application with its own allocator policy).
Elsewhere than glibc they do nothing.

:class:`ScratchPool` reuses large buffers whose pages are already faulted in (the codec's
temporaries: :mod:`asyncsync.codec.scratch`). :func:`host_copy` and :func:`host_chunks` bring a
GPU tensor's bytes to the host through such a pool of *pinned* buffers: a copy into fresh
pageable memory ran at 1.4 GB/s on an H200 host, one into a reused pinned buffer at 53 GB/s
(BENCHMARKS.md, "Issue 26, nineteenth session"), and both the publish of device tensors and
the apply into a module on the device spent ~75 % of their time in such copies.
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import functools
import gc
import logging
import math
import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import DTypeLike, NDArray

from asyncsync.errors import ConfigError, check_bytes

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_THRESHOLD",
    "MIN_BYTES",
    "ScratchPool",
    "check_env",
    "env_mib",
    "freeze_startup_objects",
    "gc_paused",
    "host_chunks",
    "host_copies",
    "host_copy",
    "keep_freed_memory",
    "page_cache_room",
    "pinned_pool",
    "release_large_buffers",
    "scratch_env",
    "size_class",
    "trim_free_memory",
]

logger = logging.getLogger(__name__)

DEFAULT_THRESHOLD = 1 << 20
_M_MMAP_THRESHOLD = -3  # glibc malloc.h
_applied: int | None = None
#: the most free bytes an arena may keep at its top (:func:`keep_freed_memory`, the publisher's)
KEEP_FREE_MAX = 32 << 20
#: ... as a share of the model: 1/32 of its bytes
KEEP_FREE_SHARE = 32
_TRIM_DEFAULT = 128 << 10  # glibc's M_TRIM_THRESHOLD
_M_TRIM_THRESHOLD = -1  # glibc malloc.h
_kept = _TRIM_DEFAULT
#: below this, malloc's own free lists serve a buffer without faults: not worth pooling
MIN_BYTES = 256 << 10
#: the pinned pool's bytes at most, unless ``ASYNCSYNC_PINNED_MB`` says (0: no pinned buffers)
PINNED_LIMIT = 1 << 30
#: the bytes :func:`host_chunks` copies at a time
CHUNK = 16 << 20
#: the largest ``ASYNCSYNC_PINNED_MB`` taken (1 TiB)
MAX_PINNED_MB = 1 << 20
#: the largest ``ASYNCSYNC_SCRATCH_MB`` taken (1 TiB): beyond, the scratch pool would have no bound
MAX_SCRATCH_MB = 1 << 20


def _malloc_call(name: str) -> Any:
    """glibc's function ``name`` (a ctypes function), or None: not Linux, a libc without it
    (musl), or ``ASYNCSYNC_MALLOPT=0`` (an application with its own allocator policy)."""
    if os.environ.get("ASYNCSYNC_MALLOPT", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    if not sys.platform.startswith("linux"):
        return None
    return getattr(_libc(), name, None)


@functools.cache
def _libc() -> Any:
    """The C library, looked up once (``find_library`` may run ``ldconfig``); None if none."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def release_large_buffers(threshold: int = DEFAULT_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes; True when it is in effect."""
    global _applied
    if _applied is not None:
        return _applied == threshold
    if not _mallopt(_M_MMAP_THRESHOLD, threshold, "M_MMAP_THRESHOLD"):
        return False
    _applied = threshold
    logger.debug("malloc: buffers of %d bytes or more are returned to the OS on free", threshold)
    return True


def _mallopt(param: int, value: int, name: str) -> bool:
    """glibc's ``mallopt(param, value)``; False where there is none or it refuses."""
    mallopt = _malloc_call("mallopt")
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    if mallopt(param, int(value)) != 1:
        logger.debug("mallopt(%s, %d) was refused", name, value)
        return False
    return True


def keep_freed_memory(model_bytes: int) -> bool:
    """Let each malloc arena keep free bytes at its top (glibc's ``M_TRIM_THRESHOLD``) instead
    of giving them back to the OS, by the size of the model moved: 1/32 of it, between glibc's
    own 128 KiB and :data:`KEEP_FREE_MAX`; raised for a larger model, never lowered (as the
    scratch pool's :func:`asyncsync.codec.scratch.fit`). True when in effect;
    ``ASYNCSYNC_MALLOPT=0`` leaves malloc alone here too. The publisher calls it each version.

    Fixing the mmap threshold (:func:`release_large_buffers`) also fixes glibc's trim threshold
    at its 128 KiB default: while the mmap threshold moves, glibc keeps the trim threshold at
    twice it (up to 64 MiB). A publish allocates and frees, bucket after bucket, each tensor's
    temporaries under the 1 MiB mmap threshold (positions, values and XORs of a few MiB tensor,
    byte planes, zstd frames); an arena whose top held more than 128 KiB free once a bucket's
    were freed gave it back, and the next bucket faulted it in again, zeroed page by page: at 1
    GiB (291 tensors) 1,600-4,900 minor faults a version, 270-620 with 32 MiB kept
    (BENCHMARKS.md, thirty-fourth session). What stays is bounded by what each arena's threads
    held at once in buffers under the mmap threshold, and by the model: kept whatever the model,
    32 MiB took a 64 MB receiver (whose bench child opens a publisher to warm up) from 1.16x to
    1.31-1.43x the model."""
    global _kept
    limit = min(KEEP_FREE_MAX, max(_TRIM_DEFAULT, model_bytes // KEEP_FREE_SHARE))
    if limit <= _kept:
        return _malloc_call("mallopt") is not None
    if not _mallopt(_M_TRIM_THRESHOLD, limit, "M_TRIM_THRESHOLD"):
        return False
    _kept = limit
    return True


def page_cache_room(
    proc: Path = Path("/proc"), cgroups: Path = Path("/sys/fs/cgroup")
) -> int | None:
    """Bytes of file pages this process can bring into memory without pushing others out:
    the host's ``MemAvailable``, and under a cgroup memory limit (v2 ``memory.max`` of its
    cgroup and every one above it, v1 ``hierarchical_memory_limit``) that limit less what
    the cgroup holds that is not file cache. None where nothing can be read (not Linux)."""
    rooms = []
    with suppress(OSError, ValueError, IndexError):
        for line in (proc / "meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                rooms.append(int(line.split()[1]) << 10)
    with suppress(OSError):
        lines = (proc / "self" / "cgroup").read_text().splitlines()
        for line in lines:
            with suppress(OSError, ValueError, KeyError):  # (a line of another hierarchy)
                rooms.extend(_cgroup_rooms(cgroups, *line.split(":", 2)[1:]))
    return max(0, min(rooms)) if rooms else None


def _cgroup_rooms(cgroups: Path, controllers: str, path: str) -> Iterator[int]:
    """Each memory limit over the cgroup ``path``, less what it holds that is not file cache."""
    if controllers == "":  # v2: the limits from here up
        at = cgroups / path.lstrip("/")
        used = int((at / "memory.current").read_text()) - _stat(at / "memory.stat")["file"]
        while at != cgroups.parent and (at / "memory.max").exists():
            if (top := (at / "memory.max").read_text().strip()) != "max":
                yield int(top) - used
            at = at.parent
    elif "memory" in controllers.split(","):  # v1 (a limit of ~2**63: none)
        at = cgroups / "memory" / path.lstrip("/")
        stat = _stat(at / "memory.stat")
        if (limit := stat["hierarchical_memory_limit"]) < 1 << 62:
            yield limit - (int((at / "memory.usage_in_bytes").read_text()) - stat["total_cache"])


def _stat(path: Path) -> dict[str, int]:
    return {k: int(v) for k, v in (line.split() for line in path.read_text().splitlines())}


def trim_free_memory() -> bool:
    """Give the free pages malloc's arenas hold back to the OS (glibc ``malloc_trim(0)``);
    True when it was called. Buffers below the mmap threshold come from the arenas, and an
    arena keeps its freed memory resident while a live chunk sits above it: a receiver's full
    apply of a model whose tensors are each under 1 MiB (a 64 MB model) left ~0.75x the
    model's bytes free but resident in two worker threads' arenas (BENCHMARKS.md, issue 26,
    twenty-fifth session). The agent calls it after each full apply; ``ASYNCSYNC_MALLOPT=0``
    leaves malloc alone here too. Elsewhere than glibc it does nothing."""
    trim = _malloc_call("malloc_trim")
    if trim is None:
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    trim(0)
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


_gc_lock = threading.Lock()
_gc_pauses = 0  # gc_paused blocks running now, in any thread
_gc_was_enabled = False


@contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off for the block (back on after the last such block
    running in any thread ends, if it was on before the first began).

    For the parse of a version's records (a manifest's JSON, a delta shard's header): tens of
    thousands of dicts and lists for a MoE model, alive all at once and freed by reference
    counting right after, which the collector would otherwise trace, promote and trace again
    (issue 26: ~9 us of a small tensor's ~110 in each parse). Only what cannot form cycles
    worth collecting belongs in it. The switch is process-wide: a thread that runs meanwhile
    allocates with the collector off too, for as long as the parse takes.

    The receiver's agent also applies a version in it (begin, stream, commit): the version's
    records, patches and blob views are acyclic and live until the version is applied, and
    the collector's passes over them (~200-300 young, ~20-30 middle and 1-2 full collections
    a version of 10,000 small tensors) were 7-21 us of a tensor with the startup objects
    frozen, 23-31 without (of ~75-105). The collector takes up its schedule again after the
    pause: what a version leaves does not pile up across versions (BENCHMARKS.md, helper-91:
    the RSS over 50 versions). The pause lasts the apply: for a process that serves beside the
    agent, cycles made meanwhile wait that long to be collected."""
    global _gc_pauses, _gc_was_enabled
    with _gc_lock:
        if _gc_pauses == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_pauses += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pauses -= 1
            if _gc_pauses == 0 and _gc_was_enabled:
                gc.enable()


def _no_pause_in_child() -> None:
    """A forked child runs none of its parent's blocks (their threads are not in it): its
    collector back as it was before them, not off for good (an engine forks its workers)."""
    global _gc_lock, _gc_pauses
    _gc_lock = threading.Lock()  # (the fork may have caught another thread holding it)
    if _gc_pauses:
        _gc_pauses = 0
        if _gc_was_enabled:
            gc.enable()


os.register_at_fork(after_in_child=_no_pause_in_child)


class ScratchPool:
    """Best-fit reuse of at most ``limit`` bytes of NumPy buffers (thread-safe).

    ``alloc(n)`` makes a new buffer of ``n`` bytes (a 1-D uint8 array; ``np.empty`` unless
    given): the pinned pool's are NumPy views of pinned torch tensors. New buffers are rounded
    up to a :func:`size_class`; with ``pow2``, to a power of two (torch's caching host
    allocator pins that much for any request: the pool then counts the bytes pinned, and
    reuses more). Beyond ``limit``, buffers are plain ``np.empty`` arrays, not pooled."""

    def __init__(
        self,
        limit: int,
        alloc: Callable[[int], NDArray[np.uint8]] | None = None,
        *,
        pow2: bool = False,
    ) -> None:
        check_bytes("ScratchPool limit", limit, minimum=0)
        self.limit = limit
        self._alloc = alloc or _plain
        self._pow2 = pow2
        self._bufs: list[NDArray[np.uint8]] = []
        self._sizes: list[int] = []  # their sizes, ascending
        self._held = 0
        self._lock = threading.Lock()
        self.reused = 0  # buffers handed out again (for tests and the bench)
        self.spilled = 0  # plain arrays handed out because the pool had no room

    @property
    def held(self) -> int:
        """Bytes of the buffers the pool keeps (in use or free)."""
        return self._held

    def empty(self, n: int, dtype: DTypeLike) -> NDArray[Any]:
        """An uninitialised 1-D array of ``n`` elements of ``dtype`` (a view of a pooled
        buffer when one is free and large enough, or when the pool has room for a new one)."""
        dt = np.dtype(dtype)
        nbytes = n * dt.itemsize
        if nbytes < MIN_BYTES or self.limit == 0:
            return np.empty(n, dt)
        with self._lock:
            bufs = self._bufs  # ascending by size: the first free one that fits fits best
            for i in range(bisect.bisect_left(self._sizes, nbytes), len(bufs)):
                if _refs(bufs, i) <= _FREE:
                    self.reused += 1
                    return bufs[i][:nbytes].view(dt)
            size = 1 << (nbytes - 1).bit_length() if self._pow2 else size_class(nbytes)
            over = self._held + size - self.limit
            i = 0
            while over > 0 and i < len(bufs):  # make room: drop free ones, smallest first
                if _refs(bufs, i) <= _FREE:
                    over -= self._sizes[i]
                    self._held -= self._sizes.pop(i)
                    del bufs[i]
                else:
                    i += 1
            if over > 0:  # (also where the rounding up alone passes the limit)
                self.spilled += 1
                return np.empty(n, dt)
            buf = self._alloc(size)
            i = bisect.bisect_right(self._sizes, size)
            self._sizes.insert(i, size)
            bufs.insert(i, buf)
            self._held += size
            return buf[:nbytes].view(dt)


def size_class(n: int) -> int:
    """``n`` bytes rounded up to a multiple of 1/16 of the largest power of two below it (at
    most 6.25 % more): the size of a new pooled buffer. A version's temporaries are a few
    elements larger or smaller than the last one's (each tensor's changed count moves), and
    an exact-size buffer serves no larger request: a pool of exact sizes kept taking fresh
    buffers, whose first touch is all page faults (50-95 ms per 16 MB buffer in a VM whose
    host hands back memory it reclaimed: BENCHMARKS.md, issue 26, thirty-first session)."""
    granule = 1 << max(0, (n - 1).bit_length() - 5)
    return -(-n // granule) * granule


def _refs(bufs: list[NDArray[np.uint8]], i: int) -> int:
    return sys.getrefcount(bufs[i])


#: what :func:`_refs` reads for a buffer only its list refers to (measured, not assumed:
#: interpreters differ in the references they count); a view or tensor of it adds one or more
_FREE = _refs([np.empty(1, np.uint8)], 0)


def _plain(n: int) -> NDArray[np.uint8]:
    return np.empty(n, np.uint8)


def env_mib(name: str, most: int = MAX_PINNED_MB) -> int | None:
    """The environment variable ``name``, a number of MiB in [0, ``most``], in bytes; None when
    it is not set; a :class:`ConfigError` naming it when it is not such a number."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        mib = float(raw)
    except ValueError:
        mib = math.nan
    if not math.isfinite(mib) or not 0 <= mib <= most:
        raise ConfigError(f"{name} must be a number of MiB in [0, {most}], got {raw!r}")
    return int(mib * (1 << 20))


def check_env() -> None:
    """A :class:`ConfigError` now for a bad ``ASYNCSYNC_PINNED_MB`` or ``ASYNCSYNC_SCRATCH_MB``:
    the Publisher and the receiver's agent call it as they are made, so the operator sees it at
    start-up, not at the first device copy inside a publish (where the pinned pool is made) nor
    as a traceback out of an import (where the scratch pool is made: it takes the default)."""
    _pinned_limit()
    scratch_env()


def scratch_env() -> int | None:
    """``ASYNCSYNC_SCRATCH_MB`` in bytes (0 turns the scratch pool off), None when it is not set;
    a :class:`ConfigError` when it is not a number of MiB in [0, :data:`MAX_SCRATCH_MB`]."""
    return env_mib("ASYNCSYNC_SCRATCH_MB", MAX_SCRATCH_MB)


def _pinned_limit() -> int:
    """``ASYNCSYNC_PINNED_MB`` in bytes, or :data:`PINNED_LIMIT` when it is not set."""
    limit = env_mib("ASYNCSYNC_PINNED_MB")
    return PINNED_LIMIT if limit is None else limit


def _pinned_alloc(n: int) -> NDArray[np.uint8]:
    import torch

    try:
        return torch.empty(n, dtype=torch.uint8, pin_memory=True).numpy()
    except RuntimeError as exc:  # no page-locked memory left, or no allocator for it
        if _pinned is not None and _pinned.limit:
            logger.warning(
                "pinned host memory is not available (%s): device-to-host copies go through "
                "plain memory from now on (slower)",
                exc,
            )
            _pinned.limit = 0
        return np.empty(n, np.uint8)


_pinned: ScratchPool | None = None
_pinned_lock = threading.Lock()


def pinned_pool() -> ScratchPool:
    """The process-wide pool of pinned host buffers (made on first use: only a process that
    copies CUDA tensors pins memory). Its buffers, powers of two, come to at most
    ``ASYNCSYNC_PINNED_MB`` (default 1 GiB) for the life of the process; a copy that does not
    fit goes to plain memory. A buffer it drops to make room for another size stays pinned in
    torch's cache of freed pinned blocks (for torch's next pinned allocation), so a process
    whose tensor sizes keep changing can pin more than the limit."""
    global _pinned
    with _pinned_lock:
        if _pinned is None:
            _pinned = ScratchPool(_pinned_limit(), _pinned_alloc, pow2=True)
        return _pinned


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached, with a bool's elements as its bytes (torch copies a bool as 0/1)."""
    import torch

    t = t.detach()
    return t.view(torch.uint8) if t.dtype == torch.bool else t


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor with ``t``'s dtype, shape and bytes (a bool's too).

    A contiguous CUDA tensor is copied into a buffer of :func:`pinned_pool` (taken back by the
    pool once nothing refers to the result); strided ones, other devices, and copies the pool
    has no room for, go to plain memory. A CPU tensor is returned contiguous, copied only when
    it is not."""
    return host_copies([t])[0]


def host_copies(ts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """:func:`host_copy` of each of ``ts``: the CUDA copies are issued together, then each
    device's stream is waited for once (not once per tensor)."""
    import torch

    out: list[torch.Tensor] = []
    streams = {}
    try:
        for t in ts:
            src = _bytes_of(t)
            nbytes = src.numel() * src.element_size()
            if t.device.type == "cpu":
                host = src.contiguous()
            elif t.device.type != "cuda" or nbytes < MIN_BYTES or not src.is_contiguous():
                # a strided view goes as before: torch would make it contiguous on the device
                # first, a copy of it in GPU memory, which an engine may not have to spare
                host = src.to("cpu").contiguous()
            else:
                buf = pinned_pool().empty(nbytes, np.uint8)
                host = torch.from_numpy(buf).view(src.dtype).view(src.shape)
                stream = torch.cuda.current_stream(t.device)
                streams[stream.cuda_stream] = stream
                host.copy_(src, non_blocking=True)  # read only once the stream is waited for
            out.append(host.view(torch.bool) if t.dtype == torch.bool else host)
    finally:  # on an error too: no buffer goes back to the pool with a copy still landing in it
        for stream in streams.values():
            stream.synchronize()
    return out


def host_chunks(t: torch.Tensor, start: int = 0, stop: int | None = None) -> Iterator[memoryview]:
    """Bytes ``start:stop`` of ``t``'s row-major bytes, :data:`CHUNK` bytes at a time.

    A CPU tensor's chunks are views of its memory (of a contiguous copy when it is not
    contiguous). A device tensor's are copied through one reused pinned buffer: each view is
    valid until the next one is asked for."""
    import torch

    src = _bytes_of(t)
    if not src.is_contiguous():  # made contiguous on the host, not in the device's memory
        src = src.to("cpu").contiguous()
    flat = src.reshape(-1).view(torch.uint8)
    stop = flat.numel() if stop is None else stop
    if not 0 <= start <= stop <= flat.numel():
        raise ValueError(f"bytes {start}:{stop} of a tensor of {flat.numel()} bytes")
    if flat.device.type == "cpu":
        mv = memoryview(flat.numpy())  # type: ignore[arg-type]
        for o in range(start, stop, CHUNK):
            yield mv[o : min(o + CHUNK, stop)]
        return
    size = min(CHUNK, stop - start)
    buf: Any = (
        pinned_pool().empty(size, np.uint8) if t.device.type == "cuda" else np.empty(size, np.uint8)
    )
    staged = torch.from_numpy(buf)
    for o in range(start, stop, CHUNK):
        n = min(CHUNK, stop - o)
        staged[:n].copy_(flat[o : o + n])
        yield memoryview(buf[:n])
