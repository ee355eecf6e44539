"""The flush after the ack: committed deltas written back to disk on the engine's own thread
(:class:`Flusher`), one at a time, in order, beside the next delta."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from asyncsync import fsio
from asyncsync.errors import AsyncSyncError
from receiver.engines.st_layout import FileMaps

__all__ = ["FAILED_NAME", "SPARE_NAME", "Flusher"]

logger = logging.getLogger(__name__)

#: in the engine's state directory while a failed flush's pages may be clean and unwritten
FAILED_NAME = "flush-failed"
#: made at open, renamed to :data:`FAILED_NAME` where the disk refuses the note a new file
SPARE_NAME = "flush-failed.spare"
_SPARE_TEXT = b"a flush failed; the disk refused a new note, so this spare one was renamed\n"
_EMPTY_NOTE = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC


def _note(state_dir: Path, why: str) -> bool:
    """Note, durably where the disk lets it, that a flush failed: the kernel may have marked
    the pages it could not write clean (the error is reported once, to that flush), so an
    fsync at the next open would succeed and write nothing. An open in a new process (the
    receiver restarted) reads the note and writes the data files again before it trusts them
    (``CheckpointFiles.rewrite_data_files``); without it, it could not tell a failed flush from
    one not yet run."""
    try:
        fsio.atomic_write(state_dir / FAILED_NAME, (why + "\n").encode())
    except OSError as exc:  # the disk that failed the flush, full: a rename needs no new block
        try:
            try:
                os.replace(state_dir / SPARE_NAME, state_dir / FAILED_NAME)
            except FileNotFoundError:  # none (the disk full at open): an empty note, a new name
                os.close(os.open(state_dir / FAILED_NAME, _EMPTY_NOTE, 0o644))  # no data block
            fsio.fsync_dir(state_dir)
        except OSError:  # noted again at close (a kill before then: the plain re-check)
            logger.warning("%s: the failed flush could not be noted yet (%s)", state_dir, exc)
            return False
        logger.warning(
            "%s: the failed flush is noted by a spare or empty note (%s)", state_dir, exc
        )
    return True


class Flusher:
    """Runs ``flush(maps, version)`` for each committed delta on a thread of its own (not a
    task, which the loop that started it cancels as it ends: ``asyncio.run``), in order.

    A flush still waiting when a newer version's is submitted is dropped, its maps closed: the
    newer one writes back every data file (``fsync_data_files``), so it covers the dropped
    one's pages, and only the newest version may be marked ``synced`` anyway. However far the
    versions run ahead of a slow disk, at most two flushes (one running, one waiting) hold
    their maps, a descriptor per file, instead of one per version behind (the descriptors ran
    out: EMFILE broke the engine). On Linux the maps come without their mappings (the engine
    drops them at submit, ``FileMaps.unmap``: the next version's mapping is the only one)."""

    def __init__(self, name: str, flush: Callable[[FileMaps, int], None], state_dir: Path) -> None:
        self._name = name
        self._flush = flush
        self._state_dir = state_dir
        self._unnoted: str | None = None  # a failure not yet noted on the disk (:func:`_note`)
        self._pool: ThreadPoolExecutor | None = None
        self._waiting: tuple[Future[None], FileMaps] | None = None  # submitted last
        self.pending: Future[None] | None = None  # the newest flush, until awaited

    def submit(self, maps: FileMaps, version: int) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, self._name)
        if (waiting := self._waiting) is not None and waiting[0].cancel():  # not started
            waiting[1].close()
        self.pending = self._pool.submit(self._run, maps, version)
        self._waiting = (self.pending, maps)

    def running(self) -> bool:
        """Whether a flush submitted is not done yet (running, or waiting behind one)."""
        return (pending := self.pending) is not None and not pending.done()

    def _run(self, maps: FileMaps, version: int) -> None:
        try:
            self._flush(maps, version)
        except BaseException as exc:
            self._unnoted = f"making v{version} durable failed ({exc})"
            if _note(self._state_dir, self._unnoted):
                self._unnoted = None
            raise

    def note(self, why: str) -> bool:
        """Note durably that data pages may be clean and unwritten (a rollback's sync failed,
        as a flush's can): False where the disk refused even a spare or empty note."""
        return _note(self._state_dir, why)

    def prepare(self) -> None:
        """At open: the spare note :func:`_note` renames into place where a disk too full for
        a new file refuses the note (none on a disk already full: an empty note then)."""
        spare = self._state_dir / SPARE_NAME
        if not spare.exists():
            with contextlib.suppress(OSError):
                fsio.atomic_write(spare, _SPARE_TEXT)

    def failed_before(self) -> bool:
        """Whether a flush failed (here, or in an earlier process) since the data files were last
        written again whole: they must be, before an fsync can be trusted."""
        return self._unnoted is not None or (self._state_dir / FAILED_NAME).exists()

    def clear(self) -> None:
        """The data files were written again and synced (or removed): the note goes (a crash
        before this only costs one more rewrite)."""
        self._unnoted = None
        (self._state_dir / FAILED_NAME).unlink(missing_ok=True)
        self.prepare()  # a spare again for the next failure (one renamed for this one)

    async def wait(self) -> None:
        """Until every flush submitted is done or dropped (a failed one is logged and marks
        the engine broken: not raised here)."""
        while (pending := self.pending) is not None:
            try:
                with contextlib.suppress(AsyncSyncError):
                    await asyncio.shield(asyncio.wrap_future(pending))  # a cancelled caller too
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if not pending.cancelled() or (task is not None and task.cancelling()):
                    raise  # the caller was cancelled (a dropped flush: wait for the newer one)
            if self.pending is pending:
                self.pending = None

    def close(self) -> None:
        """Let the thread go (call once :meth:`wait` returned: every flush is done)."""
        if self._unnoted is not None and _note(self._state_dir, self._unnoted):
            self._unnoted = None  # the disk is back: a new process rewrites before it trusts
        pool, self._pool, self._waiting = self._pool, None, None
        if pool is not None:
            pool.shutdown(wait=False)
