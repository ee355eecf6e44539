"""Progress bars: drawn on a terminal for operations that last, silent otherwise."""

from __future__ import annotations

import io

from asyncsync.console.progress import Progress, ProgressWatcher
from tests.conftest import eventually


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


class Source:
    """The progress a watcher polls, and a count of its polls to step it by.

    The watcher handles what one poll returned before it polls again, so once ``polls`` has
    grown by two after a change, the change has been dealt with (drawn, refreshed or closed).
    """

    def __init__(self, p: Progress = None) -> None:
        self.p = p
        self.polls = 0

    def __call__(self) -> Progress:
        self.polls += 1
        return self.p

    async def dealt_with(self, what: str) -> None:
        target = self.polls + 2
        await eventually(lambda: self.polls >= target, f"the watcher to deal with {what}")


class Clock:
    """The watcher's time, moved by the test only."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_bar_follows_the_source_after_the_delay() -> None:
    src, clock, out = Source(), Clock(), Tty()
    async with ProgressWatcher(src, interval=0.001, delay=5, stream=out, clock=clock) as w:
        src.p = ("e0: v3", 0, 10)
        await src.dealt_with("a new operation")
        clock.now += 4.9
        await src.dealt_with("an operation younger than the delay")
        assert w.drawn == 0
        clock.now += 0.1
        await src.dealt_with("an operation as old as the delay")
        assert w.drawn == 1
        src.p = ("e0: v3", 7, 10)
        await src.dealt_with("progress")
        assert "e0: v3" in out.getvalue() and "7/10" in out.getvalue()
        src.p = None
        await src.dealt_with("the end of the operation")
        src.p = ("e0: v3", 8, 10)  # a new operation, even with the same label
        await src.dealt_with("a new operation")
        assert w.drawn == 1  # not drawn before its own delay
        clock.now += 5
        await src.dealt_with("the second operation's delay")
        assert w.drawn == 2


async def test_quiet_for_short_operations_and_non_terminals() -> None:
    src, clock = Source(("x", 0, 1)), Clock()
    async with ProgressWatcher(src, interval=0.001, delay=10, stream=Tty(), clock=clock) as w:
        await src.dealt_with("an operation")
        clock.now += 9.9
        await src.dealt_with("an operation younger than the delay")
        src.p = None
        await src.dealt_with("its end")
        clock.now += 100
        await src.dealt_with("time passing with nothing in flight")
    assert w.drawn == 0
    plain, src = io.StringIO(), Source(("x", 0, 1))
    async with ProgressWatcher(src, interval=0.001, delay=0, stream=plain, clock=clock) as w:
        assert not w.enabled
    assert src.polls == 0 and w.drawn == 0 and plain.getvalue() == ""
