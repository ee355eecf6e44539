"""Multi-rank publish: a rank cancelled between the plan and the commit, and a rank whose host
clock is wrong.

A cancelled rank reports its error to the commit (``Coordinator.abandon``) so that the others
fail the round at once naming it, never after the timeout; rank 0 cancelled leaves no version
directory behind, even when cancelled again meanwhile. A rank on a host whose clock is a day
off (its files dated by it, as an object-store mount keeps them) is judged by its heartbeat's
sequence, never by a time another host wrote (helper-56).
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from asyncsync import FileRendezvous, PublishError
from asyncsync.format import manifest_path
from asyncsync.format.store import list_versions
from asyncsync.publish import publisher as publisher_mod
from asyncsync.publish import writer as writer_mod
from asyncsync.publish.rendezvous import RENDEZVOUS_DIR
from tests.ports import free_port
from tests.test_distributed import _logs, _spawn, _wait_for
from tests.test_multirank_faults import W, _calls, _pair, _until, assert_finished, assert_steps

# --------------------------------------------------------------------------- a cancelled rank


@pytest.mark.parametrize("coord", ["torch", "file"])
@pytest.mark.parametrize("cancelled", [0, 1])
async def test_a_cancelled_rank_fails_the_round_at_once_naming_it(
    tmp_path: Path, coord: str, cancelled: int
) -> None:
    """A rank's publish of step 2 is cancelled while it writes its shards (the trainer stopped
    it). It told nobody: the other rank waited for its part until the timeout (the process
    group's, 30 minutes by default, over gloo; here 20 s) and then called it silent, or over
    gloo its next call's plan paired with the other's commit. Now it takes part in the commit
    with its error: the other rank fails the round at once naming it and the cancel, the step
    is published again, and every version is one step's model."""
    root, out = tmp_path / "root", tmp_path / "out"
    out.mkdir()
    cfg = {"coord": coord, "world": W, "root": str(root), "out": str(out), "steps": 3,
           "port": free_port(), "timeout": 20.0, "pg_timeout": 20,
           "cancel_in_write": [cancelled, 2]}  # fmt: skip
    procs = [_spawn({**cfg, "rank": r}) for r in range(W)]
    await _wait_for(lambda: not any(p.is_alive() for p in procs), procs, 120, "the group")
    assert [p.exitcode for p in procs] == [0, 0]
    logs = _logs(out)
    first = [next(r for r in logs[k] if r["step"] == 2) for k in range(W)]
    assert first[cancelled].get("cancelled"), first
    other = first[1 - cancelled]
    assert other["ranks"] == [cancelled], other
    assert f"rank {cancelled}" in other["error"] and "was cancelled" in other["error"], other
    assert_steps(root, [0, 1, 2, 3])
    assert_finished(root)


def _hold_rank0_writes(
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[threading.Event, threading.Event]:
    """Rank 0's shard writes wait for ``release`` (the second event) once they set ``started``
    (the first)."""
    started, release = threading.Event(), threading.Event()
    real_write = writer_mod.VersionWriter.write

    def held_write(self: Any, *a: Any, **k: Any) -> None:
        if self.prefix.startswith("r0000"):
            started.set()
            release.wait(10)
        real_write(self, *a, **k)

    monkeypatch.setattr(writer_mod.VersionWriter, "write", held_write)
    return started, release


async def test_a_rank_that_failed_too_when_rank0_was_cancelled_says_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1's encode fails while rank 0's call is cancelled during its write: rank 0 tells
    the group of its cancel at once (FileRendezvous.abandon), and rank 1's error gave only its
    own failure, as if rank 0 had been fine; now it names both ranks and both reasons."""
    root = tmp_path / "root"
    p0, p1 = _pair(root)
    real_encode = publisher_mod.encode_bucket

    def rank1_fails(items: Any, **k: Any) -> Any:
        if any(it.name.startswith("rank1.") for it in items.items):
            raise OSError(28, "No space left on device (injected)")
        return real_encode(items, **k)

    async with p0, p1:
        await asyncio.gather(*_calls(p0, p1, 0))
        started, release = _hold_rank0_writes(monkeypatch)
        monkeypatch.setattr(publisher_mod, "encode_bucket", rank1_fails)
        t0, t1 = (asyncio.ensure_future(c) for c in _calls(p0, p1, 1))
        await _until(started.is_set)
        t0.cancel()
        await asyncio.sleep(0.05)
        release.set()
        with pytest.raises(PublishError) as ei:
            await t1
        with pytest.raises(asyncio.CancelledError):
            await t0
    assert ei.value.ranks == (0, 1), ei.value
    assert "rank 0: its publish call was cancelled" in str(ei.value), ei.value
    assert "No space left on device" in str(ei.value), ei.value
    assert list_versions(root) == [0]


async def test_rank0_cancelled_again_while_it_tells_the_others_leaves_no_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0's call is cancelled during its write, then again while it tells the others of
    the cancel (over gloo that waits for every rank to reach the commit): the second cancel
    skipped the removal of the version directory, left with rank 1's shards and part record."""
    root = tmp_path / "root"
    p0, p1 = _pair(root, timeout=1.0)
    telling = asyncio.Event()
    real_abandon = FileRendezvous.abandon

    async def slow_abandon(self: FileRendezvous, *a: Any) -> None:
        telling.set()
        await asyncio.sleep(30)
        await real_abandon(self, *a)

    async with p0, p1:
        await asyncio.gather(*_calls(p0, p1, 0))
        started, release = _hold_rank0_writes(monkeypatch)
        monkeypatch.setattr(FileRendezvous, "abandon", slow_abandon)
        t0, t1 = (asyncio.ensure_future(c) for c in _calls(p0, p1, 1))
        vdir = manifest_path(root, 1).parent
        await _until(lambda: started.is_set() and any(vdir.glob("part-r0001-*")))
        t0.cancel()
        release.set()
        await telling.wait()
        t0.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t0
        assert not vdir.exists(), sorted(p.name for p in vdir.iterdir())
        with pytest.raises(PublishError):
            await t1
    assert list_versions(root) == [0]


# --------------------------------------------------------------------------- clock skew


@pytest.mark.parametrize("skew", [-86400.0, 86400.0])
async def test_a_rank_on_a_host_with_a_wrong_clock_is_judged_by_its_heartbeat(
    tmp_path: Path, skew: float
) -> None:
    """Rank 1 runs on a host whose clock is a day off, and its rendezvous files and part
    records carry that clock's mtimes (an object-store mount keeps the writer's). Its step 2
    writes for 4 s against a 2 s timeout: rank 0 must judge it by its beats changing (its own
    monotonic clock), never by a time another host wrote, so every step commits on both."""
    root, out = tmp_path / "root", tmp_path / "out"
    out.mkdir()
    cfg = {"coord": "file", "world": W, "root": str(root), "out": str(out), "steps": 3,
           "timeout": 2.0, "slow": [1, 2, 4.0], "skew": [1, skew]}  # fmt: skip
    procs = [_spawn({**cfg, "rank": r}) for r in range(W)]
    await _wait_for(lambda: not any(p.is_alive() for p in procs), procs, 120, "the group")
    assert [p.exitcode for p in procs] == [0, 0]
    logs = _logs(out)
    assert [[r["step"] for r in logs[k] if "version" in r] for k in range(W)] == [[0, 1, 2, 3]] * 2
    beat = root / RENDEZVOUS_DIR / "beat-r0001.json"
    assert abs(beat.stat().st_mtime - time.time() - skew) < 600  # its clock dated its files
    assert_steps(root, [0, 1, 2, 3])
