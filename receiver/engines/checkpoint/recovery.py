"""What :class:`~receiver.engines.checkpoint.LocalCheckpoint` does when it finds its directory
not as it left it: ``open`` after a crash (an interrupted delta undone from its journal, an
interrupted full apply wiped, a version committed before it was durable checked again), the
recovery after a failed flush, a rollback that failed done again, and the wipe that sends the
receiver back to a keyframe. The rules are in :mod:`receiver.engines.checkpoint`.

:class:`Recovery` is a part of the engine, not an object of its own: it reads and writes the
engine's state (declared below), always under the engine's lock (``LocalCheckpoint._run``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from asyncsync import fsio
from asyncsync.errors import EngineStateError
from asyncsync.format import Manifest
from receiver.engines.base import AuditReport, EngineState
from receiver.engines.checkpoint import inplace, journal
from receiver.engines.checkpoint.files import CheckpointFiles, verify_checkpoint
from receiver.engines.checkpoint.flusher import Flusher
from receiver.engines.checkpoint.stamps import Stamps
from receiver.engines.st_layout import FileMaps, TensorLocation, no_copy_on_write
from receiver.state import STATE_NAME, PersistedState, StateStore, check_writable, unwritable

if TYPE_CHECKING:
    from receiver.engines.checkpoint.engine import _Txn

__all__ = ["Recovery", "own_dir"]

logger = logging.getLogger(__name__)


def _own_file(path: Path) -> bool:
    """A regular file with one link, which a delta writes in place (a symlink or a hard link
    is copied into a file of the checkpoint's own first: ``own_data_files``)."""
    st = fsio.lstat(path)
    return st is not None and stat.S_ISREG(st.st_mode) and st.st_nlink == 1


_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFREG: "a regular file", stat.S_IFLNK: "a symlink"}


def own_dir(path: Path) -> None:
    """Make the state directory's ``path`` (journal/, staging/, redo/) where missing; anything else
    there (a FIFO, a file: mkdir said only "File exists") is refused by name, never removed."""
    try:
        fsio.make_dir(path)  # 0755 whatever the umask (0177: one it could not enter)
    except FileExistsError:
        st = fsio.lstat(path)
        if st is not None and not stat.S_ISDIR(st.st_mode):
            kind = _KINDS.get(stat.S_IFMT(st.st_mode), "a special file")
            raise EngineStateError(
                f"{path} is {kind}, not the engine's own directory; remove it (the receiver "
                "makes it again)"
            ) from None


class Recovery:
    """The engine's state changes and its ways back to a version it fully holds (a mixin of
    :class:`~receiver.engines.checkpoint.LocalCheckpoint`, which sets every attribute)."""

    directory: Path
    files: CheckpointFiles
    state: EngineState
    _store: StateStore
    _ps: PersistedState
    _layout: dict[str, TensorLocation]
    _flusher: Flusher
    _stamps: Stamps
    _broken: str | None  # why the last flush failed (the held version must be checked again)
    _undo_pending: str | None  # a rollback that failed: done again at the next begin
    _txn: _Txn | None  # the version being applied, between begin and commit or abort
    #: why the files of the version held cannot be read back (a FIFO, a device, a directory
    #: put in place of a data file: refused, never opened nor removed); None: they can
    _unreadable: str | None = None

    def ackable(self) -> EngineState:
        """Nothing while the files cannot be read back (:attr:`_unreadable`): the ack claims no
        version the files may no longer hold (``Engine.ackable``)."""
        return EngineState() if self._unreadable else self.state

    async def serving_version(self) -> int | None:
        """None while the files cannot be read back: ``/readyz`` answers 503."""
        return None if self._unreadable else self.state.version

    def _refuse_unsafe(self, exc: EngineStateError) -> None:
        """Raise ``exc`` when it is a data file that is not a regular file (``fsio.UnsafePath``:
        put there, not an edit of the bytes; refused, never opened nor removed), the files
        then claimed by no ack nor ``/readyz`` until they read again."""
        if isinstance(exc.__cause__, fsio.UnsafePath):
            self._unreadable = str(exc)
            raise exc

    def _set(self, ps: PersistedState, *, spare: bool = False, restamp: bool = True) -> None:
        """Save ``ps``; the files stamped as they are (``restamp``: False where the engine has
        not just written them, whose stamps are those it recorded then)."""
        self._ps = self._store.save(ps, spare=spare)
        self.state = EngineState(ps.head_version, ps.run_id, ps.head_fingerprint)
        if ps.version is None:
            self._stamps.forget()
        elif not ps.applying and restamp:  # the files hold ps.version, as this engine left them
            self._stamps.record()

    def _open(self) -> EngineState:
        if self._store.locked:
            return self.state
        try:
            fsio.make_dir(self.directory, parents=True, exist_ok=True)  # 0755: servers read it
        except OSError as exc:  # a read-only filesystem, a parent of another uid
            if (refused := self._refused(exc)) is None:
                raise
            raise refused from exc
        no_copy_on_write(self.directory)  # btrfs: the files it gets from now on (and staging/)
        if not os.path.lexists(self._store.directory / STATE_NAME):  # (a symlink: load names it)
            self.files.refuse_foreign()
        ps = self._store.open()
        rewrite = bool(self._broken) or self._flusher.failed_before()
        self._broken = None  # a flush failed (here, or before a restart): rewritten, checked below
        fresh = ps is None
        try:  # every write refused now, not at the first version's (the lock opened: 0644)
            check_writable(self._written(), self.directory)
            # a copy of a linked data file (own_data_files) or an index cut short by a kill
            fsio.remove_temp_files(self.directory)
            self._stamps.load()
            if ps is None:
                self.files.refuse_foreign()
                ps = PersistedState()
            self._ps = ps
            for d in (self._store.journal_dir, self._store.staging_dir):
                own_dir(d)
            no_copy_on_write(self._store.staging_dir)  # made before the flag, by an older one
            fsio.fsync_dir(self._store.directory)  # durable before a journal record or staged file
            self._flusher.prepare()
            if ps.applying and ps.mode == "delta":
                logger.warning(
                    "%s: interrupted delta to v%s; undoing", self.directory, ps.target_version
                )
                try:  # a file cut or replaced behind its back mid-apply (the writes through
                    # its mapping then end the receiver with SIGBUS): no undo mends that
                    self._layout = self.files.load_layout()
                except EngineStateError as exc:  # (a FIFO, a device put there: refused)
                    self._refuse_unsafe(exc)
                    self._lost(exc)
                else:
                    maps = FileMaps(self.directory)
                    try:
                        self._undo(maps, at_open=True)  # progressive: not synced, checked below
                    except inplace.LostJournal as exc:
                        self._lost(exc)
                    finally:
                        maps.close()
            elif ps.applying:
                logger.warning(
                    "%s: interrupted full apply of v%s; the files are mixed, removing them so "
                    "the receiver re-initialises from a keyframe",
                    self.directory,
                    ps.target_version,
                )
                self._wipe()
            else:  # stale: a commit that finished (a progressive record kept as a spare)
                self._recycle_journal()
                self._store.clear_dir(self._store.staging_dir)
            if not self._ps.synced and self._ps.version is not None:
                self._check_unsynced(rewrite)
            if fresh:  # the first state.json: the directory is an asyncsync checkpoint now
                self._set(self._ps)
            else:  # saved by each step that changed it: none written to a full disk for nothing
                ps = self._ps
                self.state = EngineState(ps.head_version, ps.run_id, ps.head_fingerprint)
            if self._ps.version is not None and not self._edited():
                self._layout = self.files.load_layout()
                if self._ps.checksums and set(self._ps.checksums) != set(self._layout):
                    raise EngineStateError(
                        f"{self.directory}: the tensors in the files differ from state.json; "
                        "remove the directory to re-initialise from the newest keyframe"
                    )
            else:  # nothing to write again before it is trusted (a wipe killed before the note)
                self._flusher.clear()
                if self.files.data_files():
                    logger.warning("%s: holds no version but has data files", self.directory)
        except BaseException:
            self._store.close()
            raise
        logger.info("%s: open at version %s", self.directory, self.state.version)
        return self.state

    def _lost(self, exc: Exception) -> None:
        """An interrupted delta that cannot be undone: the files wiped (the receiver
        re-initialises from a keyframe), not refused for good ("remove it to reinit")."""
        logger.warning("%s: %s; removing the files so the receiver re-initialises from a "
                       "keyframe", self.directory, exc)  # fmt: skip
        self._wipe()

    def _written(self) -> list[Path]:
        """The directories and files the engine writes (a data file with other links is
        copied into one of its own before a delta writes it: only its directory counts)."""
        store = self._store
        dirs = [self.directory, store.directory, store.journal_dir, store.staging_dir]
        return [*dirs, store.redo_dir, *filter(_own_file, self.files.data_files())]

    def _refused(self, exc: OSError) -> EngineStateError | None:
        """The typed error of a write the filesystem refused (None: ``exc`` is another),
        naming the path refused: where ``exc`` names none (a file opened in its directory),
        the first the engine writes that this process may not."""
        name = exc.filename
        if isinstance(name, str) and os.path.isabs(name):
            return unwritable(Path(name), exc, self.directory)
        try:
            check_writable(self._written(), self.directory, exc)
        except EngineStateError as err:
            return err
        except OSError:  # (the directory gone meanwhile): named as a whole
            pass
        return unwritable(self.directory, exc, self.directory)

    def _check_unsynced(self, rewrite: bool = False) -> None:
        """The held version was committed before it was durable and the receiver stopped (or
        its flush failed): if the machine went down (or the kernel dropped pages a failed flush
        could not write), some of its pages may be lost. Keep it if every tensor still matches,
        else wipe (the receiver re-initialises from a keyframe); a layout that no longer reads
        is wiped too, but not a FIFO, device or directory put there: refused and left."""
        ps = self._ps
        try:
            self._layout = self.files.load_layout()
        except EngineStateError as exc:  # a header in the pages lost (no layout: no checksums)
            self._refuse_unsafe(exc)  # a FIFO put there: refused, as _edited and the audit do
            logger.warning("%s: %s", self.directory, exc)
            bad = ["(its file's header)"]
        else:
            bad = inplace.mismatched(self.directory, self._layout, ps)
        if bad:
            logger.warning(
                "%s: v%s was committed but not yet durable (its flush failed, or the receiver "
                "stopped first), and %d tensors (e.g. %r) no longer match it; removing the "
                "files so the receiver re-initialises from a keyframe",
                self.directory, ps.version, len(bad), bad[0],
            )  # fmt: skip
            self._wipe()
            return
        (self.files.rewrite_data_files if rewrite else self.files.fsync_data_files)()
        self._flusher.clear()
        self._set(replace(ps, synced=True))
        logger.info("%s: v%s verified and made durable again", self.directory, ps.version)

    def _edited(self) -> bool:
        """Whether the data files were changed behind the engine's back, so that the version
        held is theirs no more (:mod:`~receiver.engines.checkpoint.stamps`): the files whose
        stamps changed are checked against the held version's checksums, and wiped if any
        tensor differs or their layout no longer reads (True: the engine holds nothing now).
        Nothing recorded (a checkpoint of an older receiver): stamped as they are."""
        if self._ps.version is None or self._ps.applying:
            self._unreadable = None
            return False
        changed = self._stamps.changed()
        if self._unreadable is not None:  # every file read again until they do (its stamps
            changed = (changed or set()) | set(self.files.stamps())  # may be the FIFO's)
        if not changed:
            if changed is None:
                self._stamps.record()
            return False
        try:
            self._layout = self.files.load_layout()
        except EngineStateError as exc:
            self._refuse_unsafe(exc)  # a FIFO, a device, a directory put there: refused
            self._unreadable = None
            bad = [f"(a file's layout: {exc})"]
        else:
            self._unreadable = None  # (every file reads: checked below as any other change)
            ps = self._ps
            bad = sorted(set(ps.checksums) ^ set(self._layout)) if ps.checksums else []
            part = {n: loc for n, loc in self._layout.items() if loc.file in changed}
            bad += inplace.mismatched(self.directory, part, ps)
        files = ", ".join(sorted(changed))
        if not bad:
            logger.info("%s: %s changed since this receiver wrote them, but every tensor "
                        "still matches v%s", self.directory, files, self._ps.version)  # fmt: skip
            self._stamps.record()
            return False
        logger.warning(
            "%s: %s changed behind the receiver's back and %d tensors (e.g. %r) no longer "
            "match v%s; removing the files so the receiver re-initialises from a keyframe",
            self.directory, files, len(bad), bad[0], self._ps.version,
        )  # fmt: skip
        self._wipe()
        return True

    def _edited_under_flush(self) -> bool:
        """Whether the data files changed behind the engine's back while a flush of theirs
        runs: their check (:meth:`_edited`) may wipe them, so it waits for the flush (a wipe
        under it failed it on the files removed: the engine marked broken, the failure noted)."""
        if self._ps.version is None or self._ps.applying or not self._flusher.running():
            return False
        return bool(self._stamps.changed())

    def _edited_unless_flushing(self) -> bool | None:
        """:meth:`_edited`, or None (nothing checked) while a flush runs under edited files."""
        return None if self._edited_under_flush() else self._edited()

    def _audit(self, manifest: Manifest) -> AuditReport | None:
        """:meth:`LocalCheckpoint.audit` (None: nothing held, a repair removed it)."""
        if self._ps.version is None:
            return None
        if (self._ps.version, self._ps.run_id) != (manifest.version, manifest.run_id):
            raise EngineStateError(
                f"{self.directory} holds v{self._ps.version}, not v{manifest.version} of run "
                f"{manifest.run_id}: audit the manifest of the version held"
            )
        # A delta patched into the files in place may be open (streamed before its manifest,
        # outside the agent's lock the auditor holds): the tensors it patched hold its bytes,
        # not the version held's, and are not compared; the others are (attack-80)
        txn, skipped = self._txn, {}
        if txn is not None and txn.maps is not None:
            why = f"being patched to v{txn.manifest.version} (a delta applied before its manifest)"
            skipped = {e.name: why for e in manifest.tensors if e.name in txn.seen}
        try:
            bad = verify_checkpoint(
                self.directory, manifest, file_prefix=self.files.file_prefix, skip=skipped
            )
        except EngineStateError as exc:  # a layout that no longer reads: nothing matches
            self._refuse_unsafe(exc)  # a FIFO put there: refused
            bad = [e.name for e in manifest.tensors]
        checked = len(manifest.tensors) - len(skipped)
        return AuditReport(manifest.version, checked, tuple(bad), skipped, "the files")

    def _wipe_audited(self) -> None:
        """:meth:`LocalCheckpoint.repair`: the files hold the version no more."""
        if self._ps.version is not None:
            logger.warning("%s: an audit found other bytes in the files than v%s; removing "
                           "them so the receiver re-initialises from a keyframe",
                           self.directory, self._ps.version)  # fmt: skip
            self._wipe()

    def _recycle_journal(self) -> None:
        """Clear undo records that state.json's version has made stale (never undone): the
        progressive ones are kept as spares that the next records are written over
        (:func:`journal.recycled_name`), the others removed."""
        self._store.clear_dir(self._store.journal_dir, keep=journal.recycled_name)

    def _recover(self) -> None:
        """After a failed flush, what a reopen does (the held version is not ``synced``): check
        it again and flush it (an error there: still broken, the begin refused), or wipe it."""
        if (why := self._broken) is None:
            return
        self._finish_rollback()
        if self._ps.version is not None:
            self._check_unsynced(rewrite=True)  # a failed flush's pages may be clean, unwritten
        self._broken = None
        done = "wiped" if self.state.version is None else f"flushed again, at v{self.state.version}"
        logger.info("%s: %s; %s", self.directory, why, done)

    def _wipe(self) -> None:
        """Forget everything: the state holds no version (first, durably: a wipe cut short
        then leaves a directory that opens empty, not one that names removed files), then
        remove data files, index, staging and journal, and last a failed flush's note (its
        files gone, nothing is left to write again). On a full disk the state is written over
        the state's spare (no new block: an open after a delta whose undo record was lost
        failed for want of space); where that is refused too, the files go first (freeing
        their space) where the state left makes an open wipe again (a full apply, a version
        not known durable): a wipe cut short still opens empty."""
        self._layout, self._unreadable = {}, None  # (a FIFO there: unlinked, never opened)
        try:
            self._set(PersistedState(), spare=True)
        except OSError:
            ps = self._ps
            if not (ps.mode == "full" if ps.applying else not ps.synced):
                raise
            self.state = EngineState()  # its files go: claimed no more, saved or not
            self.files.remove_data()
            self._set(PersistedState())
        self.files.remove_data()
        self._store.clear_dir(self._store.staging_dir)
        self._store.clear_dir(self._store.journal_dir)
        self._store.clear_dir(self._store.redo_dir)  # they applied on the files removed
        with contextlib.suppress(OSError):  # kept, it costs one rewrite at a later open
            self._flusher.clear()

    def _undo(self, maps: FileMaps, *, at_open: bool = False) -> None:
        """:func:`inplace.undo`, then the state clean. At open after a progressive delta also
        not ``synced`` (durably, before its records go: a crash of the machine may have cost
        pages the records cannot restore, so the bytes are checked before they are trusted);
        in the process the page cache is whole and the undo's sync makes it durable."""
        dropped = self._drop_stale_records()  # at open, checked as lost pages are: a record
        # taken for stale by its header alone may be one of this apply's, its header damaged
        progressive = inplace.undo(self._store.journal_dir, self._layout, maps, sync=False)
        lost = at_open and (progressive or self._ps.progressive or dropped)
        clean = replace(self._ps.clean(), synced=self._ps.synced and not lost)
        try:
            maps.sync()
        except OSError as exc:
            if at_open or not progressive:  # durable records (or none): kept, they restore
                raise  # it exactly after a reboot (a check could only wipe it): done again
            self._undone_unsynced(clean, exc)
            return
        # a file truncated or replaced behind its back meanwhile keeps the stamps it had, so
        # the next begin checks it (stamped as the undo left it, every later delta failed on
        # it, "buffer is smaller than requested size", the ack kept on the version before)
        restamp = self._stamps.only_rewritten()
        try:  # on a full disk over the state's spare (no new block)
            self._set(clean, spare=True, restamp=restamp)
        except OSError:  # a full disk (no block or inode left), which the records may fill: the
            self._store.clear_dir(self._store.journal_dir)  # old bytes are durable, they can go
            self._set(clean, spare=True, restamp=restamp)  # first (open() then finds an
            # interrupted delta without records)
        self._store.clear_dir(self._store.journal_dir)

    def _drop_stale_records(self) -> bool:
        """Remove the undo records of another version than the one being undone: each is of
        an apply that ended (committed: the files hold its new bytes), left where its removal
        failed; written back, its old bytes (of a version before the files' base) would mix the
        files (RELIABILITY.md, the checkpoint's redo log).
        A redo log's compaction marks the state ``applying`` before it clears the journal, so a
        crash between the two met them. Raises where one cannot be removed (undone again);
        returns whether any was removed."""
        target, jdir = self._ps.target_version, self._store.journal_dir
        if target is None or not jdir.is_dir() or jdir.is_symlink():
            return False
        stale = [
            (p, v)
            for p in jdir.iterdir()
            if p.name.startswith("undo-") and (v := journal.target_version(p)) not in (None, target)
        ]
        for path, version in stale:
            logger.warning("%s: undo record %s is of v%s, not of v%s being undone: stale (its "
                           "apply ended), removed", self.directory, path.name, version,
                           target)  # fmt: skip
            path.unlink()
        if stale:
            fsio.fsync_dir(jdir)
        return bool(stale)

    def _undone_unsynced(self, clean: PersistedState, exc: OSError) -> None:
        """A rollback written back whose data sync failed (a disk that cannot write the
        blocks): ended as a failed flush is, not kept ``applying`` to be undone again from
        progressive records, which were never durable (lost with the pages a failed writeback
        leaves clean). The note first (else a restart could trust a plain fsync of pages left
        clean, unwritten), then the state clean at the held version, not durable: the recovery
        (:meth:`_recover`, at the next begin or sync) checks it and writes it again, or wipes
        it. Raises where the disk refuses the note or the state (the rollback done again)."""
        why = f"the rollback to v{clean.version} was written back, its sync failed ({exc})"
        if not self._flusher.note(why):
            raise exc
        self._set(replace(clean, synced=False), spare=True)
        self._broken = why
        logger.error("%s: %s", self.directory, why)
        with contextlib.suppress(OSError):  # stale once the state is clean (cleared at begin)
            self._store.clear_dir(self._store.journal_dir)

    def _finish_rollback(self) -> None:
        """Undo again after a rollback that failed (idempotent): the engine goes on once the
        cause (a full disk) is gone, without a reopen."""
        if (why := self._undo_pending) is not None:
            maps = FileMaps(self.directory)
            try:
                self._undo(maps)
            except Exception as exc:
                again = "the same" if str(exc) in why else str(exc)
                raise EngineStateError(f"{self.directory}: {why}; retried: {again}") from exc
            finally:
                maps.close()
            self._undo_pending = None
            logger.info("%s: %s; retried: back at v%s", self.directory, why, self.state.version)
