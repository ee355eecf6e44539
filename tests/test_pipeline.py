"""The bounded stage pipeline: order, backpressure, serialized mode, error propagation."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from asyncsync.pipeline import GLUE_BYTES, GlueGate, run_pipeline


async def test_items_flow_in_order_through_every_stage() -> None:
    out: list[int] = []

    async def sink(x: int) -> None:
        out.append(x)

    seconds: dict[str, float] = {}
    await run_pipeline(range(20), [("a", lambda x: x + 1), ("b", lambda x: x * 10), ("c", sink)],
                       maxsize=2, seconds=seconds)  # fmt: skip
    assert out == [(i + 1) * 10 for i in range(20)]
    assert set(seconds) == {"a", "b", "c"}


def meeting_stages(wait: float) -> tuple[list[tuple[str, Any]], Callable[[], int]]:
    """Stages a and b, and the most calls of them ever in flight at once.

    ``a(1)`` and ``b(0)`` wait (up to ``wait`` seconds) for each other at a barrier: pipelined,
    they run at the same time, so they meet whatever the machine's load; serialized, they never
    do (each gives up after ``wait`` and goes on).
    """
    active = 0
    peak = 0
    lock = threading.Lock()
    meet = threading.Barrier(2)

    def work(stage: str, x: int) -> int:
        nonlocal active, peak
        with lock:
            active += 1
            peak = max(peak, active)
        if (stage, x) in (("a", 1), ("b", 0)):
            with contextlib.suppress(threading.BrokenBarrierError):
                meet.wait(wait)
        with lock:
            active -= 1
        return x

    stages = [("a", functools.partial(work, "a")), ("b", functools.partial(work, "b"))]
    return stages, lambda: peak


async def test_stages_overlap_when_pipelined_and_not_otherwise() -> None:
    stages, peak = meeting_stages(wait=30)  # only a pipeline that does not overlap waits it out
    await run_pipeline(range(6), stages, pipelined=True)
    assert peak() == 2
    stages, peak = meeting_stages(wait=0.3)  # what a serialized run costs: b(0) waits alone
    await run_pipeline(range(6), stages, pipelined=False)
    assert peak() == 1


async def test_backpressure_bounds_items_in_flight() -> None:
    produced = 0
    consumed = 0
    gap = 0

    def produce(x: int) -> int:
        nonlocal produced
        produced += 1
        return x

    async def consume(x: int) -> None:
        nonlocal consumed, gap
        gap = max(gap, produced - consumed)
        await asyncio.sleep(0.005)
        consumed += 1

    await run_pipeline(range(30), [("p", produce), ("c", consume)], maxsize=2)
    assert consumed == 30 and gap <= 4  # queue of 2 + one in each stage's hands


async def test_first_error_is_raised_as_itself() -> None:
    def boom(x: int) -> int:
        if x == 3:
            raise KeyError("bad item")
        return x

    with pytest.raises(KeyError, match="bad item"):
        await run_pipeline(range(10), [("a", boom), ("b", lambda x: x)], maxsize=1)


# ------------------------------------------------------------------ the CPU pool (every core)


def test_pool_size_comes_from_the_knob(monkeypatch: pytest.MonkeyPatch) -> None:
    from asyncsync import pipeline
    from asyncsync.errors import ConfigError

    monkeypatch.setenv("ASYNCSYNC_THREADS", "3")
    assert pipeline.threads() == 3
    pipeline.set_threads(1)
    try:
        assert pipeline.threads() == 1
    finally:
        pipeline.set_threads(None)
    for bad in ("0", "two", "10000000"):
        monkeypatch.setenv("ASYNCSYNC_THREADS", bad)
        with pytest.raises(ConfigError, match="ASYNCSYNC_THREADS"):
            pipeline.threads()
    for n in (0, pipeline.MAX_THREADS + 1):
        with pytest.raises(ConfigError, match="from 1 to 1024"):
            pipeline.set_threads(n)


@pytest.mark.parametrize("n", [1, 4])
def test_parallel_map_keeps_order_and_waits_for_every_call(n: int) -> None:
    import threading
    import time

    from asyncsync import pipeline

    done: list[int] = []
    lock = threading.Lock()

    def work(x: int) -> int:
        time.sleep(0.01 * (x % 3))
        if x == 2:
            raise ValueError("two")
        with lock:
            done.append(x)
        return x * x

    pipeline.set_threads(n)
    try:
        assert pipeline.parallel_map(lambda x: x * x, range(6)) == [0, 1, 4, 9, 16, 25]
        with pytest.raises(ValueError, match="two"):
            pipeline.parallel_map(work, range(6))
        assert sorted(done) == [0, 1, 3, 4, 5]  # every other call finished before the raise
        got = pipeline.run_all(work, range(3))
        assert got[:2] == [0, 1] and isinstance(got[2], ValueError)
    finally:
        pipeline.set_threads(None)


def test_small_work_runs_in_the_calling_thread_and_large_work_on_the_pool() -> None:
    """``cost``: items below SMALL_WORK_BYTES run in the caller (their glue would only hand the
    GIL between workers), the others on the pool meanwhile; results and errors stay in order,
    and every call has finished when run_all returns."""
    from asyncsync import pipeline

    small, big = 10, pipeline.SMALL_WORK_BYTES
    where: dict[int, str] = {}
    started = threading.Event()

    def work(x: int) -> int:
        where[x] = threading.current_thread().name
        if x == 0:  # the big one: waits until the caller has run a small one meanwhile
            assert started.wait(10)
        else:
            started.set()
        if x == 3:
            raise ValueError("three")
        return x * 10

    pipeline.set_threads(2)
    try:
        got = pipeline.run_all(work, range(5), cost=lambda x: big if x == 0 else small)
        assert got[:3] == [0, 10, 20] and isinstance(got[3], ValueError) and got[4] == 40
        me = threading.current_thread().name
        assert where[0].startswith("asyncsync-cpu") and all(where[i] == me for i in (1, 2, 3, 4))
        where.clear()
        assert pipeline.parallel_map(work, [1, 2], cost=lambda x: small) == [10, 20]
        assert set(where.values()) == {me}  # nothing large: no pool at all
        where.clear()
        assert pipeline.parallel_map(work, [1, 2]) == [10, 20]  # no cost: every item on the pool
        assert all(w.startswith("asyncsync-cpu") for w in where.values())
    finally:
        pipeline.set_threads(None)


def test_a_pool_shut_down_by_set_threads_elsewhere_leaves_the_rest_to_the_caller(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """helper-21: set_threads in another thread replaces the pool and shuts the old one down;
    a run_all that got the old pool had its submit raise, with calls already submitted still
    running after it returned. The items it could not submit now run in the caller."""
    import concurrent.futures

    from asyncsync import pipeline

    dead = concurrent.futures.ThreadPoolExecutor(1)
    dead.shutdown()
    monkeypatch.setattr(pipeline, "_executor", lambda n: dead)
    pipeline.set_threads(2)
    try:
        me = threading.current_thread().name
        seen: list[str] = []
        got = pipeline.run_all(lambda x: seen.append(threading.current_thread().name) or x, [1, 2])
        assert got == [1, 2] and seen == [me, me]
    finally:
        pipeline.set_threads(None)


@pytest.mark.parametrize("failing", ["_native_change", "_native_batch"])
def test_a_failed_parallel_diff_leaves_every_old_as_it_was(
    monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    """A tensor diffed alone (on the pool) or a call of small ones (diff_many) that fails
    leaves its olds as they were, and the others that were advanced are put back."""
    import torch

    from asyncsync import codec, pipeline
    from asyncsync.codec import diff

    sizes = [1000, 1000, 40_000, 1000] if failing == "_native_batch" else [40_000] * 4
    olds = [torch.arange(n, dtype=torch.int16) for n in sizes]
    news = [o.clone() for o in olds]
    for t in news:
        t[::7] += 1
    before = [o.clone() for o in olds]
    real = getattr(diff, failing)

    def flaky(old: Any, *a: Any) -> Any:
        if old is olds[2] or (isinstance(old, list) and any(o is olds[0] for o in old)):
            raise MemoryError("injected")
        return real(old, *a)

    monkeypatch.setattr(diff, failing, flaky)
    pipeline.set_threads(2)
    try:
        if codec.native.kernels is not None:
            with pytest.raises(MemoryError):
                codec.diff_tensors(olds, news, algorithm="xxh3-128", advance=True)
            assert all(torch.equal(a, b) for a, b in zip(olds, before, strict=True))
        monkeypatch.setattr(diff, failing, real)
        changes = codec.diff_tensors(olds, news, algorithm="xxh3-128", advance=True)
        assert all(torch.equal(a, b) for a, b in zip(olds, news, strict=True))
        codec.revert(olds, changes)
        assert all(torch.equal(a, b) for a, b in zip(olds, before, strict=True))
    finally:
        pipeline.set_threads(None)


def test_a_forked_child_gets_a_pool_of_its_own() -> None:
    """A child forked after the pool started has none of its threads: it must not wait on
    them (the fork launch of stress/crash.py hung there)."""
    import os

    from asyncsync import pipeline

    pipeline.set_threads(2)
    try:
        assert pipeline.parallel_map(lambda x: x + 1, range(4)) == [1, 2, 3, 4]
        pid = os.fork()
        if pid == 0:  # the child: exit 0 only if the pool works
            try:
                ok = pipeline.parallel_map(lambda x: x + 1, range(4)) == [1, 2, 3, 4]
            finally:
                os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        pipeline.set_threads(None)


def test_the_kernel_scaling_probe_times_every_stage_and_checks_what_it_timed() -> None:
    """stress/kernel_scaling.py (the 16-core host's per-stage scaling, BENCHMARKS.md) at a tiny
    size: a row per stage and thread count, and the diff's snapshot and the patched copies end
    at the new bytes (it raises otherwise)."""
    from stress import kernel_scaling

    rows = kernel_scaling.run([1, 2], model_mib=4, tensor_mib=1, bucket_mib=2, reps=1)
    assert [(r["stage"], r["threads"]) for r in rows] == [
        (s, n) for n in (1, 2) for s in ("diff", "encode", "decode", "patch")
    ]
    assert all(r[k]["gb_s"] > 0 for r in rows for k in ("bucket", "model"))


async def test_a_glue_gate_runs_calls_on_small_tensors_one_at_a_time_and_others_freely() -> None:
    """Calls mostly in Python (many tensors under GLUE_BYTES on average) run one at a time;
    calls on larger tensors, or on one tensor, are neither held back nor held for."""
    gate = GlueGate()
    lock = threading.Lock()
    running, peak, order = [0], [0], []

    def work(tag: str) -> str:
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.05)
        with lock:
            running[0] -= 1
            order.append(tag)
        return tag

    small, large, one = [4096] * 10, [4 * GLUE_BYTES] * 2, [4096]
    got = await asyncio.gather(*(gate.run(work, f"s{i}", small) for i in range(3)))
    assert got == ["s0", "s1", "s2"] and peak[0] == 1
    peak[0] = 0
    await asyncio.gather(*(gate.run(work, f"l{i}", large) for i in range(3)))
    assert peak[0] == 3
    peak[0] = 0
    await asyncio.gather(gate.run(work, "s", small), gate.run(work, "l", large),
                         gate.run(work, "o", one))  # fmt: skip
    assert peak[0] == 3  # a large (or lone) tensor's call ran beside the small ones'
    async with gate.hold(small):  # held: a small call waits, a large one does not
        t = asyncio.ensure_future(gate.run(work, "waits", small))
        assert await gate.run(work, "free", large) == "free"
        await asyncio.sleep(0.1)
        assert not t.done()
    assert await t == "waits"
