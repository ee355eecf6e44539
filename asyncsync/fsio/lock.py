"""The lock of a root or a state directory: :class:`FileLock`."""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
from pathlib import Path

from asyncsync.fsio.files import UnsafePath, _open_write, _parent, _Path, _Root, read_bytes


class FileLock:
    """An exclusive, non-blocking ``flock`` held for the life of the object (the kernel drops it
    when the process dies); a lock file that is a symlink, a FIFO or hard-linked: UnsafePath.

    The file names its holder, ``pid host token`` (the token is this lock's own: two of one
    process differ), and :meth:`intact` reads it back: an ``flock`` holds the inode it opened,
    so a directory wiped (or the file replaced) under a holder let a second taker lock a new
    file there, and both wrote beside each other. A holder checks it before each write that
    must be its alone (a publisher's manifest, a receiver's state). Not the inode number: FUSE
    filesystems need not keep one stable."""

    text = b""  # what the file held when this lock took it

    def __init__(self, path: _Path, *, root: _Root = None):
        self.path = Path(path)
        self.root = root
        self._fd: int | None = None

    def acquire(self) -> bool:
        with _parent(self.path, self.root) as (dfd, name):
            fd = _open_write(dfd, name, os.O_RDWR | os.O_CREAT, self.path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        text = f"{os.getpid()} {os.uname().nodename} {secrets.token_hex(8)}\n".encode()
        try:
            os.ftruncate(fd, 0)
            os.write(fd, text)
        except OSError:
            os.close(fd)  # closing drops the lock too
            raise
        self._fd, self.text = fd, text
        return True

    def intact(self) -> bool:
        """Whether the file at the path is still the one this lock holds (False when it is
        not held, or the file was removed or replaced since it was taken)."""
        if self._fd is None:
            return False
        try:
            return read_bytes(self.path, limit=4096, root=self.root) == self.text
        except (FileNotFoundError, UnsafePath, ValueError):  # removed, or something else there
            return False

    def holder(self) -> str:
        try:
            text = read_bytes(self.path, limit=4096, root=self.root).decode(errors="replace")
        except (OSError, ValueError):
            return "unknown"
        return text.strip() or "unknown"

    def taken(self) -> bool | None:
        """Whether some process holds an ``flock`` on the file now, read from ``/proc/locks``
        (Linux) without taking it: False only where none does (no ``FLOCK`` line names the
        file's inode; the device is not compared: btrfs reports another one to ``stat``),
        None where it cannot tell (no ``/proc``, the file unreadable)."""
        try:
            ino = os.lstat(self.path).st_ino
            with open("/proc/locks", encoding="ascii", errors="replace") as f:
                lines = f.read().splitlines()
        except OSError:
            return None
        for line in lines:
            fields = line.split()
            if (
                len(fields) > 5
                and fields[1] == "FLOCK"
                and fields[5].rsplit(":", 1)[-1] == str(ino)
            ):
                return True
        return False

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None
