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
    task, which the loop that started it cancels as it ends: ``asyncio.run``), in order."""

    def __init__(self, name: str, flush: Callable[[FileMaps, int], None]) -> None:
        self._name = name
        self._flush = flush
        self._pool: ThreadPoolExecutor | None = None
        self.pending: Future[None] | None = None  # the newest flush, until awaited

    def submit(self, maps: FileMaps, version: int) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, self._name)
        self.pending = self._pool.submit(self._flush, maps, version)

    async def wait(self) -> None:
        """Until every flush submitted is done (a failed one is logged and marks
        the engine broken: not raised here)."""
        while (pending := self.pending) is not None:
            with contextlib.suppress(AsyncSyncError):
                await asyncio.shield(asyncio.wrap_future(pending))  # a cancelled caller too
            if self.pending is pending:
                self.pending = None

    def close(self) -> None:
        """Let the thread go (call once :meth:`wait` returned: every flush is done)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False)
