"""The stamps of a checkpoint's data files: how the engine tells that they were changed behind
its back (a byte flipped, a file truncated, a copy put in its place) between two of its own
writes.

Whenever ``state.json`` is saved clean at a version, each data file's (inode, size, mtime in
ns) is recorded, in memory and in ``.asyncsync/stamps.json``. Before a delta or a zero diff
begins, at each sync with nothing newer, and at open, the files are stamped again: a file
whose stamp differs has its tensors checked against the held version's checksums (the engine
wipes the files if any differs: the receiver re-initialises from a keyframe, its ack withdrawn).
Without this, a tensor the next versions do not touch kept an edit for good, acknowledged
version after version, and a truncated file refused every delta, the ack left on the version
before.

``stamps.json`` is written without an fsync, after the state: lost or stale (a crash between
the two), it only costs a check of the files the receiver changed since; missing or
unreadable (a checkpoint of an older receiver), the files are stamped as they are, unchecked.
What it cannot see: a change within the clock tick of the file's last write (the same mtime),
and a write through a shared mapping on a filesystem that does not update mtime for those
(tmpfs).
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

from asyncsync import fsio
from receiver.engines.checkpoint.files import CheckpointFiles

__all__ = ["STAMPS_NAME", "Stamps"]

logger = logging.getLogger(__name__)

#: in the engine's state directory: the data files' stamps at the version held
STAMPS_NAME = "stamps.json"


class Stamps:
    """The data files' stamps recorded at the version held (None: none recorded)."""

    def __init__(self, files: CheckpointFiles, state_dir: Path) -> None:
        self.files = files
        self.path = state_dir / STAMPS_NAME
        self.held: dict[str, list[int]] | None = None

    def load(self) -> None:
        """The stamps a previous process recorded (none where missing or unreadable)."""
        self.held = None
        with contextlib.suppress(OSError, ValueError, RecursionError):
            data = json.loads(fsio.read_bytes(self.path, limit=1 << 20))
            if isinstance(data, dict) and all(
                isinstance(v, list) and len(v) == 3 and all(type(x) is int for x in v)
                for v in data.values()
            ):
                self.held = data

    def record(self) -> None:
        """Stamp the files as they are now (the version held is theirs)."""
        self.held = self.files.stamps()
        try:
            data = json.dumps(self.held, separators=(",", ":")).encode()
            fsio.atomic_write(self.path, data, fsync=False, sync_dir=False)
        except OSError as exc:  # a full disk: kept in memory; the next open stamps again
            logger.debug("%s: stamps not saved: %s", self.path, exc)

    def only_rewritten(self) -> bool:
        """Whether the data files are the ones stamped, at the sizes stamped: all an undo of
        the engine's own changes is their mtimes (it rewrites bytes in place). False where one
        was replaced, truncated, added or removed behind its back; True where none recorded."""
        if self.held is None:
            return True
        now = self.files.stamps()
        return now.keys() == self.held.keys() and all(
            v[:2] == self.held[n][:2] for n, v in now.items()
        )

    def forget(self) -> None:
        """The engine holds no version: nothing to compare with."""
        self.held = None
        with contextlib.suppress(OSError):
            self.path.unlink(missing_ok=True)

    def changed(self) -> set[str] | None:
        """The data files whose stamp differs from the one recorded (new and removed ones
        too); None where none was recorded."""
        if self.held is None:
            return None
        now = self.files.stamps()
        return {n for n in now.keys() | self.held.keys() if now.get(n) != self.held.get(n)}
