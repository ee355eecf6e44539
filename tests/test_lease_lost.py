"""A receiver that lost its engine id while a sync was under way (helper 29, finding 1)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from asyncsync import Publisher
from asyncsync.format.acks import read_acks
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
        for _ in range(10):  # the other holder keeps its lease fresh
            lease_path(root, "e1").write_bytes(other.to_json())
            await asyncio.sleep(0.1)
        stop.set()
    await agent.close()
    assert read_acks(root)["e1"].version == 0  # v1 onwards never acked by the loser
    assert committed == [0, 1]  # and the walk stopped at the loss
