"""A non-recursive inotify watch of one directory, read by the asyncio event loop (Linux).

The receiver's watch (:mod:`receiver.watch`) needs one thing from inotify: to wake as soon as
an entry of the root changes (a new version directory, the log line a commit appends). This
reads the kernel's events on the loop itself (``loop.add_reader``): no thread, no timer, so an
idle receiver does not wake at all, and a change wakes it at once. (watchfiles, the portable
fallback, runs a thread that checks for events every ``step`` ms: 500 wake-ups a second at the
2 ms a prompt commit needs.)

The watch is of the directory's own entries: it never descends into subdirectories nor follows
a symlink among them (FORMAT.md: nothing below the root is followed).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import errno
import functools
import logging
import os
import struct
import sys
from collections.abc import Callable
from pathlib import Path

__all__ = ["DirectoryWatch", "available", "close_off_loop", "nap", "watch_or_none"]

_IN_MODIFY = 0x00000002
_IN_ATTRIB = 0x00000004
_IN_CLOSE_WRITE = 0x00000008
_IN_MOVED_FROM = 0x00000040
_IN_MOVED_TO = 0x00000080
_IN_CREATE = 0x00000100
_IN_DELETE = 0x00000200
_IN_DELETE_SELF = 0x00000400
_IN_MOVE_SELF = 0x00000800
_IN_UNMOUNT = 0x00002000
_IN_Q_OVERFLOW = 0x00004000
_IN_IGNORED = 0x00008000
_IN_ONLYDIR = 0x01000000
_IN_DONT_FOLLOW = 0x02000000
_IN_NONBLOCK = os.O_NONBLOCK
_IN_CLOEXEC = getattr(os, "O_CLOEXEC", 0o2000000)

#: what can mean a new version: entries created, moved in or out, written, removed
_MASK = (
    _IN_MODIFY | _IN_ATTRIB | _IN_CLOSE_WRITE | _IN_MOVED_FROM | _IN_MOVED_TO | _IN_CREATE
    | _IN_DELETE | _IN_DELETE_SELF | _IN_MOVE_SELF | _IN_ONLYDIR
)  # fmt: skip
#: entries arriving whole (created, renamed in, closed after a write), the directory gone: not
#: each write (a file being made: a shard's temporary, or one written in a loop by anyone)
_ARRIVALS = (
    _IN_CREATE | _IN_MOVED_TO | _IN_CLOSE_WRITE | _IN_DELETE_SELF | _IN_MOVE_SELF | _IN_ONLYDIR
)
#: the watched directory itself went away (removed, moved, its filesystem unmounted)
_GONE = _IN_DELETE_SELF | _IN_MOVE_SELF | _IN_UNMOUNT | _IN_IGNORED
_EVENT = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len; then the name
#: bytes of events read at once: ~1,000 events with names of the root's kind
READ_BYTES = 32 * 1024
#: reads of events that wanted nothing after which :func:`nap` reads no more (a flood)
FUTILE_READS = 4

logger = logging.getLogger(__name__)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        libc.inotify_init1.argtypes = [ctypes.c_int]
        libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
    except (OSError, AttributeError):
        return None
    return libc


def available() -> bool:
    """Whether this platform has inotify (Linux, a C library that exports it)."""
    return _libc() is not None


def _watch(directory: Path, mask: int) -> int:
    """A new inotify descriptor watching ``directory``."""
    libc = _libc()
    if libc is None:
        raise OSError(errno.ENOSYS, "inotify is not available here")
    fd = libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"inotify_init1: {os.strerror(err)}")
    if libc.inotify_add_watch(fd, os.fsencode(directory), mask) < 0:
        err = ctypes.get_errno()
        os.close(fd)
        raise OSError(err, f"inotify_add_watch {directory}: {os.strerror(err)}")
    return fd


class DirectoryWatch:
    """inotify events of ``directory``'s own entries, read without blocking.

    Raises OSError when the watch cannot be made (no inotify here: ENOSYS; the per-user
    instance or watch limit reached: EMFILE, ENOSPC; not a directory: ENOTDIR).
    """

    def __init__(self, directory: Path, *, follow: bool = True, arrivals: bool = False) -> None:
        mask = _ARRIVALS if arrivals else _MASK
        self._mask = mask | (0 if follow else _IN_DONT_FOLLOW)  # (not: a symlink is refused)
        self.fd = _watch(directory, self._mask)
        self.directory = directory
        self.gone = False  # a read saw the directory go (the watch of it is dead)

    def renew(self) -> None:
        """After the directory went: watch the one its path names now (made again; none
        there: still gone, tried again at the next call). Raises OSError as the constructor."""
        try:
            fd = _watch(self.directory, self._mask)
        except FileNotFoundError:
            return
        close_off_loop(self.fd)
        self.fd, self.gone = fd, False

    def read(self, keep: Callable[[str], bool]) -> tuple[bool, bool]:
        """Read the pending events, at most one buffer of them (a flood of events must not hold
        the caller: the rest are read at the next call): (whether one names an entry ``keep``
        wants, or the queue overflowed; whether the directory itself is gone)."""
        wanted = gone = False
        try:
            buf = os.read(self.fd, READ_BYTES)
        except (BlockingIOError, InterruptedError):
            return wanted, gone
        at = 0
        while at + _EVENT.size <= len(buf):
            _wd, mask, _cookie, length = _EVENT.unpack_from(buf, at)
            name = buf[at + _EVENT.size : at + _EVENT.size + length].split(b"\0", 1)[0]
            at += _EVENT.size + length
            if mask & _IN_Q_OVERFLOW:
                wanted = True  # events were lost: look
            elif mask & _GONE:
                gone = self.gone = True
            elif name and not wanted and keep(os.fsdecode(name)):
                wanted = True
        return wanted, gone

    def close(self) -> None:
        """Close the watch: it reads nothing after this call. On an event loop the kernel's
        end of the instance is waited for on the loop's executor (:func:`close_off_loop`),
        elsewhere here."""
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            close_off_loop(fd)


def close_off_loop(fd: int) -> None:
    """Close inotify instance ``fd`` on the running loop's default executor (no loop, or
    its executor shut down: here). Closing one waits in the kernel for a grace period
    (``fsnotify_destroy_group``): 0.1 ms on an idle host, 5-22 ms with both cores busy
    (measured here), which on the loop held every other task: the stream's watch of each
    version directory closed in the version's tail, with the engine's last groups and the
    ack waiting behind it."""
    try:
        asyncio.get_running_loop().run_in_executor(None, _close_quietly, fd)
    except RuntimeError:  # no running loop, or its executor is shut down
        _close_quietly(fd)


def _close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


def watch_or_none(directory: Path, use_inotify: bool) -> DirectoryWatch | None:
    """A watch of the entries arriving in ``directory`` (a symlink refused) where inotify is
    wanted and one can be made, else None: the caller polls only (no inotify here, the
    per-user instance or watch limit reached, the directory gone)."""
    if not (use_inotify and available()):
        return None
    try:
        return DirectoryWatch(directory, follow=False, arrivals=True)
    except OSError as exc:
        logger.debug("no inotify watch of %s (%s): polling only", directory, exc)
        return None


async def nap(
    watch: DirectoryWatch | None,
    seconds: float,
    stop: asyncio.Event,
    keep: Callable[[str], bool],
) -> None:
    """Sleep ``seconds`` or less: until ``stop``, or an entry of ``watch``'s directory (where
    one was made) that ``keep`` wants (the stream's: the next shard, the manifest) is
    created, written or renamed in or out, or the directory goes (one made again in its place
    is watched from the next call). The events are read and dropped (the caller looks at the
    directory itself); those of other entries wake nothing, and after :data:`FUTILE_READS`
    reads of them the rest of the nap is a plain sleep: a flood of them (a process writing
    other files there in a loop) must not spin a core (its events wait in the kernel's queue,
    or overflow it: the next nap wakes at the overflow)."""
    if stop.is_set():
        return
    if watch is not None and watch.gone:  # the directory made again: watched again
        try:
            watch.renew()
        except OSError as exc:  # (a symlink now, the limits reached): polls alone
            logger.debug("no inotify watch of %s again (%s)", watch.directory, exc)
    loop = asyncio.get_running_loop()
    woken: asyncio.Future[None] = loop.create_future()

    futile = 0  # reads that wanted nothing

    def ready() -> None:
        nonlocal futile
        assert watch is not None
        try:
            wanted, gone = watch.read(keep)
        except OSError:
            wanted, gone = True, True
        if (wanted or gone) and not woken.done():
            woken.set_result(None)
        elif (futile := futile + 1) >= FUTILE_READS:  # a flood of other entries' events: the
            loop.remove_reader(watch.fd)  # rest of this nap is a poll (left queued, or lost)

    stopped = asyncio.ensure_future(stop.wait())
    if watch is not None:
        loop.add_reader(watch.fd, ready)
    try:
        await asyncio.wait((woken, stopped), timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if watch is not None:
            loop.remove_reader(watch.fd)
        stopped.cancel()
        woken.cancel()
