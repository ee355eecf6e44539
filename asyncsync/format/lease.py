"""Engine-id leases: ``ROOT/leases/<engine_id>.json``, one live receiver per engine id.

Acks are keyed by engine id, so two receivers that share an id (a copied config, a second
pod) would overwrite each other's ack and retention would protect neither. A receiver
therefore holds its id's *lease* while it runs (FORMAT.md section 7.1). The algorithm needs no
``link()``, no ``rename`` that refuses to replace and no ``O_EXCL`` that excludes across hosts:
object-store filesystems (rclone, gcsfuse, s3fs) have none of them. It needs only that a file
written through one mount shows in every mount's listing within a bound, the *settle* time:

* **claim**: a taker writes ``leases/<engine_id>.<owner>.claim`` (its record), waits ``settle``
  seconds, then lists the claims of the id. Another live claim means a concurrent taker (or
  the holder): it withdraws its claim, backs off a random time and tries again (when all the
  rivals it sees have greater owners it first waits one more settle for them to withdraw). Of
  two claims written at any times, the later taker's listing shows the earlier one (it waited
  at least the filesystem's visibility delay), so no two takers both see themselves alone;
* **install**: the taker that saw no rival writes the lease ``<engine_id>.json``: exclusively
  (``link``) where the filesystem has ``link`` and the name is free, replacing a stale one
  otherwise. It keeps its claim while it holds the id;
* **heartbeat** (:meth:`EngineLease.renew`, every ``ttl / 3`` s): rewrite the claim and the
  lease after checking that the lease still names this holder;
* a record (lease or claim) is **dead** when its taker has *seen it unchanged for its ttl*,
  on the taker's own monotonic clock (:mod:`asyncsync.format.liveness`), or when it was written
  by a process of this kernel boot and this pid namespace that is gone (same ``boot_id`` and
  ``pid_ns``; a pid equal to ours with another process ``nonce`` is a previous life, e.g. a
  restarted container's pid 1). It is **live** once the taker sees it change (a heartbeat).
  Never by its mtime's age: on object-store mounts (rclone, s3fs, gcsfuse) the mtime is the
  writer's clock, so a taker whose clock ran more than the ttl ahead took live leases. A taker
  that finds a lease of another holder therefore watches it, up to its ttl, before it either
  refuses (it changed) or takes it (it did not);
* a lease or claim file that cannot be read is watched the same way, for the taker's own ttl
  (the file cannot say its own);
* **release** removes the lease if it still names this holder, and the claim.

Blocking functions: async callers use ``asyncio.to_thread``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import random
import re
import secrets
import socket
import time
from pathlib import Path

from asyncsync.errors import ConfigError, LockHeld
from asyncsync.format.lease_file import (
    CLAIM_SUFFIX,
    DEFAULT_LEASE_TTL,
    LeaseRecord,
    UnreadableLease,
    _read_lease_file,
    claim_path,
    inspect_lease,
    lease_path,
    read_lease,
    replace_record,
    unreadable_leases,
)
from asyncsync.format.liveness import ChangeWatch, LeftTemps
from asyncsync.format.mounts import NETWORK_SETTLE, default_settle, filesystem_type
from asyncsync.format.names import ACKS_DIR, check_engine_id
from asyncsync.fsio import TMP_PREFIX, atomic_write, make_dir, remove, scan

__all__ = [
    "DEFAULT_LEASE_TTL",
    "NETWORK_SETTLE",
    "EngineLease",
    "LeaseRecord",
    "UnreadableLease",
    "claim_path",
    "default_settle",
    "filesystem_type",
    "inspect_lease",
    "lease_path",
    "read_lease",
    "replace_record",
    "unreadable_leases",
]

logger = logging.getLogger(__name__)

_HELD: set[str] = set()  # owners of the leases this process holds or is taking
_NONCE = secrets.token_hex(8)  # this process; a forked child draws its own


def _after_fork() -> None:
    global _NONCE
    _NONCE = secrets.token_hex(8)
    _HELD.clear()  # a child holds none of its parent's leases


os.register_at_fork(after_in_child=_after_fork)


def _read_proc(path: str, link: bool = False) -> str:
    try:
        return (os.readlink(path) if link else Path(path).read_text()).strip()[:64]
    except OSError:
        return ""


def _boot_id() -> str:
    return _read_proc("/proc/sys/kernel/random/boot_id")


def _pid_ns() -> str:
    return _read_proc("/proc/self/ns/pid", link=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # OverflowError: no pid_t is that large
        return False
    except PermissionError:
        return True
    return True


class EngineLease:
    """The lease of one engine id, held by one agent (see the module docstring).

    ``settle``: seconds a taker waits between writing its claim and reading the others'; at
    least the time a file written through another host's mount takes to show in this one's
    listing. None: :func:`default_settle` of the root's filesystem.

    Example::

        lease = EngineLease(root, "node3-gpu0")
        lease.acquire()          # LockHeld naming the holder when another receiver runs
        ...                      # lease.renew() at least every ttl / 3 seconds
        lease.release()
    """

    def __init__(
        self,
        root: Path,
        engine_id: str,
        *,
        ttl: float = DEFAULT_LEASE_TTL,
        settle: float | None = None,
    ):
        if ttl <= 0:
            raise ValueError(f"lease ttl must be > 0, got {ttl}")
        if settle is not None and not 0 <= settle * 4 <= ttl:
            raise ConfigError(
                f"lease settle {settle:g}s must be between 0 and a quarter of the lease ttl "
                f"({ttl:g}s): a claim must stay fresh while its taker settles"
            )
        self.root = Path(root)
        self.engine_id = check_engine_id(engine_id)
        self.path = lease_path(self.root, engine_id)
        self.ttl = ttl
        self.settle = settle
        self.owner = secrets.token_hex(8)
        self.claim = claim_path(self.root, engine_id, self.owner)
        self.held = False
        self._acquired_at = 0.0
        self._watch = ChangeWatch()  # the leases and claims this taker saw, and since when
        self._temps: list[LeftTemps] = []  # left temps of this id seen at the take, not decided
        self._poll = min(1.0, max(0.02, ttl / 20))  # between two looks at a watched lease

    def __repr__(self) -> str:
        return f"<EngineLease {self.engine_id} owner={self.owner} held={self.held}>"

    def _record(self) -> LeaseRecord:
        now = time.time()
        return LeaseRecord(
            self.engine_id, self.owner, socket.gethostname(), os.getpid(), self.ttl,
            self._acquired_at or now, now, _boot_id(), _pid_ns(), _NONCE,
        )  # fmt: skip

    def _by_pid(self, rec: LeaseRecord) -> bool | None:
        """Whether the record's holder is gone (True) or live (False) by its pid, where the pid
        names the same process for us (same kernel boot and pid namespace); None: it tells
        nothing (another host, boot or namespace; a live pid perhaps reused)."""
        if rec.boot_id and rec.pid_ns and (rec.boot_id, rec.pid_ns) == (_boot_id(), _pid_ns()):
            if rec.pid == os.getpid():
                if rec.nonce != _NONCE:
                    return True  # a previous life with our pid (a restarted container's pid 1)
                return rec.owner not in _HELD  # this process: live if one of its leases has it
            if not _pid_alive(rec.pid):
                return True  # the holder is gone (kill -9): free at once
        return None

    def judge(self, path: Path, found: tuple[LeaseRecord, float] | UnreadableLease | None) -> str:
        """What this taker knows of a lease or claim read from ``path`` (FORMAT.md 7.1):
        ``"free"`` (none, ours, its holder gone by its pid, or seen unchanged for its ttl),
        ``"live"`` (seen renewed, or a holder of this process) or ``"watching"`` (seen
        unchanged for less than its ttl so far). Never by its mtime's age: on object-store
        mounts that is the writer's clock (:mod:`asyncsync.format.liveness`)."""
        key = str(path)
        if found is None:
            self._watch.forget(key)
            return "free"
        if isinstance(found, UnreadableLease):  # honoured for our ttl after its last change
            look, ttl = self._watch.look(key, found.ident), self.ttl
        else:
            rec = found[0]
            if rec.owner == self.owner:
                return "free"
            gone = self._by_pid(rec)
            if gone is not None:
                return "free" if gone else "live"
            look, ttl = self._watch.look(key, rec), rec.ttl  # every write changes heartbeat_at
        if look.still > ttl:
            return "free"
        return "live" if look.renewed else "watching"

    def _in_use(self, found: tuple[LeaseRecord, float] | UnreadableLease) -> str:
        """Why a lease seen live keeps this taker out."""
        if isinstance(found, UnreadableLease):
            return (
                f"engine id {self.engine_id!r}: the lease file {self.path} is unreadable "
                f"({found.reason}) and changed while this receiver watched it: a live "
                "receiver's lease being written? Retry, or remove it if no receiver of this "
                "id runs"
            )
        return (
            f"engine id {self.engine_id!r} is in use by the receiver on {found[0].describe()}, "
            "which renews its lease (a lease is taken once a taker sees it unchanged for its "
            f"ttl, {found[0].ttl:g}s): give this receiver another --engine-id, or stop that one"
        )

    def _undecided(self, found: tuple[LeaseRecord, float] | UnreadableLease, waited: float) -> str:
        """Why a taker gives up watching a lease that neither changed nor stayed unchanged for
        its ttl (a ttl longer than this taker's patience): it is taken at a later try."""
        if isinstance(found, UnreadableLease):
            what, ttl = f"the unreadable lease file {self.path} ({found.reason})", self.ttl
        else:
            what, ttl = f"the lease of the receiver on {found[0].describe()}", found[0].ttl
        return (
            f"engine id {self.engine_id!r}: {what} did not change in the {waited:.0f}s this "
            f"receiver watched it; it is taken once seen unchanged for {ttl:g}s: retry, or "
            "remove it if no receiver of this id runs"
        )

    def _await_lease(self, patience: float) -> tuple[LeaseRecord, float] | UnreadableLease | None:
        """Read the lease until it is free (returned: None, ours or dead); LockHeld as soon as
        it is seen live, or after ``patience`` seconds of watching it undecided."""
        start = time.monotonic()
        while True:
            found = _read_lease_file(self.path, self.root)
            verdict = self.judge(self.path, found)
            if verdict == "free":
                return found
            assert found is not None
            if verdict == "live":
                raise LockHeld(self._in_use(found))
            waited = time.monotonic() - start
            if waited > patience:
                raise LockHeld(self._undecided(found, waited))
            time.sleep(self._poll)

    def settle_seconds(self) -> float:
        if self.settle is None:
            self.settle = min(default_settle(self.path.parent), self.ttl / 4)
            if self.settle:
                logger.info(
                    "engine id %s: %s is on a %s filesystem: the lease is taken after a %gs "
                    "settle (--lease-settle)", self.engine_id, self.path.parent,
                    filesystem_type(self.path.parent) or "unknown", self.settle,
                )  # fmt: skip
        return self.settle

    def acquire(self, *, patience: float | None = None) -> None:
        """Take the lease, or raise LockHeld naming the live holder (or the unreadable file).
        Blocks while it watches a lease or claim of another holder for a renewal: up to
        ``patience`` seconds for the lease (default: the ttl and a few settles). What it saw
        is kept: a caller that tries again later (a lost id's retake, ``patience=0``) takes a
        dead lease once it has been seen unchanged for its ttl across the tries."""
        make_dir(self.path.parent, root=self.root, exist_ok=True)
        settle = self.settle_seconds()
        self._acquired_at = time.time()
        _HELD.add(self.owner)  # our claim is live to the other leases of this process
        try:
            self._take(settle, self.ttl + 4 * settle + 1 if patience is None else patience)
        except BaseException:
            if not self.held:  # refused, or interrupted while taking: leave no claim behind
                _HELD.discard(self.owner)
                self._withdraw()
            raise

    def _take(self, settle: float, patience: float) -> None:
        deadline = None
        while True:
            self._await_lease(patience)
            if deadline is None:  # a silent rival claim is seen unchanged for its ttl by then
                deadline = time.monotonic() + self.ttl + 6 * settle + 2
            atomic_write(self.claim, self._record().to_json(), root=self.root)
            time.sleep(settle)
            rivals = self._rival_claims()
            if rivals and all(owner > self.owner for owner in rivals):
                # rivals with greater owners yield to ours: give them a settle to withdraw
                time.sleep(settle + 0.01)
                rivals = self._rival_claims()
            if not rivals:
                try:
                    installed = self._install()
                except BaseException:
                    self._withdraw()
                    raise
                if installed:
                    self.held = True
                    with contextlib.suppress(OSError):  # housekeeping: never fails a take
                        self._remove_stale_claims()
                    logger.debug("engine id %s: lease taken (%s)", self.engine_id, self.path)
                    return
            self._withdraw()
            if rivals and time.monotonic() > deadline:
                raise LockHeld(self._contended(rivals))
            time.sleep(random.uniform(2 * settle, 3 * settle) + random.uniform(0.005, 0.05))

    def _claims(self) -> list[Path]:
        """The claim files of this engine id, by listing ``leases/`` (names only)."""
        prefix = f"{self.engine_id}."
        try:
            names = [name for name, _ in scan(self.path.parent, root=self.root)]
        except FileNotFoundError:
            return []
        out = []
        for name in names:
            if name.startswith(prefix) and name.endswith(CLAIM_SUFFIX):
                owner = name[len(prefix) : -len(CLAIM_SUFFIX)]
                if "." not in owner:  # "<id>.<x>.<owner>.claim" is another id's claim
                    out.append(self.path.parent / name)
        return out

    def _rival_claims(self) -> dict[str, LeaseRecord | UnreadableLease]:
        """The claims of other takers not known dead (seen live, or watched for less than
        their ttl so far), by owner ("" for an unreadable one)."""
        out: dict[str, LeaseRecord | UnreadableLease] = {}
        for path in self._claims():
            if path == self.claim:
                continue
            found = _read_lease_file(path, self.root)
            if found is None or self.judge(path, found) == "free":
                continue
            if isinstance(found, UnreadableLease):
                out[""] = found  # sorts first: we yield to it
            else:
                out[found[0].owner] = found[0]
        return out

    def _contended(self, rivals: dict[str, LeaseRecord | UnreadableLease]) -> str:
        """Why a taker gives up on rival claims that neither went nor stayed unchanged for
        their ttl within its deadline: the first one."""
        rival = rivals[min(rivals)]
        return (
            f"engine id {self.engine_id!r}: another receiver is taking it at the same time "
            f"({rival.describe()}); give this receiver another --engine-id, or stop that one"
        )

    def _withdraw(self) -> None:
        with contextlib.suppress(OSError):
            remove(self.claim, root=self.root)

    def _remove_stale_claims(self) -> None:
        """Claims left by takers that died (kill -9 while holding or taking): removed; and the
        temp files of this id's lease, claims and ack (and clock probes) that a writer killed
        before its rename left: listed now, each removed at a heartbeat once seen unchanged for
        the ttl (:class:`LeftTemps`: never by its mtime, the writer's clock on object stores)."""
        for path in self._claims():
            found = _read_lease_file(path, self.root)
            if path != self.claim and found is not None and self.judge(path, found) == "free":
                with contextlib.suppress(OSError):
                    remove(path, root=self.root)
        eid, x = re.escape(self.engine_id), r"\.[0-9a-f]{12}"  # .tmp.<name>.<12 hex>
        own = rf"(?:\.tmp\.)?{eid}\.json{x}(?:{x})?|{eid}\.[0-9a-f]{{16}}\.claim{x}|clock{x}"
        acks = re.compile(rf"\.tmp\.{eid}\.json{x}").fullmatch  # an ack being written
        self._temps = [
            LeftTemps(
                self.root, self.path.parent, re.compile(rf"\.tmp\.(?:{own})").fullmatch, self.ttl
            ),
            LeftTemps(self.root, self.root / ACKS_DIR, acks, self.ttl),
        ]
        self._sweep()

    def _sweep(self) -> None:
        """One look at the left temps not decided yet (see :meth:`_remove_stale_claims`)."""
        for temps in self._temps:
            with contextlib.suppress(OSError):  # housekeeping: never fails a take or heartbeat
                temps.sweep()
        self._temps = [t for t in self._temps if t.pending]

    def _free_lease(self) -> tuple[LeaseRecord, float] | UnreadableLease | bool | None:
        """The lease read again before it is written: returned when free; LockHeld when seen
        live; False while undecided (one that appeared or changed since it was watched)."""
        found = _read_lease_file(self.path, self.root)
        verdict = self.judge(self.path, found)
        if verdict == "live":
            assert found is not None
            raise LockHeld(self._in_use(found))
        return found if verdict == "free" else False

    def _install(self) -> bool:
        """Write the lease of the claim that saw no rival: exclusively where the name is free
        and the filesystem has ``link``, else replacing it (a dead lease, or no ``link``).
        False when a lease appeared or changed meanwhile: it is watched at the next round."""
        found = self._free_lease()
        if found is False:
            return False
        data = self._record().to_json()
        if found is None:
            if self._create(data):
                return True
            # Created meanwhile although our claim saw no rival: a filesystem whose listing
            # lags the settle (NFS attribute caches). The exclusive create kept one holder.
            found = self._free_lease()
            if found is None or found is False:
                return False  # (not readable yet, or new: watched at the next round)
        assert found is not True
        if not isinstance(found, UnreadableLease) and found[0].owner == self.owner:
            replace_record(self.path, data, self.root)
            return True
        what = found.describe() if isinstance(found, UnreadableLease) else found[0].describe()
        logger.warning("engine id %s: taking over the dead lease of %s", self.engine_id, what)
        replace_record(self.path, data, self.root)
        return True

    def _create(self, data: bytes) -> bool:
        """Create the lease where none is: False when another was created first."""
        tmp = self.path.with_name(f"{TMP_PREFIX}{self.path.name}.{secrets.token_hex(6)}")
        atomic_write(tmp, data, root=self.root, sync_dir=False)
        try:
            os.link(tmp, self.path)
            return True
        except FileExistsError:
            with contextlib.suppress(OSError):
                return os.stat(tmp).st_nlink == 2  # the link was made, its reply was lost
            return False
        except OSError as exc:  # no link() here (rclone: EIO, gcsfuse: ENOSYS, s3fs: EPERM)
            logger.debug("engine id %s: link() failed (%s): rename", self.engine_id,
                         errno.errorcode.get(exc.errno or 0, exc))  # fmt: skip
            os.replace(tmp, self.path)  # the claims made this taker the only one
            return True
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)

    def forget(self) -> None:
        """No longer held, and nothing written or removed: the root it was held in is gone or
        is another directory now (:meth:`acquire` takes it again in the new one)."""
        self.held = False
        _HELD.discard(self.owner)

    def renew(self) -> None:
        """The heartbeat: rewrite claim and lease. LockHeld when another receiver's lease is
        there (lost: :meth:`acquire` takes the id again once it sees that lease dead); a lease
        that is missing, or names another owner gone by its pid, is taken again at once."""
        found = _read_lease_file(self.path, self.root)
        if found is None:  # removed from outside: take it again
            self.held = False
            _HELD.discard(self.owner)
            self.acquire()
            return
        if isinstance(found, UnreadableLease):  # damaged from outside: ours, rewritten
            logger.warning("engine id %s: rewriting the unreadable lease %s (%s)",
                           self.engine_id, self.path, found.reason)  # fmt: skip
        elif found[0].owner != self.owner and self._by_pid(found[0]):
            # another owner's lease whose holder is gone (e.g. a root restored with its leases/):
            # nobody holds the id, so it is taken again as at the start, not given up for good
            logger.warning("engine id %s: the lease names %s, which is gone: taking it again",
                           self.engine_id, found[0].describe())  # fmt: skip
            self.held = False
            _HELD.discard(self.owner)
            self.acquire()
            return
        elif found[0].owner != self.owner:
            self.held = False
            _HELD.discard(self.owner)
            self._withdraw()
            raise LockHeld(
                f"engine id {self.engine_id!r}: the lease was taken over by "
                f"{found[0].describe()} (this receiver's heartbeat was late by more than the "
                "lease ttl, or the lease file was replaced from outside)"
            )
        data = self._record().to_json()
        replace_record(self.claim, data, self.root)
        replace_record(self.path, data, self.root)
        self._sweep()

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        _HELD.discard(self.owner)
        found = read_lease(self.root, self.engine_id)
        if found is not None and found[0].owner == self.owner:
            remove(self.path, root=self.root)
        self._withdraw()
