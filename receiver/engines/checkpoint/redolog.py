"""A LocalCheckpoint with a redo log (``redo_log=N``): committed deltas kept as redo records
beside the data files, and merged into the files every N versions (compaction).

Why: a delta of a few percent of the elements of a bf16 model writes into every 4 KiB page of
the files, so each version patched in place dirties (and writes back) the whole checkpoint, and
its apply is mostly page-cache work (prefault, patch, flush). A record holds only the changed
positions and values (:mod:`~receiver.engines.checkpoint.redo`), a few percent of the model,
written once and fsynced; compaction patches N records into the files and flushes them once.

* delta: each apply group's patches are appended to the version's record (a temp file); the
  commit checks that every tensor the manifest says changed was patched, makes the record
  durable (fsync, rename, directory fsync), then commits ``state.json`` naming it
  (``redo``, format_version 3); the ack follows. The data files are not touched.
* compaction (:meth:`RedoLog._compact`): when N records are held (after the ack of the Nth, or
  at the next begin), when the receiver is idle, at close and at open, and before anything
  reads the tensors' bytes (a zero-diff version, ``load_state_dict``): the records patched
  into the files in turn through the undoable in-place path (journal, patch with checksums,
  :mod:`~receiver.engines.checkpoint.inplace`), checked against the newest record's
  checksums, flushed once, then ``state.json`` holds the newest version
  with no records, then the records go. A checksum that differs means the files were not the
  base the records apply on (damaged between versions): the files are removed, as a failed
  re-check does, and the receiver re-initialises from a keyframe. A compaction that fails
  otherwise is rolled back (the records kept, tried again).
* a full version replaces every file: its records are dropped, not merged.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from asyncsync import fsio
from asyncsync.errors import ApplyFailed, ChecksumMismatch, FormatError
from asyncsync.format import Manifest, TensorEntry
from asyncsync.format.checksum import new_hasher
from receiver.engines.base import TensorUpdate
from receiver.engines.checkpoint import inplace
from receiver.engines.checkpoint.recovery import Recovery, own_dir
from receiver.engines.checkpoint.redo import Record, RecordWriter, record_name
from receiver.engines.st_layout import FileMaps
from receiver.rules import check_patch, layouts_of
from receiver.state import PersistedState

__all__ = ["IDLE_CAP", "RedoLog", "Writing", "check_redo_log"]

logger = logging.getLogger(__name__)

#: the most seconds of idleness before a compaction, whatever the interval between versions
IDLE_CAP = 300.0
_GROUP_BYTES = 256 << 20  # a record's values patched in one journaled group


def check_redo_log(redo_log: object, compact_idle: object) -> tuple[int, float]:
    """The validated options (ValueError saying what is wrong)."""
    if isinstance(redo_log, bool) or not isinstance(redo_log, int) or redo_log < 0:
        raise ValueError(
            f"redo_log must be a non-negative integer (0: off; N: compact every N versions), "
            f"got {redo_log!r}"
        )
    if (
        isinstance(compact_idle, bool)
        or not isinstance(compact_idle, int | float)
        or not compact_idle > 0
        or compact_idle == float("inf")
    ):
        raise ValueError(f"compact_idle must be a positive number of seconds, got {compact_idle!r}")
    return redo_log, float(compact_idle)


class _Unreadable(Exception):
    """A record's patch that cannot be read back (damaged on disk): never merged again."""


@dataclass(frozen=True)
class _Head:
    """What the newest record says of its version, the files' once the records are merged
    (read before anything is written: a trailer damaged on disk is a record that cannot be
    read, not a compaction that fails at every open)."""

    version: int
    algo: str
    checksums: dict[str, str]
    parts: dict[str, list[tuple[int, int]]]
    fingerprint: str
    run_id: str

    @classmethod
    def of(cls, rec: Record, names: Collection[str]) -> _Head:
        """ValueError naming ``rec`` where its trailer is not a whole one of the tensors
        ``names``."""
        m = rec.meta
        try:
            new_hasher(m["checksum_algorithm"])  # ConfigError, a ValueError: unknown
            checksums = dict(m["checksums"])
            if set(checksums) != set(names):
                raise ValueError(f"v{rec.version}'s record names other tensors")
            parts = {str(k): [(int(a), int(b)) for a, b in v] for k, v in m["parts"].items()}
            texts = (m["checksum_algorithm"], m["fingerprint"], m["run_id"], *checksums.values())
            if not all(isinstance(t, str) for t in texts):
                raise ValueError("a field of another type")
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(
                f"{rec.path}: not a whole trailer ({type(exc).__name__}: {exc})"
            ) from exc
        return cls(
            rec.version, m["checksum_algorithm"], checksums, parts, m["fingerprint"], m["run_id"]
        )


@dataclass
class Writing:
    """The record of the delta being applied."""

    writer: RecordWriter
    numels: dict[str, int]


class RedoLog(Recovery):
    """The redo log of :class:`~receiver.engines.checkpoint.LocalCheckpoint` (a part of the
    engine, as :class:`~receiver.engines.checkpoint.recovery.Recovery` is: the engine sets
    every attribute; everything here runs under the engine's lock)."""

    sync_before_ack: bool
    redo_log: int
    compact_idle: float
    _last_begin: float | None
    _begin_interval: float | None

    if TYPE_CHECKING:

        def _after_commit(self, version: int) -> None: ...

    # -- when ---------------------------------------------------------------------------
    @property
    def redo_held(self) -> int:
        """Redo records held beside the files (merged into them at the next compaction)."""
        return len(self._ps.redo)

    def info(self) -> dict[str, Any] | None:
        """For ``/status`` (a redo log on, or records held): the records, and whether the
        files are loadable (no record held: they hold the version acknowledged)."""
        if not (self.redo_log or self._ps.redo):
            return None
        return {
            "redo_log": self.redo_log,
            "redo_records": [v for v, _ in self._ps.redo],
            "files_version": self._ps.version,
            "files_loadable": not self._ps.redo and not self._ps.applying,
        }

    def metrics(self) -> dict[str, tuple[str, float | None]]:
        if not self.redo_log:
            return {}
        return {
            "redo_records": ("Redo records held beside the checkpoint's files.", self.redo_held),
            "files_version": ("Version the checkpoint's files hold.", self._ps.version),
        }

    def _note_begin(self) -> None:
        now = time.monotonic()
        if self._last_begin is not None:
            self._begin_interval = now - self._last_begin
        self._last_begin = now

    def idle_for(self) -> float:
        """How long without a begin makes the receiver idle (then it compacts): the configured
        ``compact_idle``, or twice the interval between the last two versions where longer
        (versions a minute apart: a compaction after each would write the model back per
        version, which the log is there to avoid), at most :data:`IDLE_CAP`."""
        interval = self._begin_interval or 0.0
        return max(self.compact_idle, min(2 * interval, IDLE_CAP))

    def _idle(self) -> bool:
        last = self._last_begin
        return last is None or time.monotonic() - last >= self.idle_for()

    # -- open ---------------------------------------------------------------------------
    def _open_redo(self) -> None:
        """At open: records no state names removed (written, not committed: the version was
        never acknowledged), then those it names compacted."""
        d = self._store.redo_dir
        if self.redo_log or fsio.lstat(d) is not None:  # (a symlink there: never followed)
            own_dir(d)
        if d.is_dir():
            named = {record_name(v) for v, _ in self._ps.redo}
            stale = [p for p in d.iterdir() if p.name not in named]
            for p in stale:
                logger.warning("%s: removing redo record %s (no state names it)", d, p.name)
                if p.is_dir() and not p.is_symlink():  # as clear_dir does: the open failed
                    shutil.rmtree(p, ignore_errors=True)  # (IsADirectoryError) at every start
                else:
                    p.unlink(missing_ok=True)
        if self._ps.redo:
            try:
                self._compact("open")
            except (ApplyFailed, OSError) as exc:  # a full disk: kept, merged later (as at
                # close); the open goes on, the version acknowledged held as records
                logger.warning("%s: compaction at open failed: %s", self.directory, exc)

    # -- delta --------------------------------------------------------------------------
    def _begin_redo(self, manifest: Manifest) -> Writing:
        numels = {
            n: loc.nbytes // max(loc.int_dtype.itemsize, 1) for n, loc in self._layout.items()
        }
        own_dir(self._store.redo_dir)
        return Writing(RecordWriter(self._store.redo_dir, manifest.version), numels)

    def _apply_redo(self, w: Writing, claimed: list[tuple[TensorEntry, TensorUpdate]]) -> None:
        """Append the group's checked patches to the version's record."""
        items = []
        for entry, u in claimed:
            if u.patch is None:
                raise ApplyFailed(f"tensor {entry.name!r}: a delta needs a patch, not full data")
            loc = self._layout[entry.name]
            numel = w.numels[entry.name]
            shape = torch.empty(1, dtype=loc.int_dtype).expand(numel)  # dtype and numel only
            items.append((entry.name, numel, check_patch(u.patch, shape, entry.name)))
        w.writer.add(items)

    def _commit_redo(self, w: Writing, manifest: Manifest, seen: set[str]) -> None:
        """The record made durable, then the state naming it (the ack follows)."""
        m = manifest
        try:
            missing = [e.name for e in m.tensors if e.changed > 0 and e.name not in seen]
            if missing:
                raise ApplyFailed(
                    f"{self.directory}: v{m.version} changes {len(missing)} tensors that were "
                    f"not applied (e.g. {missing[0]!r}); refused"
                )
            w.writer.finish(
                {
                    "version": m.version,
                    "base_version": m.base_version,
                    "run_id": m.run_id,
                    "fingerprint": m.fingerprint,
                    "checksum_algorithm": m.checksum_algorithm,
                    "checksums": {e.name: e.checksum for e in m.tensors},
                    "parts": layouts_of(m),
                }
            )
            self._set(replace(self._ps, redo=(*self._ps.redo, (m.version, m.fingerprint))))
        except BaseException:
            w.writer.discard()
            raise
        logger.info(
            "%s: committed delta v%s as a redo record (%d held, %.1f MiB)",
            self.directory, m.version, len(self._ps.redo), w.writer.nbytes / 2**20,
        )  # fmt: skip

    # -- compaction ---------------------------------------------------------------------
    def _compact(self, why: str) -> None:
        """Merge every record held into the files (see the module docstring)."""
        if not self._ps.redo:
            return
        # a compaction's rollback that failed (a full disk) done first: its undo records are
        # cleared by this one, which merged over files half patched (a mismatch: wiped)
        self._finish_rollback()
        ps = self._ps
        t0 = time.perf_counter()
        records: list[Record] = []
        try:
            try:
                for v, fingerprint in ps.redo:
                    rec = Record.open(self._store.redo_dir / record_name(v))
                    records.append(rec)
                    if (rec.version, rec.meta.get("fingerprint")) != (v, fingerprint):
                        raise ValueError(f"{rec.path} holds v{rec.version}, not the one named")
                head = _Head.of(records[-1], self._layout)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                logger.error(
                    "%s: a redo record cannot be read (%s); removing the files so the "
                    "receiver re-initialises from a keyframe", self.directory, exc,
                )  # fmt: skip
                self._wipe()
                return
            self._merge_into_files(records, head, why)
        finally:
            for rec in records:
                rec.close()
        with contextlib.suppress(OSError):  # unnamed now: removed at the next open otherwise
            self._remove_records([rec.path for rec in records])
        logger.info("%s: compacted %d redo records into v%s (%s) in %.3fs", self.directory,
                    len(records), self._ps.version, why, time.perf_counter() - t0)  # fmt: skip

    def _remove_records(self, paths: list[Path]) -> None:
        """The records a compaction merged (these alone, not the redo directory cleared: a
        delta streamed into a record before its manifest, beside an audit's compaction, is
        writing its own there, attack-80)."""
        for path in paths:
            path.unlink(missing_ok=True)
        fsio.fsync_dir(self._store.redo_dir)

    def _merge_into_files(self, records: list[Record], head: _Head, why: str) -> None:
        ps, version, algo = self._ps, head.version, head.algo
        checksums, parts = head.checksums, head.parts
        self._set(ps.begin(version, "delta", progressive=not self.sync_before_ack))
        maps = FileMaps(self.directory)
        try:
            digests = self._patch_records(maps, records, version, algo, parts)
            bad = self._first_bad(maps, ps, digests, algo, checksums, parts)
            if bad is not None:
                raise ChecksumMismatch(bad, path=str(self.directory))
            maps.sync()
            self._set(
                replace(
                    ps.clean(), version=version, fingerprint=head.fingerprint,
                    run_id=head.run_id, checksum_algorithm=algo, checksums=checksums,
                    parts=parts, synced=True, redo=(),
                )
            )  # fmt: skip
        except ChecksumMismatch as exc:
            logger.error("%s: compaction (%s): %s; the files were not the base the records "
                         "apply on: removing them so the receiver re-initialises from a "
                         "keyframe", self.directory, why, exc)  # fmt: skip
            self._wipe()
            return
        except _Unreadable as exc:  # as one whose trailer cannot be read (_compact)
            logger.error("%s: compaction (%s): a redo record cannot be read (%s); removing the "
                         "files so the receiver re-initialises from a keyframe",
                         self.directory, why, exc)  # fmt: skip
            self._wipe()
            return
        except BaseException as exc:
            try:
                self._undo(maps)
            except BaseException as undo_exc:
                self._undo_pending = f"rollback of a compaction to v{version} failed ({undo_exc})"
            raise ApplyFailed(
                f"{self.directory}: compaction of {len(records)} redo records failed ({exc}); "
                "rolled back, the records are kept and merged again later"
            ) from exc
        finally:
            maps.close()
        self._after_commit(version)

    def _patch_records(
        self,
        maps: FileMaps,
        records: list[Record],
        version: int,
        algo: str,
        parts: Mapping[str, Any],
    ) -> dict[str, str | None]:
        """Each record's patches journaled and patched in turn, oldest first, in groups of
        about :data:`_GROUP_BYTES`; each tensor's checksum taken in the last pass that touches
        it, as it is patched (the earlier passes only patch it: their digests would be thrown
        away), which gives its final one (None: hashed later, the tensors share bytes).

        One pass per record, not one of the records merged: the merge (numpy, on sorted or
        dense positions) cost ~2x the passes it saved (measured, BENCHMARKS.md); each pass is
        the in-place path's native kernels (positions as the decoder checked them, the xef
        blob kept), and the pages it writes are in the cache for the next one."""
        algorithm = algo if inplace.disjoint(self._layout) else None
        last = {name: i for i, rec in enumerate(records) for name in rec.entries}
        digests: dict[str, str | None] = {}
        work: list[inplace.Work] = []
        size = seq = 0

        def flush(at: int) -> None:  # the group of records[at]
            nonlocal work, size, seq
            if work:
                layouts = {n: parts.get(n) for n, *_ in work}
                digests.update(dict.fromkeys((n for n, *_ in work), None))
                digests.update(inplace.journal_and_patch(
                    maps, self._store.journal_dir, seq, version, work, algorithm, layouts,
                    durable=self.sync_before_ack, hashed={n for n, *_ in work if last[n] == at},
                ))  # fmt: skip
                seq += 1
            work, size = [], 0

        self._recycle_journal()  # the records of versions before (a progressive one: a spare)
        for i, rec in enumerate(records):
            for name, loc in self._layout.items():
                if name not in rec.entries:
                    continue
                flat = maps.flat(loc)
                try:  # damaged on disk: kept, every later compaction (each open) failed again
                    patch = check_patch(
                        rec.as_patch(name, loc.int_dtype), flat, name, kernels_check=True
                    )
                except (FormatError, ApplyFailed, ValueError, LookupError, TypeError) as exc:
                    raise _Unreadable(f"{rec.path}: tensor {name!r}: {exc}") from exc
                work.append((name, loc, flat, patch))
                size += patch.values.nbytes
                if size >= _GROUP_BYTES:
                    flush(i)
            flush(i)  # a record's group never holds a tensor a later record patches again
        return digests

    def _first_bad(
        self,
        maps: FileMaps,
        ps: PersistedState,
        digests: Mapping[str, str | None],
        algo: str,
        checksums: Mapping[str, str],
        parts: Mapping[str, Any],
    ) -> str | None:
        """Why the merged files are not the newest record's version (None: they are).
        Tensors patched (``digests``' keys) by their checksums, taken as they were patched or
        else hashed from the files; the others by the checksums the files' version recorded,
        where taken with the same algorithm."""
        for name, loc in self._layout.items():
            if name in digests:
                got = digests[name] or maps.checksum(loc, algo, parts.get(name))
            elif ps.checksum_algorithm == algo:
                got = ps.checksums.get(name, checksums[name])
            else:
                continue
            if got != checksums[name]:
                return f"tensor {name!r} in {loc.file}: checksum {got} != {checksums[name]}"
        return None
