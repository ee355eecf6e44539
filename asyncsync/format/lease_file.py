"""The lease and claim files of ``ROOT/leases/`` and their reading (FORMAT.md section 7.1):
:class:`LeaseRecord`, what an unreadable one is (:class:`UnreadableLease`), and the atomic
replacement every record of the root (lease, claim, ack) is written by. The protocol that
takes and holds a lease is :mod:`asyncsync.format.lease`."""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
from dataclasses import asdict, dataclass
from pathlib import Path

from asyncsync.errors import ManifestError
from asyncsync.format.fields import _float, _int, _str, load_json
from asyncsync.format.names import LEASES_DIR, check_engine_id
from asyncsync.fsio import (
    UnsafePath,
    atomic_write,
    lstat,
    open_dir,
    read_file,
    scan,
)

__all__ = [
    "CLAIM_SUFFIX",
    "DEFAULT_LEASE_TTL",
    "LEASE_FORMAT",
    "LEASE_FORMAT_VERSION",
    "LeaseRecord",
    "UnreadableLease",
    "claim_path",
    "inspect_lease",
    "lease_path",
    "read_lease",
    "replace_record",
    "unreadable_leases",
]

logger = logging.getLogger(__name__)

LEASE_FORMAT = "asyncsync-lease"
LEASE_FORMAT_VERSION = 2  # 2 added boot_id, pid_ns, nonce and the claims; 1 is still read
CLAIM_SUFFIX = ".claim"
DEFAULT_LEASE_TTL = 30.0


def lease_path(root: Path, engine_id: str) -> Path:
    return root / LEASES_DIR / f"{check_engine_id(engine_id)}.json"


def claim_path(root: Path, engine_id: str, owner: str) -> Path:
    return root / LEASES_DIR / f"{check_engine_id(engine_id)}.{owner}{CLAIM_SUFFIX}"


@dataclass(frozen=True)
class LeaseRecord:
    engine_id: str
    owner: str  # a random id of the holding agent instance
    host: str
    pid: int
    ttl: float
    acquired_at: float  # the holder's clock: for people only
    heartbeat_at: float  # the holder's clock: for people only; staleness uses the file's mtime
    boot_id: str = ""  # the holder's kernel boot (empty: unknown, e.g. a version 1 record)
    pid_ns: str = ""  # the holder's pid namespace, e.g. "pid:[4026531836]"
    nonce: str = ""  # random per holder process: tells a previous life with the same pid

    def to_json(self) -> bytes:
        d = {"format": LEASE_FORMAT, "format_version": LEASE_FORMAT_VERSION, **asdict(self)}
        return (json.dumps(d) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> LeaseRecord:
        d = load_json(data, where)
        if d.get("format") != LEASE_FORMAT:
            raise ManifestError(f"{where}: not an asyncsync lease")
        opt = {k: _str(d, k, where, 64) for k in ("boot_id", "pid_ns", "nonce") if k in d}
        return cls(
            engine_id=check_engine_id(d.get("engine_id")),
            owner=_str(d, "owner", where, 64),
            host=_str(d, "host", where, 256),
            pid=_int(d, "pid", where),
            ttl=_float(d, "ttl", where),
            acquired_at=_float(d, "acquired_at", where),
            heartbeat_at=_float(d, "heartbeat_at", where),
            **opt,
        )

    def describe(self) -> str:
        return f"host {self.host} pid {self.pid} (owner {self.owner})"


@dataclass(frozen=True)
class UnreadableLease:
    """A lease file that exists but cannot be read as a lease (FORMAT.md section 7.1)."""

    path: Path
    mtime: float
    reason: str
    ident: tuple[int, int]  # (st_ino, st_mtime_ns)

    def describe(self) -> str:
        return f"the unreadable file {self.path} ({self.reason})"


def _read_lease_file(path: Path, root: Path) -> tuple[LeaseRecord, float] | UnreadableLease | None:
    # through asyncsync.fsio (FORMAT.md 11.1): a symlinked leases/, or a lease that is a
    # symlink or a FIFO, is an unreadable lease, never followed nor blocked on
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
    except (OSError, ValueError, ManifestError) as exc:  # (a FIFO's size is 0 too: named)
        empty = st.st_size == 0 and stat.S_ISREG(st.st_mode)
        reason = "empty file" if empty else str(exc) or type(exc).__name__
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


def replace_record(path: Path, data: bytes, root: Path) -> None:
    """:func:`atomic_write` of a lease, claim or ack; a directory at its name (never one, FORMAT.md
    11.1) is removed first when empty, else named (UnsafePath, EISDIR), never emptied."""
    try:
        atomic_write(path, data, root=root)
        return
    except IsADirectoryError:
        pass
    fd = open_dir(path.parent, root=root)
    try:
        os.rmdir(path.name, dir_fd=fd)
    except OSError as exc:
        raise UnsafePath(
            errno.EISDIR, f"{path} is a directory where a file belongs and cannot be removed "
            f"({exc.strerror}): remove it if you did not put it there",
        ) from exc  # fmt: skip
    finally:
        os.close(fd)
    logger.warning("removed the empty directory %s where a file belongs", path)
    atomic_write(path, data, root=root)
