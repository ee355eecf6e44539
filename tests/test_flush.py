"""LocalCheckpoint's flush after the ack, under a disk that fails for a while or falls behind
(found by attack 44 on the flush moved to the engine's own thread, with a real receiver)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

import pytest

from asyncsync import Publisher, fsio
from asyncsync.errors import ApplyFailed, OutOfOrder
from asyncsync.format.acks import read_acks
from receiver import ReceiverAgent
from receiver.engines.checkpoint import LocalCheckpoint
from receiver.engines.st_layout import FileMaps
from tests.conftest import flip_tensor_byte, mixed_state, mutate
from tests.mounts import ext4_on_tmpfs, fill, punch_pages, remount
from tests.test_engines import (
    apply_version,
    assert_same,
    build_manifest,
    delta_batches,
    full_batches,
    init_checkpoint,
)


def _enospc(*_args: object, **_kw: object) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


async def _v1_whose_flush_failed(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[LocalCheckpoint, dict[str, Any], dict[str, Any]]:
    """A checkpoint at v1 over the seed whose flush of v1 failed (ENOSPC): (it, sd0, sd1)."""
    sd0 = mixed_state(0)
    ck = await init_checkpoint(path, sd0)
    sd1 = mutate(sd0, 0.05, seed=1)
    m1 = build_manifest(sd1, 1, base=sd0)
    await apply_version(ck, m1, delta_batches(m1, sd0, sd1), "delta")
    with monkeypatch.context() as m:
        m.setattr(FileMaps, "sync", _enospc)
        await ck.acknowledged()
        await ck.flushed()
    return ck, sd0, sd1


async def _recovered(
    ck: LocalCheckpoint, path: Path, sd1: dict[str, Any], how: str
) -> LocalCheckpoint:
    """The recovery of v1 (lost after its failed flush) run by the next delta's begin, which it
    refuses ("in_place"), or by an open of the directory after a close (else): the checkpoint."""
    if how == "in_place":
        sd2 = mutate(sd1, 0.05, seed=2)
        m2 = build_manifest(sd2, 2, base=sd1)
        with pytest.raises(OutOfOrder, match="removed"):
            await ck.begin(m2, "delta")
        return ck
    await ck.close()
    ck = LocalCheckpoint(path)
    await ck.open()
    return ck


def _state(path: Path) -> dict[str, Any]:
    st: dict[str, Any] = json.loads((path / ".asyncsync" / "state.json").read_text())
    return st


@contextlib.asynccontextmanager
async def _receiver_whose_v1_was_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[Path, dict[str, Any], LocalCheckpoint, ReceiverAgent]]:
    """A root at v1 over a keyframe and a receiver that acked v1, whose flush of v1 failed and
    one of whose tensors then read back other bytes (a dropped page): (root, sd1, ck, agent)."""
    root = tmp_path / "root"
    sd0 = mixed_state(0)
    sd1 = mutate(sd0, 0.05, seed=1)
    async with Publisher(root, keyframe_interval=0) as pub:
        await pub.seed(sd0)
        await pub.publish(sd1)
    ck = LocalCheckpoint(tmp_path / "ck")
    async with ReceiverAgent(root, ck, "e", use_inotify=False, prefetch=False) as agent:
        with monkeypatch.context() as m:
            m.setattr(FileMaps, "sync", _enospc)
            assert await agent.sync_once() == 1
            await ck.flushed()
        _damage(ck)
        yield root, sd1, ck, agent


def _acks_at_full(
    monkeypatch: pytest.MonkeyPatch, ck: LocalCheckpoint, root: Path, agent: ReceiverAgent
) -> list[int | None]:
    """The receiver's ack each time ``ck`` begins a full version (the agent then claims none)."""
    seen: list[int | None] = []
    begin = ck.begin

    async def watched(m: Any, mode: Literal["delta", "full"]) -> None:
        if mode == "full":
            ack = read_acks(root).get("e")
            seen.append(None if ack is None else ack.version)
            assert agent.status().version is None
        await begin(m, mode)

    monkeypatch.setattr(ck, "begin", watched)
    return seen


@pytest.mark.parametrize("how", ["in_place", "reopened"])
async def test_the_engine_goes_on_once_a_failed_flush_can_be_done_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: Literal["in_place", "reopened"]
) -> None:
    """v1's flush fails (a disk full for a few seconds; a real receiver on a tmpfs filled while
    the flush ran): the engine is broken, and it stayed so for good, every later version
    refused until the process restarted ("close and reopen it", but the agent never does,
    and the same object closed and reopened stayed broken too). Now the next begin does what
    a reopen does: re-checks v1, flushes it again, and goes on; while the disk still fails,
    that begin is refused and v1 kept."""
    sd0 = mixed_state(0)
    ck = await init_checkpoint(tmp_path, sd0)
    sd1 = mutate(sd0, 0.05, seed=1)
    m1 = build_manifest(sd1, 1, base=sd0)
    await apply_version(ck, m1, delta_batches(m1, sd0, sd1), "delta")
    working = FileMaps.sync

    monkeypatch.setattr(FileMaps, "sync", _enospc)
    await ck.acknowledged()
    await ck.flushed()  # v1's flush failed: logged, the engine broken
    assert _state(tmp_path)["synced"] is False
    sd2 = mutate(sd1, 0.05, seed=2)
    m2 = build_manifest(sd2, 2, base=sd1)
    if how == "in_place":
        monkeypatch.setattr(
            "receiver.engines.checkpoint.files.CheckpointFiles.rewrite_data_files", _enospc
        )
        with pytest.raises(ApplyFailed):  # still full: refused, v1 kept
            await ck.begin(m2, "delta")
        assert ck.state.version == 1 and _state(tmp_path)["status"] == "clean"
        monkeypatch.undo()  # the space is back
    else:
        monkeypatch.setattr(FileMaps, "sync", working)
        await ck.close()
        assert (await ck.open()).version == 1
    await apply_version(ck, m2, delta_batches(m2, sd1, sd2), "delta")
    await ck.acknowledged()
    await ck.flushed()
    st = _state(tmp_path)
    assert (st["version"], st.get("synced", True)) == (2, True)
    await ck.close()
    assert_same(LocalCheckpoint(tmp_path).load_state_dict(), sd2)


def _data_fds(root: Path) -> list[str]:
    """This process's descriptors open on data files under ``root``: only this test's (the full
    suite's run counted another test's checkpoint, not yet collected, and read 10 for 8)."""
    found = []
    for fd in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith(f"{root}/") and target.endswith(".safetensors"):
                found.append(target)
    return found


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts descriptors in /proc")
async def test_versions_ahead_of_a_slow_flush_hold_two_flushes_at_most(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """v1's flush is held (a slow disk) while v2..v9 are applied and acknowledged: each waiting
    flush held its maps, a descriptor and a mapping per data file, so the descriptors grew
    with the versions behind (a real receiver at ``ulimit -n 128`` ran out at 58 versions,
    EMFILE broke the engine). A waiting flush is dropped when a newer one comes (that one
    writes back every data file): v9 is still made durable, bit for bit."""
    sd = mixed_state(0)
    ck = await init_checkpoint(tmp_path, sd)
    files = len(ck.files.data_files())
    gate, started = threading.Event(), threading.Event()
    working = FileMaps.sync
    calls: list[int] = []

    def held(self: FileMaps) -> None:
        calls.append(1)
        if len(calls) == 1:
            started.set()
            gate.wait(20)
        working(self)

    monkeypatch.setattr(FileMaps, "sync", held)
    for v in range(1, 10):
        new = mutate(sd, 0.05, seed=v)
        m = build_manifest(new, v, base=sd)
        await apply_version(ck, m, delta_batches(m, sd, new), "delta")
        await ck.acknowledged()
        sd = new
        if v == 1:
            assert await asyncio.to_thread(started.wait, 10)
    # v1's flush running, v9's waiting: two maps, each file's descriptor and its mapping's own
    held_fds = _data_fds(tmp_path)
    assert len(held_fds) <= 2 * 2 * files, held_fds
    gate.set()
    await ck.flushed()
    assert len(calls) == 2
    st = _state(tmp_path)
    assert (st["version"], st.get("synced", True)) == (9, True)
    await ck.close()
    assert _data_fds(tmp_path) == []
    assert_same(LocalCheckpoint(tmp_path).load_state_dict(), sd)


@pytest.mark.parametrize(
    "how",
    [
        "in_place",
        "reopened",
        "restarted",
    ],
)
async def test_a_version_flushed_again_after_a_failed_writeback_is_on_the_disk(
    tmp_path: Path, how: Literal["in_place", "reopened", "restarted"]
) -> None:
    """v2's flush fails for real (ext4 on a failing disk: the blocks of the pages v2 changed
    cannot be written); the kernel marks those pages clean, so the fsync of the recovery
    succeeded and wrote nothing: ``synced`` became true at v3 with v2's pages not on disk,
    and after a reboot (remount) the checkpoint was damaged (its first file's header, here).
    The recovery writes the bytes again before the fsync: v3 is on the disk, bit for bit."""
    with ext4_on_tmpfs(tmp_path / "disk") as (disk, image):
        ck_dir = disk / "ck"
        sd1 = mutate(mixed_state(0), 0.05, seed=1)
        ck = await init_checkpoint(ck_dir, sd1)  # (v0 holds sd1)
        os.sync()
        before = {f: f.read_bytes() for f in ck.files.data_files()}
        sd2 = mutate(sd1, 0.05, seed=2)
        m2 = build_manifest(sd2, 1, base=sd1)
        await apply_version(ck, m2, delta_batches(m2, sd1, sd2), "delta")  # not flushed yet
        for f, old in before.items():  # the disk cannot write the pages v2 changed
            new = f.read_bytes()
            changed = {
                i // 4096
                for i in range(0, len(new), 4096)
                if new[i : i + 4096] != old[i : i + 4096]
            }
            punch_pages(f, image, changed)
        fill(image.parent, 0)
        await ck.acknowledged()
        await ck.flushed()
        assert ck._broken is not None and _state(ck_dir)["synced"] is False
        (image.parent / "ballast").unlink()  # the space is back
        if how != "in_place":
            await ck.close()
            if how == "restarted":  # a new process (a receiver restarted by its operator)
                ck = LocalCheckpoint(ck_dir)
            assert (await ck.open()).version == 1
        sd3 = mutate(sd2, 0.05, seed=3, names=["model.scalar"])
        m3 = build_manifest(sd3, 2, base=sd2)
        await apply_version(ck, m3, delta_batches(m3, sd2, sd3), "delta")
        await ck.flushed()
        assert _state(ck_dir).get("synced", True) is True
        await ck.close()
        remount(disk)
        ck = LocalCheckpoint(ck_dir)
        assert (await ck.open()).version == 2
        assert_same(ck.load_state_dict(), sd3)
        await ck.close()


class _LockAfter:
    """The engine's lock, taken by any thread but the flush's only once ``ready`` is set: holds
    a begin between its look at the engine and its locked part (where a flush may fail)."""

    def __init__(self, inner: Any, ready: threading.Event) -> None:
        self.inner, self.ready, self.waiting = inner, ready, threading.Event()

    def __enter__(self) -> None:
        if not threading.current_thread().name.startswith("flush "):
            self.waiting.set()
            assert self.ready.wait(20)
        self.inner.__enter__()

    def __exit__(self, *exc: object) -> None:
        self.inner.__exit__(*exc)


async def test_a_flush_that_fails_as_a_begin_takes_the_lock_is_recovered_not_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """v1's flush fails after v2's begin looked for a failed flush (none yet) and before it
    took the engine's lock: the flag was set outside the lock, and the begin's locked part
    found it and refused v2 ("rechecked at next begin"); the agent then takes a refused version
    as a reason to go on from the next keyframe (a full download) instead of the delta. The
    failure is now recorded under the lock, and a begin that finds it there recovers first
    (v1 re-checked and flushed again), as one that saw it before does: v2 applies."""
    from receiver.engines.checkpoint import flusher

    sd0 = mixed_state(0)
    ck = await init_checkpoint(tmp_path, sd0)
    sd1 = mutate(sd0, 0.05, seed=1)
    m1 = build_manifest(sd1, 1, base=sd0)
    await apply_version(ck, m1, delta_batches(m1, sd0, sd1), "delta")
    release, noted = threading.Event(), threading.Event()
    working, calls = FileMaps.sync, []

    def fails_once(self: FileMaps) -> None:
        calls.append(1)
        if len(calls) == 1:
            assert release.wait(20)
            raise OSError(errno.EIO, "Input/output error")
        working(self)

    def note(state_dir: Path, why: str) -> bool:
        try:
            return real_note(state_dir, why)
        finally:
            noted.set()  # the failure is recorded (before the note) in either code

    real_note = flusher._note
    monkeypatch.setattr(FileMaps, "sync", fails_once)
    monkeypatch.setattr(flusher, "_note", note)
    await ck.acknowledged()  # v1's flush runs, held in its sync
    lock = _LockAfter(ck._mutex, noted)
    monkeypatch.setattr(ck, "_mutex", lock)
    sd2 = mutate(sd1, 0.05, seed=2)
    m2 = build_manifest(sd2, 2, base=sd1)
    begin = asyncio.ensure_future(ck.begin(m2, "delta"))
    assert await asyncio.to_thread(lock.waiting.wait, 20)  # past its look, before its lock
    release.set()  # v1's flush fails now
    await begin
    for b in delta_batches(m2, sd1, sd2):
        await ck.apply(b)
    await ck.commit()
    await ck.flushed()
    st = _state(tmp_path)
    assert (st["version"], st.get("synced", True)) == (2, True)
    await ck.close()
    assert_same(LocalCheckpoint(tmp_path).load_state_dict(), sd2)


def _damage(ck: LocalCheckpoint) -> None:
    """One tensor's first bytes changed in its file: what a page the failed flush could not
    write reads back as once the kernel dropped it (clean, unwritten)."""
    loc = next(iter(ck.files.load_layout().values()))
    with open(ck.directory / loc.file, "r+b") as f:
        f.seek(loc.begin)
        old = f.read(4)
        f.seek(loc.begin)
        f.write(bytes(b ^ 0xFF for b in old))


@pytest.mark.parametrize("v2", ["delta", "zero_diff"])
async def test_a_version_the_recovery_wipes_is_no_longer_acked_and_the_sync_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, v2: str
) -> None:
    """v1's flush fails; before v2 its bytes no longer match (a dropped page), so the recovery
    at v2's begin wipes the checkpoint. The begin raised OutOfOrder ("the engine holds
    vNone"), the sync failed, and the ack still named v1, which the receiver no longer held,
    until a later sync (the next wake) applied the keyframe. Now the ack goes at once, and the
    same sync goes on from the keyframe: the ack is gone while the keyframe is applied. A
    zero-diff v2 was taken over the lost v1 (its bump never recovered) and acked; now its bump
    recovers as a begin does, and the ack goes at once there too (it stayed until the
    keyframe's)."""
    root, ckpt = tmp_path / "root", tmp_path / "ck"
    sd0 = mixed_state(0)
    sd1 = mutate(sd0, 0.05, seed=1)
    sd2 = sd1 if v2 == "zero_diff" else mutate(sd1, 0.05, seed=2)
    async with Publisher(root, keyframe_interval=0) as pub:
        await pub.seed(sd0)
        await pub.publish(sd1)
        ck = LocalCheckpoint(ckpt)
        async with ReceiverAgent(root, ck, "e", use_inotify=False, prefetch=False) as agent:
            working = FileMaps.sync

            monkeypatch.setattr(FileMaps, "sync", _enospc)
            assert await agent.sync_once() == 1
            await ck.flushed()  # failed, after the ack
            assert ck._broken is not None and read_acks(root)["e"].version == 1
            monkeypatch.setattr(FileMaps, "sync", working)
            _damage(ck)
            await pub.publish(sd2)
            acks_at_full = _acks_at_full(monkeypatch, ck, root, agent)
            assert await agent.sync_once() == 2
            assert acks_at_full == [None]  # v1 was no longer claimed while v0 was applied
            assert read_acks(root)["e"].version == 2
            await ck.flushed()
        assert_same(LocalCheckpoint(ckpt).load_state_dict(), sd2)


@pytest.mark.parametrize("how", ["in_place", "restarted"])
async def test_a_wipe_removes_the_failed_flush_note(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: Literal["in_place", "restarted"]
) -> None:
    """A failed flush leaves ``.asyncsync/flush-failed`` (the next open in a new process writes
    the data files again before it trusts them). A wipe (the held version no longer matched)
    removes every data file, but the note stayed: the next checkpoint, made from a keyframe,
    was rewritten whole at its first open for nothing. The wipe removes the note, after the
    files (a crash before that leaves a note and no version: an open removes it then)."""
    from receiver.engines.checkpoint.flusher import FAILED_NAME

    note = tmp_path / ".asyncsync" / FAILED_NAME
    ck, _, sd1 = await _v1_whose_flush_failed(tmp_path, monkeypatch)
    assert note.exists()
    _damage(ck)
    ck = await _recovered(ck, tmp_path, sd1, how)
    assert ck.state.version is None and not ck.files.data_files()
    assert not note.exists()
    await ck.close()


async def test_an_open_holding_no_version_removes_the_failed_flush_note(tmp_path: Path) -> None:
    """A wipe killed after the files went but before the note did: the open, which finds no
    version to check, removes the note (else the next version's first open rewrites it all)."""
    from receiver.engines.checkpoint.flusher import FAILED_NAME

    ck = LocalCheckpoint(tmp_path)
    await ck.open()
    await ck.close()
    note = tmp_path / ".asyncsync" / FAILED_NAME
    note.write_text("making v1 durable failed (ENOSPC)\n")
    await ck.open()
    assert not note.exists()
    await ck.close()


async def test_a_full_version_removes_the_failed_flush_note(tmp_path: Path) -> None:
    """A full version replaces every data file with one written and fsynced whole: a failed
    flush's note has nothing left to cover and goes (it stayed until a later open rewrote it
    all)."""
    from receiver.engines.checkpoint.flusher import FAILED_NAME

    sd0 = mixed_state(0)
    ck = await init_checkpoint(tmp_path, sd0)
    note = tmp_path / ".asyncsync" / FAILED_NAME
    note.write_text("making v0 durable failed (ENOSPC)\n")
    sd1 = mutate(sd0, 0.05, seed=1)
    m1 = build_manifest(sd1, 1)
    await apply_version(ck, m1, full_batches(m1, sd1), "full")
    assert not note.exists()
    await ck.close()


@pytest.mark.parametrize("how", ["in_place", "restarted"])
async def test_an_unsynced_version_whose_header_was_lost_is_wiped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: Literal["in_place", "restarted"]
) -> None:
    """v1's flush fails and the kernel drops the pages it could not write (clean): the first
    page of the data file reads back as the disk holds it, here zeros (found by the real
    receiver on an ext4 whose blocks were lost, killed after the failed flush and restarted).
    The re-check read the layout before any checksum, and the unreadable header made the open
    fail ("the checkpoint is damaged, remove it"): the receiver stayed down with its ack on v1,
    and an engine still running refused every begin while it reported v1. A version that is
    not known durable and whose layout no longer reads is wiped like one whose bytes differ."""
    ck, _, sd1 = await _v1_whose_flush_failed(tmp_path, monkeypatch)
    for f in ck.files.data_files():
        with open(f, "r+b") as fh:
            fh.write(bytes(4096))
    ck = await _recovered(ck, tmp_path, sd1, how)
    assert ck.state.version is None and not ck.files.data_files()
    assert _state(tmp_path)["version"] is None
    await ck.close()


async def test_a_failed_flush_is_recovered_when_nothing_newer_comes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """v1's flush fails and no newer version comes: the recovery waited for the next version's
    begin, so meanwhile the receiver went on acknowledging and serving v1 while the kernel
    could drop the pages it had not written (here one tensor reads back other bytes): every
    sync said v1 with the files no longer holding it. A sync with nothing newer recovers now:
    v1 re-checked, found lost, wiped, its ack removed, and applied again from the keyframe."""
    ckpt = tmp_path / "ck"
    async with _receiver_whose_v1_was_lost(tmp_path, monkeypatch) as (root, sd1, ck, agent):
        acks_at_full = _acks_at_full(monkeypatch, ck, root, agent)
        assert await agent.sync_once() == 1
        assert acks_at_full == [None]
        await ck.flushed()
    assert_same(LocalCheckpoint(ckpt).load_state_dict(), sd1)
    st = _state(ckpt)
    assert (st["version"], st.get("synced", True)) == (1, True)


async def test_a_wipe_whose_state_the_disk_refuses_claims_no_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The recovery after a failed flush wipes v1 (its pages lost) on a disk that refuses even
    the state's small write (a real receiver on a failing ext4: the loop device refused the
    blocks of the files just removed): the files went, but the engine's state and the ack
    kept naming v1 until a retry could save the state (22 s in the attack). Once its files go,
    the engine claims no version, saved or not, and the ack goes with the failed sync; once
    the disk takes the state, the receiver goes on from the keyframe."""
    from receiver.state import StateStore

    ckpt = tmp_path / "ck"
    async with _receiver_whose_v1_was_lost(tmp_path, monkeypatch) as (root, sd1, ck, agent):
        with monkeypatch.context() as m:
            m.setattr(StateStore, "save", _enospc)
            with pytest.raises(ApplyFailed, match="No space left"):
                await agent.sync_once()
            assert not ck.files.data_files()
            assert agent.status().version is None and "e" not in read_acks(root)
        assert await agent.sync_once() == 1
        await ck.flushed()
    assert_same(LocalCheckpoint(ckpt).load_state_dict(), sd1)


@pytest.mark.parametrize("records", ["progressive", "durable"])
async def test_a_rollback_whose_data_sync_fails_ends_clean_not_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, records: str
) -> None:
    """A delta rolled back on a disk that cannot write the data blocks (the undo's data sync
    fails until it can): the undo is written back in the page cache, but state.json said
    ``applying`` and every begin did the undo again from the journal, whose progressive
    records were never made durable (they are lost with the pages a failed writeback leaves
    clean). It ends as a failed flush does: the note first (a restart rewrites before it
    trusts), then state.json clean at v0 not durable, the records gone; the recovery (at
    the next begin or sync) checks v0, writes it again or is refused while the disk fails.
    Durable records (``sync_before_ack``) are kept instead: after a reboot they restore v0
    exactly, where a check could only wipe it."""
    from receiver.engines.checkpoint.files import CheckpointFiles
    from receiver.engines.checkpoint.flusher import FAILED_NAME

    sd0 = mixed_state(0)
    await (await init_checkpoint(tmp_path, sd0)).close()
    ck = LocalCheckpoint(tmp_path, sync_before_ack=records == "durable")
    await ck.open()
    sd1 = mutate(sd0, 0.05, seed=1)
    m1 = build_manifest(sd1, 1, base=sd0)
    await ck.begin(m1, "delta")
    for b in delta_batches(m1, sd0, sd1):
        await ck.apply(b)
    note, journal = tmp_path / ".asyncsync" / FAILED_NAME, tmp_path / ".asyncsync" / "journal"
    with monkeypatch.context() as m:
        m.setattr(FileMaps, "sync", _enospc)
        if records == "durable":
            with pytest.raises(ApplyFailed, match="No space left"):
                await ck.abort()
            assert _state(tmp_path)["status"] == "applying" and any(journal.iterdir())
        else:
            await ck.abort()  # was: ApplyFailed, "applying" and the undo done at every begin
            st = _state(tmp_path)
            assert (st["version"], st["status"], st.get("synced")) == (0, "clean", False)
            assert note.exists() and not any(journal.iterdir())
            m.setattr(CheckpointFiles, "rewrite_data_files", _enospc)
            with pytest.raises(ApplyFailed, match="No space left"):  # the disk still fails
                await ck.begin(m1, "delta")
            assert ck.state.version == 0
    await ck.reconcile()  # the disk writes again
    st = _state(tmp_path)
    assert (st["version"], st["status"], st.get("synced", True)) == (0, "clean", True)
    assert not note.exists()
    await apply_version(ck, m1, delta_batches(m1, sd0, sd1), "delta")
    await ck.close()
    assert_same(LocalCheckpoint(tmp_path).load_state_dict(), sd1)


async def test_a_rollback_done_again_whose_sync_fails_is_recovered_before_the_begin_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rollback whose data sync fails while the disk refuses even its note stays pending
    (``applying``, its records kept) and is done again at the next begin, where its sync fails
    again and the note is taken: it ends clean, not durable, the engine broken, and that begin
    went on with a delta over the unflushed version (refused only at its commit). It recovers
    first now (the held version checked and written again), then goes on."""
    from receiver.engines.checkpoint.flusher import Flusher

    sd0 = mixed_state(0)
    ck = await init_checkpoint(tmp_path, sd0)
    sd1 = mutate(sd0, 0.05, seed=1)
    m1 = build_manifest(sd1, 1, base=sd0)
    await ck.begin(m1, "delta")
    for b in delta_batches(m1, sd0, sd1):
        await ck.apply(b)
    with monkeypatch.context() as m:
        m.setattr(FileMaps, "sync", _enospc)  # the undo's (the recovery's rewrite is written)
        m.setattr(Flusher, "note", lambda self, why: False)
        with pytest.raises(ApplyFailed, match="No space left"):
            await ck.abort()
        assert _state(tmp_path)["status"] == "applying"
        m.undo()
        m.setattr(FileMaps, "sync", _enospc)
        await apply_version(ck, m1, delta_batches(m1, sd0, sd1), "delta")  # was: refused
    await ck.close()
    assert_same(LocalCheckpoint(tmp_path).load_state_dict(), sd1)


@pytest.mark.parametrize("bytes_", ["kept", "lost"])
async def test_a_zero_diff_version_recovers_a_failed_flush_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bytes_: Literal["kept", "lost"]
) -> None:
    """v1's flush fails, then a zero-diff v2 comes: the bump did not look at the failed flush,
    so v2 was taken (and acked) over v1 not known durable, its bytes lost or not (``lost``:
    a page the kernel dropped, v2 then claimed bytes the files no longer hold). A bump
    recovers first, as a begin does: v1 checked and written again (v2 taken, durable), or
    wiped (v2 refused, OutOfOrder: the receiver goes on from a keyframe)."""
    from receiver.engines.checkpoint.flusher import FAILED_NAME

    ck, _, sd1 = await _v1_whose_flush_failed(tmp_path, monkeypatch)
    m2 = build_manifest(sd1, 2, base=sd1)
    if bytes_ == "lost":
        _damage(ck)
        with pytest.raises(OutOfOrder, match="removed"):
            await ck.bump(m2)
        assert ck.state.version is None and _state(tmp_path)["version"] is None
    else:
        await ck.bump(m2)
        st = _state(tmp_path)
        assert (st["version"], st.get("synced", True)) == (2, True)
        assert not (tmp_path / ".asyncsync" / FAILED_NAME).exists()
    await ck.close()


def _flush_held_at_its_files(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """The flush held (a slow disk) once its maps are written back, before it opens the data
    files to fsync them: it runs on until the returned event is set."""
    gate, working = threading.Event(), fsio.open_file

    def slow(*args: Any, **kw: Any) -> int:
        if threading.current_thread().name.startswith("flush "):
            assert gate.wait(60)
        return working(*args, **kw)

    monkeypatch.setattr(fsio, "open_file", slow)
    return gate


async def _released_when_done_or_waiting(
    ck: LocalCheckpoint, call: Any, gate: threading.Event, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run ``call`` (an engine call) while the flush is held; the flush released once the call
    ended or once it waits for the flush (never by a clock), then the call awaited."""
    waiting = asyncio.Event()
    wait = ck._flusher.wait

    async def observed() -> None:
        waiting.set()
        await wait()

    monkeypatch.setattr(ck._flusher, "wait", observed)
    task = asyncio.ensure_future(call)
    waits = asyncio.ensure_future(waiting.wait())
    await asyncio.wait({task, waits}, return_when=asyncio.FIRST_COMPLETED)
    waits.cancel()
    gate.set()
    with contextlib.suppress(OutOfOrder):
        await task


async def _v1_flushing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[LocalCheckpoint, dict[str, Any], threading.Event]:
    """A checkpoint at v1 (a delta) whose flush runs, held before it opens the data files
    until the returned gate is set: (the engine, v1's state dict, the gate)."""
    sd0 = mixed_state(0)
    ck = await init_checkpoint(tmp_path, sd0)
    sd1 = mutate(sd0, 0.05, seed=1)
    m1 = build_manifest(sd1, 1, base=sd0)
    await apply_version(ck, m1, delta_batches(m1, sd0, sd1), "delta")
    gate = _flush_held_at_its_files(monkeypatch)
    await ck.acknowledged()
    return ck, sd1, gate


@pytest.mark.parametrize("call", ["reconcile", "begin"])
async def test_files_edited_during_a_flush_are_wiped_after_it_not_under_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, call: str
) -> None:
    """v1's flush is slow and a data file is edited behind the receiver's back meanwhile; a
    sync with nothing newer (``reconcile``) or the next delta's begin finds the edit and wipes
    the files. The wipe ran under the running flush, which then failed on the files removed
    under it: "making v1 durable failed" logged, a failed-flush note written and the engine
    marked broken until the next begin. The check now waits for the flush first: it ends
    clean, then the files are wiped, the engine holds nothing and is not broken."""
    ck, sd1, gate = await _v1_flushing(tmp_path, monkeypatch)
    flip_tensor_byte(tmp_path, "model.layers.2.weight")
    if call == "reconcile":
        action = ck.reconcile()
    else:
        sd2 = mutate(sd1, 0.05, seed=2)
        action = ck.begin(build_manifest(sd2, 2, base=sd1), "delta")
    await _released_when_done_or_waiting(ck, action, gate, monkeypatch)
    await ck.flushed()
    assert "durable failed" not in caplog.text, caplog.text
    assert ck._broken is None and ck.state.version is None
    assert not (tmp_path / ".asyncsync" / "flush-failed").exists()
    assert _state(tmp_path)["version"] is None and ck.files.data_files() == []
    sd3 = mutate(sd1, 0.05, seed=3)  # the receiver re-initialises from a keyframe
    m3 = build_manifest(sd3, 3)
    await apply_version(ck, m3, full_batches(m3, sd3), "full")
    await ck.close()
    assert_same(LocalCheckpoint(tmp_path).load_state_dict(), sd3)


async def test_a_sync_with_nothing_newer_does_not_wait_for_the_flush_of_unedited_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``reconcile`` (every sync that finds nothing newer) waits for a running flush only where
    the files were edited behind the receiver's back: otherwise the next version's sync would
    queue behind the last one's writeback, which the flush runs beside by design."""
    ck, sd1, gate = await _v1_flushing(tmp_path, monkeypatch)
    try:
        async with asyncio.timeout(120):  # liveness only: the flush cannot end before the gate
            await ck.reconcile()
        assert ck._flusher.running() and ck.state.version == 1
    finally:
        gate.set()
    await ck.flushed()
    assert ck._broken is None and _state(tmp_path)["version"] == 1
    await ck.close()
    assert_same(LocalCheckpoint(tmp_path).load_state_dict(), sd1)


def _mappings(directory: Path) -> dict[str, int]:
    """How many mappings of each file in ``directory`` this process holds (/proc/self/maps)."""
    out: dict[str, int] = {}
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split(maxsplit=5)[5:]
        if path and Path(path[0]).parent == directory:
            out[Path(path[0]).name] = out.get(Path(path[0]).name, 0) + 1
    return out


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc")
async def test_a_running_flush_holds_no_mapping_of_the_files_the_next_version_maps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """v1's flush is slow (held before it fsyncs the files) while v2 is applied and committed.
    The flush held v1's own mappings of the data files throughout, and v2 mapped them again:
    every page both touched was mapped twice, so the receiver's RSS counted it twice (no second
    copy in memory; the bench's peak read up to 2.08x the model where a slow flush overlapped
    the next apply). The flush needs only the descriptors (fsync): its mappings are dropped
    when it is submitted, so each data file is mapped once, by v2, while v1's flush runs."""
    ck, sd1, gate = await _v1_flushing(tmp_path, monkeypatch)
    try:
        sd2 = mutate(sd1, 0.05, seed=2)
        m2 = build_manifest(sd2, 2, base=sd1)
        async with asyncio.timeout(120):  # liveness only: v2 does not wait for v1's flush
            await apply_version(ck, m2, delta_batches(m2, sd1, sd2), "delta")
        assert ck._flusher.running()  # v1's, held
        mapped = _mappings(tmp_path)
        assert mapped and max(mapped.values()) == 1, mapped
    finally:
        gate.set()
    await ck.flushed()
    assert ck._broken is None and _state(tmp_path)["version"] == 2
    assert _mappings(tmp_path) == {}  # v2's flush done: its maps closed
    await ck.close()
    assert_same(LocalCheckpoint(tmp_path).load_state_dict(), sd2)
