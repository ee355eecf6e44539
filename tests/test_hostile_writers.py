"""Issue 22, finding 1: the trainer side never writes, chmods or deletes through a symlink planted
in the root (every host that runs a receiver can write there).

Each symlink leads to a file or directory outside the root with mode 0600/0700 and content of
its own; after the publisher, multi-rank rank 0 or retention ran, the target is exactly as it
was (bytes, mode, entries). The protocol's own files are then what the publisher made of them:
a lock it could not take is an error naming the link; a log it will not append to does not
stop a commit; a symlinked old version is unlinked by retention, its target untouched.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch

from asyncsync import AckTimeout, ConfigError, Publisher
from asyncsync.format import LOG_NAME, MANIFEST_NAME, version_dir
from asyncsync.format.acks import read_acks, wait_acked, write_ack
from asyncsync.format.store import list_versions
from asyncsync.publish.rendezvous import FileRendezvous
from asyncsync.publish.retention import RetentionPolicy, collect


def _state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(32, 16, generator=g), "b": torch.randn(16, generator=g)}


def _tree(top: Path) -> dict[str, tuple[int, str | None]]:
    """mode and content digest of every entry under ``top`` (links not followed)."""
    out: dict[str, tuple[int, str | None]] = {".": (os.lstat(top).st_mode, None)}
    for p in sorted(top.rglob("*")):
        st = os.lstat(p)
        digest = hashlib.sha256(p.read_bytes()).hexdigest() if stat.S_ISREG(st.st_mode) else None
        out[str(p.relative_to(top))] = (st.st_mode, digest)
    return out


def _outside_file(tmp: Path, content: bytes) -> Path:
    target = tmp / "outside" / "precious"
    target.parent.mkdir()
    target.write_bytes(content)
    target.chmod(0o600)
    return target


async def test_a_symlinked_lock_file_is_never_truncated(tmp_path: Path) -> None:
    root = tmp_path / "root"
    async with Publisher(root) as pub:
        await pub.seed(_state(0))
    target = _outside_file(tmp_path, b"a file of someone else\n")
    before = _tree(target.parent)
    (root / ".publisher.lock").unlink()
    (root / ".publisher.lock").symlink_to(target)
    with pytest.raises(ConfigError, match="symlink"):
        async with Publisher(root):
            pass
    assert _tree(target.parent) == before  # today's main: truncated to "pid host"


async def test_a_symlinked_log_is_never_appended_to_nor_chmodded(tmp_path: Path) -> None:
    root = tmp_path / "root"
    async with Publisher(root, keyframe_interval=0) as pub:
        await pub.seed(_state(0))
        target = _outside_file(tmp_path, b'{"version": 99}\n')
        before = _tree(target.parent)
        (root / LOG_NAME).unlink()
        (root / LOG_NAME).symlink_to(target)
        r = await pub.publish(_state(1))  # the log is for operators: the commit stands
        assert r.version == 1
    async with Publisher(root, retention=RetentionPolicy(keep_versions=1, ack_ttl=None)) as pub:
        await pub.seed(_state(2))  # reopen (finish_interrupted), retention trims the log
    assert list_versions(root) == [2]
    assert _tree(target.parent) == before  # today's main: mode 0644 and a JSON line appended
    assert (root / LOG_NAME).is_symlink()


async def test_rank_0_never_empties_a_symlinked_rendezvous_directory(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    elsewhere = tmp_path / "outside" / "someones-dir"
    elsewhere.mkdir(parents=True)
    (elsewhere / "notes.json").write_text("{}")
    (elsewhere / "group-v2.json").write_text('{"group": "not asyncsync"}')
    before = _tree(elsewhere.parent)
    (root / ".rendezvous").symlink_to(elsewhere, target_is_directory=True)
    coordinator = FileRendezvous(root, 0, 2, timeout=0.2)
    with pytest.raises(ConfigError, match="symlink"):
        async with Publisher(root, coordinator=coordinator):
            pass
    assert _tree(elsewhere.parent) == before  # today's main: notes.json gone, group-v2.json new


async def test_retention_unlinks_a_symlinked_version_and_never_touches_its_target(
    tmp_path: Path,
) -> None:
    root = tmp_path / "root"
    async with Publisher(root, keyframe_interval=0) as pub:
        await pub.seed(_state(0))
        await pub.publish(_state(1))
        await pub.publish(_state(2), keyframe=True)
    v0 = version_dir(root, 0)
    target = tmp_path / "outside" / v0.name
    shutil.move(v0, target)  # a real version's files, with its manifest
    for p in [target, *target.iterdir()]:
        p.chmod(0o700 if p.is_dir() else 0o600)
    v0.symlink_to(target, target_is_directory=True)
    before = _tree(target.parent)
    report = collect(root, RetentionPolicy(keep_versions=1, ack_ttl=None))
    assert report.deleted == (0, 1)
    assert not os.path.lexists(v0) and list_versions(root) == [2]
    assert _tree(target.parent) == before  # today's main: the target's manifest.json deleted
    assert (target / MANIFEST_NAME).is_file()


async def test_a_junk_entry_at_the_next_version_is_removed_not_followed(tmp_path: Path) -> None:
    """A symlink (or FIFO) planted at the name of the version a running publisher writes next
    is in its way: it is removed (the link, not its target) and the version written."""
    root = tmp_path / "root"
    elsewhere = tmp_path / "outside" / "dir"
    elsewhere.mkdir(parents=True)
    (elsewhere / "notes.txt").write_text("mine\n")
    before = _tree(elsewhere.parent)
    async with Publisher(root, keyframe_interval=0) as pub:
        await pub.seed(_state(0))
        version_dir(root, 1).symlink_to(elsewhere, target_is_directory=True)
        assert (await pub.publish(_state(1))).version == 1
        os.mkfifo(version_dir(root, 2))
        assert (await pub.publish(_state(2))).version == 2
    assert list_versions(root) == [0, 1, 2] and not version_dir(root, 1).is_symlink()
    assert _tree(elsewhere.parent) == before  # today's main: v1's shards written into it


@pytest.mark.parametrize("wait", ["named", "quorum"])
async def test_acks_that_is_a_symlink_is_said_by_a_wait_and_never_followed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, wait: str
) -> None:
    """``acks/`` replaced by a symlink to a directory holding a valid-looking ack: a wait
    never reads through it (it would have taken that ack) and says once why it reads none,
    whether it reads the named engines' files or lists them all."""
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    async with Publisher(root) as pub:
        await pub.seed({"w": torch.zeros(100)})
        run_id = pub.run_id
    write_ack(root, "gpu0", 0, "ab" * 16, run_id)
    (root / "acks").rename(elsewhere)
    (root / "acks").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(AckTimeout):
        if wait == "named":
            await wait_acked(root, 0, engines=["gpu0"], timeout=0.5)
        else:
            await wait_acked(root, 0, quorum=1, timeout=0.5)
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(said) == 1 and "cannot list acks" in said[0], said


async def test_an_unreadable_ack_is_said_once_not_at_every_poll(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """(attack-42) One unreadable file in ``acks/`` (a torn ack, a stray file) was logged as a
    WARNING at every read of the acks: ~11 a second from a trainer's ``wait_acked`` (it polls
    every 20-100 ms) and from ``asyncsync tail -f``, for as long as they ran. It is said once
    (again after ten minutes, or when its reason changes)."""
    root = tmp_path / "root"
    async with Publisher(root) as pub:
        await pub.seed({"w": torch.zeros(100)})
    (root / "acks").mkdir(exist_ok=True)
    (root / "acks" / "torn.json").write_text('{"format": "asyncsync", "engine_id": ')
    (root / "acks" / "other.json").write_text(
        (root / "acks" / "torn.json").read_text() + '"x", "version": 0}'
    )
    with pytest.raises(AckTimeout):  # a wait for named engines reads their files only
        await wait_acked(root, 0, engines=["gpu0"], timeout=0.3)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    with pytest.raises(AckTimeout):  # a quorum's reads every ack, at every poll
        await wait_acked(root, 0, quorum=1, timeout=1.0)
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(said) == 2, said  # once for each file
    assert any("torn.json" in m for m in said) and any("other.json" in m for m in said)
    (root / "acks" / "torn.json").write_text("[]")  # another reason: said again
    read_acks(root)
    assert sum("torn.json" in r.getMessage() for r in caplog.records) == 2
