"""Safetensors files as byte ranges: parse a header into tensor locations, map them writable.

``LocalCheckpoint`` patches tensors in place; it needs to know where each tensor's bytes sit in
its file (from the safetensors header, validated against the file size) and a writable,
zero-copy integer view of those bytes (``mmap``).
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import errno
import fcntl
import json
import logging
import mmap
import os
import struct
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asyncsync import fsio
from asyncsync.codec import int_dtype, native
from asyncsync.codec.views import BY_CODE  # (safetensors code -> torch dtype)
from asyncsync.errors import EngineStateError
from asyncsync.format.checksum import checksum_bytes, layout_checksum
from asyncsync.memory import page_cache_room

__all__ = ["FileMaps", "TensorLocation", "int_dtype", "read_layout"]

logger = logging.getLogger(__name__)

# Linux >= 5.14: fault a range in writable in one call (Python's mmap module may not name it).
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
# A file's pages faulted in through the mapping as PMD-sized folios, whatever the device's
# read_ahead_kb (at 128 KiB a cold checkpoint's first version faulted 3x the CPU in, and each
# version after paid ~15 % more in write faults and munmap on the small folios it left)
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)
# Where fsync(fd) also writes back the pages dirtied through shared mappings of the file
_FSYNC_WRITES_MAPPINGS = sys.platform.startswith("linux")

_WARM_SPAN = 32 << 20  # a warm-up stops within one populate of this many bytes
_WARM_BYTES = 2 << 30  # a warm-up faults in at most this many bytes (the rest: the patch)
_MAX_HEADER = 100 << 20  # safetensors' own limit


@dataclass(frozen=True)
class TensorLocation:
    """Where a tensor's bytes are: ``[begin, end)`` absolute offsets in ``file`` (a plain name)."""

    name: str
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def int_dtype(self) -> torch.dtype:
        return int_dtype(self.dtype)


_BTRFS_MAGIC = 0x9123683E
# statfs f_type of the filesystems whose overwrites allocate new space, copy-on-write or
# log-structured: btrfs, zfs, bcachefs, f2fs, nilfs2 (not XFS: only its reflinked extents are
# copied, and the receiver makes none)
_COW_MAGIC = {_BTRFS_MAGIC, 0x2FC12FC1, 0xCA451A4E, 0xF2F52010, 0x3434}
# FS_IOC_GETFLAGS, FS_IOC_SETFLAGS (64-bit ABI; the kernel reads and writes an int), FS_NOCOW_FL
_GETFLAGS, _SETFLAGS, _NOCOW_FL = 0x80086601, 0x40086602, 0x00800000


def _fs_magic(path: Path) -> int | None:
    """The statfs ``f_type`` of the filesystem holding ``path`` (None where it cannot be told)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        buf = ctypes.create_string_buffer(512)  # struct statfs: f_type (a long) first
        if libc.statfs(os.fsencode(path), buf) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF


def overwrites_allocate(path: Path) -> bool:
    """Whether ``path`` lies on a filesystem whose overwrites need new space (Linux statfs;
    False where that cannot be told)."""
    return _fs_magic(path) in _COW_MAGIC


def no_copy_on_write(directory: Path) -> bool:
    """On btrfs, mark ``directory`` no-copy-on-write (``chattr +C``; True once it is): the files
    made in it from then on (a full version's staged files, and the directories under it) are
    overwritten in place, so a delta's writes through the mapping need no new space (on a full
    btrfs such a write fault is SIGBUS) and do not fragment the files. Files made before keep
    copy-on-write until a full version replaces them, and a snapshot of the subvolume makes the
    next write of each extent copy once more (then the prefault's error, with its race, is what
    is left). Elsewhere (or refused) False."""
    if _fs_magic(directory) != _BTRFS_MAGIC:
        return False
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        flags = array.array("l", [0])
        fcntl.ioctl(fd, _GETFLAGS, flags, True)
        if not flags[0] & _NOCOW_FL:
            flags[0] |= _NOCOW_FL
            fcntl.ioctl(fd, _SETFLAGS, flags)
            logger.info("%s: set no-copy-on-write (btrfs) for the checkpoint's files", directory)
        return True
    except OSError as exc:
        logger.debug("%s: no-copy-on-write not set (%s)", directory, exc)
        return False
    finally:
        os.close(fd)


def _page_runs(loc: TensorLocation, positions: torch.Tensor, size: int) -> list[tuple[int, int]]:
    """[start, end) byte ranges (page-aligned starts, within ``size``) of the runs of whole
    pages that hold the elements at ``positions`` of ``loc``."""
    if positions.numel() == 0:
        return []
    page, width = mmap.PAGESIZE, loc.dtype.itemsize
    at = loc.begin + positions.numpy().astype(np.int64) * width
    pages = np.union1d(at // page, (at + width - 1) // page)  # sorted, unique
    cut = np.flatnonzero(np.diff(pages) > 1) + 1
    starts = pages[np.concatenate(([0], cut))] * page
    ends = np.minimum((pages[np.concatenate((cut - 1, [pages.size - 1]))] + 1) * page, size)
    return list(zip(starts.tolist(), ends.tolist(), strict=True))


def read_layout(path: Path) -> dict[str, TensorLocation]:
    """Parse and validate a safetensors file's header: each tensor's dtype, shape, byte range."""

    def bad(what: str) -> EngineStateError:
        return EngineStateError(f"{path}: {what}; the checkpoint is damaged, remove it to reinit")

    try:  # a FIFO or a device there raises UnsafePath at once, never blocks
        with os.fdopen(fsio.open_file(path, follow_symlinks=True), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise bad("too short for a safetensors file")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                raise bad(f"invalid header length {n}")
            header = json.loads(f.read(n))
    except (OSError, ValueError) as exc:
        raise bad(f"unreadable safetensors header ({exc})") from exc
    except RecursionError:
        raise bad("safetensors header nested too deeply") from None
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    data_start = 8 + n
    out: dict[str, TensorLocation] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        code = info.get("dtype") if isinstance(info, dict) else None
        if type(code) is not str or code not in BY_CODE:  # (a list: unhashable, TypeError)
            raise bad(f"tensor {name!r} has no supported dtype")
        shape, offs = info.get("shape"), info.get("data_offsets")
        if not isinstance(shape, list) or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape
        ):
            raise bad(f"tensor {name!r} has an invalid shape {shape!r}")
        if not (
            isinstance(offs, list)
            and len(offs) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) for o in offs)
        ):
            raise bad(f"tensor {name!r} has invalid data_offsets {offs!r}")
        dtype = BY_CODE[code]
        b, e = data_start + offs[0], data_start + offs[1]
        numel = 1
        for s in shape:
            numel *= s
        if not data_start <= b <= e <= size or e - b != numel * dtype.itemsize:
            raise bad(f"tensor {name!r} byte range {offs} does not fit its shape or the file")
        out[name] = TensorLocation(name, path.name, dtype, tuple(shape), b, e)
    # safetensors loads a file only if its tensors cover the data bytes end to end, no hole,
    # no overlap, nothing after the last (else "file not fully covered"): nor is it ours then
    at = data_start
    for loc in sorted(out.values(), key=lambda loc: (loc.begin, loc.end)):
        if loc.begin != at:
            raise bad(f"bytes {at}..{loc.begin} are not covered by exactly one tensor")
        at = loc.end
    if at != size:
        raise bad(f"bytes {at}..{size} are not covered by a tensor (safetensors refuses it)")
    return out


class FileMaps:
    """Writable mmaps of the data files one version touches, opened lazily, closed together."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._open: dict[str, tuple[int, mmap.mmap]] = {}
        self._unmapped: list[int] = []  # descriptors whose mapping :meth:`unmap` dropped
        self._cow: bool | None = None  # overwrites need new space (a copy-on-write filesystem)
        self._dropped = False  # :meth:`unmap` ran: the maps are the flush's from then on
        self._warming: tuple[threading.Thread, threading.Event, threading.Event] | None = None
        self._warmed: set[str] = set()  # the tensors the warm-up has faulted in

    def _map(self, file: str) -> mmap.mmap:
        if file not in self._open:
            fd = os.open(self.directory / file, os.O_RDWR)
            try:
                mm = mmap.mmap(fd, 0, access=mmap.ACCESS_WRITE)
            except BaseException:
                os.close(fd)
                raise
            if _MADV_HUGEPAGE is not None:
                with contextlib.suppress(OSError):  # (transparent huge pages off: EINVAL)
                    mm.madvise(_MADV_HUGEPAGE)
            self._open[file] = (fd, mm)
        return self._open[file][1]

    def flat(self, loc: TensorLocation) -> torch.Tensor:
        """The tensor's bytes in the file as a flat writable int tensor (no copy)."""
        if loc.nbytes == 0:
            return torch.empty(0, dtype=loc.int_dtype)
        arr = np.frombuffer(self._map(loc.file), dtype=np.uint8, count=loc.nbytes, offset=loc.begin)
        return torch.from_numpy(arr).view(loc.int_dtype)

    def prefault(self, loc: TensorLocation, positions: torch.Tensor | None = None) -> bool:
        """Fault the tensor's pages in writable now, by ``madvise(MADV_POPULATE_WRITE)``: every
        page of it, or with ``positions`` (its changed elements, sorted) only the pages holding
        them, one call per run of pages. One call instead of a read and a write fault per page
        as a patch touches them (several times faster where most pages are written); it marks
        the pages dirty. False where the kernel does not support it, and with ``positions`` on
        a filesystem whose overwrites need no new space (there a write fault cannot fail).

        Where the kernel cannot make a page writable (EFAULT: on a full filesystem whose
        overwrites need new space, btrfs, ZFS, bcachefs, f2fs, nilfs2) it raises OSError ENOSPC
        naming the file: writing that page through the mapping would have killed the process
        with SIGBUS, in the middle of a patch. XFS is not among them: only its reflinked
        (shared) extents are copied on write, and the receiver makes none, so there a sparse
        prefault is skipped like on any overwrite-in-place filesystem, as is the whole-range one
        of a tensor :meth:`warm` has faulted in (True: done)."""
        if loc.nbytes == 0 or not hasattr(mmap.mmap, "madvise"):
            return False
        if positions is not None and not self._allocating():
            return False
        if positions is None and loc.name in self._warmed:  # (none where overwrites allocate:
            return True  # pages a flush made read-only since take a write fault, not a SIGBUS)
        mm = self._map(loc.file)
        if positions is None:
            runs = [(loc.begin - loc.begin % mmap.PAGESIZE, loc.end)]
        else:
            runs = _page_runs(loc, positions, len(mm))
        k = native.kernels
        for start, end in runs:
            try:
                if k is not None and hasattr(k, "populate_write"):
                    k.populate_write(mm, start, end - start)  # the GIL released meanwhile
                else:  # holds the GIL throughout
                    mm.madvise(_MADV_POPULATE_WRITE, start, end - start)
            except OSError as exc:
                if exc.errno != errno.EFAULT:  # EINVAL: an older kernel; ENOMEM, EINTR: the
                    return False  # patch faults the pages in as it goes, as it did before
                if (now := os.fstat(self._open[loc.file][0]).st_size) < end:  # past its end
                    raise OSError(
                        errno.EIO,
                        f"the file is {now} bytes now, short of {loc.name!r}'s end at {end}: "
                        "cut behind the receiver's back (its next check re-initialises it)",
                        str(self.directory / loc.file),
                    ) from exc
                raise OSError(
                    errno.ENOSPC,
                    f"the kernel cannot make the pages of {loc.name!r} writable (EFAULT): no "
                    "space to overwrite them (a full copy-on-write filesystem?)",
                    str(self.directory / loc.file),
                ) from exc
        return True

    def warm(self, locs: Sequence[TensorLocation], after: Future[Any] | None = None) -> None:
        """Fault the pages of ``locs`` in writable (:meth:`prefault`'s kernel call), in order,
        on a thread of their own, once ``after`` (the previous version's flush) is done: at a
        delta's begin, while the trainer is still writing the shards the patch waits for, so
        the page-cache work of the dense tensors' prefaults is done in that idle time and not
        inside the apply. Not before the flush: it would write the pages dirtied here back
        before the patch dirties them again. At most :data:`_WARM_BYTES` of them, and half of
        what the page cache can hold (:func:`~asyncsync.memory.page_cache_room`, a cgroup's
        limit included): pages the patch reaches much later would meet the dirty-page limits
        first, or be pushed out (written back unchanged) before the patch comes to them (a
        model larger than memory); the patch prefaults the rest as before.

        Best effort: a failure ends it (the patch's own prefault raises it); :meth:`sync`,
        :meth:`unmap` and :meth:`close` stop it first. A no-op without the C kernels (Python's
        ``madvise`` would hold the GIL throughout) or where a warm-up already ran. None where
        overwrites need new space (:func:`overwrites_allocate`): a dirty page holds its new
        space there until written back, and on a nearly full disk a warm-up holding it for
        every dense tensor at once failed versions that fit, and their rollbacks."""
        k = native.kernels
        if not locs or self._warming is not None or not hasattr(k, "populate_write"):
            return  # (no statfs nor /proc reads at the begin of a sparse delta)
        if self._allocating():  # each page it faults in would hold new space from now on
            return  # (btrfs: the undo record and the rollback then found the disk full)
        room = page_cache_room()
        todo, left = [], _WARM_BYTES if room is None else min(_WARM_BYTES, room // 2)
        for loc in locs:
            if 0 < loc.nbytes <= left:
                todo.append(loc)
                left -= loc.nbytes
        try:
            work = [(self._map(loc.file), loc) for loc in todo]
        except OSError as exc:  # (the patch's own map raises it)
            logger.debug("no warm-up of %s: %s", self.directory, exc)
            return
        if not work:
            return
        stop, go = threading.Event(), threading.Event()  # go: the flush before done, or stop
        thread = threading.Thread(
            target=_warm, args=(work, stop, go, self._warmed), name="asyncsync-warm", daemon=True
        )
        try:
            thread.start()
        except RuntimeError as exc:  # a thread limit (pids.max): the patch prefaults as before
            logger.debug("no warm-up of %s: %s", self.directory, exc)
            return
        self._warming = (thread, stop, go)
        if after is None:
            go.set()
        else:  # (at once where it is done already)
            after.add_done_callback(lambda _done: go.set())

    def _allocating(self) -> bool:
        if self._cow is None:
            self._cow = overwrites_allocate(self.directory)
        return self._cow

    def _stop_warm(self) -> None:
        if self._warming is not None:
            thread, stop, go = self._warming
            stop.set()
            go.set()
            thread.join()

    def checksum(
        self,
        loc: TensorLocation,
        algorithm: str,
        layout: Sequence[tuple[int, int]] | None = None,
    ) -> str:
        """The tensor's checksum as its manifest entry defines it (``layout``: its parts)."""
        if loc.nbytes == 0:
            return checksum_bytes(b"", algorithm)
        with memoryview(self._map(loc.file)) as mv, mv[loc.begin : loc.end] as region:
            return layout_checksum(region, loc.dtype.itemsize, layout, algorithm)

    def sync(self) -> None:
        """Make every page written through the maps durable.

        On Linux ``fsync`` of the file writes the pages dirtied through a shared mapping too
        (``msync(MS_SYNC)`` is itself an fsync of the mapped range there), and releases the
        GIL while Python's ``mmap.flush`` holds it for the whole writeback: hundreds of ms per
        GiB during which the rest of the receiver (the next version's apply, its acks) would
        crawl. Elsewhere the mapping is flushed first."""
        self._stop_warm()
        for fd, mm in self._open.values():
            if not _FSYNC_WRITES_MAPPINGS:
                mm.flush()
            os.fsync(fd)
        for fd in self._unmapped:
            os.fsync(fd)

    def unmap(self) -> None:
        """Drop the mappings, keep the descriptors (Linux): once the version is committed its
        flush needs only ``fsync`` of the files (:meth:`sync`). A mapping held through the
        flush kept every page of the files it mapped in this process's RSS while the next
        version mapped them again, so they counted twice: no second copy in memory, but the
        receiver's peak RSS read up to 2x the model where a slow flush overlapped the next
        apply. Elsewhere (``mmap.flush`` needed) the mappings stay until :meth:`close`.

        Once: a mapping still exported now (a view not yet collected) is closed by
        :meth:`close`, not by a second call, which may come from another thread while the
        flush's :meth:`sync` iterates them (two callers of the ack at once)."""
        self._stop_warm()
        if not _FSYNC_WRITES_MAPPINGS or self._dropped:
            return
        self._dropped = True
        for file, (fd, mm) in list(self._open.items()):
            if _unmap(file, mm):
                del self._open[file]
                self._unmapped.append(fd)

    def close(self) -> None:
        self._stop_warm()
        for file, (fd, mm) in self._open.items():
            _unmap(file, mm)
            os.close(fd)
        self._open.clear()
        for fd in self._unmapped:
            os.close(fd)
        self._unmapped.clear()


def _warm(
    work: list[tuple[mmap.mmap, TensorLocation]],
    stop: threading.Event,
    go: threading.Event,
    warmed: set[str],
) -> None:
    """:meth:`FileMaps.warm`'s thread: once ``go`` is set, each range populated writable, a
    span at a time (until ``stop``), its tensor's name added to ``warmed`` once all of it is."""
    populate = native.kernels.populate_write
    go.wait()
    loc = work[0][1]
    try:
        for mm, loc in work:
            at = loc.begin - loc.begin % mmap.PAGESIZE
            while at < loc.end:
                if stop.is_set():
                    return
                n = min(_WARM_SPAN, loc.end - at)
                populate(mm, at, n)  # the GIL released meanwhile
                at += n
            warmed.add(loc.name)
    except (OSError, ValueError) as exc:  # EFAULT (a page it cannot make writable), EINVAL
        logger.debug("warm-up stopped at %s: %s", loc.name, exc)  # (an old kernel): the patch


def _unmap(file: str, mm: mmap.mmap) -> bool:
    """Close ``mm``; False where a view of it is still referenced (gc unmaps it later)."""
    try:
        mm.close()
    except BufferError:
        logger.debug("mmap of %s still exported at close", file)
        return False
    return True
