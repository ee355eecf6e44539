"""One receiver per inference server on a host: a lock file named after the server's address.

Two receivers that drive the same server (the same ``--sglang-url``: a copy-pasted unit file,
a second receiver started by hand beside the supervisor's) reloaded it against each other:
each one's reload made the other read a label it does not hold, mark the server lost and
reload its own checkpoint, every second or two, for as long as both ran, the server pausing
at each. The second one to open the server is refused now, with one line naming the receiver
that holds it.

The lock is ``flock`` on ``<tempdir>/asyncsync-server-<hash>.lock`` (``$TMPDIR``, else
``/tmp``), held while the engine is open: the kernel releases it when its process dies,
SIGKILL included, so a replacement starts at once after the holder is gone. The file holds
the holder's pid and checkpoint (read for the message only). It binds the receivers of one
host (and one temporary directory) only: the names ``localhost``, ``127.0.0.1`` and ``::1``
are one server; another name of the same server (its host's address, a DNS alias), or a
receiver on another host, is not seen.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import hashlib
import json
import os
import stat
import tempfile
import threading
from pathlib import Path

from yarl import URL

from asyncsync.errors import ConfigError, LockHeld

__all__ = ["ServerLock", "server_key"]

_LOOPBACK = {"localhost", "127.0.0.1", "::1", "ip6-localhost"}


def server_key(url: URL) -> str:
    """The server's address as the lock names it: scheme, host (loopback names as one), port
    and path, lowercased."""
    host = (url.host or "").lower().rstrip(".")
    host = "loopback" if host in _LOOPBACK or host.startswith("127.") else host
    return f"{url.scheme}://{host}:{url.port}{url.path.rstrip('/')}".lower()


class ServerLock:
    """This process's hold on one server (:meth:`take`; :meth:`release` when closed)."""

    def __init__(self, fd: int | None = None, path: Path | None = None) -> None:
        self.fd = fd  # None: not held
        self.path = path

    @classmethod
    def take(cls, kind: str, url: URL, checkpoint: str) -> ServerLock:
        """Hold the server at ``url`` for this process, else raise LockHeld naming the
        receiver that holds it."""
        key = server_key(url)
        digest = hashlib.sha256(key.encode()).hexdigest()[:24]
        path = Path(tempfile.gettempdir()) / f"asyncsync-server-{digest}.lock"
        fd, writable = _open(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise LockHeld(
                f"{kind} at {url} is driven by another receiver on this host ({holder}; lock "
                f"{path}): two receivers on one server reload it against each other; stop that "
                "one, or give this one its own server"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        if writable:  # who holds it, for the message of the next one (best effort)
            me = {"pid": os.getpid(), "checkpoint": checkpoint, "server": key}
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
                os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        return cls(fd, path)

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
        if fd is not None:
            os.close(fd)


def _open(path: Path) -> tuple[int, bool]:
    """The lock file's fd, and whether it is writable. Created 0666 (another uid's receiver
    writes its own pid there); a file of another uid that is not writable is locked read-only
    (flock needs no write access); a symlink there is refused (a shared temporary directory)."""
    flags = os.O_CLOEXEC | os.O_NOFOLLOW
    for _ in range(3):
        try:
            try:
                return os.open(path, flags | os.O_RDWR), True
            except PermissionError:
                return os.open(path, flags | os.O_RDONLY), False
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
        try:
            fd = os.open(path, flags | os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            continue  # another receiver made it meanwhile: opened as its
        with contextlib.suppress(OSError):
            os.fchmod(fd, 0o666)  # (past the umask)
        return fd, True
    raise ConfigError(f"cannot open the lock file {path}: it keeps appearing and vanishing")


def _unreadable(path: Path, exc: OSError) -> str:
    """Why the lock file at ``path`` cannot be opened, and the fix."""
    try:
        st = os.lstat(path)
        what = f"it belongs to uid {st.st_uid} (mode {stat.S_IMODE(st.st_mode):04o})"
    except OSError as why:
        what = f"its owner cannot be read ({why.strerror})"
    return (
        f"cannot open the lock file {path} ({exc.strerror}): {what}, this receiver runs as "
        f"uid {os.geteuid()}; remove it (the next receiver makes it anew, mode 0666) or let "
        "every receiver's uid read it"
    )


def _read_holder(fd: int) -> str:
    try:
        d = json.loads(os.pread(fd, 4096, 0))
        return f"pid {int(d['pid'])}, checkpoint {str(d['checkpoint'])[:300]}"
    except (OSError, ValueError, KeyError, TypeError):
        return "its pid not recorded"
