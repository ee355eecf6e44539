"""What a receiver tells the root about its engine: the engine-id lease and the ack.

:class:`RootPresence` holds the lease of the agent's engine id (one live receiver per id,
``asyncsync.format.lease``), and keeps ``acks/<engine_id>.json`` equal to what the engine holds:

* :meth:`~RootPresence.ack` after each version the engine committed;
* :meth:`~RootPresence.reconcile` when the engine lost what it held (an ack must never name
  more than the engine holds);
* :meth:`~RootPresence.ensure` at the end of every sync: an ack deleted or changed from outside
  (an operator, a crash between the engine's commit and the ack) is written again, with the
  versions the receiver found bad.

Blocking file work runs in threads; the class itself is driven by the agent's one sync at a time.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import stat
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path

from asyncsync import fsio
from asyncsync.errors import ConfigError, LockHeld, ManifestError
from asyncsync.format import ACKS_DIR, ack_path
from asyncsync.format.acks import AckRecord, read_ack, write_ack
from asyncsync.format.lease import DEFAULT_LEASE_TTL, EngineLease
from asyncsync.format.names import LEASES_DIR
from asyncsync.format.store import not_a_root
from asyncsync.pipeline import LoopLock, finish_thread
from receiver.engines.base import Engine

__all__ = ["RootPresence", "check_root_for_receiver", "not_writable"]

logger = logging.getLogger(__name__)


def check_root_for_receiver(root: Path) -> bool:
    """True when ``root`` is an asyncsync root this receiver can write its ack and lease in;
    False when it does not exist yet or is still empty (the publisher has not opened it).

    Raises ConfigError for a directory that is something else (another engine's checkpoint,
    a typo): nothing is created in it. And for a root whose ``acks/`` or ``leases/`` this
    receiver cannot write (another uid than the publisher), saying how to fix it.
    """
    if not root.is_dir():
        return False
    foreign = not_a_root(root)
    if foreign == []:
        return False  # waiting for the publisher
    if foreign is not None:
        raise ConfigError(
            f"{root} is not an asyncsync root (no asyncsync.json file, no committed version; it "
            f"holds {', '.join(foreign[:5])}{', ...' if len(foreign) > 5 else ''}): pass the "
            "directory given to Publisher(...) as --root (`asyncsync inspect ROOT` tells)"
        )
    for d in (root / ACKS_DIR, root / LEASES_DIR):
        st = fsio.lstat(d, root=root)  # a symlink there is not followed (FORMAT.md 11.1)
        target = d if st is not None and stat.S_ISDIR(st.st_mode) else root
        if not os.access(target, os.W_OK | os.X_OK):
            code = None  # root passes every mode bit: refused all the same, the cause is other
            if not os.getuid() and _overrides_modes():
                ro = os.statvfs(target).f_flag & os.ST_RDONLY
                code = errno.EROFS if ro else errno.EPERM
            raise ConfigError(not_writable(root, str(target), code))
    return True


def _overrides_modes() -> bool:
    """Whether this process (uid 0) passes mode bits: it holds CAP_DAC_OVERRIDE. A root
    without it (a container whose capabilities were dropped) is refused by the modes like any
    uid, so it is told to make the directories writable, not to look for an attribute."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            caps = next((ln.split()[1] for ln in f if ln.startswith("CapEff:")), None)
        return caps is None or bool(int(caps, 16) & (1 << 1))  # bit 1: CAP_DAC_OVERRIDE
    except (OSError, ValueError, IndexError):
        return True  # no /proc: as before


def not_writable(root: Path, path: str, code: int | None = None) -> str:
    """What to do when this receiver cannot write ``path`` in the root (``code``: the errno)."""
    if code == errno.EPERM and (sticky := _sticky_owner(path)):
        return (
            f"this receiver (uid {os.getuid()}) may not replace or remove {path}: {sticky}, and "
            "in a sticky directory only a file's owner (or root) may. Remove it as that uid "
            f"once, or let the publisher's user make {Path(path).parent} group-writable and not "
            f"sticky: `asyncsync prepare {root} --group GROUP` (mode 2775)"
        )
    if code in (errno.EPERM, errno.EROFS):  # not the mode bits (EACCES)
        why = (
            "its filesystem is mounted read-only" if code == errno.EROFS else "an immutable or "
            f"append-only attribute (`lsattr -d {path or root}`), or a security module's policy"
        )  # fmt: skip
        return (
            f"writing {path or root} is refused whatever its mode ({errno.errorcode[code]}): "
            f"{why}; a receiver writes its ack and its lease there"
        )
    try:
        st = os.stat(path or root)
        owner = f" (owner uid {st.st_uid} gid {st.st_gid}, mode {stat.S_IMODE(st.st_mode):04o})"
    except OSError:
        owner = ""
    gids = sorted({os.getgid(), *os.getgroups()})
    return (
        f"this receiver (uid {os.getuid()}, gids {','.join(map(str, gids))}) cannot write "
        f"{path or root}{owner}: a receiver writes its ack in {root / ACKS_DIR}/ and its lease in "
        f"{root / LEASES_DIR}/. Make both writable for the receivers' group once, as the "
        f"publisher's user: `asyncsync prepare {root} --group GROUP` (docs/INTEGRATION.md, "
        '"Receivers under another uid"), or run the receiver as the publisher\'s uid'
    )


def _sticky_owner(path: str) -> str:
    """Why a sticky directory keeps this uid from removing ``path`` ("": it does not)."""
    try:
        st, up = os.lstat(path), os.stat(Path(path).parent)
    except (OSError, ValueError):
        return ""
    if not up.st_mode & stat.S_ISVTX or st.st_uid == os.getuid() or up.st_uid == os.getuid():
        return ""
    mode = stat.S_IMODE(up.st_mode)
    return f"it belongs to uid {st.st_uid} and its directory is sticky (mode {mode:04o})"


class RootPresence:
    """The lease and the ack of one engine in one root (see the module docstring)."""

    def __init__(
        self,
        root: Path,
        engine_id: str,
        engine: Engine,
        *,
        lease_ttl: float = DEFAULT_LEASE_TTL,
        lease_settle: float | None = None,
    ):
        self.root = root
        self.engine_id = engine_id
        self.engine = engine
        self.lease = EngineLease(root, engine_id, ttl=lease_ttl, settle=lease_settle)
        self.acked: tuple[str, int] | None = None  # (run_id, version) of our last ack
        self.lost: str | None = None  # why the lease was lost, if it was
        # the ack file as we last wrote or read it, and what it said
        self._written: tuple[tuple[int, int, int], tuple[object, ...]] | None = None
        self._renewed = 0.0
        self._retried = 0.0  # when the lost lease was last tried again
        # held by a renew, and by an ack from its check to its write: an ack waits for a renew
        # in flight (it may find the id lost) instead of writing meanwhile
        self._renewal = LoopLock()  # (not an asyncio.Lock: the presence outlives a loop)

    # -- the lease -------------------------------------------------------------------------
    async def hold(self) -> None:
        """Take the lease (once the root exists), renew it when a third of its ttl passed.

        Raises LockHeld when another live receiver holds the engine id, or took it over.
        """
        if self.lost is not None:
            await self._retake()
        if not self.lease.held:
            if not await asyncio.to_thread(check_root_for_receiver, self.root):
                return  # waiting for the publisher: nothing can be acked there yet
            try:  # to its end if cancelled: a take the caller no longer awaited stayed held
                await finish_thread(self.lease.acquire)
            except PermissionError as exc:
                raise ConfigError(not_writable(self.root, exc.filename or "", exc.errno)) from exc
            self._renewed = time.monotonic()
            return
        if time.monotonic() - self._renewed >= self.lease.ttl / 3:
            await self.renew()

    async def _retake(self) -> None:
        """The lease was lost: take the id again, by the take's steps, once no live receiver
        holds it (the other holder stopped, or its lease was restored from a backup and is seen
        unchanged for its ttl); LockHeld until then. Tried at most once a third of the ttl."""
        assert self.lost is not None
        now = time.monotonic()
        if now - self._retried < self.lease.ttl / 3:
            raise LockHeld(self.lost)
        self._retried = now
        try:  # one look at the other lease per try: its watch goes on across the tries
            await finish_thread(partial(self.lease.acquire, patience=0.0))
        except LockHeld:
            raise LockHeld(self.lost) from None
        logger.warning("agent %s: engine id %r taken again: no live receiver holds it now",
                       self.engine_id, self.engine_id)  # fmt: skip
        self.lost = None
        self._renewed = time.monotonic()

    async def renew(self) -> None:
        async with self._renewal:
            await self._renew()

    async def _renew(self) -> None:
        if not self.lease.held:
            return
        # the root may have gone, or be another directory now (made again, a mount on it, a
        # directory that is no root): nothing is written in it before it is a root again (the
        # lease is then taken again by hold); ConfigError for one that is something else
        if not await asyncio.to_thread(check_root_for_receiver, self.root):
            self.lease.forget()
            return
        try:
            await asyncio.to_thread(self.lease.renew)
        except LockHeld as exc:
            if self.lost is None:  # the heartbeat and a sync may both find it: said once, here
                self.lost = str(exc)
                self._retried = time.monotonic()
                logger.error("agent %s: %s; no syncs until no live receiver holds it",
                             self.engine_id, exc)  # fmt: skip
            raise
        self._renewed = time.monotonic()

    async def release(self) -> None:
        await finish_thread(self.lease.release)

    # -- the ack ---------------------------------------------------------------------------
    async def load(self) -> None:
        mine = await asyncio.to_thread(self._read)
        self.acked = (mine.run_id, mine.version) if mine else None

    def _read(self) -> AckRecord | None:
        try:
            return read_ack(self.root, self.engine_id)
        except (OSError, ManifestError) as exc:
            logger.warning("agent %s: unreadable ack (%s): it is rewritten", self.engine_id, exc)
            return None

    def _not_lost(self) -> None:
        """LockHeld once the id was lost: the ack is the other holder's now. A sync already under
        way when the heartbeat found the loss (a catch-up of many versions) must not go on
        writing it, nor rewrite or remove it (ensure, reconcile)."""
        if self.lost is not None:
            raise LockHeld(self.lost)

    async def ack(self, version: int, fingerprint: str, run_id: str, bad: Sequence[int]) -> None:
        async with self._renewal:  # a heartbeat's renew in flight ends first (and may find the
            self._not_lost()  # id lost: then nothing is written)
            # a heartbeat overdue (the process was paused, e.g. SIGSTOP, mid-apply past the
            # ttl): renew first, so that a receiver that took the id over is not overwritten
            if self.lease.held and time.monotonic() - self._renewed >= self.lease.ttl / 3:
                await self._renew()
            if self.engine.ackable().version != version:  # its server stopped serving it since
                logger.info("agent %s: v%d not acknowledged: the engine's server no longer "
                            "serves it", self.engine_id, version)  # fmt: skip
                return
            await self._write(version, fingerprint, run_id, bad)

    async def _write(self, version: int, fingerprint: str, run_id: str, bad: Sequence[int]) -> None:
        try:
            await asyncio.to_thread(
                write_ack, self.root, self.engine_id, version, fingerprint, run_id, tuple(bad)
            )
        except PermissionError as exc:  # a rename's: the ack it would replace (filename2)
            path = exc.filename2 or exc.filename or ""
            raise ConfigError(not_writable(self.root, path, exc.errno)) from exc
        except OSError as exc:  # e.g. ENOSPC from the write or fsync, which names no file
            if exc.filename is not None:
                raise
            path = ack_path(self.root, self.engine_id)
            raise OSError(exc.errno, f"{exc.strerror} (writing the ack)", str(path)) from exc
        self.acked = (run_id, version)
        ident = await asyncio.to_thread(self._ident)
        self._written = (
            None if ident is None else (ident, (version, fingerprint, run_id, tuple(bad)))
        )

    def _ident(self) -> tuple[int, int, int] | None:
        """(inode, size, mtime) of the ack file: an ack replaced or edited from outside changes
        it. Compared instead of reading the file at every sync: on rclone each open of a file
        whose upload is pending postpones the upload (the ack would never reach the root)."""
        try:  # lstat: a symlink there is another file than the ack written (never followed)
            st = fsio.lstat(ack_path(self.root, self.engine_id), root=self.root)
        except OSError:
            return None
        return None if st is None else (st.st_ino, st.st_size, st.st_mtime_ns)

    async def ensure(self, bad: Sequence[int]) -> bool:
        """Rewrite the ack if it does not say what the engine holds; True if it was written."""
        st = self.engine.ackable()
        if st.version is None or st.run_id is None or st.fingerprint is None:
            return False
        if not await asyncio.to_thread(self.root.is_dir):
            return False
        self._not_lost()
        want = (st.version, st.fingerprint, st.run_id, tuple(bad))
        ident = await asyncio.to_thread(self._ident)
        if ident is not None and (ident, want) == self._written:
            return False  # the file we wrote, untouched (a stat: the ack is not opened)
        on_disk = await asyncio.to_thread(self._read)
        if (
            on_disk is not None
            and (on_disk.version, on_disk.fingerprint, on_disk.run_id, on_disk.bad_versions) == want
        ):
            self.acked = (st.run_id, st.version)
            self._written = (ident, want) if ident is not None else None
            return False
        if on_disk is None and self.acked is not None:
            logger.warning("agent %s: its ack is gone: writing it again", self.engine_id)
        await self.ack(st.version, st.fingerprint, st.run_id, bad)
        return True

    async def reconcile(self, bad: Sequence[int]) -> None:
        """Make our ack name no more than the engine holds (``Engine.ackable``).

        An engine can lose what it held: a full apply that fails or is killed while its files
        are moved into place leaves none (LocalCheckpoint removes the mixed files), a
        restarted in-memory engine starts empty, and a server engine's server may stop serving
        it (restarted, stopped). An ack written before would then claim a version the engine
        does not hold; it is rewritten to what the engine holds, or removed. Decided and done
        under the lock an ack is written under: the engine's idle check and ``/readyz`` call
        it while a sync may be acking a version the server just confirmed.
        """
        if self.acked is None:
            return
        async with self._renewal:
            self._not_lost()
            state = self.engine.ackable()
            if self.acked is None:
                return
            run_id, version = self.acked
            if state.version is not None and state.run_id == run_id and state.version >= version:
                return
            if state.version is not None and state.run_id and state.fingerprint:
                logger.warning("agent %s: ack names v%d, the engine holds v%d: rewriting the "
                               "ack", self.engine_id, version, state.version)  # fmt: skip
                await self._write(state.version, state.fingerprint, state.run_id, bad)
                return
            logger.warning("agent %s: ack names v%d, the engine holds nothing (or its server "
                           "does not serve it): removing the ack",
                           self.engine_id, version)  # fmt: skip
            path = ack_path(self.root, self.engine_id)
            try:
                await asyncio.to_thread(partial(fsio.remove, path, root=self.root))  # not followed
            except PermissionError as exc:
                raise ConfigError(not_writable(self.root, exc.filename or "", exc.errno)) from exc
            self.acked = self._written = None
