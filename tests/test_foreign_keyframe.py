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

import json
import shutil
from pathlib import Path

import pytest

from asyncsync import Publisher
from asyncsync.errors import AsyncSyncError, ManifestError
from asyncsync.format.acks import read_acks
from asyncsync.format.store import read_root_info
from receiver import ReceiverAgent
from receiver.engines.checkpoint import LocalCheckpoint
from tests.conftest import assert_holds, mixed_state, mutate


def _vdir(root: Path, v: int) -> Path:
    return root / f"v{v:012d}"


async def _another_run(root: Path, versions: int, keyframe_at: int | None = None) -> Path:
    """``root``: a seed and ``versions`` deltas of a run of its own (``keyframe_at``: that
    version a keyframe instead)."""
    async with Publisher(root, bucket_bytes=8192, keyframe_interval=0) as pub:
        sd = mixed_state(5)
        await pub.seed(sd)
        for v in range(1, versions + 1):
            sd = mutate(sd, 0.03, seed=49 + v)
            await pub.publish(sd, keyframe=v == keyframe_at)
    return root


async def test_a_keyframe_of_another_run_mid_chain_is_never_taken(tmp_path: Path) -> None:
    other = await _another_run(tmp_path / "other", 3, keyframe_at=3)

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


@pytest.mark.parametrize("bad", [3, 4], ids=["mid-chain", "newest"])
@pytest.mark.parametrize("how", ["another root's", "a flipped bit"])
async def test_a_manifest_of_another_run_is_refused_by_name(
    tmp_path: Path, how: str, bad: int, caplog: pytest.LogCaptureFixture
) -> None:
    """A manifest whose run id is not the root's (``asyncsync.json``): the receiver said
    "version 3 is missing" (mid-chain) or "the root is run X: re-seeding from a keyframe"
    (the newest), neither true. It is a bad version whose message names the file, its run id
    and the root's, and says refused; the receiver goes as far as the root's run allows, and
    on from the root's next keyframe (helper-39, task 2)."""
    other = await _another_run(tmp_path / "other", 4)

    root = tmp_path / "root"
    states = [mixed_state(0)]
    async with Publisher(root, bucket_bytes=8192, keyframe_interval=0) as pub:
        await pub.seed(states[0])
        info = read_root_info(root)
        assert info is not None
        run = info.run_id
        engine = LocalCheckpoint(tmp_path / "ckpt")
        agent = ReceiverAgent(root, engine, "e1", use_inotify=False, verify_deadline=0.05)
        async with agent:
            for i in range(4):
                states.append(mutate(states[-1], 0.03, seed=i + 1))
                await pub.publish(states[-1])
                if i == 1:
                    assert await agent.sync_once() == 2
            path = _vdir(root, bad) / "manifest.json"
            if how == "another root's":
                shutil.copy(_vdir(other, bad) / "manifest.json", path)
                foreign = json.loads(path.read_bytes())["run_id"]
            else:
                d = json.loads(path.read_bytes())
                foreign = d["run_id"] = format(int(d["run_id"], 16) ^ 1, "016x")
                path.write_text(json.dumps(d))
            assert foreign != run
            for attempt in range(2):
                caplog.clear()
                with pytest.raises(ManifestError, match="refused") as exc_info:
                    await agent.sync_once()
                said = str(exc_info.value)
                assert str(path) in said and foreign in said and run in said, said
                assert (engine.state.version, engine.state.run_id) == (bad - 1, run)
                assert agent.status().bad_versions == (bad,)
                assert "re-seeding" not in caplog.text and "missing" not in caplog.text
                if attempt == 0:  # said once, with why
                    assert f"v{bad} is bad" in caplog.text and foreign in caplog.text
            assert_holds(engine.load_state_dict(), states[bad - 1])
            states.append(mutate(states[-1], 0.03, seed=20))
            await pub.publish(states[-1], keyframe=True)  # v5: the root's run again
            assert await agent.sync_once() == 5
            assert engine.state.run_id == run
            assert_holds(engine.load_state_dict(), states[5])
