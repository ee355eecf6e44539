"""Filesystem primitives: atomic durable writes, directory fsync, temp-file hygiene, locks.

Every file asyncsync writes into a shared root goes through :func:`atomic_write`: it is written
under a temporary name that starts with :data:`TMP_PREFIX` (readers ignore such names), fsynced,
renamed to its final name, and the directory is fsynced. A crash leaves either the old state or
the complete new file, plus at most a temp file that the next writer removes.

These are blocking functions: async callers run them through ``asyncio.to_thread``.

A :class:`Throttle` (bandwidth and per-file latency) can be set process-wide, or through the
environment variable ``ASYNCSYNC_THROTTLE`` (e.g. ``200MB/s,5ms``), to simulate a slow shared
filesystem: :func:`atomic_write` and :func:`read_bytes` then sleep as such a filesystem would.
The benchmark uses it; production leaves it unset.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

__all__ = [
    "TMP_PREFIX",
    "FileLock",
    "Throttle",
    "append_line",
    "atomic_write",
    "fs_now",
    "fsync_dir",
    "make_dir",
    "parse_size",
    "get_throttle",
    "is_temp_name",
    "read_bytes",
    "remove_temp_files",
    "set_throttle",
]

TMP_PREFIX = ".tmp."
# Errors that mean "this filesystem cannot fsync a directory", not "the data is lost":
# NFS, FUSE and some overlay filesystems answer EINVAL/ENOTSUP/EBADF/EACCES to a directory fsync.
_DIR_FSYNC_UNSUPPORTED = {errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF, errno.EACCES}

# Set on every file and directory asyncsync creates in a root, whatever the umask (FORMAT.md,
# "Permissions"): receivers often run as another uid (the Docker image runs as uid 10001).
FILE_MODE = 0o644
DIR_MODE = 0o755


_UNITS = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "KI": 1024, "MI": 1 << 20, "GI": 1 << 30}


@dataclass(frozen=True)
class Throttle:
    """A simulated slow filesystem: ``bandwidth`` bytes/s (None: unlimited) and ``latency``
    seconds per file operation, for files under ``root`` (None: every file)."""

    bandwidth: float | None = None
    latency: float = 0.0
    root: str | None = None

    def __post_init__(self) -> None:
        if self.bandwidth is not None and self.bandwidth <= 0:
            raise ValueError(f"throttle bandwidth must be > 0, got {self.bandwidth}")
        if self.latency < 0:
            raise ValueError(f"throttle latency must be >= 0, got {self.latency}")

    @classmethod
    def parse(cls, text: str) -> Throttle:
        """``"200MB/s,5ms"``, ``"1GiB/s"``, ``"10ms@/shared/root"`` -> Throttle."""
        bw: float | None = None
        lat = 0.0
        text, _, root = text.partition("@")
        for part in filter(None, (p.strip() for p in text.split(","))):
            m = re.fullmatch(r"([\d.]+)\s*([KMG]I?)?B/S", part.upper())
            if m:
                bw = float(m.group(1)) * _UNITS[m.group(2) or ""]
                continue
            m = re.fullmatch(r"([\d.]+)\s*(MS|S|US)", part.upper())
            if m:
                lat = float(m.group(1)) * {"S": 1.0, "MS": 1e-3, "US": 1e-6}[m.group(2)]
                continue
            raise ValueError(f"cannot parse throttle {text!r}: use e.g. '200MB/s,5ms@/root'")
        return cls(bw, lat, os.path.abspath(root) if root else None)

    def applies_to(self, path: str | os.PathLike[str]) -> bool:
        if self.root is None:
            return True
        p = os.path.abspath(path)
        return p == self.root or p.startswith(self.root.rstrip(os.sep) + os.sep)

    def cost(self, nbytes: int) -> float:
        """Seconds one file operation of ``nbytes`` takes on this filesystem."""
        return self.latency + (nbytes / self.bandwidth if self.bandwidth else 0.0)


_throttle: Throttle | None = (
    Throttle.parse(os.environ["ASYNCSYNC_THROTTLE"])
    if os.environ.get("ASYNCSYNC_THROTTLE")
    else None
)


_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "kb": 10**3,
    "m": 1 << 20,
    "mib": 1 << 20,
    "mb": 10**6,
    "g": 1 << 30,
    "gib": 1 << 30,
    "gb": 10**9,
    "t": 1 << 40,
    "tib": 1 << 40,
    "tb": 10**12,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def parse_size(text: str) -> int:
    """Bytes in ``text``: ``4096``, ``32MiB``, ``1.5G`` (K/M/G/T = 1024^n, KB/MB/... = 1000^n)."""
    m = _SIZE_RE.match(text.replace("_", ""))
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _SIZE_UNITS:
        raise ValueError(f"{text!r} is not a size; write e.g. 33554432, 32MiB or 1G")
    value = float(m.group(1)) * _SIZE_UNITS[unit]
    if value != int(value):
        raise ValueError(f"{text!r} is not a whole number of bytes")
    return int(value)


def set_throttle(throttle: Throttle | None) -> None:
    """Simulate a slow filesystem in this process (None: off)."""
    global _throttle
    _throttle = throttle


def get_throttle() -> Throttle | None:
    return _throttle


def _throttled(path: str | os.PathLike[str], nbytes: int, started: float) -> None:
    t = _throttle
    if t is not None and t.applies_to(path):
        remaining = t.cost(nbytes) - (time.perf_counter() - started)
        if remaining > 0:
            time.sleep(remaining)


def is_temp_name(name: str) -> bool:
    return name.startswith(TMP_PREFIX)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory so renames in it are durable; a no-op where the filesystem can't."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        if exc.errno in _DIR_FSYNC_UNSUPPORTED:
            return
        raise
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in _DIR_FSYNC_UNSUPPORTED:
            raise
    finally:
        os.close(fd)


def _set_mode(fd: int, mode: int = FILE_MODE) -> None:
    """Give an open file ``mode`` exactly (the umask only narrows what ``open`` asked for)."""
    if os.fstat(fd).st_mode & 0o7777 != mode:
        os.fchmod(fd, mode)


def make_dir(
    path: str | os.PathLike[str], *, parents: bool = False, exist_ok: bool = False
) -> Path:
    """``mkdir`` with the documented mode (:data:`DIR_MODE`) whatever the umask.

    Only directories this call creates are changed; an existing one keeps its mode.
    """
    path = Path(path)
    if parents and not path.parent.exists():
        make_dir(path.parent, parents=True, exist_ok=True)
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        if not exist_ok or not path.is_dir():
            raise
        return path
    os.chmod(path, DIR_MODE)
    return path


def fs_now(directory: str | os.PathLike[str]) -> float:
    """The current time on the clock of the filesystem holding ``directory``.

    A file created there gets its mtime from that filesystem (on NFS: the server's clock), so
    comparing it with other files' mtimes measures ages on one clock, whatever the local
    clock says. The probe file is a temp name (readers ignore it) and is removed at once.
    """
    tmp = Path(directory) / f"{TMP_PREFIX}clock.{secrets.token_hex(6)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    try:
        return os.fstat(fd).st_mtime
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def _write_all(f: IO[bytes], chunks: Iterable[bytes | bytearray | memoryview]) -> int:
    n = 0
    for c in chunks:
        f.write(c)
        n += len(c)
    return n


def atomic_write(
    path: str | os.PathLike[str],
    data: bytes | bytearray | memoryview | Iterable[bytes | bytearray | memoryview],
    *,
    fsync: bool = True,
    sync_dir: bool = True,
) -> int:
    """Write ``data`` to ``path`` atomically and durably; return the number of bytes written.

    temp file in the same directory -> write -> fsync -> rename -> fsync(dir). On any error the
    temp file is removed and the destination is untouched.
    """
    path = Path(path)
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{secrets.token_hex(6)}")
    chunks = [data] if isinstance(data, bytes | bytearray | memoryview) else data
    started = time.perf_counter()
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
        try:
            _set_mode(fd)
        except BaseException:
            os.close(fd)
            raise
        with os.fdopen(fd, "wb") as f:
            n = _write_all(f, chunks)
            _throttled(path, n, started)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    if sync_dir:
        fsync_dir(path.parent)
    return n


def append_line(path: str | os.PathLike[str], line: str) -> None:
    """Append one line with a single O_APPEND write and fsync it (an append-only log)."""
    if "\n" in line.rstrip("\n"):
        raise ValueError("a log line must not contain a newline")
    data = (line.rstrip("\n") + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, FILE_MODE)
    try:
        _set_mode(fd)
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def read_bytes(path: str | os.PathLike[str], *, limit: int | None = None) -> bytes:
    """Read a whole file; with ``limit``, refuse (ValueError) a file larger than that.

    The size is taken from ``fstat`` before anything is allocated, so a hostile ``limit``
    (a manifest claiming 2^40 bytes) never allocates more than the file holds (plus one byte,
    to notice a file that grew).
    """
    started = time.perf_counter()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if limit is not None and size > limit:
            raise ValueError(f"{path} is larger than {limit} bytes ({size})")
        want = size + 1 if limit is None else min(size, limit) + 1
        data = f.read(want)
        if len(data) == want and limit is None:
            data += f.read()  # it grew while we read: take the rest
    _throttled(path, len(data), started)
    if limit is not None and len(data) > limit:
        raise ValueError(f"{path} is larger than {limit} bytes")
    return data


def remove_temp_files(directory: str | os.PathLike[str]) -> list[Path]:
    """Remove leftover temp files of interrupted writes in ``directory`` (not recursive)."""
    removed = []
    with contextlib.suppress(FileNotFoundError), os.scandir(directory) as it:
        for e in it:
            if is_temp_name(e.name) and e.is_file(follow_symlinks=False):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(e.path)
                removed.append(Path(e.path))
    return removed


class FileLock:
    """An exclusive, non-blocking ``flock`` held for the life of the object.

    The lock file records the holder's pid and host for the error message of the next taker.
    The kernel drops the lock when the process dies, so a crash never leaves it stuck.
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self._fd: int | None = None

    def acquire(self) -> bool:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, FILE_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        try:
            _set_mode(fd)
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()} {os.uname().nodename}\n".encode())
        except OSError:
            os.close(fd)  # closing drops the lock too
            raise
        self._fd = fd
        return True

    def holder(self) -> str:
        try:
            return self.path.read_text().strip() or "unknown"
        except OSError:
            return "unknown"

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None
