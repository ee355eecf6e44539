"""The bounded stage pipeline: order, backpressure, serialized mode, error propagation."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from asyncsync.pipeline import run_pipeline


async def test_items_flow_in_order_through_every_stage() -> None:
    out: list[int] = []

    async def sink(x: int) -> None:
        out.append(x)

    seconds: dict[str, float] = {}
    await run_pipeline(range(20), [("a", lambda x: x + 1), ("b", lambda x: x * 10), ("c", sink)],
                       maxsize=2, seconds=seconds)  # fmt: skip
    assert out == [(i + 1) * 10 for i in range(20)]
    assert set(seconds) == {"a", "b", "c"}


async def test_stages_overlap_when_pipelined_and_not_otherwise() -> None:
    active = 0
    peak = 0
    lock = threading.Lock()

    def work(x: int) -> int:
        nonlocal active, peak
        with lock:
            active += 1
            peak = max(peak, active)
        time.sleep(0.02)
        with lock:
            active -= 1
        return x

    await run_pipeline(range(6), [("a", work), ("b", work)], pipelined=True)
    assert peak == 2
    peak = 0
    await run_pipeline(range(6), [("a", work), ("b", work)], pipelined=False)
    assert peak == 1


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
