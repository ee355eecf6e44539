"""Progress bars for long operations (seeding, keyframes, catch-up, bench) on a terminal.

The work itself never knows about bars: publishers and agents expose their progress as plain
numbers (``Publisher.progress``, ``ReceiverAgent.status().progress``), and a
:class:`ProgressWatcher` task polls such a source and draws a tqdm bar on stderr while an
operation is in flight. Nothing is drawn when stderr is not a terminal (logs, CI, pipes), or
when the operation finishes before ``delay`` seconds: short syncs stay quiet.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Callable
from typing import Any, TextIO

__all__ = ["Progress", "ProgressWatcher"]

#: (label, done, total) of the operation in flight, or None when idle
Progress = tuple[str, int, int] | None


class ProgressWatcher:
    """Poll ``source`` every ``interval`` seconds and mirror it in a tqdm bar.

    A bar appears once an operation (a label) has been in flight for ``delay`` seconds of
    ``clock`` (the event loop's clock by default; tests pass one they advance by hand).

    Example::

        async with ProgressWatcher(lambda: agent_progress(agent)):
            await agent.run()
    """

    def __init__(
        self,
        source: Callable[[], Progress],
        *,
        interval: float = 0.2,
        delay: float = 1.0,
        stream: TextIO | None = None,
        force: bool = False,
        unit: str = "shard",
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.source = source
        self.interval = interval
        self.delay = delay
        self.stream = stream or sys.stderr
        self.enabled = force or (hasattr(self.stream, "isatty") and self.stream.isatty())
        self.unit = unit
        self.clock = clock
        self._task: asyncio.Task[None] | None = None
        self.drawn = 0  # bars shown (for tests)

    async def __aenter__(self) -> ProgressWatcher:
        if self.enabled:
            self._task = asyncio.create_task(self._watch(), name="progress")
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _watch(self) -> None:
        from tqdm import tqdm

        bar: Any = None
        label: str | None = None
        seen_since: float | None = None
        clock = self.clock or asyncio.get_running_loop().time
        try:
            while True:
                p = self.source()
                now = clock()
                if p is None:
                    if bar is not None:
                        bar.close()
                    bar, label, seen_since = None, None, None
                else:
                    name, done, total = p
                    if name != label:
                        if bar is not None:
                            bar.close()
                        bar, label, seen_since = None, name, now
                    if bar is None and seen_since is not None and now - seen_since >= self.delay:
                        bar = tqdm(total=total, desc=name, unit=self.unit, file=self.stream,
                                   leave=False, dynamic_ncols=True)  # fmt: skip
                        self.drawn += 1
                    if bar is not None:
                        bar.total = total
                        bar.n = done
                        bar.refresh()
                await asyncio.sleep(self.interval)
        finally:
            if bar is not None:
                bar.close()
