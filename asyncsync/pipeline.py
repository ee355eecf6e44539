"""A bounded pipeline of stages over a sequence of items, used by the publisher and receiver.

Each stage is a function from the previous stage's output to its own; blocking functions run in
worker threads (torch, zstd and xxhash release the GIL, so stages truly overlap) and coroutine
functions run on the loop. Stages are joined by ``asyncio.Queue(maxsize)``: a slow stage pushes
back on the ones before it, so at most ``maxsize`` items wait between two stages. With
``pipelined=False`` every item goes through all stages before the next starts, which is the
baseline the overlap is measured against.

Within a stage, independent pieces of work (the tensors of a bucket: diff, encode; of an apply
group: decode, gather, patch and hash) run on one process-wide pool of :func:`threads` workers
(:func:`parallel_map`, :func:`run_all`): the C kernels, zstd and xxhash release the GIL, so a
stage uses every core. The pool's size is ``ASYNCSYNC_THREADS`` (default: the CPUs this process
may run on) or :func:`set_threads`; 1 runs everything in the calling thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import inspect
import logging
import os
import threading
import time
from collections.abc import Callable, Coroutine, Iterable, MutableMapping, Sequence
from typing import Any, TypeVar

from asyncsync.errors import ConfigError, PublishError, first_error

__all__ = [
    "GlueGate",
    "LoopLock",
    "LoopTasks",
    "Stage",
    "check_threads_env",
    "finish_thread",
    "pack_cap",
    "parallel_map",
    "run_all",
    "run_pipeline",
    "set_threads",
    "threads",
]

_T = TypeVar("_T")
_R = TypeVar("_R")
_pool_lock = threading.Lock()
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_size = 0
_threads: int | None = None  # set_threads(); None: ASYNCSYNC_THREADS or the CPU count
#: the most workers the pool may have (a typo such as 10000000 is an error, not that many
#: threads: each may hold a tensor's temporaries at once)
MAX_THREADS = 1024


def threads() -> int:
    """Workers of the pool :func:`parallel_map` uses (``set_threads``, else ``ASYNCSYNC_THREADS``,
    else the CPUs this process may run on)."""
    if _threads is not None:
        return _threads
    if (n := check_threads_env()) is not None:
        return n
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def check_threads_env() -> int | None:
    """``ASYNCSYNC_THREADS`` (None: unset); a ConfigError if it is no count of threads. The
    Publisher and the ReceiverAgent call it as they are made, so that a bad value is said at
    start-up, not at the first parallel map."""
    env = os.environ.get("ASYNCSYNC_THREADS", "").strip()
    if not env:
        return None
    try:
        n = int(env)
    except ValueError:
        raise ConfigError(f"ASYNCSYNC_THREADS={env!r} is not a whole number") from None
    if not 1 <= n <= MAX_THREADS:
        raise ConfigError(f"ASYNCSYNC_THREADS={env!r} must be from 1 to {MAX_THREADS}")
    return n


def set_threads(n: int | None) -> None:
    """Size the pool (``None``: back to ``ASYNCSYNC_THREADS`` or the CPU count)."""
    global _threads
    if n is not None and (
        not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_THREADS
    ):
        raise ConfigError(f"threads must be a whole number from 1 to {MAX_THREADS}, got {n!r}")
    _threads = n


def _executor(n: int) -> concurrent.futures.ThreadPoolExecutor:
    global _pool, _pool_size
    with _pool_lock:
        if _pool is None or _pool_size != n:
            if _pool is not None:
                _pool.shutdown(wait=False)  # running work finishes; new work goes to the new pool
            _pool = concurrent.futures.ThreadPoolExecutor(n, thread_name_prefix="asyncsync-cpu")
            _pool_size = n
        return _pool


def _forget_pool() -> None:
    """In a forked child: the parent's workers do not exist here; start a new pool on use."""
    global _pool, _pool_lock, _pool_size
    _pool, _pool_size, _pool_lock = None, 0, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


#: Work of fewer bytes than this (``cost`` of :func:`run_all`) runs in the calling thread. Such an
#: item is mostly Python glue (~100 us), which holds the GIL: on the pool, its torch, NumPy and
#: zstd calls release the GIL and hand it to another worker's glue at every call, so two
#: workers ran 2000 tensors of 8 KiB ~2.5x slower than one thread did.
SMALL_WORK_BYTES = 1 << 20


def run_all(
    fn: Callable[[_T], _R], items: Iterable[_T], *, cost: Callable[[_T], int] | None = None
) -> list[_R | BaseException]:
    """``fn`` of every item on the pool, each result or the exception it raised, in order.

    ``cost``: the bytes of work of an item; items below :data:`SMALL_WORK_BYTES` run in the
    calling thread meanwhile, one after another (all of them, where no item is larger).

    Every call has finished when this returns (nothing outlives it). Never call it from work
    running on the pool itself: the callers are stage threads and engine threads.
    """
    todo = list(items)
    n = threads()
    out: list[_R | BaseException] = [_PENDING] * len(todo)  # type: ignore[list-item]
    big = list(range(len(todo)))
    if cost is not None and n > 1:
        big = [i for i, x in enumerate(todo) if cost(x) >= SMALL_WORK_BYTES]
    futures: list[tuple[int, concurrent.futures.Future[_R]]] = []
    try:
        if n > 1 and len(todo) > 1 and big:
            pool = _executor(n)
            for i in big:
                try:
                    futures.append((i, pool.submit(fn, todo[i])))
                except RuntimeError:  # set_threads elsewhere shut this pool down: the rest here
                    break
        pooled = {i for i, _ in futures}
        for i in (i for i in range(len(todo)) if i not in pooled):
            try:
                out[i] = fn(todo[i])
            except Exception as exc:
                out[i] = exc
    finally:  # (a BaseException here: the pool's calls still finish before it goes on)
        concurrent.futures.wait([f for _, f in futures])
    for i, f in futures:
        err = f.exception()
        out[i] = err if err is not None else f.result()
    return out


_PENDING = object()


def pack_cap(sizes: Iterable[int], limit: int, spread: int) -> int:
    """The most bytes a pack of items larger than ``limit`` may hold, as the publisher's buckets
    and the receiver's apply groups pack them (up to ``spread`` to a pack, one per worker):
    ``spread * limit``, or twice the largest such item, so a pack's memory stays within twice
    what the largest item alone would hold."""
    return max([spread * limit] + [2 * n for n in sizes if n > limit])


def parallel_map(
    fn: Callable[[_T], _R], items: Iterable[_T], *, cost: Callable[[_T], int] | None = None
) -> list[_R]:
    """``[fn(x) for x in items]`` on the pool (``cost``: as :func:`run_all`'s); the first
    item's exception is raised (after every call has finished)."""
    results = run_all(fn, items, cost=cost)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results  # type: ignore[return-value]


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


#: work on tensors that average fewer bytes than this is mostly Python's (:class:`GlueGate`)
GLUE_BYTES = 128 << 10


class GlueGate:
    """Runs a stage's call in a thread (:func:`finish_thread`), one at a time among the calls
    whose work is mostly Python: many small tensors, fewer than :data:`GLUE_BYTES` each on
    average. Two such calls side by side (a bucket's diff beside the last one's encode) hand
    the GIL back and forth at every call that releases it (zstd, the kernels, torch): a
    publish of 20,000 tensors of 8 KiB took ~1.5x the CPU and the wall time it takes with
    its stages one after another (BENCHMARKS.md, issue 26, thirty-seventh session). Calls on
    larger tensors, whose time is in code that releases the GIL, are not held back, nor held
    for. Made in the loop that uses it."""

    def __init__(self) -> None:
        self._lock = asyncio.Lock()

    def hold(self, sizes: Sequence[int]) -> contextlib.AbstractAsyncContextManager[Any]:
        """Held across work on tensors of ``sizes`` bytes each, if it is mostly Python."""
        if len(sizes) > 1 and sum(sizes) < len(sizes) * GLUE_BYTES:
            return self._lock
        return contextlib.nullcontext()

    async def run(self, fn: Callable[[_T], _R], item: _T, sizes: Sequence[int]) -> _R:
        """``fn(item)`` in a thread; ``sizes``: the bytes of each tensor it works on."""
        async with self.hold(sizes):
            return await finish_thread(fn, item)


class LoopLock:
    """An :class:`asyncio.Lock` made anew in each event loop that takes it.

    An ``asyncio.Lock`` binds itself to the first loop that waits on it, so an object that
    outlives one ``asyncio.run`` (a publisher) could not be contended under the next one. Taken
    while a task of another loop holds it, it raises ``RuntimeError`` (two loops at once is a
    misuse: the object is not thread-safe).

    ``reentered``: taken again by the work that holds it (a task or thread it started: a
    publisher's pre-commit hook calling ``publish``), it raises PublishError(``reentered``)
    instead of waiting for itself for ever.
    """

    def __init__(self, reentered: str = "") -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = asyncio.Lock()
        self._reentered = reentered

    def _current(self) -> asyncio.Lock:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            if self._lock.locked():
                raise RuntimeError("this lock is held by a task of another event loop")
            self._loop, self._lock = loop, asyncio.Lock()
        return self._lock

    def locked(self) -> bool:
        return self._lock.locked()

    async def __aenter__(self) -> None:
        held = _HELD.get()
        if self._reentered and id(self) in held:
            raise PublishError(self._reentered)
        await self._current().acquire()
        _HELD.set(held | {id(self)})  # (seen by the tasks and threads started meanwhile)

    async def __aexit__(self, *exc: object) -> None:
        _HELD.set(_HELD.get() - {id(self)})
        self._lock.release()


#: the LoopLocks the running work holds (ids), as its tasks and threads inherit it
_HELD: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar(
    "asyncsync_held_locks", default=frozenset()
)


class LoopTasks:
    """Tasks started to outlive the call that made them (a resume a cancelled sync still owes),
    each bound to the event loop that runs it, as every task is.

    :meth:`finish` waits for the running loop's tasks and forgets the others: a task of a loop
    that has ended was cancelled with it, and one of a loop that is not running (an
    ``asyncio.Runner`` between runs) can be neither awaited nor cancelled from this one. An
    error of a task is logged when it ends, never lost.
    """

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def __bool__(self) -> bool:
        return bool(self._tasks)

    def start(self, coro: Coroutine[Any, Any, Any], *, name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logging.getLogger(__name__).warning("%s failed: %s", task.get_name(), task.exception())

    async def finish(self, timeout: float) -> list[str]:
        """Wait up to ``timeout`` seconds for the running loop's tasks, then cancel and await
        those still running (their names are returned); forget the other loops'."""
        loop = asyncio.get_running_loop()
        others = [t for t in self._tasks if t.get_loop() is not loop]
        self._tasks.difference_update(others)
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout)
        late = list(self._tasks)
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)
        return [t.get_name() for t in late]


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
