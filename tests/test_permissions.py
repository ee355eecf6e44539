"""Files in a root are 0644 and directories 0755 whatever the umask (issue 13, failure 2):
receivers often run as another uid (the Docker image runs as uid 10001)."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncsync import Publisher, fsio
from asyncsync.format.acks import write_ack
from asyncsync.publish.retention import RetentionPolicy
from receiver import ReceiverAgent
from receiver.engines.checkpoint import LocalCheckpoint
from tests.conftest import mixed_state, mutate


@pytest.fixture
def umask_077() -> Iterator[None]:
    old = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(old)


def _modes(root: Path) -> dict[str, int]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            out[os.path.relpath(p, root)] = stat.S_IMODE(os.lstat(p).st_mode)
    return out


async def test_every_file_and_dir_of_a_root_has_the_documented_mode(
    tmp_path: Path, umask_077: None
) -> None:
    root = tmp_path / "root"
    sd = mixed_state(0)
    policy = RetentionPolicy(keep_versions=2)
    async with Publisher(root, bucket_bytes=8192, keyframe_interval=2, retention=policy) as pub:
        await pub.seed(sd)
        for i in range(1, 4):
            sd = mutate(sd, 0.05, seed=i)
            await pub.publish(sd)
        async with ReceiverAgent(
            root, LocalCheckpoint(tmp_path / "ck"), "e1", use_inotify=False
        ) as a:
            assert await a.sync_once() == 3
            modes = _modes(root)
    assert any(k.startswith("acks") for k in modes) and any(k.startswith("leases") for k in modes)
    assert "log.jsonl" in modes and "asyncsync.json" in modes
    for rel, mode in modes.items():
        is_dir = (root / rel).is_dir()
        assert mode == (0o755 if is_dir else 0o644), (rel, oct(mode))
    assert stat.S_IMODE(root.stat().st_mode) == 0o755


def test_fsio_primitives_set_the_mode_on_the_descriptor(tmp_path: Path, umask_077: None) -> None:
    fsio.atomic_write(tmp_path / "a", b"x")
    fsio.append_line(tmp_path / "log", "{}")
    lock = fsio.FileLock(tmp_path / "lock")
    assert lock.acquire()
    lock.release()
    d = fsio.make_dir(tmp_path / "d" / "e", parents=True)
    write_ack(tmp_path, "e1", 1, "ab" * 16, "r")
    for p in ("a", "log", "lock", "acks/e1.json"):
        assert stat.S_IMODE((tmp_path / p).stat().st_mode) == 0o644, p
    for p in (d, d.parent, tmp_path / "acks"):
        assert stat.S_IMODE(p.stat().st_mode) == 0o755, p
