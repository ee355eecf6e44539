"""Engine-id leases: ``ROOT/leases/<engine_id>.json``, one live receiver per engine id.

Acks are keyed by engine id, so two receivers that share an id (a copied config, a second
pod) would overwrite each other's ack and retention would protect neither. A receiver
therefore holds its id's *lease* while it runs (FORMAT.md section 7.1):

* **take** it by writing a temp file and ``link``-ing it to the lease name: ``link`` fails
  when the name exists, on every host, because it is an exact-path operation (it does not
  depend on a cached listing, and is the classic NFS lock-file primitive). A lost reply is
  detected by the temp file's link count;
* **renew** it (the heartbeat) by replacing the file atomically every ``ttl / 3`` seconds,
  after checking that it still names this holder;
* a lease is **stale** when its file's mtime is older than its ``ttl`` on the *filesystem's*
  clock (:func:`asyncsync.fsio.fs_now`: the hosts' clocks are never compared), or when it
  names this host and a process that is gone (a receiver restarted after ``kill -9`` takes its
  id back at once). A stale lease is taken over by ``rename``-ing it aside first: only one
  contender's rename of that exact path succeeds, and the winner checks that what it moved is
  the stale record it judged before it creates its own;
* a lease file that cannot be read (empty, truncated, garbage, another format: outside damage,
  or a filesystem that showed the name before its data) is judged like a holder that stopped
  heartbeating: it is refused with :class:`~asyncsync.errors.LockHeld` naming the file while
  its mtime is younger than this receiver's own ``ttl`` (the file cannot say its own), and taken
  over the same way once older; the winner checks that what it moved is that same file;
* **release** removes the file if it still names this holder.

Blocking functions: async callers use ``asyncio.to_thread``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from asyncsync.errors import LockHeld, ManifestError
from asyncsync.format.fields import _float, _int, _load_json, _str
from asyncsync.format.names import LEASES_DIR, check_engine_id
from asyncsync.fsio import (
    TMP_PREFIX,
    atomic_write,
    fs_now,
    lstat,
    make_dir,
    read_file,
    remove,
    scan,
)

__all__ = [
    "DEFAULT_LEASE_TTL",
    "EngineLease",
    "LeaseRecord",
    "UnreadableLease",
    "inspect_lease",
    "lease_path",
    "read_lease",
    "unreadable_leases",
]

logger = logging.getLogger(__name__)

LEASE_FORMAT = "asyncsync-lease"
DEFAULT_LEASE_TTL = 30.0
_HELD: set[str] = set()  # owners of the leases this process holds


def lease_path(root: Path, engine_id: str) -> Path:
    return root / LEASES_DIR / f"{check_engine_id(engine_id)}.json"


@dataclass(frozen=True)
class LeaseRecord:
    engine_id: str
    owner: str  # a random id of the holding agent instance
    host: str
    pid: int
    ttl: float
    acquired_at: float  # the holder's clock: for people only
    heartbeat_at: float  # the holder's clock: for people only; staleness uses the file's mtime

    def to_json(self) -> bytes:
        d = {"format": LEASE_FORMAT, "format_version": 1, **asdict(self)}
        return (json.dumps(d) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> LeaseRecord:
        d = _load_json(data, where)
        if d.get("format") != LEASE_FORMAT:
            raise ManifestError(f"{where}: not an asyncsync lease")
        return cls(
            engine_id=check_engine_id(d.get("engine_id")),
            owner=_str(d, "owner", where, 64),
            host=_str(d, "host", where, 256),
            pid=_int(d, "pid", where),
            ttl=_float(d, "ttl", where),
            acquired_at=_float(d, "acquired_at", where),
            heartbeat_at=_float(d, "heartbeat_at", where),
        )

    def describe(self) -> str:
        return f"host {self.host} pid {self.pid} (owner {self.owner})"


@dataclass(frozen=True)
class UnreadableLease:
    """A lease file that exists but cannot be read as a lease (FORMAT.md section 7.1)."""

    path: Path
    mtime: float
    reason: str
    ident: tuple[int, int]  # (st_ino, st_mtime_ns): the takeover moves this very file only


def _read_lease_file(path: Path, root: Path) -> tuple[LeaseRecord, float] | UnreadableLease | None:
    # read through asyncsync.fsio: a symlinked leases/ or a lease that is a FIFO or a symlink
    # is an unreadable lease, never followed nor blocked on (FORMAT.md section 1)
    try:
        st = lstat(path, root=root)
    except OSError as exc:  # leases/ is not a directory
        return UnreadableLease(path, 0.0, str(exc), (0, 0))
    if st is None:
        return None
    ident = (st.st_ino, st.st_mtime_ns)
    try:
        rec = LeaseRecord.from_json(read_file(path, limit=64 << 10, root=root)[0], str(path))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, ManifestError) as exc:
        reason = "empty file" if st.st_size == 0 else str(exc) or type(exc).__name__
        return UnreadableLease(path, st.st_mtime, reason, ident)
    return rec, st.st_mtime


def inspect_lease(root: Path, engine_id: str) -> tuple[LeaseRecord, float] | UnreadableLease | None:
    """The lease of ``engine_id`` and its file's mtime, an :class:`UnreadableLease`, or None."""
    return _read_lease_file(lease_path(root, engine_id), root)


def read_lease(root: Path, engine_id: str) -> tuple[LeaseRecord, float] | None:
    """The lease of ``engine_id`` and its file's mtime, or None (no lease, or unreadable)."""
    found = inspect_lease(root, engine_id)
    if isinstance(found, UnreadableLease):
        logger.warning("unreadable lease %s: %s", found.path, found.reason)
        return None
    return found


def unreadable_leases(root: Path) -> dict[str, UnreadableLease]:
    """The lease files in ``ROOT/leases/`` that cannot be read, by engine id (for status)."""
    try:
        names = sorted(name for name, _ in scan(root / LEASES_DIR, root=root))
    except OSError:  # none, or leases/ is not a directory
        return {}
    out = {}
    for name in names:
        if name.startswith(".") or not name.endswith(".json"):
            continue
        try:
            engine_id = check_engine_id(name[: -len(".json")])
        except ValueError:
            continue
        found = _read_lease_file(root / LEASES_DIR / name, root)
        if isinstance(found, UnreadableLease):
            out[engine_id] = found
    return out


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class EngineLease:
    """The lease of one engine id, held by one agent (see the module docstring).

    Example::

        lease = EngineLease(root, "node3-gpu0")
        lease.acquire()          # LockHeld naming the holder when another receiver runs
        ...                      # lease.renew() at least every ttl / 3 seconds
        lease.release()
    """

    def __init__(self, root: Path, engine_id: str, *, ttl: float = DEFAULT_LEASE_TTL):
        if ttl <= 0:
            raise ValueError(f"lease ttl must be > 0, got {ttl}")
        self.root = Path(root)
        self.engine_id = check_engine_id(engine_id)
        self.path = lease_path(self.root, engine_id)
        self.ttl = ttl
        self.owner = secrets.token_hex(8)
        self.held = False
        self._acquired_at = 0.0

    def __repr__(self) -> str:
        return f"<EngineLease {self.engine_id} owner={self.owner} held={self.held}>"

    def _record(self) -> LeaseRecord:
        now = time.time()
        return LeaseRecord(
            self.engine_id, self.owner, socket.gethostname(), os.getpid(), self.ttl,
            self._acquired_at or now, now,
        )  # fmt: skip

    def stale(self, rec: LeaseRecord, mtime: float) -> bool:
        if rec.host == socket.gethostname():
            if rec.pid == os.getpid():  # this process: live if one of its leases holds it
                return rec.owner not in _HELD  # else a previous life (a container's pid 1)
            if not _pid_alive(rec.pid):
                return True  # this host's holder is gone (kill -9): free at once
        return fs_now(self.path.parent, root=self.root) - mtime > rec.ttl

    def acquire(self) -> None:
        """Take the lease, or raise LockHeld naming the live holder (or the unreadable file)."""
        make_dir(self.path.parent, root=self.root, exist_ok=True)
        self._acquired_at = time.time()
        for _ in range(8):
            if self._create():
                self.held = True
                _HELD.add(self.owner)
                logger.debug("engine id %s: lease taken (%s)", self.engine_id, self.path)
                return
            found = _read_lease_file(self.path, self.root)
            if found is None:
                continue  # released meanwhile: try again
            if isinstance(found, UnreadableLease):
                self._take_over_unreadable(found)
                continue
            rec, mtime = found
            if rec.owner == self.owner:
                self.held = True
                _HELD.add(self.owner)
                return
            if not self.stale(rec, mtime):
                age = fs_now(self.path.parent, root=self.root) - mtime
                raise LockHeld(
                    f"engine id {self.engine_id!r} is in use by the receiver on {rec.describe()}, "
                    f"last heartbeat {max(age, 0.0):.0f}s ago (a lease goes stale after "
                    f"{rec.ttl:g}s): give this receiver another --engine-id, or stop that one"
                )
            logger.warning(
                "engine id %s: taking over the stale lease of %s", self.engine_id, rec.describe()
            )
            self._remove_stale(rec)
        raise LockHeld(f"engine id {self.engine_id!r}: could not take {self.path} (contended)")

    def _take_over_unreadable(self, bad: UnreadableLease) -> None:
        """Move an unreadable lease aside once its mtime is older than this lease's ttl.

        The file cannot say its holder nor its ttl, so it is honoured as a live holder's lease
        for ``self.ttl`` after its last write (a holder rewrites it at its next heartbeat).
        """
        age = fs_now(self.path.parent, root=self.root) - bad.mtime
        if age <= self.ttl:
            raise LockHeld(
                f"engine id {self.engine_id!r}: the lease file {self.path} is unreadable "
                f"({bad.reason}), last written {max(age, 0.0):.0f}s ago; it is honoured as a "
                f"live receiver's lease until it is {self.ttl:g}s old, then taken over: retry "
                f"in {self.ttl - age:.0f}s, or remove it if no receiver of this id runs"
            )
        logger.warning(
            "engine id %s: taking over the unreadable lease %s (%s, %.0fs old)",
            self.engine_id, self.path, bad.reason, age,
        )  # fmt: skip
        self._remove_stale(bad)

    def _create(self) -> bool:
        tmp = self.path.with_name(f"{TMP_PREFIX}{self.path.name}.{secrets.token_hex(6)}")
        atomic_write(tmp, self._record().to_json(), root=self.root, sync_dir=False)
        try:
            os.link(tmp, self.path)
            return True
        except FileExistsError:
            with contextlib.suppress(OSError):
                return os.stat(tmp).st_nlink == 2  # the link was made, its reply was lost
            return False
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)

    def _remove_stale(self, judged: LeaseRecord | UnreadableLease) -> None:
        """Move the lease judged stale aside and remove it; put back anything else moved."""
        aside = self.path.with_name(f"{TMP_PREFIX}stale.{self.path.name}.{secrets.token_hex(6)}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return  # another contender moved it first
        moved = _read_lease_file(aside, self.root)
        if isinstance(judged, UnreadableLease):
            # the very file judged: same inode, not written since (else a lease taken meanwhile)
            same = isinstance(moved, UnreadableLease) and moved.ident == judged.ident
        else:
            same = not isinstance(moved, tuple) or moved[0].owner == judged.owner
        if not same:
            # we moved a lease taken after we judged the old one stale: put it back
            with contextlib.suppress(OSError):
                os.link(aside, self.path)
        with contextlib.suppress(OSError):
            os.unlink(aside)

    def renew(self) -> None:
        """The heartbeat: rewrite the lease. Raises LockHeld when another receiver took it."""
        found = _read_lease_file(self.path, self.root)
        if found is None:  # removed from outside: take it again
            self.held = False
            self.acquire()
            return
        if isinstance(found, UnreadableLease):  # damaged from outside: ours until it went stale
            logger.warning("engine id %s: rewriting the unreadable lease %s (%s)",
                           self.engine_id, self.path, found.reason)  # fmt: skip
            atomic_write(self.path, self._record().to_json(), root=self.root)
            return
        rec, _ = found
        if rec.owner != self.owner:
            self.held = False
            _HELD.discard(self.owner)
            raise LockHeld(
                f"engine id {self.engine_id!r}: the lease was taken over by {rec.describe()} "
                "(this receiver's heartbeat was late by more than the lease ttl)"
            )
        atomic_write(self.path, self._record().to_json(), root=self.root)

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        _HELD.discard(self.owner)
        found = read_lease(self.root, self.engine_id)
        if found is not None and found[0].owner == self.owner:
            remove(self.path, root=self.root)
