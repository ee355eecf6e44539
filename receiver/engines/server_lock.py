"""One receiver per inference server on a host: a lock file named after the server's address.

Two receivers that drive the same server (the same ``--sglang-url``: a copy-pasted unit file,
a second receiver started by hand beside the supervisor's) reloaded it against each other:
each one's reload made the other read a label it does not hold, mark the server lost and
reload its own checkpoint, every second or two, for as long as both ran, the server pausing
at each. The second one to open the server is refused now, with one line naming the receiver
that holds it.

The lock is ``flock`` on ``<tempdir>/asyncsync-servers/server-<hash>.lock`` (``$TMPDIR``,
else ``/tmp``), held while the engine is open: the kernel releases it when its process dies,
SIGKILL included, so a replacement starts at once after the holder is gone. The file holds
the holder's pid and checkpoint (read for the message only). Its directory (mode 1777) is held
shared (``flock LOCK_SH``) meanwhile: systemd-tmpfiles' age-based cleanup of the temporary
directory (files unused for 10 days on most distributions) skips a directory it cannot lock,
and it removed a lock file held by a receiver up for longer than that, so a second receiver
took the server (checked with the real systemd-tmpfiles: tests/test_server_lock.py). The lock
of earlier releases, ``<tempdir>/asyncsync-server-<hash>.lock``, is taken as well, so a
receiver of an earlier release on the same host is refused, and refuses. It binds the
receivers of one host (and one temporary directory) only: the names ``localhost``,
``127.0.0.1`` and ``::1`` are one server; another name of the same server (its host's
address, a DNS alias), or a receiver on another host, is not seen.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import fcntl
import hashlib
import json
import logging
import os
import secrets
import stat
import tempfile
import threading
import time
from pathlib import Path

from yarl import URL

from asyncsync.errors import ConfigError, LockHeld

__all__ = ["ServerLock", "server_key"]

logger = logging.getLogger(__name__)

#: The lock files' directory in the temporary directory, and how long a take waits for a
#: process that holds it exclusively (systemd-tmpfiles cleaning it) to let go.
DIR_NAME = "asyncsync-servers"
LOCK_DIR_WAIT = 10.0

_AT_FDCWD, _NOREPLACE = -100, 1  # renameat2's "the working directory" and RENAME_NOREPLACE

_LOOPBACK = {"localhost", "127.0.0.1", "::1", "ip6-localhost"}


def server_key(url: URL) -> str:
    """The server's address as the lock names it: scheme, host (loopback names as one), port
    and path, lowercased."""
    host = (url.host or "").lower().rstrip(".")
    host = "loopback" if host in _LOOPBACK or host.startswith("127.") else host
    return f"{url.scheme}://{host}:{url.port}{url.path.rstrip('/')}".lower()


class ServerLock:
    """This process's hold on one server (:meth:`take`; :meth:`release` when closed)."""

    def __init__(
        self, fd: int | None = None, path: Path | None = None, others: tuple[int, ...] = ()
    ) -> None:
        self.fd = fd  # None: not held
        self.path = path
        self._others = others  # the directory's shared lock, the earlier releases' lock

    @classmethod
    def take(cls, kind: str, url: URL, checkpoint: str) -> ServerLock:
        """Hold the server at ``url`` for this process, else raise LockHeld naming the
        receiver that holds it."""
        key = server_key(url)
        digest = hashlib.sha256(key.encode()).hexdigest()[:24]
        top = Path(tempfile.gettempdir())
        held: list[int] = []
        try:
            held.append(dfd := _lock_dir(top / DIR_NAME))
            path = top / DIR_NAME / f"server-{digest}.lock"
            for at, dir_fd in ((path, dfd), (top / f"asyncsync-server-{digest}.lock", None)):
                fd, writable = _open(at, dir_fd)
                held.append(fd)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise LockHeld(
                        f"{kind} at {url} is driven by another receiver on this host "
                        f"({_read_holder(fd)}; lock {at}): two receivers on one server reload "
                        "it against each other; stop that one, or give this one its own server"
                    ) from None
                if writable:  # who holds it, for the message of the next one (best effort)
                    me = {"pid": os.getpid(), "checkpoint": checkpoint, "server": key}
                    with contextlib.suppress(OSError):
                        os.ftruncate(fd, 0)
                        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        except BaseException:
            for fd in held:
                os.close(fd)
            raise
        return cls(held[1], path, (held[0], held[2]))

    @classmethod
    async def take_in_thread(cls, kind: str, url: URL, checkpoint: str) -> ServerLock:
        """:meth:`take` in a thread; a take that finishes after its caller was cancelled (or
        failed otherwise) is released there, not left held by a lock nobody has."""
        guard = threading.Lock()
        taken: list[ServerLock] = []
        abandoned: list[bool] = []  # (set by the caller, read by the thread, under guard)

        def take() -> ServerLock:
            lock = cls.take(kind, url, checkpoint)
            with guard:
                if abandoned:
                    lock.release()
                else:
                    taken.append(lock)
            return lock

        try:
            return await asyncio.to_thread(take)
        except BaseException:  # cancelled in the thread, or once it returned (the result lost)
            with guard:
                abandoned.append(True)
                for lock in taken:
                    lock.release()
            raise

    def release(self) -> None:
        """Let another receiver take the server (idempotent; the fd closed releases it)."""
        fd, self.fd = self.fd, None
        others, self._others = self._others, ()
        if fd is not None:
            os.close(fd)
        for other in others:
            os.close(other)


def _lock_dir(path: Path) -> int:
    """The lock files' directory, opened and held shared (``flock LOCK_SH``): made mode 1777
    where missing (every uid's receivers make their files there; none removes another's). A
    shared lock is refused only while another process holds it exclusively: systemd-tmpfiles,
    for as long as it cleans the directory (when no receiver holds it), so that is waited for;
    a directory it removed meanwhile (aged and empty) is opened again, made anew."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(3):
        try:
            dfd = os.open(path, flags)
        except FileNotFoundError:
            _make_dir(path, flags)
            continue
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise ConfigError(
                    f"{path} is not a directory (a symbolic link or a file): remove it"
                ) from exc
            if isinstance(exc, PermissionError):
                raise ConfigError(_unreadable(path, exc, "directory")) from exc
            raise
        deadline = time.monotonic() + LOCK_DIR_WAIT
        while True:
            try:
                fcntl.flock(dfd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(dfd)
                    raise ConfigError(
                        f"{path} is locked exclusively by another process for more than "
                        f"{LOCK_DIR_WAIT:g} s (a cleanup of the temporary directory would take "
                        "less): find it with `fuser` or `lsof` on that directory"
                    ) from None
                time.sleep(0.05)
            except OSError as exc:  # a filesystem without flock on directories: the lock
                logger.debug("no shared lock on %s: %s", path, exc)  # file's own still holds
                break
        if _still_at(dfd, path):
            return dfd
        os.close(dfd)  # removed (by the cleanup that held it) while this waited: anew
    raise ConfigError(f"cannot open {path}: it keeps appearing and vanishing")


def _still_at(fd: int, path: Path) -> bool:
    """Whether the directory open at ``fd`` is still the one at ``path`` (not removed, nor
    replaced, since it was opened)."""
    try:
        st, now = os.fstat(fd), os.lstat(path)
    except FileNotFoundError:
        return False
    return (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino) and st.st_nlink > 0


def _make_dir(path: Path, flags: int) -> None:
    """``path`` made mode 1777 (past the umask), unless another process made it first. Made
    under another name, set 1777, then moved into place: a mkdir at ``path`` would show
    another uid's receiver starting meanwhile a directory of the umask's mode, one it cannot
    make its lock file in (0755) or open (0700)."""
    made = path.with_name(f".{path.name}-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        os.mkdir(made, 0o700)
    except PermissionError as exc:
        raise ConfigError(
            f"cannot create {path} ({exc.strerror}): this receiver (uid {os.geteuid()}) cannot "
            f"write {path.parent}; set TMPDIR to a directory it can write"
        ) from exc
    moved: bool | None = False
    try:
        _chmod_1777(made, flags)
        moved = _rename_noreplace(made, path)  # False: another process made it first
    finally:
        if not moved:
            with contextlib.suppress(OSError):
                os.rmdir(made)
    if moved is not None:
        return
    try:  # (no renameat2 here: made in place, 1777 a moment later)
        os.mkdir(path, 0o1777)
    except FileExistsError:
        return
    with contextlib.suppress(OSError):  # gone or replaced meanwhile: the open after says
        _chmod_1777(path, flags)


def _chmod_1777(path: Path, flags: int) -> None:
    """The directory ``path`` set mode 1777, through a descriptor (no symlink followed)."""
    fd = os.open(path, flags)
    try:
        os.fchmod(fd, 0o1777)
    finally:
        os.close(fd)


def _rename_noreplace(src: Path | str, dst: Path | str, dir_fd: int | None = None) -> bool | None:
    """``src`` renamed ``dst`` (both in ``dir_fd`` where given) unless something is there
    (``renameat2`` RENAME_NOREPLACE): True, False where something is, None where the C
    library, kernel or filesystem cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return None
    d = _AT_FDCWD if dir_fd is None else dir_fd
    if renameat2(d, os.fsencode(src), d, os.fsencode(dst), _NOREPLACE) == 0:
        return True
    err = ctypes.get_errno()
    if err == errno.EEXIST:
        return False
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return None
    raise OSError(err, os.strerror(err), str(dst))


def _open(path: Path, dir_fd: int | None = None) -> tuple[int, bool]:
    """The lock file's fd (``dir_fd``: the directory ``path``'s name is opened in), and
    whether it is writable. Created 0666 (another uid's receiver writes its own pid there); a
    file of another uid that is not writable is locked read-only (flock needs no write
    access); a symlink there is refused (a shared temporary directory)."""
    flags = os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK  # (a FIFO's open waits: refused)
    at = path if dir_fd is None else path.name
    for _ in range(3):
        try:
            try:
                return _regular(os.open(at, flags | os.O_RDWR, dir_fd=dir_fd), path), True
            except PermissionError:
                return _regular(os.open(at, flags | os.O_RDONLY, dir_fd=dir_fd), path), False
        except FileNotFoundError:
            pass
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise ConfigError(f"{path} is a symbolic link: remove it") from exc
            if exc.errno == errno.EISDIR:
                raise ConfigError(f"{path} is a directory, not a lock file: remove it") from exc
            if isinstance(exc, PermissionError):  # not even readable (flock needs no more)
                raise ConfigError(_unreadable(path, exc)) from exc
            raise
        made = f".{path.name}-{os.getpid()}-{secrets.token_hex(4)}"
        made = made if dir_fd is not None else str(path.parent / made)
        for name in (made, at):  # made 0666 under another name, moved into place: another
            try:  # uid's receiver never sees it 0600 (umask 077), which it could not open
                fd = os.open(name, flags | os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666, dir_fd=dir_fd)
            except PermissionError as exc:  # a directory of another uid, not writable
                raise ConfigError(
                    _unreadable(path.parent, exc, "directory", "create the lock file in")
                ) from exc
            with contextlib.suppress(OSError):
                os.fchmod(fd, 0o666)  # (past the umask)
            if name == at:  # (no renameat2 here: made in place, 0666 a moment later)
                return fd, True
            try:
                moved = _rename_noreplace(made, at, dir_fd)
            except BaseException:
                os.close(fd)
                os.unlink(made, dir_fd=dir_fd)
                raise
            if moved:
                return fd, True
            os.close(fd)
            os.unlink(made, dir_fd=dir_fd)
            if moved is False:
                break  # another receiver made it meanwhile: opened as its
    raise ConfigError(f"cannot open the lock file {path}: it keeps appearing and vanishing")


def _regular(fd: int, path: Path) -> int:
    """``fd``, a regular file's with no other link, else closed and a ConfigError (a FIFO, a
    device, a hard link to another file, which the holder's pid would be written over: any
    uid can make one in the directory, the lock file's name known from the server's
    address)."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
        os.close(fd)
        what = "is not a regular file (a FIFO, a device...)"
        raise ConfigError(
            f"{path} {f'has {st.st_nlink} links' if stat.S_ISREG(st.st_mode) else what}: remove it"
        )
    return fd


def _unreadable(path: Path, exc: OSError, what: str = "file", verb: str = "open") -> str:
    """Why the lock ``what`` (file or directory) at ``path`` cannot be used, and the fix."""
    try:
        st = os.lstat(path)
        owner = f"it belongs to uid {st.st_uid} (mode {stat.S_IMODE(st.st_mode):04o})"
    except OSError as why:
        owner = f"its owner cannot be read ({why.strerror})"
    mode = "0666" if what == "file" else "1777"
    return (
        f"cannot {verb} the lock {what} {path} ({exc.strerror}): {owner}, this receiver runs "
        f"as uid {os.geteuid()}; remove it (the next receiver makes it anew, mode {mode}) or "
        f"let every receiver's uid {'read' if what == 'file' else 'write'} it"
    )


def _read_holder(fd: int) -> str:
    try:
        d = json.loads(os.pread(fd, 4096, 0))
        return f"pid {int(d['pid'])}, checkpoint {str(d['checkpoint'])[:300]}"
    except (OSError, ValueError, KeyError, TypeError):
        return "its pid not recorded"
