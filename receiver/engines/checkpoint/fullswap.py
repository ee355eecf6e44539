"""How :class:`~receiver.engines.checkpoint.LocalCheckpoint` applies a full version: every
tensor staged into new files under the state directory, checked, then moved over the old files
at the commit (a crash midway is wiped at open: the rules are in
:mod:`receiver.engines.checkpoint`).

:class:`FullVersions` is a part of the engine, as
:class:`~receiver.engines.checkpoint.recovery.Recovery` is: the engine sets every attribute;
everything here runs under the engine's lock.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from asyncsync import fsio
from asyncsync.errors import ApplyFailed, AsyncSyncError
from asyncsync.format import TensorEntry
from receiver.engines.base import TensorUpdate
from receiver.engines.checkpoint import journal, staging
from receiver.engines.checkpoint.recovery import Recovery
from receiver.rules import holding
from receiver.state import PersistedState

if TYPE_CHECKING:
    from receiver.engines.checkpoint.engine import _Txn

__all__ = ["FullVersions"]

logger = logging.getLogger(__name__)


class FullVersions(Recovery):
    """A full version's apply (staged parts) and commit (the files swapped)."""

    if TYPE_CHECKING:

        def _claim(self, txn: _Txn, u: TensorUpdate) -> TensorEntry: ...

    def _apply_full(self, txn: _Txn, updates: list[TensorUpdate]) -> None:
        items: list[tuple[TensorEntry, torch.Tensor]] = []
        for u in updates:
            entry = self._claim(txn, u)
            if u.full is None:
                raise ApplyFailed(f"tensor {entry.name!r}: full mode needs full data, not a patch")
            items.append((entry, u.full))
        if not items:
            return
        part = f"part-{txn.seq:06d}.safetensors"
        if txn.seq == 0:  # the staged files may need the room of the spare undo records
            journal.drop_spares(self._store.journal_dir)
        txn.seq += 1
        sums = staging.stage_part(
            self._store.staging_dir, part, items, txn.manifest.checksum_algorithm
        )
        txn.parts.append(part)
        txn.staged.update({n: (part, s) for n, s in sums.items()})

    def _commit_full(self, txn: _Txn) -> str:
        m, staged = txn.manifest, self._store.staging_dir
        self._txn = None
        try:
            staging.check_staged(txn.entries, txn.staged, m.version, self.state.version, staged)
            # the layout the swapped files will have, read back before any old file goes
            layout = staging.staged_layout(txn.entries, txn.staged, m.version, staged)
            fsio.fsync_dir(staged)
        except BaseException:
            self._store.clear_dir(staged)
            raise
        n = len(txn.parts)
        final = {p: self.files.file_name(k, n) for k, p in enumerate(txn.parts, 1)}
        weight_map = {name: final[part] for name, (part, _) in txn.staged.items()}
        layout = {name: replace(loc, file=weight_map[name]) for name, loc in layout.items()}
        try:
            self._set(self._ps.begin(m.version, "full"))
            old = set(self.files.data_files())
            for part, name in final.items():
                os.replace(staged / part, self.directory / name)
            self.files.write_index(m.version, weight_map, sum(e.nbytes for e in m.tensors))
            for p in old - {self.directory / name for name in final.values()}:
                p.unlink()
            fsio.fsync_dir(self.directory)
            self._set(holding(PersistedState(), m))  # no redo record: they applied on old files
            self._layout = layout
            self._undo_pending = None  # every file replaced: nothing left to undo
        except BaseException as exc:
            logger.error("%s: full apply of v%s failed midway (%s)", self.directory, m.version, exc)
            with contextlib.suppress(OSError, AsyncSyncError):
                self._wipe()
            raise ApplyFailed(
                f"{self.directory}: moving v{m.version} into place failed ({exc}); the files "
                "were removed, the receiver re-initialises from a keyframe"
            ) from exc
        with contextlib.suppress(OSError):  # kept, it costs one rewrite at a later open
            self._flusher.clear()  # nothing left to write again: every file new and fsynced
        with contextlib.suppress(OSError):  # unnamed: removed at the next open otherwise
            self._store.clear_dir(self._store.redo_dir)
        logger.info("%s: committed full v%s (%d files)", self.directory, m.version, n)
        return m.fingerprint
