"""Liveness by observed change (FORMAT.md 7.1): a record its writer rewrites every so often (a
lease, a claim) is live while a reader sees it change, on the reader's own monotonic clock.

No file's mtime is compared with any clock. On an object-store FUSE mount (rclone, s3fs,
gcsfuse) a file's mtime is its *writer's* clock, not the file server's, so an age measured
from it carries the skew between the writer's host and the reader's: a reader whose clock
runs an hour ahead saw every lease as an hour old (and took live ones), one an hour behind
saw dead ones as fresh. A change seen between two reads needs no clock but the reader's.
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass

__all__ = ["ChangeWatch", "Look"]


@dataclass(frozen=True)
class Look:
    """What a reader knows of one record after a look: ``renewed`` when it changed since the
    reader first saw it (its writer is live), and ``still``: the seconds its current content has
    been seen unchanged (0 at the first look and after each change)."""

    renewed: bool
    still: float


@dataclass
class _Seen:
    mark: Hashable
    since: float  # monotonic: when this mark was first seen
    renewed: bool


class ChangeWatch:
    """The records one reader has seen, by key (a path), each with what it held and since when.

    ``look(key, mark)`` with ``mark`` anything that changes at every write of the record (its
    content and mtime): a record that is gone is :meth:`forget`-ten, so that one written again
    later counts from its own first look.
    """

    def __init__(self) -> None:
        self._seen: dict[str, _Seen] = {}

    def __repr__(self) -> str:
        return f"<ChangeWatch records={len(self._seen)}>"

    def look(self, key: str, mark: Hashable) -> Look:
        now = time.monotonic()
        seen = self._seen.get(key)
        if seen is None:
            if len(self._seen) >= 4096:  # bounded: records come and go
                self._seen.clear()
            self._seen[key] = _Seen(mark, now, False)
            return Look(False, 0.0)
        if seen.mark != mark:
            seen.mark, seen.since, seen.renewed = mark, now, True
        return Look(seen.renewed, now - seen.since)

    def forget(self, key: str) -> None:
        self._seen.pop(key, None)
