"""The LocalCheckpoint engine: its transactions and the flush after the ack (recovery at open
and after a failed flush is :mod:`~receiver.engines.checkpoint.recovery`, a full version's
staged swap :mod:`~receiver.engines.checkpoint.fullswap`; the directory layout and crash-safety
rules are in :mod:`receiver.engines.checkpoint`)."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, TypeVar

import safetensors
import safetensors.torch
import torch

from asyncsync.errors import (
    ApplyFailed,
    AsyncSyncError,
    ChecksumMismatch,
    EngineStateError,
    OutOfOrder,
)
from asyncsync.format import Manifest, TensorEntry
from receiver.engines.base import AuditReport, Engine, EngineState, TensorUpdate
from receiver.engines.checkpoint import inplace
from receiver.engines.checkpoint.files import CheckpointFiles
from receiver.engines.checkpoint.flusher import Flusher
from receiver.engines.checkpoint.fullswap import FullVersions
from receiver.engines.checkpoint.redolog import RedoLog, Writing, check_redo_log
from receiver.engines.checkpoint.stamps import Stamps
from receiver.engines.st_layout import FileMaps, TensorLocation
from receiver.rules import bumped, check_base, check_patch, check_tensor_set, holding
from receiver.state import STATE_DIR_NAME, PersistedState, StateStore

__all__ = ["LocalCheckpoint"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

_EDITED = "its files were changed behind the receiver's back and no longer held it"


@dataclass
class _Txn:
    """The version being applied between begin and commit/abort."""

    manifest: Manifest
    mode: Literal["delta", "full"]
    entries: dict[str, TensorEntry]
    seen: set[str] = field(default_factory=set)
    staged: dict[str, tuple[str, str]] = field(default_factory=dict)  # name -> (part, checksum)
    parts: list[str] = field(default_factory=list)
    maps: FileMaps | None = None
    seq: int = 0
    digests: dict[str, str] = field(default_factory=dict)  # name -> checksum taken at its patch
    digest_on_patch: bool = False  # the files' tensors are disjoint (inplace.disjoint)
    redo: Writing | None = None  # with a redo log: the delta's record, the files untouched


# --------------------------------------------------------------------------- the engine


class LocalCheckpoint(RedoLog, FullVersions, Engine):
    """A safetensors checkpoint directory patched in place (see :mod:`receiver.engines.checkpoint`).

    Its data files and index are :attr:`files` (:mod:`~receiver.engines.checkpoint.files`); a
    delta is applied undoably in place (:mod:`~receiver.engines.checkpoint.inplace`), a full
    version through staged files (:mod:`~receiver.engines.checkpoint.staging`); and a committed
    delta is flushed after its ack (:meth:`acknowledged`, :meth:`flushed`).

    ``redo_log=N`` (N > 0): a delta is kept as a redo record beside the files instead, and the
    records are merged into them every N versions, after ``compact_idle`` seconds (or more)
    without a version, and at open and close (:mod:`~receiver.engines.checkpoint.redolog`).
    """

    streams = True  # a delta may begin from self-describing shards (receiver.stream)

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        file_prefix: str = "model",
        sync_before_ack: bool = False,
        redo_log: int = 0,
        compact_idle: float = 2.0,
    ):
        self.redo_log, self.compact_idle = check_redo_log(redo_log, compact_idle)
        self._last_begin: float | None = None
        self._begin_interval: float | None = None
        self.files = CheckpointFiles(directory, file_prefix)  # raises for a bad prefix
        self.directory = Path(directory)
        self.file_prefix = file_prefix
        self.index_path = self.files.index_path
        self._store = StateStore(self.directory / STATE_DIR_NAME)
        self._stamps = Stamps(self.files, self._store.directory)
        self._ps = PersistedState()
        self._layout: dict[str, TensorLocation] = {}
        self._txn: _Txn | None = None
        self._broken: str | None = None
        self._undo_pending: str | None = None  # a rollback that failed: done again at begin
        self._mutex = threading.Lock()
        self.sync_before_ack = sync_before_ack
        self._flusher = Flusher(f"flush {self.directory.name}", self._flush, self._store.directory)
        self._unflushed: tuple[FileMaps, int] | None = None  # committed, flush not yet started
        self._stale_journal = False  # a committed delta's undo records, cleared after its ack
        self._letting_go: asyncio.Future[None] | None = None  # the lock's release, at close
        self.state = EngineState()

    def __repr__(self) -> str:
        return f"<LocalCheckpoint {self.directory} version={self.state.version}>"

    # -- public coroutines ----------------------------------------------------------------
    async def open(self) -> EngineState:
        return await self._run(self._open_all)

    def _open_all(self) -> EngineState:
        if self._store.locked:
            return self.state
        self._open()
        try:  # records no state names removed, those it names merged into the files
            self._open_redo()
        except BaseException:
            self._store.close()
            raise
        return self.state

    async def close(self) -> None:
        try:
            if self._txn is not None:
                await self.abort()
            await self.flushed()
            if self._ps.redo and self._store.locked:
                try:
                    await self._run(self._compact, "close")
                except (AsyncSyncError, OSError) as exc:  # kept: merged at the next open
                    logger.warning("%s: compaction at close failed: %s", self.directory, exc)
        finally:  # on every path (a close cancelled or failing midway), never under work;
            # cancelled: on its own (a strong reference kept), close() returns at once
            self._letting_go = asyncio.ensure_future(self._let_go())
            if not (task := asyncio.current_task()) or not task.cancelling():
                await self._letting_go

    async def _let_go(self) -> None:
        """The lock released after the flush and any thread still at work (a cancelled open's,
        which may take the lock yet or patch the files under it): not under them, nor left
        held by nobody."""
        await self._flusher.wait()
        self._flusher.close()
        await self._run(self._store.close)

    async def begin(self, manifest: Manifest, mode: Literal["delta", "full"]) -> None:
        if mode == "delta":
            # The last delta's flush goes on meanwhile: this one journals the old values of
            # every position it writes before writing it, so a crash undoes it back to the
            # last version, which is checked at open while it is not durable (``synced``).
            await self.acknowledged()
        else:
            await self.flushed()  # a full version replaces the files the flush writes
        self._note_begin()
        # with the log off, records still held (a compaction at open failed): merged first, or
        # the delta was patched in place over the files' older version (a mismatch, re-seeded)
        if mode == "delta" and self.redo_held >= (self.redo_log or 1):
            await self._run(self._compact, f"{self.redo_held} records held")
            if self.state.version is None:
                raise self._base_removed(manifest)
        t0 = time.perf_counter()
        if not await self._run(self._begin, manifest, mode):  # a flush failed: once it can be
            await self.flushed()  # done again, go on (every flush done: none fails meanwhile)
            await self._run(self._recover)
            if mode == "delta" and self.state.version is None:  # wiped: its base is gone
                raise self._base_removed(manifest)
            if not await self._run(self._begin, manifest, mode):
                raise EngineStateError(f"{self.directory}: {self._broken}; begin refused")
        if (waited := time.perf_counter() - t0) > 0.05:
            logger.info("%s: begin of v%s waited %.3fs", self.directory, manifest.version, waited)

    async def reconcile(self) -> None:
        """Nothing newer to apply: a rollback that failed is done again now (state.json said
        ``applying`` until a newer version came, for good where the failed one was marked
        bad), and a failed flush is recovered now (the held version checked, written again, or
        wiped), not at the next version's begin only: until then the kernel may drop the pages
        it could not write, and the version acked would not be the files'. Files edited behind
        its back are checked after a running flush (a wipe under it failed it), else not waited."""
        if self._txn is not None:
            return
        if self._undo_pending is not None:
            await self._run(self._finish_rollback)
        if self._broken is not None:
            await self.flushed()
            await self._run(self._recover)
        while await self._run(self._edited_unless_flushing) is None:
            await self.flushed()  # the files changed behind its back: checked after the flush
        if self._ps.redo and self._idle():  # the files loadable again while no version comes
            await self._run(self._compact, f"idle {self.idle_for():g}s")

    async def flushed(self) -> None:
        """Wait until every committed delta is durable (a no-op with sync_before_ack); start
        the last one's flush first if nobody called :meth:`acknowledged`."""
        await self.acknowledged()
        await self._flusher.wait()

    async def apply(self, updates: list[TensorUpdate]) -> None:
        txn = self._need_txn()
        if txn.redo is not None:
            w = txn.redo
            await self._run(
                lambda: self._apply_redo(w, [(self._claim(txn, u), u) for u in updates])
            )
        elif txn.mode == "delta":
            await self._run(self._apply_delta, txn, updates)
        else:
            await self._run(self._apply_full, txn, updates)

    async def commit(self) -> str:
        txn = self._need_txn()
        if txn.mode == "full":
            return await self._run(self._commit_full, txn)
        if txn.redo is not None:
            self._txn = None
            await self._run(self._commit_redo, txn.redo, txn.manifest, txn.seen)
            return txn.manifest.fingerprint
        fingerprint = await self._run(self._commit_delta, txn)
        if not self.sync_before_ack:
            assert txn.maps is not None
            self._unflushed = (txn.maps, txn.manifest.version)
        return fingerprint

    async def confirm(self, manifest: Manifest) -> None:
        txn = self._need_txn()
        await self._run(self._confirm, txn, manifest)

    async def acknowledged(self) -> None:
        """Start flushing the delta just committed (in the background): after the ack, so the
        ack's own small write is not queued behind the flush on the same disk. The flush runs
        beside the next delta (it does not hold the engine's lock), after the flush before it."""
        unflushed = self._unflushed
        if self._stale_journal or unflushed is not None:
            await self._run(self._after_ack, unflushed)
        if unflushed is not None and self._unflushed is unflushed:  # (not a concurrent caller)
            self._unflushed = None
            self._flusher.submit(*unflushed)
        if self.redo_log and self.redo_held >= self.redo_log and self._txn is None:
            try:  # after the ack of the Nth: not on any version's latency
                await self._run(self._compact, f"{self.redo_held} records held")
            except (AsyncSyncError, OSError) as exc:  # kept: tried again at the next begin
                logger.warning("%s: compaction failed: %s", self.directory, exc)

    def _after_ack(self, unflushed: tuple[FileMaps, int] | None) -> None:
        """The undo records cleared and the mappings dropped (mapped, the next version's pages
        counted twice) in the engine's thread: on the event loop a munmap (~25 ms per GiB, ~17 s
        at 700 GB) held everything up. A cancelled caller leaves ``_unflushed``: the next one
        submits the flush (``unmap`` runs once: a second caller's would race the flush)."""
        if self._stale_journal and self._txn is None:  # stale since state.json holds it (an
            self._stale_journal = False  # open finding them with a clean state clears them too)
            try:  # progressive records kept as spares, rewritten by the next version's
                self._recycle_journal()
            except (OSError, AsyncSyncError) as exc:  # left for the next begin or open
                logger.warning("%s: clearing the undo records failed: %s", self.directory, exc)
        if unflushed is not None:
            unflushed[0].unmap()

    def _flush(self, maps: FileMaps, version: int) -> None:
        try:
            self._make_durable(maps, version)
        except AsyncSyncError:
            raise
        except (OSError, RuntimeError, ValueError) as exc:
            raise ApplyFailed(f"{self.directory}: {type(exc).__name__}: {exc}") from exc

    async def abort(self) -> None:
        await self._run(self._abort)

    async def bump(self, manifest: Manifest) -> None:
        await self.flushed()
        await self._run(self._bump, manifest)

    async def audit(self, manifest: Manifest) -> AuditReport | None:
        """The files' bytes against ``manifest``'s checksums (``receiver.audit``): every tensor
        read and hashed, the whole model; redo records held are merged into the files first."""
        if self._ps.redo:
            await self._run(self._compact, "audit")
        try:
            return await self._run(self._audit, manifest)
        finally:  # a data file that cannot be read back (a FIFO): the ack withdrawn at once
            if self._unreadable is not None and self.on_lost is not None:
                await self.on_lost()

    async def repair(self) -> None:
        """After an audit found other bytes in the files: removed (the receiver re-initialises
        them from a keyframe), the ack withdrawn at once (``on_lost``)."""
        await self.flushed()
        await self._run(self._wipe_audited)
        if self.on_lost is not None:
            await self.on_lost()

    # -- read-only helpers -----------------------------------------------------------------
    def tensor_names(self) -> list[str]:
        """Names of the tensors in the checkpoint, in index order (none before the first)."""
        return self.files.tensor_names()

    def load_state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor of the checkpoint, copied into memory (later deltas do not alter it).
        Redo records held are merged into the files first."""
        if self._ps.redo:
            with self._mutex:
                self._compact("load_state_dict")
            if self.state.version is None:  # a record or the files damaged: wiped, not {}
                raise EngineStateError(
                    f"{self.directory}: merging the redo records found them or the files "
                    "damaged: the files were removed (the receiver re-initialises them)"
                )
        elif not self._store.locked and (ps := self._store.load()) is not None:
            # not opened: the files as they lie, which are no version mid-apply or while
            # records are held (v0 was returned where the state and the ack named v4)
            why = "a version is being applied" if ps.applying else None
            if ps.redo:
                why = f"{len(ps.redo)} redo records (to v{ps.head_version}) are not merged yet"
            if why is not None:
                raise EngineStateError(
                    f"{self.directory}: {why}: the files hold no version; open() the "
                    "checkpoint first (its receiver stopped: run it, or open it here)"
                )
        return self.files.load_state_dict()

    # -- plumbing -----------------------------------------------------------------------------
    async def _run(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run blocking work in a thread, one at a time even if a caller was cancelled."""

        def locked() -> _T:
            with self._mutex:
                return fn(*args)

        try:
            return await asyncio.to_thread(locked)
        except AsyncSyncError:
            raise
        except (OSError, RuntimeError, ValueError, LookupError, safetensors.SafetensorError) as exc:
            if isinstance(exc, OSError) and (refused := self._refused(exc)) is not None:
                raise refused from exc  # a read-only filesystem, the modes: named, with the fix
            raise ApplyFailed(f"{self.directory}: {type(exc).__name__}: {exc}") from exc

    def _need_txn(self) -> _Txn:
        if self._txn is None:
            raise ApplyFailed(f"{self.directory}: apply/commit without begin")
        return self._txn

    def _write_index(self, version: int) -> None:
        """Write the HF index of the current layout, only the version new."""
        weight_map = {n: loc.file for n, loc in self._layout.items()}
        self.files.write_index(
            version, weight_map, sum(loc.nbytes for loc in self._layout.values())
        )

    def _base_removed(
        self, manifest: Manifest, why: str = "its bytes no longer matched after the failed flush"
    ) -> OutOfOrder:
        return OutOfOrder(
            f"{self.directory}: v{manifest.version} applies on v{manifest.base_version}, "
            f"which was removed ({why}): the receiver re-initialises from a keyframe"
        )

    # -- begin --------------------------------------------------------------------------------
    def _begin(self, manifest: Manifest, mode: Literal["delta", "full"]) -> bool:
        """Start the transaction; False (nothing started) while a flush's failure is recorded:
        read under the lock the flush records it under, so a flush failing at any instant of
        a begin is either seen here (recovered first) or refuses this version's commit; False
        too while a flush runs under files edited behind its back (checked once it is done)."""
        if not self._store.locked:
            raise ApplyFailed(f"{self.directory}: begin before open")
        if self._txn is not None:
            raise ApplyFailed(
                f"{self.directory}: begin v{manifest.version} while v"
                f"{self._txn.manifest.version} is in progress; commit or abort it first"
            )
        if self._broken:
            return False
        entries = manifest.tensor_map()
        txn = _Txn(manifest, mode, entries)
        if mode == "full":  # replaces every file: a rollback still pending is moot once it commits
            self._store.clear_dir(self._store.staging_dir)
            self._txn = txn
            return True
        if mode != "delta":
            raise ApplyFailed(f"unknown apply mode {mode!r}")
        self._finish_rollback()
        if self._broken or self._edited_under_flush():  # recovered / the flush done first
            return False
        if self._edited():
            raise self._base_removed(manifest, _EDITED)
        check_base(self.state.version, self.state.run_id, manifest, str(self.directory))
        check_tensor_set(self._held(), manifest, str(self.directory))
        if copied := self.files.own_data_files():  # written in place: never through a link
            logger.warning(
                "%s: %s had other links (a symlink or a hard link: a backup?); copied, so the "
                "file elsewhere keeps its bytes", self.directory, ", ".join(copied),
            )  # fmt: skip
        if self.redo_log:  # the files untouched: the delta goes into a record
            txn.redo = self._begin_redo(manifest)
            self._txn = txn
            return True
        self._recycle_journal()
        self._stale_journal = False
        self._set(self._ps.begin(manifest.version, "delta", progressive=not self.sync_before_ack))
        txn.maps = FileMaps(self.directory)
        txn.maps.warm(inplace.likely_dense(manifest, self._layout), self._flusher.pending)
        txn.digest_on_patch = inplace.disjoint(self._layout)
        self._txn = txn
        return True

    def _confirm(self, txn: _Txn, manifest: Manifest) -> None:
        """The streamed delta's real manifest replaces the provisional one (same version, base,
        run and tensor set; every tensor patched so far is one the manifest changes)."""
        prov = txn.manifest
        if txn.mode != "delta" or (manifest.version, manifest.base_version, manifest.run_id) != (
            prov.version,
            prov.base_version,
            prov.run_id,
        ):
            raise ApplyFailed(f"{self.directory}: v{manifest.version} does not confirm the delta")
        check_tensor_set(self._held(), manifest, str(self.directory))
        entries = manifest.tensor_map()
        for name in txn.seen:
            e = entries.get(name)
            if e is None or e.changed == 0 or e.parts is not None:
                raise ApplyFailed(f"tensor {name!r} was patched but v{manifest.version} says not")
        txn.manifest, txn.entries = manifest, entries

    def _held(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        return {n: (loc.dtype, tuple(loc.shape)) for n, loc in self._layout.items()}

    def _claim(self, txn: _Txn, u: TensorUpdate) -> TensorEntry:
        """The manifest entry of an update; refuses strangers, repeats and changed shapes."""
        name = u.entry.name
        entry = txn.entries.get(name)
        if entry is None:
            raise ApplyFailed(f"tensor {name!r} is not in v{txn.manifest.version}")
        if name in txn.seen:
            raise ApplyFailed(f"tensor {name!r} updated twice in v{txn.manifest.version}")
        if (u.entry.dtype, u.entry.shape) != (entry.dtype, entry.shape):
            raise ApplyFailed(f"tensor {name!r}: update does not match the manifest entry")
        txn.seen.add(name)
        return entry

    # -- delta ------------------------------------------------------------------------------
    def _apply_delta(self, txn: _Txn, updates: list[TensorUpdate]) -> None:
        """Journal the old bytes of every position the updates write (durably), then patch."""
        assert txn.maps is not None
        work: list[inplace.Work] = []
        for u in updates:
            entry = self._claim(txn, u)
            if u.patch is None:
                raise ApplyFailed(f"tensor {entry.name!r}: a delta needs a patch, not full data")
            loc = self._layout[entry.name]
            flat = txn.maps.flat(loc)
            patch = check_patch(u.patch, flat, entry.name, kernels_check=True)
            work.append((entry.name, loc, flat, patch))
        if not work:
            return
        seq, txn.seq = txn.seq, txn.seq + 1
        algorithm = txn.manifest.checksum_algorithm if txn.digest_on_patch else None
        layouts = {name: txn.entries[name].layout for name, *_ in work}
        vdigests = inplace.journal_and_patch(
            txn.maps, self._store.journal_dir, seq, txn.manifest.version, work, algorithm,
            layouts, durable=self.sync_before_ack,
        )  # fmt: skip
        txn.digests.update(vdigests)

    def _commit_delta(self, txn: _Txn) -> str:
        assert txn.maps is not None
        m = txn.manifest
        try:
            if self._broken:  # the flush of the version before failed meanwhile
                raise EngineStateError(f"{self.directory}: {self._broken}; rechecked at next begin")
            if self.sync_before_ack:
                txn.maps.sync()
            algo = m.checksum_algorithm  # touched tensors by the digests taken as they were
            held = self._ps.checksums if self._ps.checksum_algorithm == algo else None  # patched
            bad = inplace.first_mismatch(
                txn.maps, self._layout, txn.entries, txn.seen, algo, held, txn.digests
            )
            if bad is None:  # (a file truncated or replaced meanwhile: not stamped as its own)
                ps, restamp = self._ps.clean(), self._stamps.only_rewritten()
                self._set(holding(ps, m, synced=self.sync_before_ack), restamp=restamp)
        except BaseException:
            self._rollback(txn)
            raise
        if bad is not None:
            name, got = bad
            path = str(self.directory / self._layout[name].file)
            self._rollback(txn)
            raise ChecksumMismatch(
                f"tensor {name!r} of v{m.version} in {path}: checksum {got} != "
                f"{txn.entries[name].checksum}; rolled back to v{self.state.version}",
                path=path,
                tensor=name,
            )
        self._txn = None
        if self.sync_before_ack:
            txn.maps.close()
        self._stale_journal = True  # cleared after the ack: stale once state.json holds m
        self._after_commit(m.version, clear_journal=False)
        logger.info("%s: committed delta v%s", self.directory, m.version)
        return m.fingerprint

    def _make_durable(self, maps: FileMaps, version: int) -> None:
        """Background, after the commit: flush the data files, then record ``synced``.

        Not under the engine's lock: the next delta may journal and patch meanwhile (its own
        maps). Every page ``version`` wrote was written before this flush began, so once it
        returns ``version`` is durable, except the positions a later delta has patched since,
        whose ``version`` bytes that delta's journal holds durably: ``synced`` is then true of
        ``version`` even while that delta is open (a crash undoes it back to ``version``)."""
        t0 = time.perf_counter()
        try:
            maps.sync()
            self.files.fsync_data_files()  # also pages an interrupted earlier flush left dirty
            with self._mutex:  # not after a failed flush: its pages may be lost (and clean)
                if self._ps.version == version and not self._broken:
                    # not stamped again: an edit since the commit would pass for ours
                    self._set(replace(self._ps, synced=True), restamp=False)
        except BaseException as exc:
            why = f"making v{version} durable failed ({exc})"
            with self._mutex:  # ordered with the begins and commits, which read it under it
                self._broken = why
            logger.error("%s: %s", self.directory, why)
            raise
        finally:
            maps.close()
        logger.debug("%s: v%s durable in %.3fs", self.directory, version, time.perf_counter() - t0)

    def _rollback(self, txn: _Txn) -> None:
        self._txn = None
        if txn.maps is None:
            return
        try:
            self._undo(txn.maps)
        except BaseException as exc:
            self._undo_pending = f"rollback of v{txn.manifest.version} failed ({exc})"
            raise
        finally:
            txn.maps.close()

    # -- abort / bump -------------------------------------------------------------------------
    def _abort(self) -> None:
        txn = self._txn
        if txn is None:
            return
        if txn.redo is not None:
            self._txn = None
            txn.redo.writer.discard()
        elif txn.mode == "delta":
            self._rollback(txn)
        else:
            self._txn = None
            self._store.clear_dir(self._store.staging_dir)
        logger.info("%s: aborted v%s", self.directory, txn.manifest.version)

    def _bump(self, manifest: Manifest) -> None:
        if self._txn is not None:
            raise ApplyFailed(f"{self.directory}: bump while v{self._txn.manifest.version} is open")
        self._finish_rollback()
        if self._broken:  # a failed flush (or a rollback's sync): recovered first, as a begin
            self._recover()  # is (the version taken over one not known durable, else)
            if self.state.version is None:
                raise self._base_removed(manifest)
        if self._edited():
            raise self._base_removed(manifest, _EDITED)
        if self._ps.redo:  # its checksums are checked against the bytes: merged first
            self._compact("zero-diff")
            if self.state.version is None:
                raise self._base_removed(manifest)
        check_base(self.state.version, self.state.run_id, manifest, str(self.directory))
        check_tensor_set(self._held(), manifest, str(self.directory))
        self._set(bumped(self._ps, manifest))
        self._after_commit(manifest.version)

    def _after_commit(self, version: int, *, clear_journal: bool = True) -> None:
        """Housekeeping once state.json holds ``version``, never failing it: the HF index before
        the ack (a reloading engine's server reads it); the undo records (``clear_journal``,
        progressive ones kept as spares) then, or after the ack; a failed clear retried later."""

        def tried(step: Callable[[], None]) -> None:
            try:
                step()
            except OSError as exc:
                logger.warning(
                    "%s: v%s committed, but housekeeping failed: %s", self.directory, version, exc
                )

        if clear_journal:
            tried(self._recycle_journal)
        tried(lambda: self._write_index(version))
