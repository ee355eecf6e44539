"""A receiver that lost its engine id while a sync was under way (helper 29, finding 1)."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from asyncsync import Publisher
from asyncsync.errors import LockHeld
from asyncsync.format.acks import ack_path, read_acks
from asyncsync.format.lease import LeaseRecord, lease_path
from receiver import ReceiverAgent
from receiver.engines.checkpoint import LocalCheckpoint
from tests.conftest import mixed_state, mutate


async def test_a_sync_under_way_when_the_id_is_lost_writes_no_more_acks(tmp_path: Path) -> None:
    """The heartbeat finds another live holder while the agent walks through many versions
    (a catch-up): the walk used to go on acking each version, over the live holder's ack, for
    as long as it lasted (far past ttl / 3). Now the next ack refuses (the loss is said once)."""
    root = tmp_path / "root"
    states = [mixed_state(0)]
    async with Publisher(root, bucket_bytes=8192, keyframe_interval=0) as pub:
        await pub.seed(states[0])
        for i in range(1, 5):
            states.append(mutate(states[-1], 0.03, seed=i))
            await pub.publish(states[-1])
    engine = LocalCheckpoint(tmp_path / "ckpt")
    agent = ReceiverAgent(root, engine, "e1", use_inotify=False, lease_ttl=0.9, poll_interval=0.05)
    other = LeaseRecord("e1", "8" * 16, "otherhost", 4242, 0.9, 0.0, 0.0)
    commit, committed = engine.commit, []

    async def slow_commit(*args: object, **kw: object) -> None:
        await commit(*args, **kw)  # type: ignore[arg-type]
        committed.append(engine.state.version)
        if engine.state.version == 1:  # another receiver takes the id: found by the heartbeat
            lease_path(root, "e1").write_bytes(other.to_json())
            deadline = time.monotonic() + 10
            while agent._presence.lost is None:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)

    engine.commit = slow_commit  # type: ignore[method-assign]
    stop = asyncio.Event()
    async with asyncio.TaskGroup() as tg:
        tg.create_task(agent.run(stop=stop))
        deadline = time.monotonic() + 20
        while not committed or committed[-1] < 1 or agent._presence.lost is None:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        for _ in range(10):  # the other holder renews its lease (a new heartbeat each time)
            lease_path(root, "e1").write_bytes(replace(other, heartbeat_at=time.time()).to_json())
            await asyncio.sleep(0.1)
        stop.set()
    await agent.close()
    assert read_acks(root)["e1"].version == 0  # v1 onwards never acked by the loser
    assert committed == [0, 1]  # and the walk stopped at the loss


async def test_an_ack_waits_for_a_renew_in_flight_that_finds_the_id_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The heartbeat's renew runs in a thread; an ack that started meanwhile was written before
    the renew came back with the loss (one ack over the new holder's). Now it waits for it."""
    root = tmp_path / "root"
    async with Publisher(root, keyframe_interval=0) as pub:
        await pub.seed(mixed_state(0))
    agent = ReceiverAgent(root, LocalCheckpoint(tmp_path / "ck"), "e1", use_inotify=False)
    async with agent:
        assert await agent.sync_once() == 0
        presence = agent._presence
        before = ack_path(root, "e1").read_bytes()
        other = LeaseRecord("e1", "8" * 16, "otherhost", 4242, 30.0, 0.0, 0.0)
        started = threading.Event()

        def slow_renew() -> None:  # another receiver took the id while this renew was on its way
            started.set()
            time.sleep(0.5)
            lease_path(root, "e1").write_bytes(other.to_json())
            raise LockHeld("engine id 'e1' is held by otherhost")

        monkeypatch.setattr(presence.lease, "renew", slow_renew)
        renewing = asyncio.create_task(presence.renew())
        await asyncio.to_thread(started.wait, 5)
        with pytest.raises(LockHeld):
            await presence.ack(7, "f" * 16, "r" * 16, ())
        with pytest.raises(LockHeld):
            await renewing
        assert ack_path(root, "e1").read_bytes() == before  # the new holder's ack untouched
