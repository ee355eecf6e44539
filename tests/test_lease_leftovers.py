"""Engine-id leases against what crashes and hostile writers leave in ``leases/`` and ``acks/``
(FORMAT.md 7.1, 11.1): temp files of a receiver killed mid-write, a directory or a FIFO where a
lease or ack belongs, a pid no process can have."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from pathlib import Path

import pytest

from asyncsync import LockHeld
from asyncsync.format.acks import read_ack, write_ack
from asyncsync.format.lease import EngineLease, LeaseRecord, claim_path, lease_path, read_lease
from asyncsync.fsio import UnsafePath
from receiver.acking import RootPresence
from receiver.engines.checkpoint import LocalCheckpoint
from tests.test_lease import _own_record, _publish, heartbeats, renewing


def _aged(path: Path, age: float) -> Path:
    t = time.time() - age
    os.utime(path, (t, t), follow_symlinks=False)
    return path


def _write(path: Path, data: bytes, age: float = 0.0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return _aged(path, age)


def test_a_pid_no_process_can_have_is_a_dead_holder_not_a_crash(tmp_path: Path) -> None:
    """A record of this boot and pid namespace whose pid is beyond pid_t: ``kill(pid, 0)`` raises
    OverflowError. It crashed every taker (`OverflowError: signed integer is greater than
    maximum`) for as long as the file stayed, even hours old; such a holder is gone."""
    owner = "0" * 16  # smaller than any taker's: it would be yielded to if it counted
    claim = _write(
        claim_path(tmp_path, "e1", owner), _own_record(owner=owner, pid=2**31, nonce="n").to_json()
    )
    lease = EngineLease(tmp_path, "e1", settle=0.0)
    lease.acquire()
    assert lease.held and not claim.exists()
    lease.release()
    _write(lease_path(tmp_path, "e1"), _own_record(owner=owner, pid=2**40, nonce="n").to_json())
    lease = EngineLease(tmp_path, "e1", settle=0.0)
    lease.acquire()  # taken over at once, as the lease of a pid that is gone
    found = read_lease(tmp_path, "e1")
    assert found is not None and found[0].owner == lease.owner


def test_a_fifo_lease_is_named_a_fifo_not_an_empty_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = lease_path(tmp_path, "e1")
    path.parent.mkdir(parents=True)
    os.mkfifo(path)
    with caplog.at_level(logging.WARNING):  # never opened: watched, then replaced
        EngineLease(tmp_path, "e1", ttl=1.0, settle=0.0).acquire()
    said = caplog.text
    assert "taking over" in said and "FIFO" in said and "empty file" not in said, said
    assert path.is_file()


def test_a_directory_where_the_lease_or_ack_belongs(tmp_path: Path) -> None:
    """An empty directory at the lease's name was "honoured until it is 30s old, then taken
    over", and then failed every take (`[Errno 21] Is a directory: '.tmp.e1.json.…' ->
    'e1.json'`). It is removed and replaced (once seen unchanged for the ttl); one with entries
    is named, left as it is."""
    path = lease_path(tmp_path, "e1")
    path.mkdir(parents=True)
    lease = EngineLease(tmp_path, "e1", ttl=1.0, settle=0.0)
    lease.acquire()
    assert path.is_file() and read_lease(tmp_path, "e1")[0].owner == lease.owner  # type: ignore[index]
    path.unlink()  # under the holder: a directory again, then its heartbeat
    path.mkdir()
    lease.renew()
    assert lease.held and read_lease(tmp_path, "e1")[0].owner == lease.owner  # type: ignore[index]
    lease.release()
    _write(path / "x", b"")
    with pytest.raises(UnsafePath, match="is a directory where a file belongs"):
        EngineLease(tmp_path, "e1", ttl=1.0, settle=0.0).acquire()
    assert (path / "x").exists()  # never emptied
    assert [p.name for p in path.parent.iterdir()] == ["e1.json"]  # no claim left behind
    ack = tmp_path / "acks" / "e1.json"
    ack.mkdir(parents=True)  # "an unreadable ack: its receiver rewrites it"
    write_ack(tmp_path, "e1", 3, "f" * 32, "r" * 16)
    found = read_ack(tmp_path, "e1")
    assert found is not None and found.version == 3


def _temps(engine_id: str) -> list[str]:
    return [
        f".tmp.{engine_id}.json.0123456789ab",  # _create's temp, renamed, not yet linked
        f".tmp..tmp.{engine_id}.json.0123456789ab.ba9876543210",  # the temp of that temp
        f".tmp.{engine_id}.{'c' * 16}.claim.0123456789ab",  # a claim being written
        ".tmp.clock.0123456789ab",  # the filesystem clock's probe
    ]


async def test_temp_files_of_a_killed_receiver_are_removed_after_the_next_take(
    tmp_path: Path,
) -> None:
    """A receiver SIGKILLed in a write of its claim, lease or ack (a slow fsync on NFS) left its
    temp file in ``leases/`` or ``acks/`` for good: one more each time. The next taker of the
    id lists them and removes them at its first heartbeat after it saw them unchanged for the
    ttl (a write in flight ends well before: tests/test_lease_temps.py); another id's stay."""
    root = tmp_path / "root"
    await _publish(root, 1)
    leases, acks = root / "leases", root / "acks"
    old = [_write(leases / n, b"{", age=120.0) for n in _temps("e1")]
    old.append(_write(acks / ".tmp.e1.json.0123456789ab", b"{", age=120.0))
    kept = [_write(leases / n, b"{", age=120.0) for n in _temps("e1.x")[:3]]
    kept.append(_write(acks / ".tmp.e2.json.0123456789ab", b"{", age=120.0))
    presence = RootPresence(
        root, "e1", LocalCheckpoint(tmp_path / "ck"), lease_ttl=1.0, lease_settle=0.0
    )
    await presence.hold()
    assert presence.lease.held
    time.sleep(1.2)
    await presence.renew()
    assert [p.name for p in old if p.exists()] == []
    assert [p.name for p in kept if not p.exists()] == []
    await presence.release()


async def test_a_take_cancelled_in_its_thread_is_released_by_the_release_after_it(
    tmp_path: Path,
) -> None:
    """A receiver stopped (its sync cancelled) while its take of the engine id ran in a thread:
    the cancel came out at once, the release that followed found nothing held, and the thread
    then took the lease: the id stayed taken by a receiver that had let it go (another one on
    another host waits out its ttl; in the same process a later agent found it held). Now the
    cancel waits for the take, so the release after it lets the id go."""
    root = tmp_path / "root"
    await _publish(root, 1)
    presence = RootPresence(
        root, "e1", LocalCheckpoint(tmp_path / "ck"), lease_ttl=1.0, lease_settle=0.0
    )
    acquire, started = presence.lease.acquire, threading.Event()

    def slow_acquire(**kw: float) -> None:
        started.set()
        time.sleep(0.3)
        acquire(**kw)

    presence.lease.acquire = slow_acquire  # type: ignore[method-assign]
    task = asyncio.create_task(presence.hold())
    await asyncio.to_thread(started.wait)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await presence.release()
    time.sleep(0.5)  # (where the take's thread outlived the cancel, it took the lease here)
    assert not presence.lease.held
    assert read_lease(root, "e1") is None


def test_a_lease_of_a_live_unrelated_process_waits_for_its_ttl(tmp_path: Path) -> None:
    """PID reuse: a lease of this boot and pid namespace naming a pid that is now another live
    process is judged by what the taker sees, as FORMAT.md 7.1 says of a pid that tells
    nothing: refused while it changes, taken once seen unchanged for its ttl."""
    rec = _own_record(owner="0" * 16, pid=os.getppid(), nonce="n", ttl=1.0)
    path = lease_path(tmp_path, "e1")
    with (
        renewing(path, heartbeats(rec), every=0.2),
        pytest.raises(LockHeld, match=rf"pid {os.getppid()} .*renews its lease"),
    ):
        EngineLease(tmp_path, "e1", settle=0.0).acquire()
    t0 = time.monotonic()
    EngineLease(tmp_path, "e1", settle=0.0).acquire()
    assert time.monotonic() - t0 >= 1.0
    assert LeaseRecord.from_json(path.read_bytes(), "x").owner != "0" * 16
