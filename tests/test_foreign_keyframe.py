"""A keyframe of another run planted in the middle of a root's chain (attack-38).

The version directory ``v3`` of another root (a keyframe: its manifest, shards and headers all
of that root's run) is copied over this root's ``v3``, and this root's publisher goes on with
``v4``, a delta of its own run. A receiver at ``v2`` took the foreign keyframe as the next step of
its walk (its ack named the other run), then found the root's run again, re-seeded from ``v0``,
walked to ``v3`` and took the foreign keyframe once more: every sync rewrote the whole checkpoint
and the ack flipped between the runs, for ever. A version of another run is never a step of the
root's chain (FORMAT.md 11.4): the receiver stays at ``v2``, exact, and goes on from the root's
next keyframe of its own run.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from asyncsync import Publisher
from asyncsync.errors import AsyncSyncError
from asyncsync.format.acks import read_acks
from receiver import ReceiverAgent
from receiver.engines.checkpoint import LocalCheckpoint
from tests.conftest import assert_holds, mixed_state, mutate


def _vdir(root: Path, v: int) -> Path:
    return root / f"v{v:012d}"


async def test_a_keyframe_of_another_run_mid_chain_is_never_taken(tmp_path: Path) -> None:
    other = tmp_path / "other"
    async with Publisher(other, bucket_bytes=8192, keyframe_interval=0) as pub:
        sd = mixed_state(5)
        await pub.seed(sd)
        for i in range(3):
            sd = mutate(sd, 0.03, seed=50 + i)
            await pub.publish(sd, keyframe=i == 2)  # v3: a keyframe of the other run

    root = tmp_path / "root"
    states = [mixed_state(0)]
    pub = Publisher(root, bucket_bytes=8192, keyframe_interval=0)
    async with pub:
        await pub.seed(states[0])
        for i in range(2):
            states.append(mutate(states[-1], 0.03, seed=i + 1))
            await pub.publish(states[-1])
        engine = LocalCheckpoint(tmp_path / "ckpt")
        agent = ReceiverAgent(root, engine, "e1", use_inotify=False, verify_deadline=0.05)
        async with agent:
            assert await agent.sync_once() == 2
            run = engine.state.run_id
            for i in range(2):  # v3, v4 of this run
                states.append(mutate(states[-1], 0.03, seed=i + 10))
                await pub.publish(states[-1])
            shutil.rmtree(_vdir(root, 3))
            shutil.copytree(_vdir(other, 3), _vdir(root, 3))
            for _ in range(3):
                with pytest.raises(AsyncSyncError):
                    await agent.sync_once()
                assert (engine.state.version, engine.state.run_id) == (2, run)
                ack = read_acks(root)["e1"]
                assert (ack.version, ack.run_id) == (2, run)
            assert_holds(engine.load_state_dict(), states[2])
            states.append(mutate(states[-1], 0.03, seed=20))
            await pub.publish(states[-1], keyframe=True)  # v5: this run's keyframe
            assert await agent.sync_once() == 5
            assert engine.state.run_id == run
            assert_holds(engine.load_state_dict(), states[5])
