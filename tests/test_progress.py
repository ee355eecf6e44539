"""Progress bars: drawn on a terminal for operations that last, silent otherwise."""

from __future__ import annotations

import asyncio
import io

from asyncsync.ops.progress import Progress, ProgressWatcher


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


async def test_bar_follows_the_source_after_the_delay() -> None:
    state: dict[str, Progress] = {"p": None}
    out = Tty()
    async with ProgressWatcher(lambda: state["p"], interval=0.01, delay=0.05, stream=out) as w:
        state["p"] = ("e0: v3", 0, 10)
        await asyncio.sleep(0.1)
        state["p"] = ("e0: v3", 7, 10)
        await asyncio.sleep(0.05)
        state["p"] = None
        await asyncio.sleep(0.05)
    assert w.drawn == 1
    assert "e0: v3" in out.getvalue() and "7/10" in out.getvalue()


async def test_quiet_for_short_operations_and_non_terminals() -> None:
    state: dict[str, Progress] = {"p": ("x", 0, 1)}
    async with ProgressWatcher(lambda: state["p"], interval=0.01, delay=10, stream=Tty()) as w:
        await asyncio.sleep(0.05)
    assert w.drawn == 0
    plain = io.StringIO()
    async with ProgressWatcher(lambda: state["p"], interval=0.01, delay=0, stream=plain) as w:
        await asyncio.sleep(0.05)
    assert not w.enabled and w.drawn == 0 and plain.getvalue() == ""
