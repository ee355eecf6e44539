"""Liveness by observed change (FORMAT.md 7.1): a record its writer rewrites every so often (a
lease, a claim) is live while a reader sees it change, on the reader's own monotonic clock.

No file's mtime is compared with any clock. On an object-store FUSE mount (rclone, s3fs,
gcsfuse) a file's mtime is its *writer's* clock, not the file server's, so an age measured
from it carries the skew between the writer's host and the reader's: a reader whose clock
runs an hour ahead saw every lease as an hour old (and took live ones), one an hour behind
saw dead ones as fresh. A change seen between two reads needs no clock but the reader's.
"""

from __future__ import annotations

import contextlib
import stat
import time
from collections.abc import Callable, Collection, Hashable
from dataclasses import dataclass
from pathlib import Path

from asyncsync.format.lease_file import (
    DEFAULT_LEASE_TTL,
    UnreadableLease,
    inspect_lease,
    lease_path,
)
from asyncsync.fsio import lstat, remove, scan

__all__ = ["WATCH_LIMIT", "ChangeWatch", "LeftTemps", "Look", "watch_leases"]


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


#: the longest a one-shot reader (``asyncsync status``, ``asyncsync gc``) watches leases: a
#: lease is decided within its ttl (30 s by default); one with a longer ttl stays undecided
WATCH_LIMIT = 120.0


def watch_leases(
    root: Path,
    engine_ids: Collection[str],
    *,
    wait: float,
    watch: ChangeWatch | None = None,
    poll: float = 0.2,
) -> dict[str, bool | None]:
    """Whether the receiver holding each engine id is live, by its lease (FORMAT.md 7): True
    once its lease was seen renewed (whatever the dates on it: its host's clock may be off by
    hours), False when there is none (no receiver holds the id) or it was seen unchanged for its
    ttl, None while undecided. Looks until every one is decided or ``wait`` seconds passed
    (0: one look each; ``watch`` keeps what earlier looks saw, for a caller that looks again
    at its next run, e.g. retention after each commit)."""
    watch = ChangeWatch() if watch is None else watch
    out: dict[str, bool | None] = {}
    pending = sorted(set(engine_ids))
    deadline = time.monotonic() + wait
    while True:
        for engine_id in pending:
            path = lease_path(root, engine_id)
            found = inspect_lease(root, engine_id)
            if found is None:
                watch.forget(str(path))
                out[engine_id] = False
                continue
            if isinstance(found, UnreadableLease):
                look, ttl = watch.look(str(path), found.ident), DEFAULT_LEASE_TTL
            else:
                look, ttl = watch.look(str(path), found[0]), found[0].ttl
            out[engine_id] = False if look.still > ttl else True if look.renewed else None
        pending = [e for e in pending if out[e] is None]
        left = deadline - time.monotonic()
        if not pending or left <= 0:
            return out
        time.sleep(min(poll, left))


class LeftTemps:
    """The temp files in ``directory`` (the names ``is_left`` accepts) that writers killed
    between a temp and its rename left (FORMAT.md 7.1, 10): each is removed once this process
    has seen it unchanged (inode, size, mtime) for ``older_than`` seconds on its own monotonic
    clock. Never by a temp's mtime against a clock: on object-store mounts that is the writer's
    clock, so the temp of a live writer whose clock runs behind looked old and was removed under
    it (its rename failed), and that of a dead one whose clock runs ahead was never removed. A
    write in flight renames its temp, or grows it, well within ``older_than``.

    Cost: the first :meth:`sweep` lists ``directory`` (an ``lstat`` per entry); each later one
    ``lstat``s only the temps seen and not decided yet, nothing once they are removed or gone
    (a temp that appears later is seen by the next :class:`LeftTemps`: the next take or start).
    A temp goes at the first sweep ``older_than`` or more after the first one saw it.
    """

    def __init__(
        self, root: Path, directory: Path, is_left: Callable[[str], object], older_than: float
    ) -> None:
        self.root, self.directory, self.older_than = root, directory, older_than
        self._is_left = is_left
        self._watch = ChangeWatch()
        self._pending: list[str] | None = None  # None: not listed yet

    def __repr__(self) -> str:
        pending = "unlisted" if self._pending is None else len(self._pending)
        return f"<LeftTemps {self.directory} pending={pending}>"

    @property
    def pending(self) -> bool:
        """Whether a sweep has more to look at (not listed yet, or temps not decided)."""
        return self._pending is None or bool(self._pending)

    def sweep(self) -> list[str]:
        """Look at the temps (the first call lists the directory, a missing one holds none) and
        remove those seen unchanged for ``older_than``; their names. OSError when the directory
        cannot be looked at (not a directory, a symlink)."""
        if self._pending is None:
            try:
                found = [
                    (n, st) for n, st in scan(self.directory, root=self.root) if self._is_left(n)
                ]
            except FileNotFoundError:
                found = []
        else:
            found = []
            for name in self._pending:
                st = lstat(self.directory / name, root=self.root)
                if st is not None:
                    found.append((name, st))
        self._pending, gone = [], []
        for name, st in found:
            if not stat.S_ISREG(st.st_mode):  # a writer's temp is a regular file
                continue
            if (
                self._watch.look(name, (st.st_ino, st.st_size, st.st_mtime_ns)).still
                <= self.older_than
            ):
                self._pending.append(name)
                continue
            with contextlib.suppress(OSError):
                if remove(self.directory / name, root=self.root):
                    gone.append(name)
        return gone
