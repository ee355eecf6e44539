"""Notices a reader says about what it went past, capped per minute (:class:`NoticeCap`).

A reader that polls (``asyncsync tail -f``, a receiver waiting for acks) meets the same kind of
junk again and again: lines of the log that are no records, ack files that do not parse. Each
is worth one line to the operator, but a steady stream of them must not become a steady stream
of lines (it gave ``tail -f`` 21 lines at every poll): the first ``limit`` of each ``window``
seconds are said, the rest counted, and one line says how many, at most once a window.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["NoticeCap"]


class NoticeCap:
    """Says the first ``limit`` notices of each ``window`` seconds through ``say`` and counts
    the rest; :meth:`done` (the end of a read or a poll) says how many more there were, in one
    line made by ``summary(count)``: at the first read or poll that went past the cap, then at
    most once a window (a count held past a window is said at the next :meth:`done`)."""

    def __init__(
        self,
        say: Callable[[str], None] | None,
        summary: Callable[[int], str],
        *,
        limit: int = 20,
        window: float = 60.0,
    ) -> None:
        self.say, self.summary, self.limit, self.window = say, summary, limit, window
        self.said = 0  # notices said in this window
        self.held = 0  # counted since the last summary line
        self.began: float | None = None  # when this window began (its first notice)
        self.summed: float | None = None  # when the last summary line was said
        self._lock = threading.Lock()  # (readers in threads: asyncio.to_thread)

    def __call__(self, message: str) -> bool:
        """Say ``message`` unless the cap is reached (then count it); whether it was said."""
        with self._lock:
            now = time.monotonic()
            if self.began is None or now - self.began >= self.window:
                self.began, self.said = now, 0
            if self.said >= self.limit:
                self.held += 1
                return False
            self.said += 1
        if self.say is not None:
            self.say(message)
        return True

    def reset(self) -> None:
        """Forget what was said and counted: a new window begins at the next notice."""
        with self._lock:
            self.said = self.held = 0
            self.began = self.summed = None

    def done(self) -> None:
        with self._lock:
            now = time.monotonic()
            if not self.held or (
                self.summed is not None
                and self.summed >= (self.began or 0.0)
                and now - self.summed < self.window
            ):
                return  # nothing held, or its line said in this window, less than a window ago
            more, self.held, self.summed = self.held, 0, now
        if self.say is not None:
            self.say(self.summary(more))
