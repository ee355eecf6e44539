"""A committed delta's undo records are cleared after its ack, not before it (off the ack's
path: the HF index stays before it), and a receiver killed with SIGKILL between its commit
and that clear reopens at the committed version, bit for bit, the stale records cleared."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from receiver.engines.checkpoint import LocalCheckpoint
from tests import test_engines as te
from tests.conftest import mixed_state, mutate


def _records(ckdir: Path) -> list[str]:
    return sorted(p.name for p in (ckdir / ".asyncsync" / "journal").iterdir())


def _undo_records(ckdir: Path) -> list[str]:
    return [name for name in _records(ckdir) if not name.startswith("spare-")]


@pytest.mark.parametrize("durable", [False, True], ids=["progressive", "durable"])
async def test_the_undo_records_are_cleared_after_the_ack(tmp_path: Path, durable: bool) -> None:
    sd0 = mixed_state(0)
    ck = await te.init_checkpoint(tmp_path, sd0)
    ck.sync_before_ack = durable
    sd1 = mutate(sd0, 0.05, seed=1)
    m1 = te.build_manifest(sd1, 1, base=sd0)
    await te.apply_version(ck, m1, te.delta_batches(m1, sd0, sd1, "xor"), "delta")
    assert _records(tmp_path)  # committed, not yet acked: still there
    index = (tmp_path / "model.safetensors.index.json").read_text()
    assert '"asyncsync_version": 1' in index  # the index is written before the ack
    await ck.acknowledged()
    assert _undo_records(tmp_path) == []  # a progressive record is kept as a spare
    spares = [name for name in _records(tmp_path) if name.startswith("spare-")]
    assert _records(tmp_path) == spares and bool(spares) is not durable
    # the next delta's begin clears them itself where nobody called acknowledged()
    sd2 = mutate(sd1, 0.05, seed=2)
    m2 = te.build_manifest(sd2, 2, base=sd1)
    await te.apply_version(ck, m2, te.delta_batches(m2, sd1, sd2, "xor"), "delta")
    sd3 = mutate(sd2, 0.05, seed=3)
    m3 = te.build_manifest(sd3, 3, base=sd2)
    await ck.begin(m3, "delta")
    assert _undo_records(tmp_path) == []
    await ck.abort()  # undoes nothing of v2
    te.assert_same(ck.load_state_dict(), sd2)
    await ck.close()


_CHILD = """
import asyncio, sys, time
from tests import test_engines as te
from tests.conftest import mixed_state, mutate
async def main():
    sd0 = mixed_state(0)
    ck = await te.init_checkpoint(sys.argv[1], sd0)
    sd1 = mutate(sd0, 0.05, seed=1)
    m1 = te.build_manifest(sd1, 1, base=sd0)
    await te.apply_version(ck, m1, te.delta_batches(m1, sd0, sd1, "xor"), "delta")
    print("committed", flush=True)  # then killed before acknowledged() clears the records
    time.sleep(600)
asyncio.run(main())
"""


async def test_a_receiver_killed_between_the_commit_and_the_clear_reopens_at_the_version(
    tmp_path: Path,
) -> None:
    ckdir, log = tmp_path / "c", tmp_path / "child.log"
    env = {**os.environ, "PYTHONPATH": str(te.REPO)}
    with open(log, "w") as err, subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(ckdir)], env=env, cwd=te.REPO,
        stdout=subprocess.PIPE, stderr=err, text=True,
    ) as proc:  # fmt: skip
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline() == "committed\n", log.read_text()
            assert _undo_records(ckdir)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    ck = LocalCheckpoint(ckdir)
    assert (await ck.open()).version == 1
    assert _undo_records(ckdir) == [] and _records(ckdir)  # kept as spares, never read
    te.assert_same(ck.load_state_dict(), mutate(mixed_state(0), 0.05, seed=1))
    await ck.close()


async def test_a_failed_clear_of_the_records_still_writes_the_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The housekeeping after a commit that clears the journal (a zero-diff bump here) writes
    the HF index even where the clear fails: the clear is retried by the next begin or open,
    but an index left at the version before would name a version the files no longer hold
    (a reloading engine's server reads it)."""
    sd0 = mixed_state(0)
    ck = await te.init_checkpoint(tmp_path, sd0)
    store = ck._store

    def fail(path: Path, **kw: object) -> None:
        raise OSError(5, "Input/output error", str(path))

    monkeypatch.setattr(store, "clear_dir", fail)
    await ck.bump(te.build_manifest(sd0, 1, base=sd0))
    assert ck.state.version == 1
    index = (tmp_path / "model.safetensors.index.json").read_text()
    assert '"asyncsync_version": 1' in index
    monkeypatch.undo()
    await ck.close()


async def test_the_mappings_are_dropped_off_the_event_loop_and_flushed_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The munmap after the ack (~25 ms per GiB of the model) runs in the engine's thread, not
    the event loop's (which it held up: heartbeats, the next version's watch); two callers at
    once (the agent's ack and a flushed()) submit the flush once, and both return after it is
    submitted, flushed() after it is done."""
    import asyncio
    import threading

    from receiver.engines.st_layout import FileMaps

    sd0 = mixed_state(0)
    ck = await te.init_checkpoint(tmp_path, sd0)
    sd1 = mutate(sd0, 0.05, seed=1)
    m1 = te.build_manifest(sd1, 1, base=sd0)
    await te.apply_version(ck, m1, te.delta_batches(m1, sd0, sd1, "xor"), "delta")
    loop_thread = threading.current_thread()
    unmapped: list[threading.Thread] = []
    real_unmap = FileMaps.unmap

    def unmap(self: FileMaps) -> None:
        unmapped.append(threading.current_thread())
        real_unmap(self)

    submitted: list[int] = []
    real_submit = ck._flusher.submit

    def submit(maps: FileMaps, version: int) -> None:
        submitted.append(version)
        real_submit(maps, version)

    monkeypatch.setattr(FileMaps, "unmap", unmap)
    monkeypatch.setattr(ck._flusher, "submit", submit)
    await asyncio.gather(ck.acknowledged(), ck.flushed())
    assert unmapped and all(t is not loop_thread for t in unmapped)
    assert submitted == [1]
    assert not ck._flusher.running()  # flushed() waited for it
    assert ck.state.version == 1 and _undo_records(tmp_path) == []
    await ck.close()
    reopened = LocalCheckpoint(tmp_path)
    await reopened.open()
    te.assert_same(reopened.load_state_dict(), sd1)
    await reopened.close()


async def test_a_second_caller_leaves_the_mappings_to_the_flush_it_did_not_submit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by attack (attack-109): of two callers at once (the agent's ack, a flushed()), the
    second unmapped the delta's maps again in the engine's thread after the first had handed
    them to the flush, which iterates them in its own. A mapping still exported at the first
    unmap (a view of a patched tensor not yet collected: the apply pauses gc) was dropped by
    the second while the flush's fsync loop ran over them: "dictionary changed size during
    iteration" failed the flush, and the engine wrote every data file again at the next begin.
    The maps are unmapped once; after that they are the flush's."""
    import asyncio
    import threading

    from receiver.engines import st_layout
    from receiver.engines.st_layout import FileMaps

    sd0 = mixed_state(0)
    ck = await te.init_checkpoint(tmp_path, sd0)
    sd1 = mutate(sd0, 0.05, seed=1)
    m1 = te.build_manifest(sd1, 1, base=sd0)
    await te.apply_version(ck, m1, te.delta_batches(m1, sd0, sd1, "xor"), "delta")
    assert ck._unflushed is not None
    maps = ck._unflushed[0]
    views = [maps.flat(next(iter(ck._layout.values())))]  # still exported at the first unmap
    in_sync, calls = threading.Event(), []
    real_fsync, real_unmap = os.fsync, FileMaps.unmap

    def fsync(fd: int) -> None:
        if threading.current_thread().name.startswith("flush ") and not in_sync.is_set():
            in_sync.set()  # the flush, inside its loop over the maps
            assert gate.wait(30)
        real_fsync(fd)

    def unmap(self: FileMaps) -> None:
        calls.append(self)
        if len(calls) == 2:  # the second caller, once the first's flush runs
            assert in_sync.wait(30)
            views.clear()  # collected meanwhile
            try:
                real_unmap(self)
            finally:
                gate.set()
        else:
            real_unmap(self)

    gate = threading.Event()
    monkeypatch.setattr(st_layout.os, "fsync", fsync)
    monkeypatch.setattr(FileMaps, "unmap", unmap)
    await asyncio.gather(ck.acknowledged(), ck.flushed())
    assert len(calls) == 2 and in_sync.is_set()
    assert ck._broken is None and ck._ps.synced  # the flush did not fail
    monkeypatch.undo()
    await ck.close()
    reopened = LocalCheckpoint(tmp_path)
    await reopened.open()
    te.assert_same(reopened.load_state_dict(), sd1)
    await reopened.close()
