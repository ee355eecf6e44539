"""A bounded pipeline of stages over a sequence of items, used by the publisher and receiver.

Each stage is a function from the previous stage's output to its own; blocking functions run in
worker threads (torch, zstd and xxhash release the GIL, so stages truly overlap) and coroutine
functions run on the loop. Stages are joined by ``asyncio.Queue(maxsize)``: a slow stage pushes
back on the ones before it, so at most ``maxsize`` items wait between two stages. With
``pipelined=False`` every item goes through all stages before the next starts, which is the
baseline the overlap is measured against.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import Callable, Iterable, MutableMapping, Sequence
from typing import Any

from asyncsync.errors import first_error

__all__ = ["Stage", "finish_thread", "run_pipeline"]

Stage = tuple[str, Callable[[Any], Any]]
_DONE = object()


async def finish_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """``await asyncio.to_thread(fn, *args)``, except that cancellation waits for the thread.

    A thread cannot be stopped; if the caller went on while it still wrote files, cleanup could
    race it (a shard renamed into a directory being removed, or over a retry's shard). So a
    cancelled caller waits for the call to finish, then the cancellation proceeds.
    """
    fut = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        while not fut.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(fut)
        if not fut.cancelled():
            fut.exception()  # retrieved: the cancellation is what the caller sees
        raise


async def _call(fn: Callable[[Any], Any], item: Any) -> Any:
    if inspect.iscoroutinefunction(fn):
        return await fn(item)
    return await finish_thread(fn, item)


async def run_pipeline(
    items: Iterable[Any],
    stages: Sequence[Stage],
    *,
    maxsize: int = 1,
    pipelined: bool = True,
    seconds: MutableMapping[str, float] | None = None,
) -> None:
    """Push every item through ``stages`` (name, fn); time spent per stage adds to ``seconds``.

    The first error of any stage cancels the others and is raised as itself (not a group).
    """
    times: MutableMapping[str, float] = seconds if seconds is not None else {}

    async def timed(name: str, fn: Callable[[Any], Any], item: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return await _call(fn, item)
        finally:
            times[name] = times.get(name, 0.0) + time.perf_counter() - t0

    if not pipelined or len(stages) == 1:
        for item in items:
            for name, fn in stages:
                item = await timed(name, fn, item)
        return

    queues: list[asyncio.Queue[Any]] = [asyncio.Queue(maxsize) for _ in stages[1:]]

    async def source() -> None:
        name, fn = stages[0]
        for item in items:
            await queues[0].put(await timed(name, fn, item))
        await queues[0].put(_DONE)

    async def stage(k: int) -> None:
        name, fn = stages[k]
        inbox = queues[k - 1]
        outbox = queues[k] if k < len(queues) else None
        while (item := await inbox.get()) is not _DONE:
            out = await timed(name, fn, item)
            if outbox is not None:
                await outbox.put(out)
        if outbox is not None:
            await outbox.put(_DONE)

    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(source())
            for k in range(1, len(stages)):
                tg.create_task(stage(k))
    except BaseExceptionGroup as group:
        raise first_error(group) from None
