"""Safe access to a shared root (the rules: :mod:`asyncsync.fsio`): walking it by descriptor,
reading (:func:`open_file`), writing (:func:`atomic_write`, :func:`append_line`) and removing."""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import stat
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path, PurePath
from typing import Any

from asyncsync.fsio.throttle import _throttled

TMP_PREFIX = ".tmp."
# Errors that mean "this filesystem cannot fsync a directory", not "the data is lost":
# NFS, FUSE and some overlay filesystems answer EINVAL/ENOTSUP/EBADF/EACCES to a directory fsync.
_DIR_FSYNC_UNSUPPORTED = {errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF, errno.EACCES}

# Set on every file and directory asyncsync creates in a root, whatever the umask (FORMAT.md,
# "Permissions"): receivers often run as another uid (the Docker image runs as uid 10001).
FILE_MODE = 0o644
DIR_MODE = 0o755

_Path = str | os.PathLike[str]
_Root = _Path | None
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | _CLOEXEC


class UnsafePath(OSError):
    """A symlink, a special file (FIFO, socket, device), a directory where a file is expected,
    a hard-linked file to write in place, or a path through a symlink: never followed."""

    def __str__(self) -> str:
        return str(self.strerror)


def is_temp_name(name: str) -> bool:
    return name.startswith(TMP_PREFIX)


# --------------------------------------------------------------------------- walking a root

_KINDS = {stat.S_IFLNK: "a symlink", stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket",
          stat.S_IFCHR: "a device", stat.S_IFBLK: "a device",
          stat.S_IFDIR: "a directory", stat.S_IFREG: "a regular file"}  # fmt: skip


def _kind(mode: int) -> str:
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def _split(path: _Path, root: _Root) -> tuple[str, list[str]]:
    """(the trusted base directory, the components below it) of ``path``'s parent."""
    p = PurePath(path)
    if root is None:
        return str(p.parent), []
    r = PurePath(root)
    try:
        rel = p.parent.relative_to(r)
    except ValueError:
        try:
            rel = PurePath(os.path.abspath(p.parent)).relative_to(os.path.abspath(r))
        except ValueError:
            raise ValueError(f"{path} is not inside the root {root}") from None
    parts = [c for c in rel.parts if c not in ("", ".")]
    if ".." in parts:
        raise ValueError(f"{path}: '..' below the root {root}")
    return str(r), parts


def _descend(base: str, parts: Iterable[str], path: object, *, create: bool = False) -> int:
    """A descriptor of ``base/parts...``; every component of ``parts`` opened without following
    a symlink (``create``: missing ones are made with :data:`DIR_MODE`)."""
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
    try:
        for name in parts:
            fd, above = _open_subdir(fd, name, path, create=create), fd
            os.close(above)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_subdir(fd: int, name: str, path: object, *, create: bool = False) -> int:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=fd)
    except FileNotFoundError:
        if not create:
            raise
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            what = _entry_kind(fd, name)
            raise UnsafePath(
                exc.errno, f"{path}: the directory {name!r} on its way is {what}; "
                "asyncsync never follows a symlink in a root: replace it with a directory",
            ) from None  # fmt: skip
        raise
    try:
        os.mkdir(name, DIR_MODE, dir_fd=fd)
        made = True
    except FileExistsError:  # made meanwhile by another writer
        made = False
    if made:
        _chmod_made_dir(fd, name)
    return _open_subdir(fd, name, path)


def _chmod_made_dir(fd: int, name: str) -> None:
    """Give the directory ``name`` (in ``fd``) just made :data:`DIR_MODE` whatever the umask,
    without following a symlink swapped in there. Through an ``O_PATH`` descriptor (its
    ``/proc/self/fd`` link names the directory itself): opening it to read needs the read
    right a umask such as 0177 or 0777 took away (a non-root process then left a directory it
    could not enter, mode 0600 or 0000, and failed on it at every start)."""
    flags = getattr(os, "O_PATH", 0) | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC
    if not flags & getattr(os, "O_PATH", 0) or not os.path.isdir("/proc/self/fd"):
        sub = os.open(name, _DIR_FLAGS, dir_fd=fd)  # (no O_PATH: as before, needs the read right)
        try:
            os.fchmod(sub, DIR_MODE)
        finally:
            os.close(sub)
        return
    try:
        sub = os.open(name, flags, dir_fd=fd)
    except OSError as exc:  # swapped for a symlink or a file: the open after names it
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            return
        raise
    try:
        os.chmod(f"/proc/self/fd/{sub}", DIR_MODE)
    finally:
        os.close(sub)


def _entry_kind(fd: int, name: str) -> str:
    try:
        return _kind(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode)
    except OSError:
        return "not a directory"


@contextlib.contextmanager
def _parent(path: _Path, root: _Root, *, create: bool = False) -> Iterator[tuple[int, str]]:
    """(descriptor of ``path``'s directory, ``path``'s last component), closed after; an
    ``OSError`` names ``path`` where it named its last component (or one on its way) alone."""
    base, parts = _split(path, root)
    try:
        fd = _descend(base, parts, path, create=create)
        try:
            yield fd, PurePath(path).name
        finally:
            os.close(fd)
    except OSError as exc:
        for at in ("filename", "filename2"):
            if getattr(exc, at) in (PurePath(path).name, *parts):  # not a temp file's name
                setattr(exc, at, str(path))
        raise


def open_dir(path: _Path, *, root: _Root = None) -> int:
    """A descriptor of the directory ``path`` (the caller closes it)."""
    if root is None or PurePath(path) == PurePath(root):
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
    with _parent(path, root) as (fd, name):
        return _open_subdir(fd, name, path)


def lstat(path: _Path, *, root: _Root = None) -> os.stat_result | None:
    """``lstat`` of ``path``, None when it (or a directory on its way) does not exist."""
    with contextlib.suppress(FileNotFoundError), _parent(path, root) as (fd, name):
        return os.stat(name, dir_fd=fd, follow_symlinks=False)
    return None


def scan(path: _Path, *, root: _Root = None) -> list[tuple[str, os.stat_result]]:
    """(name, lstat) of each entry of the directory ``path`` (one removed meanwhile is left
    out); a missing directory raises FileNotFoundError, a symlinked one UnsafePath."""
    fd = open_dir(path, root=root)
    out = []
    try:
        for name in os.listdir(fd):
            with contextlib.suppress(FileNotFoundError):
                out.append((name, os.stat(name, dir_fd=fd, follow_symlinks=False)))
    finally:
        os.close(fd)
    return out


# --------------------------------------------------------------------------- reading


def open_file(path: _Path, *, root: _Root = None, follow_symlinks: bool = False) -> int:
    """Open a regular file for reading: the one place asyncsync does. ``O_NOFOLLOW`` (unless
    ``follow_symlinks``: a registered checkpoint's files may be symlinks), ``O_NONBLOCK``, then
    ``fstat``: anything but a regular file raises :class:`UnsafePath`. The caller closes it."""
    flags = _READ_FLAGS | (0 if follow_symlinks else os.O_NOFOLLOW)
    with _parent(path, root) as (dfd, name):
        return _open_regular(dfd, name, flags, path)[0]


_UNSAFE_ERRNOS = (errno.ELOOP, errno.ENXIO, errno.ENODEV, errno.EOPNOTSUPP, errno.EISDIR)


def _open_regular(dfd: int, name: str, flags: int, path: object) -> tuple[int, os.stat_result]:
    """``openat`` and ``fstat`` for :func:`open_file` and :func:`_open_write`: never blocks
    (``O_NONBLOCK``), anything but a regular file raises UnsafePath (fd closed)."""
    try:
        fd = os.open(name, flags | os.O_NONBLOCK | _CLOEXEC, FILE_MODE, dir_fd=dfd)
    except OSError as exc:
        if exc.errno in _UNSAFE_ERRNOS:  # ELOOP: O_NOFOLLOW met a symlink; ENXIO: a socket
            raise _unsafe(exc.errno, path, _entry_kind(dfd, name)) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _unsafe(errno.EINVAL, path, _kind(st.st_mode))
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def _unsafe(err: int, path: object, what: str) -> UnsafePath:
    return UnsafePath(
        err, f"{path} is {what}, not a regular file: asyncsync never follows a symlink nor "
        "opens a special file in a root (remove it if you did not put it there)",
    )  # fmt: skip


def read_file(
    path: _Path, *, limit: int, root: _Root = None, follow_symlinks: bool = False
) -> tuple[bytes, os.stat_result]:
    """A whole regular file (see :func:`open_file`) and its ``fstat``; one larger than ``limit``
    raises ValueError (from ``fstat``; one that grew, or procfs's 0, is read on to the limit)."""
    data, st = _read(path, limit, root, follow_symlinks, writable=False)
    assert isinstance(data, bytes)
    return data, st


def read_bytes(
    path: _Path, *, limit: int, root: _Root = None, follow_symlinks: bool = False
) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes (:func:`read_file`)."""
    return read_file(path, limit=limit, root=root, follow_symlinks=follow_symlinks)[0]


def read_buffer(
    path: _Path, *, limit: int, root: _Root = None, follow_symlinks: bool = False
) -> bytearray:
    """:func:`read_bytes` into a ``bytearray``: a private, writable buffer that tensors can view
    without a copy (torch has no read-only tensors; a full shard's, :func:`asyncsync.codec.
    shards.parse_shard`). Read straight into it (``readinto``): about the CPU of ``read`` (both
    mostly the first touch of fresh pages)."""
    data, _ = _read(path, limit, root, follow_symlinks, writable=True)
    assert isinstance(data, bytearray)
    return data


def read_into(
    path: _Path,
    alloc: Callable[[int], Any],
    *,
    limit: int,
    root: _Root = None,
    follow_symlinks: bool = False,
) -> memoryview:
    """:func:`read_bytes` into a buffer that ``alloc(size)`` gives (a writable 1-D buffer of
    bytes, at least ``size`` long: a scratch pool's, whose pages are already faulted in), as a
    read-only view of exactly the file's bytes. A fresh buffer of a few MB costs as much in
    first-touch page faults as the read itself (~3 us a page in a VM); a reused one does not.
    A file that grew after its size was read (or procfs's 0) is read on into ``bytes``, as
    :func:`read_bytes` reads it; one that shrank gives the bytes there were."""
    data, _ = _read(path, limit, root, follow_symlinks, writable=False, into=alloc)
    return data if isinstance(data, memoryview) else memoryview(data)


def _read(
    path: _Path,
    limit: int,
    root: _Root,
    follow_symlinks: bool,
    *,
    writable: bool,
    into: Callable[[int], Any] | None = None,
) -> tuple[bytes | bytearray | memoryview, os.stat_result]:
    started = time.perf_counter()
    data: bytes | bytearray | memoryview
    with os.fdopen(open_file(path, root=root, follow_symlinks=follow_symlinks), "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_size > limit:
            raise ValueError(f"{path} is larger than {limit} bytes ({st.st_size})")
        if into is not None:  # (read_into) exactly the file's bytes, unless it grew
            buf = memoryview(into(st.st_size))
            if buf.readonly or buf.ndim != 1 or buf.itemsize != 1 or buf.nbytes < st.st_size:
                raise TypeError(f"alloc({st.st_size}) gave no writable buffer of that many bytes")
            got = f.readinto(buf[: st.st_size]) if st.st_size else 0
            more = f.read(1) if got == st.st_size else b""
            data = bytes(buf[:got]) + more if more else buf[:got].toreadonly()
        elif writable:
            data = bytearray(st.st_size + 1)
            del data[f.readinto(data) :]  # (shrinking by the spare byte moves nothing)
        else:
            data = f.read(st.st_size + 1)
        # (a read of n allocates n: 64 MiB more at most; a view of ``into``'s is never more)
        if st.st_size < len(data) <= limit and not isinstance(data, memoryview):
            data += f.read(min(limit + 1 - len(data), 64 << 20))
    _throttled(path, len(data), started)
    if len(data) > limit:
        raise ValueError(f"{path} is larger than {limit} bytes")
    return data, st


# --------------------------------------------------------------------------- writing


def fsync_dir(path: _Path, *, root: _Root = None) -> None:
    """fsync a directory so renames in it are durable; a no-op where the filesystem can't."""
    try:
        fd = open_dir(path, root=root)
    except OSError as exc:
        if exc.errno in _DIR_FSYNC_UNSUPPORTED:
            return
        raise
    try:
        _fsync_dir_fd(fd)
    finally:
        os.close(fd)


def _fsync_dir_fd(fd: int) -> None:
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in _DIR_FSYNC_UNSUPPORTED:
            raise


def _set_mode(fd: int, mode: int = FILE_MODE) -> None:
    """Give an open file ``mode`` exactly (the umask only narrows what ``open`` asked for)."""
    if os.fstat(fd).st_mode & 0o7777 != mode:
        os.fchmod(fd, mode)


def _open_write(dfd: int, name: str, flags: int, path: object) -> int:
    """Open ``name`` in ``dfd`` for writing: the one place asyncsync does. Never follows, never
    blocks; an existing file (no ``O_EXCL``) must be a regular file with one link before its mode
    (set to :data:`FILE_MODE`) or bytes are touched."""
    fd, st = _open_regular(dfd, name, flags | os.O_NOFOLLOW, path)
    try:
        if st.st_nlink > 1 and not flags & os.O_EXCL:
            raise UnsafePath(
                errno.EMLINK, f"{path} has {st.st_nlink} hard links: writing it in place would "
                "change a file elsewhere too; remove it if you did not link it",
            )  # fmt: skip
        _set_mode(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def make_dir(
    path: _Path, *, root: _Root = None, parents: bool = False, exist_ok: bool = False
) -> Path:
    """``mkdir`` with the documented mode (:data:`DIR_MODE`) whatever the umask; an existing
    directory keeps its mode. With ``root``, no component below it is followed: an existing
    symlink (or anything but a directory) raises :class:`UnsafePath`, also with ``exist_ok``."""
    path = Path(path)
    if root is None:
        if parents and not path.parent.exists():
            make_dir(path.parent, parents=True, exist_ok=True)
        try:
            os.mkdir(path, DIR_MODE)
            os.chmod(path, DIR_MODE)
        except FileExistsError:
            if not exist_ok or not path.is_dir():
                raise
        return path
    with _parent(path, root, create=parents) as (dfd, name):
        try:
            os.mkdir(name, DIR_MODE, dir_fd=dfd)
        except FileExistsError:
            os.close(_open_subdir(dfd, name, path))  # UnsafePath unless a real directory
            if not exist_ok:
                raise
            return path
        _chmod_made_dir(dfd, name)
        os.close(_open_subdir(dfd, name, path))  # UnsafePath unless a real directory
    return path


def fs_now(directory: _Path, *, root: _Root = None) -> float:
    """The current time on the clock of the filesystem holding ``directory``: the mtime of a
    file created there (on NFS: the server's clock), so ages are measured on one clock, whatever
    the local clock says. The probe is a temp name (readers ignore it), removed at once."""
    name = f"{TMP_PREFIX}clock.{secrets.token_hex(6)}"
    fd = open_dir(directory, root=root)
    try:
        f = _open_write(fd, name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, Path(directory) / name)
        try:
            return os.fstat(f).st_mtime
        finally:
            os.close(f)
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=fd)
    finally:
        os.close(fd)


def atomic_write(
    path: _Path,
    data: bytes | bytearray | memoryview | Iterable[bytes | bytearray | memoryview],
    *,
    root: _Root = None,
    fsync: bool = True,
    sync_dir: bool = True,
) -> int:
    """Write ``data`` to ``path`` atomically and durably; return the number of bytes written.

    temp file in the same directory (``O_EXCL | O_NOFOLLOW``) -> write -> fsync -> rename ->
    fsync(dir). The rename replaces whatever entry ``path`` was (a symlink is replaced, never
    followed). On any error the temp file is removed and the destination is untouched.
    """
    path = Path(path)
    tmp = f"{TMP_PREFIX}{path.name}.{secrets.token_hex(6)}"
    chunks = [data] if isinstance(data, bytes | bytearray | memoryview) else data
    started = time.perf_counter()
    with _parent(path, root) as (dfd, name):
        try:
            fd = _open_write(dfd, tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, path.parent / tmp)
            with os.fdopen(fd, "wb") as f:
                n = 0
                for c in chunks:
                    f.write(c)
                    n += len(c)
                _throttled(path, n, started)
                f.flush()
                if fsync:
                    os.fsync(f.fileno())
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dfd)
            raise
        if sync_dir:
            _fsync_dir_fd(dfd)
    return n


def rewrite_as(
    spare: _Path,
    path: _Path,
    data: Iterable[bytes | bytearray | memoryview],
    *,
    size: int,
    root: _Root = None,
) -> bool:
    """:func:`atomic_write` of ``data`` to ``path`` without fsyncs, made over the pages of the
    file ``spare`` (in ``path``'s directory) instead of a new file: ``data`` written over it from
    offset 0, its size then set to ``size`` (>= the bytes written; what lies between is the
    spare's own bytes, or zeros), then renamed to ``path``. False, nothing done, where there
    is no ``spare``, or where it does not open for writing as a regular file with one link (a
    symlink, a FIFO, a hard link, a file not writable: that entry is removed, never followed or
    written). A file rewritten in place keeps its page cache: no page to allocate, zero and
    free again (a new file's cost ~1 ms of kernel CPU per MB written in small writes, on a VM).
    On an error the spare is removed, ``path`` untouched."""
    path = Path(path)
    name_of_spare = Path(spare).name
    started = time.perf_counter()
    with _parent(path, root) as (dfd, name):
        try:
            fd = _open_write(dfd, name_of_spare, os.O_WRONLY, path.parent / name_of_spare)
        except OSError:  # none; a symlink (the link only), a FIFO, a hard link, not ours
            with contextlib.suppress(OSError):
                os.unlink(name_of_spare, dir_fd=dfd)
            return False
        try:
            try:
                n = _pwrite_all(fd, [memoryview(c).cast("B") for c in data])
                if size < n:
                    raise ValueError(f"size {size} is below the {n} bytes written")
                os.ftruncate(fd, size)
                _throttled(path, n, started)
            finally:
                os.close(fd)
            os.replace(name_of_spare, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(name_of_spare, dir_fd=dfd)
            raise
    return True


def _pwrite_all(fd: int, views: list[memoryview]) -> int:
    """Write ``views`` one after another from offset 0 (``pwritev``, 512 at a time); their size."""
    n, i = 0, 0
    while i < len(views):
        done = os.pwritev(fd, views[i : i + 512], n)
        if done == 0 and any(views[i : i + 512]):
            raise OSError(errno.EIO, "pwritev wrote nothing")
        n += done
        while i < len(views) and done >= len(views[i]):
            done -= len(views[i])
            i += 1
        if done:
            views[i] = views[i][done:]
    return n


def append_bytes(path: _Path, data: bytes, *, root: _Root = None) -> None:
    """Append ``data`` with a single ``O_APPEND`` write to the regular file ``path`` (created if
    missing) and fsync it; a symlink, FIFO or hard-linked file there raises UnsafePath. A short
    write (a full disk) is taken back and raises ENOSPC: a log never keeps a torn line."""
    with _parent(path, root) as (dfd, name):
        fd = _open_write(dfd, name, os.O_WRONLY | os.O_CREAT | os.O_APPEND, path)
    try:
        if (n := os.write(fd, data)) < len(data):
            os.ftruncate(fd, os.lseek(fd, 0, os.SEEK_CUR) - n)
            raise OSError(errno.ENOSPC, f"short append ({n} of {len(data)} bytes)", str(path))
        os.fsync(fd)
    finally:
        os.close(fd)


def append_line(path: _Path, line: str, *, root: _Root = None) -> None:
    """Append one line with a single O_APPEND write and fsync it (an append-only log)."""
    if "\n" in line.rstrip("\n"):
        raise ValueError("a log line must not contain a newline")
    append_bytes(path, (line.rstrip("\n") + "\n").encode(), root=root)


# --------------------------------------------------------------------------- removing


def remove(path: _Path, *, root: _Root = None) -> bool:
    """Unlink the entry ``path`` (a symlink is removed, not its target); False if missing."""
    try:
        with _parent(path, root) as (dfd, name):
            os.unlink(name, dir_fd=dfd)
    except FileNotFoundError:
        return False
    return True


def remove_tree(path: _Path, *, root: _Root = None) -> None:
    """Remove ``path``: a directory with everything in it (descriptor-based: a symlink inside is
    unlinked, never followed), or any other entry (a symlink: the link only). Missing: no-op."""
    with contextlib.suppress(FileNotFoundError), _parent(path, root) as (dfd, name):
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        (shutil.rmtree if stat.S_ISDIR(st.st_mode) else os.unlink)(name, dir_fd=dfd)


def remove_temp_files(directory: _Path, *, root: _Root = None) -> list[Path]:
    """Remove leftover temp files of interrupted writes in ``directory`` (not recursive)."""
    try:
        names = [n for n, st in scan(directory, root=root) if not stat.S_ISDIR(st.st_mode)]
    except FileNotFoundError:
        return []
    removed = [Path(directory) / n for n in names if is_temp_name(n)]
    for p in removed:
        remove(p, root=directory if root is None else root)
    return removed
