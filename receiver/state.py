"""Persisted state of an engine that lives on disk, and the lock that makes it single-owner.

An engine that survives its receiver process (a checkpoint directory, a module whose weights
are reloaded from disk) must remember which version it holds, and whether it was in the middle
of moving to another one when the process died. That record lives in a small *state directory*
(for a checkpoint: ``<checkpoint>/.asyncsync/``)::

    STATE_DIR/
      state.json     PersistedState as JSON, replaced atomically (fsio.atomic_write)
      state.json.spare  room made beforehand for a state a full disk refuses (StateStore.save)
      lock           flock held by the one agent that owns the engine (pid and host inside)
      journal/       engine-specific undo records of an in-flight delta (see the engine)
      staging/       engine-specific new files of an in-flight full apply (see the engine)
      redo/          engine-specific redo records held beside the files (see the engine)

``state.json`` is written *before* an engine modifies anything in place (``status:
"applying"`` with the target version) and again after the new version is durable (``status:
"clean"``), so the next ``open`` knows whether it must recover. The lock is an ``flock``: the
kernel drops it when the holder dies, so a crash never leaves it stuck, and a second agent on
the same engine fails fast with :class:`~asyncsync.errors.LockHeld` naming the holder.

The rules every engine enforces before it changes anything (a version's base, its tensor set,
a patch that fits) are :mod:`receiver.rules`.

Everything here blocks; async engines call it through ``asyncio.to_thread``.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import logging
import math
import os
import shutil
import stat
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from asyncsync import fsio
from asyncsync.errors import EngineStateError, LockHeld

__all__ = [
    "JOURNAL_DIR",
    "LOCK_NAME",
    "REDO_DIR",
    "STAGING_DIR",
    "STATE_DIR_NAME",
    "STATE_FORMAT",
    "STATE_FORMAT_VERSION",
    "STATE_NAME",
    "PersistedState",
    "StateStore",
    "check_writable",
    "unwritable",
]

logger = logging.getLogger(__name__)

STATE_DIR_NAME = ".asyncsync"
STATE_NAME = "state.json"
SPARE_STATE_NAME = "state.json.spare"
_SPARE_MIN = 64 << 10  # the spare's least size; it keeps ~1/4 more room than the state needs
LOCK_NAME = "lock"
JOURNAL_DIR = "journal"
STAGING_DIR = "staging"
REDO_DIR = "redo"
STATE_FORMAT = "asyncsync-engine-state"
STATE_FORMAT_VERSION = 1
#: the format version of a state whose delta in flight journals progressively (``progressive``)
STATE_FORMAT_VERSION_PROGRESSIVE = 2
#: the format version of a state that names redo records held beside the files (``redo``)
STATE_FORMAT_VERSION_REDO = 3
_FORMAT_VERSIONS = (
    STATE_FORMAT_VERSION,
    STATE_FORMAT_VERSION_PROGRESSIVE,
    STATE_FORMAT_VERSION_REDO,
)
_MAX_STATE_BYTES = 256 << 20  # per-tensor checksums of even huge models stay far below this

Status = Literal["clean", "applying"]
Mode = Literal["delta", "full"]


@dataclass(frozen=True)
class PersistedState:
    """What ``state.json`` records.

    ``version``/``run_id``/``fingerprint``/``checksums`` describe the version the engine fully
    holds (``version`` None: nothing yet). ``status`` is ``"applying"`` while the engine moves
    to ``target_version`` in ``mode``; a reader that finds it so after a crash must recover.
    ``checksums`` maps each tensor name to its checksum (``checksum_algorithm``) at ``version``;
    ``parts`` gives the ``(offset, numel)`` parts of the tensors published in parts, whose
    checksum is the composite of their parts' (docs/FORMAT.md). ``synced`` False: ``version``
    was committed while its bytes were still only in the page cache (an engine that makes a
    version durable after acknowledging it); a reader that finds it so after a crash must
    check the bytes against ``checksums`` before trusting ``version``. ``progressive`` True:
    the delta being applied journals its old values without making them durable first
    (:mod:`receiver.engines.checkpoint.journal`); a reader that finds it so after a crash
    undoes what the journal holds and then checks every tensor the same way. It is written
    with ``format_version`` 2, so a reader of version 1 refuses the file rather than trust it.

    ``redo`` (a checkpoint run with a redo log, :mod:`receiver.engines.checkpoint.redolog`):
    the (version, fingerprint) of each redo record held beside the files, oldest first, each
    a delta on the one before, the first on ``version`` (which stays the version the files
    hold, with its checksums). The engine holds the last one (:attr:`head_version`). Written
    with ``format_version`` 3: an older reader refuses it (it would take the files' version
    for the engine's and never apply the records).
    """

    version: int | None = None
    run_id: str | None = None
    fingerprint: str | None = None
    status: Status = "clean"
    target_version: int | None = None
    mode: Mode | None = None
    checksum_algorithm: str | None = None
    checksums: dict[str, str] = field(default_factory=dict)
    updated_at: float = 0.0
    parts: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    synced: bool = True
    progressive: bool = False
    redo: tuple[tuple[int, str | None], ...] = ()

    # -- views --------------------------------------------------------------------------
    @property
    def applying(self) -> bool:
        return self.status == "applying"

    @property
    def head_version(self) -> int | None:
        """The version the engine holds: the newest redo record's, else the files'."""
        return self.redo[-1][0] if self.redo else self.version

    @property
    def head_fingerprint(self) -> str | None:
        return self.redo[-1][1] if self.redo else self.fingerprint

    def begin(
        self, target_version: int, mode: Mode, *, progressive: bool = False
    ) -> PersistedState:
        """This state, marked as moving to ``target_version``."""
        return replace(
            self,
            status="applying",
            target_version=target_version,
            mode=mode,
            progressive=progressive,
        )

    def clean(self) -> PersistedState:
        """This state with any in-flight marker cleared (the held version is unchanged)."""
        return replace(self, status="clean", target_version=None, mode=None, progressive=False)

    # -- JSON ---------------------------------------------------------------------------
    def to_json(self) -> str:
        d: dict[str, Any] = {
            "format": STATE_FORMAT,
            "format_version": STATE_FORMAT_VERSION,
            "version": self.version,
            "run_id": self.run_id,
            "fingerprint": self.fingerprint,
            "status": self.status,
            "target_version": self.target_version,
            "mode": self.mode,
            "checksum_algorithm": self.checksum_algorithm,
            "checksums": self.checksums,
            "updated_at": self.updated_at,
        }
        if self.parts:
            d["parts"] = {k: [list(p) for p in v] for k, v in self.parts.items()}
        if not self.synced:
            d["synced"] = False
        if self.progressive:
            d["format_version"] = STATE_FORMAT_VERSION_PROGRESSIVE
            d["progressive"] = True
        if self.redo:
            d["format_version"] = STATE_FORMAT_VERSION_REDO
            d["redo"] = [{"version": v, "fingerprint": f} for v, f in self.redo]
        return json.dumps(d, indent=1, sort_keys=False, allow_nan=False) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, *, where: str) -> PersistedState:
        """Parse and validate; anything unexpected is an EngineStateError saying what to do."""

        def bad(what: str) -> EngineStateError:
            return EngineStateError(f"{where}: {what}. {_REMEDY}")

        try:
            d = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise bad(f"not valid JSON ({exc})") from exc
        if not isinstance(d, dict) or d.get("format") != STATE_FORMAT:
            raise bad("not an asyncsync engine state file")
        fv = d.get("format_version")
        if isinstance(fv, bool) or fv not in _FORMAT_VERSIONS:
            raise bad(
                f"format_version {fv!r} is not supported (this reader understands "
                f"{', '.join(map(str, _FORMAT_VERSIONS))})"
            )

        def opt_int(key: str) -> int | None:
            v = d.get(key)
            if v is None:
                return None
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise bad(f"field {key!r} must be a non-negative integer or null, got {v!r}")
            return v

        def opt_str(key: str) -> str | None:
            v = d.get(key)
            if v is not None and not isinstance(v, str):
                raise bad(f"field {key!r} must be a string or null, got {type(v).__name__}")
            return v

        status = d.get("status")
        if status not in ("clean", "applying"):
            raise bad(f"field 'status' must be 'clean' or 'applying', got {status!r}")
        mode = d.get("mode")
        if mode not in (None, "delta", "full"):
            raise bad(f"field 'mode' must be 'delta', 'full' or null, got {mode!r}")
        checksums = d.get("checksums", {})
        if not isinstance(checksums, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in checksums.items()
        ):
            raise bad("field 'checksums' must map tensor names to checksum strings")
        updated_at = d.get("updated_at", 0.0)
        if (
            isinstance(updated_at, bool)
            or not isinstance(updated_at, int | float)
            or not math.isfinite(updated_at)
        ):
            raise bad(f"field 'updated_at' must be a number, got {updated_at!r}")
        parts = d.get("parts", {})
        if not isinstance(parts, dict) or not all(
            isinstance(v, list)
            and all(
                isinstance(p, list)
                and len(p) == 2
                and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in p)
                for p in v
            )
            for v in parts.values()
        ):
            raise bad("field 'parts' must map tensor names to lists of [offset, numel]")
        synced = d.get("synced", True)
        if not isinstance(synced, bool):
            raise bad(f"field 'synced' must be true or false, got {synced!r}")
        redo = _redo_refs(d.get("redo", []), bad)
        if bool(redo) != (fv == STATE_FORMAT_VERSION_REDO):
            raise bad(f"field 'redo' must be non-empty exactly in format_version {fv}")
        progressive = d.get("progressive", False)
        if not isinstance(progressive, bool) or (
            progressive != (fv == STATE_FORMAT_VERSION_PROGRESSIVE)
            and fv != STATE_FORMAT_VERSION_REDO
        ):
            raise bad(
                f"field 'progressive' must be true exactly in format_version "
                f"{STATE_FORMAT_VERSION_PROGRESSIVE} (or either in {STATE_FORMAT_VERSION_REDO}), "
                f"got {progressive!r}"
            )
        if progressive and (status, mode) != ("applying", "delta"):
            raise bad("field 'progressive' is only for a delta being applied")
        state = cls(
            version=opt_int("version"),
            run_id=opt_str("run_id"),
            fingerprint=opt_str("fingerprint"),
            status=status,
            target_version=opt_int("target_version"),
            mode=mode,
            checksum_algorithm=opt_str("checksum_algorithm"),
            checksums=dict(checksums),
            updated_at=float(updated_at),
            parts={k: [(p[0], p[1]) for p in v] for k, v in parts.items()},
            synced=synced,
            progressive=progressive,
            redo=redo,
        )
        if redo and (state.version is None or any(v <= state.version for v, _ in redo)):
            raise bad("field 'redo' names versions not after the files' version")
        if any(b[0] <= a[0] for a, b in itertools.pairwise(redo)):
            raise bad("field 'redo' is not in increasing version order")
        if state.applying and (state.target_version is None or state.mode is None):
            raise bad("status 'applying' without target_version and mode")
        return state


def _redo_refs(v: Any, bad: Any) -> tuple[tuple[int, str | None], ...]:
    """The ``redo`` field: a list of {version, fingerprint}."""
    if not isinstance(v, list):
        raise bad("field 'redo' must be a list")
    out = []
    for r in v:
        ver = r.get("version") if isinstance(r, dict) else None
        fp = r.get("fingerprint") if isinstance(r, dict) else None
        if isinstance(ver, bool) or not isinstance(ver, int) or ver < 0:
            raise bad(f"field 'redo': {r!r} has no non-negative integer version")
        if fp is not None and not isinstance(fp, str):
            raise bad(f"field 'redo': {r!r} has a fingerprint that is not a string")
        out.append((ver, fp))
    return tuple(out)


_REMEDY = (
    "The engine cannot tell which version it holds: remove the checkpoint directory "
    "(or this state directory together with the weight files next to it) so the receiver "
    "re-initialises it from the newest keyframe"
)


def unwritable(path: Path, exc: OSError, top: Path) -> EngineStateError | None:
    """The error of a receiver refused (``exc``) a write to ``path`` in the engine directory
    ``top``, naming the path and what to do; None where ``exc`` is no refusal to write (a full
    disk, a missing file, an unsafe path)."""
    code = exc.errno
    if code not in (errno.EROFS, errno.EACCES, errno.EPERM) or isinstance(exc, fsio.UnsafePath):
        return None
    keeps = f"the receiver keeps {top} at the newest version in place, and its lock and state in "
    keeps += f"{top / STATE_DIR_NAME}"
    if code == errno.EROFS:
        return EngineStateError(
            f"cannot write {path}: its filesystem is mounted read-only (EROFS); {keeps}: mount "
            "it read-write, or give the receiver a writable directory"
        )
    if code == errno.EPERM:
        return EngineStateError(
            f"cannot write {path}: refused whatever its mode (EPERM): an immutable or "
            f"append-only attribute (`lsattr -d {path}`), or a security module's policy; {keeps}"
        )
    where = path if path.exists() else path.parent  # (refused a new file: its directory)
    why, uid = exc.strerror or "permission denied", os.geteuid()
    try:
        st = where.stat()
    except OSError as exc2:  # (removed meanwhile, or no search right on its parent)
        return EngineStateError(
            f"cannot write {path} ({why}): its owner cannot be read ({exc2.strerror}), this "
            f"receiver runs as uid {uid}; {keeps}: run it as the directory's owner, or "
            f"`chown -R {uid} {top}`"
        )
    mode = f"mode {stat.S_IMODE(st.st_mode):04o}"
    if st.st_uid != uid:
        return EngineStateError(
            f"cannot write {path} ({why}): {where} belongs to uid {st.st_uid} ({mode}), this "
            f"receiver runs as uid {uid}; {keeps}: run it as the directory's owner, or "
            f"`chown -R {uid} {top}`"
        )
    return EngineStateError(
        f"cannot write {path} ({why}): {where} has {mode}, which does not let its owner "
        f"(uid {uid}, this receiver) write it; {keeps}: `chmod -R u+w {top}`"
    )


def _mode_lets_write(p: Path) -> bool:
    """Whether ``p``'s mode lets this process write it (root; or its owner, with the owner's
    write, and search for a directory, bits): access(2) refused it all the same, for another
    reason than the mode (an immutable attribute, a security module: EPERM's message), not
    one a chmod fixes (it said "has mode 0644, which does not let its owner write it")."""
    st = os.stat(p)
    need = stat.S_IWUSR | (stat.S_IXUSR if stat.S_ISDIR(st.st_mode) else 0)
    return os.geteuid() == 0 or (st.st_uid == os.geteuid() and st.st_mode & need == need)


def check_writable(paths: Iterable[Path], top: Path, exc: OSError | None = None) -> None:
    """Refuse (:func:`unwritable`) the first of ``paths`` (of those that exist) this process
    cannot write: at open, rather than at the first version's first write (a daemon retried
    that for ever). ``exc``: a write refused where its path is not known (a file opened by its
    name in its directory), whose kind the error tells; else access(2) says it."""
    for p in paths:
        # (a dangling symlink: left to the code that refuses it by name, journal/ or staging/;
        # statvfs through it raised a bare FileNotFoundError)
        if os.path.exists(p) and not os.access(p, os.W_OK | (os.X_OK if p.is_dir() else 0)):
            if exc is None:
                ro = os.statvfs(p).f_flag & os.ST_RDONLY
                code = errno.EPERM if _mode_lets_write(p) else errno.EACCES
                exc = OSError(errno.EROFS if ro else code, "refused")
            err = unwritable(p, exc, top)
            if err is not None:
                raise err


class StateStore:
    """The state directory of one engine: ``state.json``, the lock, journal and staging dirs.

    ``open()`` creates the directory, takes the lock (raising LockHeld when another live
    process holds it) and returns the persisted state, or None when there is none yet.
    ``save()`` replaces ``state.json`` atomically and durably. ``close()`` releases the lock.
    """

    def __init__(self, directory: str | os.PathLike[str]):
        self.directory = Path(directory)
        self.path = self.directory / STATE_NAME
        self.journal_dir = self.directory / JOURNAL_DIR
        self.staging_dir = self.directory / STAGING_DIR
        self.redo_dir = self.directory / REDO_DIR
        self._lock = fsio.FileLock(self.directory / LOCK_NAME)

    def __repr__(self) -> str:
        return f"<StateStore {self.directory} locked={self._lock.held}>"

    @property
    def locked(self) -> bool:
        return self._lock.held

    @property
    def exists(self) -> bool:
        return self.path.exists()

    def open(self) -> PersistedState | None:
        """Create the directory, take the lock, clear temp files, and load the state."""
        if not self._lock.held:
            top = self.directory.parent
            try:
                fsio.make_dir(self.directory, parents=True, exist_ok=True)  # 0755 (umask)
                # its entry durable before anything next to it refers to it (a crash must never
                # leave the engine's files without the state that says what they hold)
                fsio.fsync_dir(top)
                took = self._lock.acquire()
            except OSError as exc:  # fsio names the lock's path; mkdir's, the directory's
                name = exc.filename
                path = Path(name) if isinstance(name, str) and os.path.isabs(name) else None
                if (err := unwritable(path or self._lock.path, exc, top)) is None:
                    raise
                raise err from exc
            if not took:
                raise LockHeld(
                    f"engine state {self.directory} is locked by {self._lock.holder()} "
                    "(pid host token): one receiver agent per engine. Stop that agent, or point "
                    "this one at another engine"
                )
        try:
            fsio.remove_temp_files(self.directory)
            return self.load()
        except BaseException:
            self.close()
            raise

    def load(self) -> PersistedState | None:
        """The persisted state, or None when ``state.json`` does not exist."""
        try:
            data = fsio.read_bytes(self.path, limit=_MAX_STATE_BYTES)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise EngineStateError(f"cannot read {self.path}: {exc}. {_REMEDY}") from exc
        return PersistedState.from_json(data, where=str(self.path))

    def save(self, state: PersistedState, *, spare: bool = False) -> PersistedState:
        """Persist ``state`` (stamped with the current time) atomically; return what was saved.

        ``spare`` (a rollback or a wipe, which must not fail on the disk that failed the
        apply; a begin on a full disk is refused instead of using it up): where the disk is too
        full for a new file, the state is written over the spare (:data:`SPARE_STATE_NAME`,
        allocated and written before: no new block, even on a thinly provisioned disk), renamed
        into place."""
        if not self._lock.held:
            raise EngineStateError(f"{self.directory}: save() without holding the lock")
        if not self._lock.intact():  # the directory wiped under us: another agent may own it
            raise LockHeld(
                f"{self._lock.path} is no longer the lock file this receiver holds (the state "
                "directory was wiped, or the file removed or replaced): another receiver may "
                "be writing this engine; nothing was saved. Close this agent and open it again"
            )
        state = replace(state, updated_at=time.time())
        data = state.to_json().encode()
        try:
            fsio.atomic_write(self.path, data)
        except OSError as exc:  # a full disk: a new file needs a block it cannot get
            if not (spare and exc.errno in (errno.ENOSPC, errno.EDQUOT) and self._in_spare(data)):
                raise
            logger.warning("%s: state saved over its spare (%s)", self.directory, exc)
        else:
            with contextlib.suppress(OSError):  # made again once there is room
                self._make_spare(len(data))
        logger.debug(
            "state %s: version=%s status=%s target=%s",
            self.directory,
            state.version,
            state.status,
            state.target_version,
        )
        return state

    def _make_spare(self, need: int) -> None:
        """The spare, written and synced, where it is missing or has little room left."""
        spare = self.directory / SPARE_STATE_NAME
        with contextlib.suppress(FileNotFoundError):
            if spare.stat().st_size >= need + 4096:
                return
        size = -(-max(_SPARE_MIN, need * 5 // 4) // 4096) * 4096
        fsio.atomic_write(spare, b" " * (size - 1) + b"\n")

    def _in_spare(self, data: bytes) -> bool:
        """Write ``data`` over the spare in place (padded with blanks: JSON ignores them, and no
        truncate), sync it and rename it to ``state.json``; False where there is none that
        fits (the disk was full before one could be made)."""
        spare = self.directory / SPARE_STATE_NAME
        try:
            fd = os.open(spare, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size < len(data):
                return False
            view = memoryview(data + b" " * (st.st_size - len(data)))
            while view:
                view = view[os.pwrite(fd, view, st.st_size - len(view)) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(spare, self.path)  # a directory entry replaced: no new block
        fsio.fsync_dir(self.directory)
        return True

    def clear_dir(self, path: Path, *, keep: Callable[[Path], str | None] | None = None) -> None:
        """Remove every file in ``path`` (one level, e.g. journal/ or staging/) and fsync it.

        ``keep``: the name a file (not a symlink) is renamed to instead of removed, or None to
        remove it (the journal's spares: ``journal.recycled_name``).

        A symlink there is refused (EngineStateError), never followed: clearing through it
        would remove whatever it points to."""
        if path.is_symlink():
            raise EngineStateError(
                f"{path} is a symlink, not the engine's own directory; refusing to clear "
                "through it (remove it)"
            )
        if not path.is_dir():
            return
        removed = False
        for p in path.iterdir():
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            elif keep is not None and not p.is_symlink() and (to := keep(p)) is not None:
                if to == p.name:  # kept as it is (a spare): nothing to rename or to sync
                    continue
                p.replace(path / to)
            else:
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
            removed = True
        if removed:
            fsio.fsync_dir(path)

    def close(self) -> None:
        self._lock.release()
