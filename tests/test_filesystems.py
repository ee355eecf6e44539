"""Odd filesystems: FUSE mounts where inotify is blind, a full disk, I/O errors, slow I/O.

The FUSE and full-disk tests mount real filesystems (bindfs, a tiny tmpfs); they need root and
/dev/fuse and skip with the reason otherwise (`.ci/run` installs bindfs).
"""

from __future__ import annotations

import asyncio
import errno
import os
from pathlib import Path

import pytest
import torch

from asyncsync import Publisher, PublishError, fsio
from asyncsync.format.store import list_versions
from receiver import ReceiverAgent
from receiver.engines.checkpoint import LocalCheckpoint
from receiver.watch import wakeups
from tests.conftest import mixed_state, mutate, same_bytes
from tests.mounts import bindfs_mount
from tests.mounts import tmpfs as tiny_tmpfs


async def test_inotify_is_blind_on_fuse_but_polling_finds_every_version(tmp_path: Path) -> None:
    real, fuse = tmp_path / "real", tmp_path / "fuse"
    with bindfs_mount(real, fuse):
        # 1. the premise: a write through the other mount wakes the watcher only by polling
        reasons: list[str] = []

        async def watch() -> None:
            async for r in wakeups(fuse, poll_interval=0.3, use_inotify=True):
                reasons.append(r)
                if len(reasons) >= 4:
                    return

        task = asyncio.create_task(watch())
        await asyncio.sleep(0.1)
        for i in range(3):
            (real / f"v{i}").mkdir()
            await asyncio.sleep(0.1)
        await asyncio.wait_for(task, 10)
        assert reasons[0] == "start" and set(reasons[1:]) == {"poll"}
        for i in range(3):  # not a root's entries: a receiver refuses such a directory
            (real / f"v{i}").rmdir()

        # 2. the receiver, watching the FUSE side with inotify on, still takes every version
        sd = mixed_state(0)
        agent = ReceiverAgent(fuse, LocalCheckpoint(tmp_path / "ckpt"), "e", poll_interval=0.2)
        stop = asyncio.Event()
        async with asyncio.TaskGroup() as tg:
            tg.create_task(agent.run(stop=stop))
            async with Publisher(real) as pub:  # the trainer writes through the real path
                await pub.seed(sd)
                for i in range(1, 5):
                    sd = mutate(sd, 0.03, seed=i)
                    r = await pub.publish(sd)
                    await pub.wait_acked(r.version, engines=["e"], timeout=30)
            stop.set()
        held = agent.engine.load_state_dict()  # type: ignore[attr-defined]
        assert all(same_bytes(held[k], v) for k, v in sd.items())
        await agent.close()


async def test_full_disk_commits_nothing_and_recovers(tmp_path: Path) -> None:
    with tiny_tmpfs(tmp_path / "small", "4m") as root:
        sd = {"w": torch.randn(256, 1024)}  # 1 MiB per version as a keyframe
        async with Publisher(root, bucket_bytes=256 << 10, keyframe_interval=0) as pub:
            await pub.seed(sd)
            ballast = root / "ballast"
            with pytest.raises(OSError), open(ballast, "wb") as f:  # fill the disk
                while True:
                    f.write(b"\0" * (64 << 10))
            before = sorted(p.name for p in root.iterdir())
            with pytest.raises(PublishError) as ei:
                await pub.publish({"w": sd["w"] + 1}, keyframe=True)
            cause = ei.value.__cause__
            assert isinstance(cause, OSError) and cause.errno == errno.ENOSPC
            assert sorted(p.name for p in root.iterdir()) == before  # no partial version dir
            assert not [p for p in root.rglob(".tmp.*")]
            assert list_versions(root) == [0]
            ballast.unlink()  # space is back
            r = await pub.publish({"w": sd["w"] + 1}, keyframe=True)
            assert r.version == 1 and list_versions(root) == [0, 1]


async def test_eio_on_fsync_commits_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sd = mixed_state(0)
    async with Publisher(tmp_path, keyframe_interval=0) as pub:
        await pub.seed(sd)
        real_fsync = os.fsync

        def failing_fsync(fd: int) -> None:
            raise OSError(errno.EIO, "Input/output error (injected)")

        monkeypatch.setattr(os, "fsync", failing_fsync)
        with pytest.raises(PublishError, match="Input/output error"):
            await pub.publish(mutate(sd, 0.05, seed=1))
        monkeypatch.setattr(os, "fsync", real_fsync)
        assert list_versions(tmp_path) == [0]
        assert not list(tmp_path.rglob(".tmp.*"))
        assert (await pub.publish(mutate(sd, 0.05, seed=1))).version == 1


async def test_slow_filesystem_nothing_times_out_and_progress_is_reported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """At 20 MB/s and 20 ms per file, a multi-shard sync is slow but completes; the agent's
    status reports shards done while the version is in flight."""
    sd = mixed_state(0, scale=8)
    root = tmp_path / "root"
    fsio.set_throttle(fsio.Throttle(bandwidth=20e6, latency=0.02))
    seen_progress: list[tuple[int, int]] = []
    try:
        async with Publisher(root, bucket_bytes=16 << 10, keyframe_interval=0) as pub:
            await pub.seed(sd)
            sd = mutate(sd, 0.2, seed=1)
            await pub.publish(sd)
        agent = ReceiverAgent(root, LocalCheckpoint(tmp_path / "c"), "e", use_inotify=False)
        async with agent:
            task = asyncio.create_task(agent.sync_once())
            while not task.done():
                p = agent.status().progress
                if p is not None:
                    seen_progress.append(p)
                await asyncio.sleep(0.01)
            assert await task == 1
    finally:
        fsio.set_throttle(None)
    assert seen_progress and max(t for _, t in seen_progress) > 1
    assert any(0 < d < t for d, t in seen_progress)
