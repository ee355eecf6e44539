"""Acknowledgements: each receiver writes ``ROOT/acks/<engine_id>.json`` after its engine holds a
version; the trainer reads them to wait for engines (:func:`wait_acked`).

The record (:class:`AckRecord`) and the reading and writing of the files live together here:
:func:`wait_acked` is a read loop over the same files and holds no trainer state, so it is part
of the protocol both sides share, not of the publisher.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import socket
import time
from collections.abc import Container, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from asyncsync.errors import (
    MIN_SHORT_POLL_SECONDS,
    AckTimeout,
    ConfigError,
    ManifestError,
    check_poll_interval,
    check_seconds,
    shown,
)
from asyncsync.format.fields import _float, _hex, _int, _str, load_json
from asyncsync.format.lease import read_lease, replace_record
from asyncsync.format.names import (
    ACKS_DIR,
    FORMAT_NAME,
    FORMAT_VERSION,
    MAX_VERSION,
    READ_FORMAT_VERSIONS,
    ack_path,
    check_engine_id,
)
from asyncsync.format.notices import NoticeCap
from asyncsync.fsio import (
    UnsafePath,
    fs_now,
    is_temp_name,
    make_dir,
    open_dir,
    read_file,
    scan,
)

__all__ = [
    "AckAge",
    "AckRecord",
    "ack_ages",
    "read_ack",
    "read_acks",
    "root_clock",
    "root_now",
    "wait_acked",
    "write_ack",
]

logger = logging.getLogger(__name__)
_MAX_ACK_BYTES = 64 << 10
_SAY_AGAIN_AFTER = 600.0  # seconds before the same complaint about the same ack is said again
_said: dict[tuple[str, str], float] = {}  # (path, complaint) -> when it was last said


# complaints said at WARNING: the first 20 of a minute (a steady stream of junk ack files is
# a line a minute then, not one per file); the rest at DEBUG, counted in one line
_capped = NoticeCap(
    lambda message: logger.warning("%s", message),
    lambda more: f"and {more} more complaints about ack files in the last minute (DEBUG: each)",
)


def _say_once(path: Path, complaint: str) -> None:
    """A WARNING about an ack file, said once (again after ``_SAY_AGAIN_AFTER`` s, or with
    another complaint), DEBUG otherwise: the acks are read at every poll (``wait_acked`` every
    20-100 ms, ``asyncsync tail -f``), and one bad file must not fill the reader's log; nor
    must many (at most 20 such WARNINGs a minute, :data:`_capped`)."""
    key, now = (str(path), complaint), time.monotonic()
    if now - _said.get(key, -math.inf) < _SAY_AGAIN_AFTER:
        logger.debug("%s (said before)", complaint)
        return
    if len(_said) >= 4096:  # bounded: files come and go
        _said.clear()
    _said[key] = now
    if not _capped(complaint):
        logger.debug("%s", complaint)


@dataclass(frozen=True)
class AckRecord:
    """What an engine holds: written by its receiver only after the engine holds ``version``."""

    engine_id: str
    version: int
    fingerprint: str
    run_id: str
    applied_at: float
    host: str = ""
    format_version: int = FORMAT_VERSION
    #: versions the receiver found damaged or unusable and went past (FORMAT.md section 8)
    bad_versions: tuple[int, ...] = ()
    #: the ack file's mtime on the shared filesystem's clock (set by read_acks; not written)
    mtime: float | None = field(default=None, compare=False)

    def to_json(self) -> str:
        d = {"format": FORMAT_NAME, **asdict(self)}
        del d["mtime"]
        if not self.bad_versions:
            del d["bad_versions"]
        else:
            d["bad_versions"] = list(self.bad_versions)
        return json.dumps(d, allow_nan=False) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, *, where: str = "ack") -> AckRecord:
        d = load_json(text, where)
        if d.get("format") != FORMAT_NAME:
            raise ManifestError(f"{where}: not an asyncsync ack record")
        fv = _int(d, "format_version", where)
        if fv not in READ_FORMAT_VERSIONS:
            raise ManifestError(f"{where}: unsupported format_version {fv}")
        return cls(
            engine_id=check_engine_id(d.get("engine_id")),
            version=_int(d, "version", where, hi=MAX_VERSION),
            fingerprint=_hex(d, "fingerprint", where),
            run_id=_str(d, "run_id", where, 128),
            applied_at=_float(d, "applied_at", where),
            host=_str(d, "host", where, 256) if "host" in d else "",
            format_version=fv,
            bad_versions=_bad_versions(d, where),
        )


def _bad_versions(d: dict[str, object], where: str) -> tuple[int, ...]:
    raw = d.get("bad_versions", [])
    if not isinstance(raw, list) or len(raw) > 1024:
        raise ManifestError(f"{where}: bad_versions must be a list of versions")
    out = []
    for v in raw:
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_VERSION:
            raise ManifestError(f"{where}: bad_versions holds {v!r}, not a version")
        out.append(v)
    return tuple(out)


def write_ack(
    root: Path,
    engine_id: str,
    version: int,
    fingerprint: str,
    run_id: str,
    bad_versions: tuple[int, ...] = (),
) -> AckRecord:
    rec = AckRecord(
        engine_id=check_engine_id(engine_id),
        version=version,
        fingerprint=fingerprint,
        run_id=run_id,
        applied_at=time.time(),
        host=socket.gethostname(),
        bad_versions=tuple(bad_versions),
    )
    make_dir(root / ACKS_DIR, root=root, exist_ok=True)
    replace_record(ack_path(root, engine_id), rec.to_json().encode(), root)
    return rec


def _read(root: Path, path: Path) -> AckRecord:
    """One ack file, opened safely (:func:`asyncsync.fsio.read_file`: never a symlink, a FIFO
    or more than 64 KiB) and parsed, with its mtime."""
    try:
        data, st = read_file(path, limit=_MAX_ACK_BYTES, root=root)
    except ValueError as exc:  # larger than the limit
        raise ManifestError(str(exc)) from exc
    return replace(AckRecord.from_json(data, where=f"ack {path.name}"), mtime=st.st_mtime)


def read_ack(root: Path, engine_id: str) -> AckRecord | None:
    """The ack of one engine (None when there is none). Raises ManifestError or OSError when
    it exists but cannot be read (:class:`asyncsync.fsio.UnsafePath`: a symlink, a FIFO)."""
    path = ack_path(root, engine_id)
    try:
        rec = _read(root, path)
    except FileNotFoundError:
        return None
    if rec.engine_id != engine_id:
        raise ManifestError(f"{path}: names engine {rec.engine_id!r}")
    return rec


def read_acks(
    root: Path, unreadable: dict[Path, str] | None = None, *, skip: Container[str] = ()
) -> dict[str, AckRecord]:
    """Every readable ack record in the root, by engine id; malformed ones are logged, skipped,
    and put in ``unreadable`` (path -> why), when given, as is ``acks/`` when it cannot be
    listed (``asyncsync status`` names them; retention deletes nothing for them). The files
    of the engines in ``skip`` are not read (a wait has seen them already)."""
    out: dict[str, AckRecord] = {}
    skipped: dict[Path, str] = {} if unreadable is None else unreadable
    d = root / ACKS_DIR
    try:
        names = [name for name, _ in scan(d, root=root)]
    except FileNotFoundError:
        return out
    except OSError as exc:
        return _unlistable(d, exc, skipped)
    for name in names:
        if is_temp_name(name) or not name.endswith(".json") or name[:-5] in skip:
            continue
        if (rec := _read_named(root, d, name, skipped)) is not None:
            out[rec.engine_id] = rec
    _capped.done()
    return out


def _read_named(root: Path, d: Path, name: str, skipped: dict[Path, str]) -> AckRecord | None:
    """The record in ``d/name`` as :func:`read_acks` takes it. None where it is gone; where it
    is not a regular file (quietly: it is polled), unreadable or malformed, or names another
    engine (said once), None with the reason put in ``skipped``."""
    try:
        rec = _read(root, d / name)
    except FileNotFoundError:
        return None
    except UnsafePath as exc:  # not a regular file: skipped as before, quietly (polled)
        logger.debug("ignoring %s: %s", d / name, exc)
        skipped[d / name] = str(exc)
        return None
    except (OSError, ManifestError) as exc:
        _say_once(d / name, f"ignoring unreadable ack {d / name}: {exc}")
        skipped[d / name] = str(exc)
        return None
    if f"{rec.engine_id}.json" != name:
        _say_once(d / name, f"ignoring ack {d / name}: it names engine {rec.engine_id!r}")
        skipped[d / name] = f"it names engine {rec.engine_id!r}"
        return None
    return rec


def _unlistable(d: Path, exc: OSError, skipped: dict[Path, str]) -> dict[str, AckRecord]:
    """``acks/`` is a file or a symlink (a damaged root, not a crash): said once, none read."""
    _say_once(d, f"cannot list acks in {d}: {exc}")
    skipped[d] = str(exc)
    _capped.done()
    return {}


def _read_engines(root: Path, engines: Iterable[str]) -> dict[str, AckRecord]:
    """The acks of ``engines`` only, each read as :func:`read_acks` reads it: one file an
    engine, no listing of ``acks/`` (which holds every engine's: at 1,000 of them a read of
    all cost ~85 ms of CPU, and as many opens on a network filesystem); ``acks/`` itself
    opened once, so that one which is a file or a symlink is said as :func:`read_acks` says it."""
    d = root / ACKS_DIR
    try:
        os.close(open_dir(d, root=root))
    except FileNotFoundError:
        return {}
    except OSError as exc:
        return _unlistable(d, exc, {})
    out: dict[str, AckRecord] = {}
    for e in engines:
        if (rec := _read_named(root, d, f"{e}.json", {})) is not None:
            out[e] = rec
    _capped.done()
    return out


def root_clock(root: Path) -> tuple[float, str | None]:
    """Now on the clock of the root's filesystem (the mtime of a probe file, see
    :func:`asyncsync.fsio.fs_now`) and None; where this process cannot make the probe (a
    read-only mount, an operator without write access: FORMAT.md 7), now on this host's clock
    and a sentence saying so, for the caller to show."""
    try:
        return fs_now(root, root=root), None
    except OSError as exc:
        why = exc.strerror or str(exc)
        return time.time(), (
            f"cannot make the clock probe in {root} ({why}: a read-only root, or no write "
            "access): ages are measured on this host's clock, not the file server's"
        )


def root_now(root: Path) -> float:
    """:func:`root_clock` without the sentence."""
    return root_clock(root)[0]


@dataclass(frozen=True)
class AckAge:
    """How long ago an engine was last heard of, on one clock (the root's filesystem).

    ``age``: seconds since the later of its ack's write and its lease's last heartbeat (file
    mtimes, so no receiver's clock is trusted); ``skew``: the receiver's clock minus the
    filesystem's when it wrote the ack (``applied_at - mtime``; large means a wrong clock);
    ``ahead``: how far that ack or heartbeat is dated in the future of the filesystem's clock
    (a clock stepped back on the file server, a hand-set mtime), 0 when it is not: ``age`` is
    then 0, so an engine that went quiet never looks stale: retention asks the lease of one
    dated more than ``ack_ttl`` ahead, as of one that old.
    """

    age: float
    skew: float
    ahead: float = 0.0


def ack_ages(root: Path, acks: dict[str, AckRecord], now: float | None = None) -> dict[str, AckAge]:
    """:class:`AckAge` of each ack (read by :func:`read_acks`, which records the mtimes)."""
    now = root_now(root) if now is None else now
    out = {}
    for engine_id, ack in acks.items():
        seen = ack.mtime if ack.mtime is not None else ack.applied_at
        lease = read_lease(root, engine_id)
        if lease is not None:
            seen = max(seen, lease[1])
        skew = 0.0 if ack.mtime is None else ack.applied_at - ack.mtime
        out[engine_id] = AckAge(age=max(0.0, now - seen), skew=skew, ahead=max(0.0, seen - now))
    return out


def _check_wait(version: object, engines: object, quorum: object, timeout: object) -> None:
    """ConfigError for arguments :func:`wait_acked` cannot wait on (a string for ``engines``
    was waited on character by character: with no timeout, forever)."""
    if (engines is None) == (quorum is None):
        raise ConfigError("wait_acked needs exactly one of engines=[...] or quorum=N")
    if engines is not None and (
        isinstance(engines, str | bytes) or not isinstance(engines, Iterable)
    ):
        raise ConfigError(f"wait_acked: engines must be a list of engine ids, got {engines!r}")
    if engines is not None and not engines:
        raise ConfigError("wait_acked: engines=[] names no engine")
    if quorum is not None and not (_whole(quorum) and quorum >= 1):  # type: ignore[operator]
        raise ConfigError(f"wait_acked: quorum must be an int >= 1, got {shown(quorum)}")
    if not _whole(version):
        raise ConfigError(f"wait_acked: version must be an int, got {version!r}")
    check_seconds("wait_acked: timeout", timeout, optional=True, forever=True)


def _whole(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _held(ack: AckRecord | None, run_id: str | None) -> str:
    """What an engine behind holds, for AckTimeout: an ack of another run (a receiver left from
    an earlier run of the publisher, or reading another root) says so; its version, higher than
    the one waited for, read as 'behind' (helper-43e)."""
    if ack is None:
        return "no ack"
    if run_id is not None and ack.run_id != run_id:
        return f"{ack.version} of another run ({ack.run_id}; this root is on run {run_id})"
    return str(ack.version)


async def wait_acked(
    root: Path,
    version: int,
    *,
    engines: Sequence[str] | None = None,
    quorum: int | None = None,
    timeout: float | None = None,
    run_id: str | None = None,
    poll_interval: float = 0.02,
    max_poll_interval: float = 0.1,
) -> dict[str, AckRecord]:
    """Wait until the named ``engines`` (all of them) or any ``quorum`` engines hold ``version``.

    An engine holds it when its ack names ``version`` or a later one (of ``run_id`` when given).
    Returns the acks that satisfied the wait. An engine seen holding the version is not read
    again (it did pick it up): with ``engines`` each poll reads the files of those of them not
    yet seen holding it, and nothing else; for a quorum it lists ``acks/`` and reads the files
    of the engines not yet seen holding it. On timeout raises :class:`AckTimeout` naming the
    engines that are behind and the versions they hold.
    """
    _check_wait(version, engines, quorum, timeout)
    for name, value in (("poll_interval", poll_interval), ("max_poll_interval", max_poll_interval)):
        check_poll_interval(f"wait_acked: {name}", value, minimum=MIN_SHORT_POLL_SECONDS)
    if engines is not None:
        try:
            engines = [check_engine_id(e) for e in engines]
        except ManifestError as exc:  # the caller's argument, not a record of the root
            raise ConfigError(f"wait_acked: {exc}") from None
    deadline = None if timeout is None else time.monotonic() + timeout
    delay = poll_interval
    ok: dict[str, AckRecord] = {}
    while True:
        if engines is not None:  # only theirs, and only those not seen holding it yet
            todo = [e for e in dict.fromkeys(engines) if e not in ok]
            acks = await asyncio.to_thread(_read_engines, root, todo)
        else:  # every engine's but those seen holding it
            acks = await asyncio.to_thread(read_acks, root, skip=frozenset(ok))
        ok.update(
            (e, a)
            for e, a in acks.items()
            if a.version >= version and (run_id is None or a.run_id == run_id)
        )
        if engines is not None:
            if all(e in ok for e in engines):
                return {e: ok[e] for e in engines}
        elif quorum is not None and len(ok) >= quorum:
            return ok
        if deadline is not None and time.monotonic() >= deadline:
            watched = engines if engines is not None else sorted(acks)
            behind = {e: (acks[e].version if e in acks else None) for e in watched if e not in ok}
            desc = ", ".join(f"{e} at {_held(acks.get(e), run_id)}" for e in behind)
            need = f"engines {list(engines)}" if engines is not None else f"a quorum of {quorum}"
            desc = desc or ("no other engine has acked" if ok else "no engine has acked yet")
            raise AckTimeout(
                f"version {version} not acknowledged by {need} within {timeout}s; "
                f"{len(ok)} acked, behind: {desc}. "
                "Are the receivers running and do they see this root? (asyncsync tail ROOT -f)",
                version=version,
                behind=behind,
            )
        await asyncio.sleep(
            delay if deadline is None else min(delay, max(0.0, deadline - time.monotonic()))
        )
        delay = min(delay * 1.5, max_poll_interval)
