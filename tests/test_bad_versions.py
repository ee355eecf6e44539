"""One damaged version never stalls a receiver (issue 13, failure 1; FORMAT.md section 8).

Publish v0-v2, sync to v2, publish v3-v5, damage v3 (a flipped byte, a truncated, missing or
wrong-size shard, a damaged manifest), publish a keyframe v6 and v7-v8: the receiver marks v3
bad after its bounded re-reads, goes on from v6 and reaches v8 bit-exact, reports v3 (status,
ack, /metrics, ``asyncsync status``), and v3 no longer pins retention. With no keyframe past
the damage it stays at v2, says why, and takes the next keyframe as soon as it is published.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import aiohttp
import pytest
import torch

from asyncsync import ChecksumMismatch, ConfigError, FormatError, IncompleteVersion, Publisher
from asyncsync.format.acks import read_acks
from asyncsync.format.store import list_versions, read_manifest
from asyncsync.ops.cli import main as cli_main
from asyncsync.publish.retention import RetentionPolicy, collect
from receiver import ReceiverAgent
from receiver.badversions import MAX_BAD_KEPT
from receiver.engines.checkpoint import LocalCheckpoint
from receiver.engines.torch_module import TorchModule
from receiver.server import StatusServer
from tests.conftest import Holder, assert_holds, mixed_state, mutate, sync_to


def _vdir(root: Path, v: int) -> Path:
    return root / f"v{v:012d}"


def _delta_shard(root: Path, v: int) -> Path:
    m = read_manifest(root, v)
    return _vdir(root, v) / next(s.file for s in m.shards if s.role == "delta")


def flip(root: Path, v: int) -> None:
    p = _delta_shard(root, v)
    b = bytearray(p.read_bytes())
    b[len(b) // 2] ^= 0x40
    p.write_bytes(bytes(b))


def truncate(root: Path, v: int) -> None:
    p = _delta_shard(root, v)
    p.write_bytes(p.read_bytes()[:-9])


def delete(root: Path, v: int) -> None:
    _delta_shard(root, v).unlink()


def grow(root: Path, v: int) -> None:  # the wrong size: longer than the manifest says
    p = _delta_shard(root, v)
    p.write_bytes(p.read_bytes() + b"\0" * 16)


def break_manifest(root: Path, v: int) -> None:
    p = _vdir(root, v) / "manifest.json"
    p.write_bytes(p.read_bytes()[:-40])


DAMAGE = {
    "flip": (flip, ChecksumMismatch),
    "truncate": (truncate, IncompleteVersion),
    "delete": (delete, IncompleteVersion),
    "wrong_size": (grow, IncompleteVersion),
    "manifest": (break_manifest, FormatError),
}


class Trainer:
    def __init__(self, root: Path):
        self.root = root
        self.pub = Publisher(root, bucket_bytes=8192, keyframe_interval=0)
        self.states: list[dict[str, torch.Tensor]] = []

    async def publish(self, n: int = 1, *, keyframe: bool = False) -> None:
        for _ in range(n):
            if not self.states:
                self.states.append(mixed_state(0))
                await self.pub.seed(self.states[0])
                continue
            self.states.append(mutate(self.states[-1], 0.03, seed=len(self.states)))
            await self.pub.publish(self.states[-1], keyframe=keyframe)


def _agent(
    root: Path, engine: object, engine_id: str = "e1", verify_deadline: float = 0.1
) -> ReceiverAgent:
    return ReceiverAgent(
        root,
        engine,  # type: ignore[arg-type]
        engine_id,
        use_inotify=False,
        verify_deadline=verify_deadline,
    )


def invalidate_manifest(root: Path, v: int) -> None:  # parses, breaks a rule (totals)
    p = _vdir(root, v) / "manifest.json"
    d = json.loads(p.read_bytes())
    d["totals"]["changed"] += 1
    p.write_text(json.dumps(d))


async def test_a_manifest_that_parses_but_breaks_a_rule_is_bad_without_the_re_reads(
    tmp_path: Path,
) -> None:
    """Only bytes that are not yet JSON are worth re-reading: with an hour of patience, a
    manifest that breaks a rule is still called bad on the first sync that meets it."""
    root = tmp_path / "root"
    t = Trainer(root)
    async with t.pub:
        await t.publish(3)
        agent = _agent(root, LocalCheckpoint(tmp_path / "ckpt"), verify_deadline=3600)
        async with agent:
            assert await agent.sync_once() == 2
            await t.publish(1)  # v3
            invalidate_manifest(root, 3)
            await t.publish(1, keyframe=True)  # v4
            assert await asyncio.wait_for(agent.sync_once(), 120) == 4
            assert agent.status().bad_versions == (3,)
            assert_holds(agent.engine.load_state_dict(), t.states[4])  # type: ignore[attr-defined]


@pytest.mark.parametrize("damage", sorted(DAMAGE))
async def test_a_damaged_version_is_gone_past_from_the_next_keyframe(
    tmp_path: Path, damage: str
) -> None:
    root = tmp_path / "root"
    t = Trainer(root)
    async with t.pub:
        await t.publish(3)  # v0..v2
        agent = _agent(root, LocalCheckpoint(tmp_path / "ckpt"))
        async with agent:
            assert await agent.sync_once() == 2
            await t.publish(3)  # v3..v5
            DAMAGE[damage][0](root, 3)
            await t.publish(1, keyframe=True)  # v6
            await t.publish(2)  # v7, v8
            assert await agent.sync_once() == 8
            assert_holds(agent.engine.load_state_dict(), t.states[8])  # type: ignore[attr-defined]
            st = agent.status()
            assert st.bad_versions == (3,) and st.last_error is None
            ack = read_acks(root)["e1"]
            assert (ack.version, ack.bad_versions) == (8, (3,))
            # the bad version no longer pins retention: the engine is past it
            collect(root, RetentionPolicy(keep_versions=1, ack_ttl=600))
            assert list_versions(root) == [6, 7, 8]


async def test_no_keyframe_past_the_damage_stays_says_why_then_takes_the_next_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "root"
    t = Trainer(root)
    async with t.pub:
        await t.publish(3)
        module = Holder(mixed_state(0))
        agent = _agent(root, TorchModule(module), "m1")
        async with agent:
            assert await agent.sync_once() == 2
            await t.publish(3)
            flip(root, 3)
            with pytest.raises(ChecksumMismatch):
                await agent.sync_once()
            st = agent.status()
            assert st.version == 2 and st.bad_versions == (3,)
            assert st.last_error is not None and "no keyframe follows it" in st.last_error
            assert read_acks(root)["m1"].bad_versions == (3,)  # reported in the ack as well
            assert cli_main(["status", str(root), "--json"]) == 3  # behind: a straggler
            rows = json.loads(capsys.readouterr().out)["engines"]
            assert rows[0]["bad_versions"] == [3]
            await t.publish(1, keyframe=True)  # v6
            assert await agent.sync_once() == 6
            assert_holds(module.state_dict(), t.states[6])
            assert agent.status().last_error is None


async def test_a_repaired_version_is_taken_after_all(tmp_path: Path) -> None:
    root = tmp_path / "root"
    t = Trainer(root)
    async with t.pub:
        await t.publish(3)
        agent = _agent(root, LocalCheckpoint(tmp_path / "ckpt"))
        async with agent:
            assert await agent.sync_once() == 2
            await t.publish(1)
            shard = _delta_shard(root, 3)
            good = shard.read_bytes()
            flip(root, 3)
            with pytest.raises(ChecksumMismatch):
                await agent.sync_once()
            shard.write_bytes(good)
            assert await agent.sync_once() == 3
            assert agent.status().bad_versions == ()
            assert read_acks(root)["e1"].bad_versions == ()


async def test_a_damaged_newest_manifest_is_reported_and_waited_past(tmp_path: Path) -> None:
    root = tmp_path / "root"
    t = Trainer(root)
    async with t.pub:
        await t.publish(3)
        agent = _agent(root, LocalCheckpoint(tmp_path / "ckpt"))
        async with agent:
            break_manifest(root, 2)  # the newest: v0, v1 are still reachable
            with pytest.raises(FormatError):
                await agent.sync_once()
            assert agent.version == 1 and agent.status().bad_versions == (2,)
            await t.publish(1, keyframe=True)
            assert await agent.sync_once() == 3
            assert_holds(agent.engine.load_state_dict(), t.states[3])  # type: ignore[attr-defined]


async def test_bad_versions_in_metrics(tmp_path: Path) -> None:
    root = tmp_path / "root"
    t = Trainer(root)
    async with t.pub:
        await t.publish(3)
        agent = _agent(root, LocalCheckpoint(tmp_path / "ckpt"))
        async with agent, StatusServer(agent) as server, aiohttp.ClientSession() as http:
            assert await agent.sync_once() == 2
            await t.publish(2)
            flip(root, 3)
            await t.publish(1, keyframe=True)
            assert await agent.sync_once() == 5
            async with http.get(f"{server.url}/metrics") as resp:
                text = await resp.text()
            assert 'asyncsync_receiver_bad_versions{engine_id="e1"} 1.0' in text
            assert 'asyncsync_receiver_newest_bad_version{engine_id="e1"} 3.0' in text
            async with http.get(f"{server.url}/status") as resp:
                assert (await resp.json())["bad_versions"] == [3]


def _flip_full_shard(root: Path, v: int) -> None:
    m = read_manifest(root, v)
    p = _vdir(root, v) / next(s.file for s in m.shards if s.role == "full")
    b = bytearray(p.read_bytes())
    b[len(b) // 2] ^= 0x40
    p.write_bytes(bytes(b))


@pytest.mark.parametrize("damaged", [5, 17])
async def test_more_damaged_keyframes_than_marks_kept_never_livelock(
    tmp_path: Path, damaged: int
) -> None:
    """Issue 22, finding 5: an empty receiver tries keyframes newest first; with more damaged
    ones than MAX_BAD_KEPT (16), the mark of the oldest was evicted as soon as it was made, so
    the planner chose it again, forever (539 "is bad" lines in 40 s). Every version found bad
    in a sync is skipped for the rest of it, however many: it reaches the newest version."""
    assert MAX_BAD_KEPT == 16
    root = tmp_path / "root"
    t = Trainer(root)
    async with t.pub:
        await t.publish(1)  # v0: a good keyframe
        await t.publish(damaged, keyframe=True)  # v1..: keyframes whose full data is damaged
    for v in range(1, damaged + 1):
        _flip_full_shard(root, v)
    agent = _agent(root, LocalCheckpoint(tmp_path / "ckpt"), verify_deadline=0.01)
    async with agent:
        # from v0's full data, then each version's intact delta
        assert await asyncio.wait_for(agent.sync_once(), 120) == damaged
        assert_holds(agent.engine.load_state_dict(), t.states[damaged])  # type: ignore[attr-defined]
        assert agent.status().bad_versions == ()  # each was applied after all (its delta)


async def test_a_receiver_stuck_behind_a_damaged_version_backs_off_and_says_it_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """(issue 20, operator) Stuck with no keyframe past the damage, the running agent retries
    less and less often and logs the failure once per REPEAT_LOG_SECONDS, not at every poll."""
    root = tmp_path / "root"
    t = Trainer(root)
    async with t.pub:
        await t.publish(3)
        engine = TorchModule(Holder(mixed_state(0)))
        agent = ReceiverAgent(
            root, engine, "m1", use_inotify=False, verify_deadline=0.05, poll_interval=0.02
        )
        async with agent:
            assert await agent.sync_once() == 2
            await t.publish(2)
            flip(root, 3)
            stop = asyncio.Event()
            caplog.clear()
            with caplog.at_level(logging.INFO, logger="receiver"):
                task = asyncio.create_task(agent.run(stop=stop))
                await asyncio.sleep(3.0)  # 150 polls
                stop.set()
                await asyncio.wait_for(task, 30)
            lines = [r for r in caplog.records if r.levelno >= logging.WARNING]
            assert agent.status().failures <= 12  # backed off: 0.02 s doubling
            # said once, in the bad version's line (see the test below); "sync failed" comes
            # back as a reminder only after REPEAT_LOG_SECONDS
            assert not [r for r in lines if "sync failed" in r.getMessage()]
            assert len(lines) <= 4, [r.getMessage() for r in lines]
            assert agent.version == 2


@pytest.mark.parametrize("keyframe", [False, True])
async def test_a_bad_version_is_one_log_line_with_why_and_what_follows(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, keyframe: bool
) -> None:
    """A bad version was said two or three times: "v3 is bad (why)" when marked, then "v3 is
    bad and no keyframe follows it yet: ..." (or "v3 is bad: going on from keyframe v6"),
    then, stuck, the same error again as "sync failed: ...". One line says it all now."""
    root = tmp_path / "root"
    t = Trainer(root)
    async with t.pub:
        await t.publish(3)
        agent = ReceiverAgent(
            root, LocalCheckpoint(tmp_path / "ckpt"), "e1", use_inotify=False,
            verify_deadline=0.05, poll_interval=0.02,
        )  # fmt: skip
        async with agent:
            assert await agent.sync_once() == 2
            await t.publish(3)  # v3..v5
            flip(root, 3)
            if keyframe:
                await t.publish(1, keyframe=True)  # v6
            stop = asyncio.Event()
            caplog.clear()
            with caplog.at_level(logging.INFO, logger="receiver"):
                task = asyncio.create_task(agent.run(stop=stop))
                await asyncio.sleep(1.0)
                stop.set()
                await asyncio.wait_for(task, 30)
            assert agent.version == (6 if keyframe else 2)
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1, lines
    assert lines[0].startswith("agent e1: v3 is bad (ChecksumMismatch: ") and "checksum" in lines[0]
    if keyframe:
        assert lines[0].endswith("): going on from keyframe v6")
    else:
        assert lines[0].endswith("the engine stays at v2 and goes on from the next keyframe "
                                 "as soon as one is published")  # fmt: skip


@pytest.mark.parametrize("planted", ["garbage", "copied"])
async def test_a_version_planted_at_the_last_number_is_gone_past(
    tmp_path: Path, planted: str
) -> None:
    """(helper-23, finding 1) A version directory at the last number (v999999999999) with a
    manifest that does not read, or a real manifest copied there: the receiver's probe for
    the next version raised "version 1000000000000 out of range" at every sync, so it never
    applied anything, and a publisher could not open the root. Now the receiver goes past it
    to the newest version that reads (it is reported bad), and the publisher refuses the root
    with one message naming the directory."""
    root = tmp_path / "root"
    states = [mixed_state(0)]
    async with Publisher(root, keyframe_interval=0) as pub:
        await pub.seed(states[0])
        states.append(mutate(states[0], 0.03, seed=1))
        await pub.publish(states[1])
    last = root / "v999999999999"
    last.mkdir()
    if planted == "garbage":
        (last / "manifest.json").write_text("{garbage")
    else:
        doc = json.loads((_vdir(root, 1) / "manifest.json").read_text())
        (last / "manifest.json").write_text(json.dumps({**doc, "version": 999999999999}))
    agent = ReceiverAgent(root, LocalCheckpoint(tmp_path / "c"), "e1", use_inotify=False,
                          verify_deadline=0.05)  # fmt: skip
    async with agent:
        with pytest.raises(FormatError, match="v999999999999"):
            await agent.sync_once()
        assert agent.version == 1
        assert_holds(agent.engine.load_state_dict(), states[1])  # type: ignore[attr-defined]
    ack = read_acks(root)["e1"]
    assert ack.version == 1 and ack.bad_versions == (999999999999,)
    with pytest.raises(ConfigError, match="v999999999999 is the last version number"):
        async with Publisher(root, keyframe_interval=0):
            pass
    async with Publisher(tmp_path / "other", keyframe_interval=0):  # nothing held
        pass
    import shutil

    shutil.rmtree(last)
    async with Publisher(root, keyframe_interval=0) as pub:  # the lock was released
        assert pub.next_version == 2


async def test_a_version_removed_by_retention_while_it_is_read_is_not_bad(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """(helper-23, finding 6) Retention removed v1 (its manifest, then its directory) while a
    lagging receiver read its shards: the missing shard marked v1 bad for good (reported in
    the ack and by `asyncsync status`) with "no keyframe follows it yet" though one did. The
    receiver now sees the version gone and goes on from the keyframe, nothing marked bad."""
    import shutil

    import receiver.agent as agent_mod

    root = tmp_path / "root"
    states = [mixed_state(0)]
    async with Publisher(root, keyframe_interval=0) as pub:
        await pub.seed(states[0])
        for v in (1, 2, 3):
            states.append(mutate(states[-1], 0.03, seed=v))
            await pub.publish(states[-1], keyframe=v == 2)
    agent = ReceiverAgent(root, LocalCheckpoint(tmp_path / "c"), "e1", use_inotify=False,
                          verify_deadline=0.05, prefetch=False)  # fmt: skip
    async with agent:
        real = agent_mod.read_verified

        def racing(path: Path, *a: object, **k: object) -> bytes:
            if path.parent.name == _vdir(root, 1).name and path.parent.exists():
                (path.parent / "manifest.json").unlink()  # as retention does: manifest first
                shutil.rmtree(path.parent)
            return real(path, *a, **k)  # type: ignore[arg-type]

        await sync_to(agent, root, 0)
        monkeypatch.setattr(agent_mod, "read_verified", racing)
        with caplog.at_level(logging.WARNING):
            assert await agent.sync_once() == 3
        assert_holds(agent.engine.load_state_dict(), states[3])  # type: ignore[attr-defined]
    assert "v1 was removed while it was read" in caplog.text
    assert "v1 is bad" not in caplog.text
    assert read_acks(root)["e1"].bad_versions == ()
