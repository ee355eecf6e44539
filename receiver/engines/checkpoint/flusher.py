"""The flush after the ack: committed deltas written back to disk on the engine's own thread
(:class:`Flusher`), one at a time, in order, beside the next delta."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from asyncsync.errors import AsyncSyncError
from receiver.engines.st_layout import FileMaps

__all__ = ["Flusher"]


class Flusher:
    """Runs ``flush(maps, version)`` for each committed delta on a thread of its own (not a
    task, which the loop that started it cancels as it ends: ``asyncio.run``), in order.

    A flush still waiting when a newer version's is submitted is dropped, its maps closed: the
    newer one writes back every data file (``fsync_data_files``), so it covers the dropped
    one's pages, and only the newest version may be marked ``synced`` anyway. However far the
    versions run ahead of a slow disk, at most two flushes (one running, one waiting) hold
    their maps, a descriptor and a mapping per file, instead of one per version behind (the
    descriptors ran out: EMFILE broke the engine)."""

    def __init__(self, name: str, flush: Callable[[FileMaps, int], None]) -> None:
        self._name = name
        self._flush = flush
        self._pool: ThreadPoolExecutor | None = None
        self._waiting: tuple[Future[None], FileMaps] | None = None  # submitted last
        self.pending: Future[None] | None = None  # the newest flush, until awaited

    def submit(self, maps: FileMaps, version: int) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, self._name)
        if (waiting := self._waiting) is not None and waiting[0].cancel():  # not started
            waiting[1].close()
        self.pending = self._pool.submit(self._flush, maps, version)
        self._waiting = (self.pending, maps)

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
        pool, self._pool, self._waiting = self._pool, None, None
        if pool is not None:
            pool.shutdown(wait=False)
