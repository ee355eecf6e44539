"""One live receiver per engine id, across hosts; acks rewritten when changed from outside
(issue 13, failure 4; FORMAT.md section 7.1)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from asyncsync import LockHeld, Publisher
from asyncsync.format.acks import read_acks
from asyncsync.format.lease import EngineLease, LeaseRecord, lease_path, read_lease
from receiver import ReceiverAgent
from receiver.engines.checkpoint import LocalCheckpoint
from tests.conftest import mixed_state, mutate

REPO = Path(__file__).resolve().parent.parent


async def _publish(root: Path, n: int) -> list[dict[str, torch.Tensor]]:
    states = [mixed_state(0)]
    async with Publisher(root, bucket_bytes=8192, keyframe_interval=0) as pub:
        await pub.seed(states[0])
        for i in range(1, n + 1):
            states.append(mutate(states[-1], 0.03, seed=i))
            await pub.publish(states[-1])
    return states


def _agent(root: Path, ckpt: Path, engine_id: str = "e1", **kw: object) -> ReceiverAgent:
    return ReceiverAgent(root, LocalCheckpoint(ckpt), engine_id, use_inotify=False, **kw)  # type: ignore[arg-type]


async def test_a_second_receiver_with_the_same_id_refuses_to_start(tmp_path: Path) -> None:
    root = tmp_path / "root"
    await _publish(root, 2)
    async with _agent(root, tmp_path / "a") as first:
        assert await first.sync_once() == 2
        second = _agent(root, tmp_path / "b")
        with pytest.raises(
            LockHeld, match=rf"in use by .*host {socket.gethostname()} pid {os.getpid()}"
        ):
            await second.open()
        # the first one's ack was not touched, and it keeps working
        assert read_acks(root)["e1"].version == 2
        assert await first.sync_once() == 2
        assert not (tmp_path / "b" / ".asyncsync" / "state.json").exists()  # engine untouched
    assert read_lease(root, "e1") is None  # released at close
    async with _agent(root, tmp_path / "b") as again:  # the id is free now
        assert await again.sync_once() == 2


def _foreign_lease(root: Path, age: float, ttl: float = 30.0) -> None:
    rec = LeaseRecord("e1", "f" * 16, "other-host", 4242, ttl, 0.0, 0.0)
    path = lease_path(root, "e1")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(rec.to_json())
    t = time.time() - age
    os.utime(path, (t, t))


async def test_a_live_lease_of_another_host_is_refused_a_stale_one_taken_over(
    tmp_path: Path,
) -> None:
    root = tmp_path / "root"
    await _publish(root, 1)
    _foreign_lease(root, age=1.0)
    with pytest.raises(LockHeld, match="host other-host pid 4242"):
        await _agent(root, tmp_path / "a").open()
    # stale on the filesystem's clock (mtime older than its ttl): taken over
    _foreign_lease(root, age=120.0)
    async with _agent(root, tmp_path / "a") as agent:
        found = read_lease(root, "e1")
        assert found is not None and found[0].host == socket.gethostname()
        assert await agent.sync_once() == 1


def test_only_one_of_two_contenders_takes_a_stale_lease(tmp_path: Path) -> None:
    _foreign_lease(tmp_path, age=120.0)
    a, b = EngineLease(tmp_path, "e1"), EngineLease(tmp_path, "e1")
    a.acquire()
    with pytest.raises(LockHeld):
        b.acquire()
    b2 = EngineLease(tmp_path, "e1", ttl=30.0)
    with pytest.raises(LockHeld):
        b2.acquire()
    a.release()
    b.acquire()
    assert b.held and read_lease(tmp_path, "e1")[0].owner == b.owner  # type: ignore[index]


def test_a_lease_taken_over_is_noticed_at_the_next_heartbeat(tmp_path: Path) -> None:
    a = EngineLease(tmp_path, "e1", ttl=30.0)
    a.acquire()
    rec = LeaseRecord("e1", "9" * 16, "other-host", 1, 30.0, 0.0, 0.0)
    lease_path(tmp_path, "e1").write_bytes(rec.to_json())
    with pytest.raises(LockHeld, match="taken over by host other-host"):
        a.renew()
    assert not a.held


async def test_the_id_of_a_killed_receiver_is_free_at_once_on_its_host(tmp_path: Path) -> None:
    root = tmp_path / "root"
    await _publish(root, 1)
    argv = [sys.executable, "-m", "receiver.cli", "--root", str(root), "--engine-id", "e1",
            "--checkpoint", str(tmp_path / "a"), "--poll-interval", "0.1",
            "--force-polling"]  # fmt: skip
    child = subprocess.Popen(argv, cwd=REPO, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while (read_acks(root).get("e1") is None) and time.monotonic() < deadline:
            assert child.poll() is None
            time.sleep(0.05)
        assert read_lease(root, "e1") is not None
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert read_lease(root, "e1") is not None  # left behind by the kill
    async with _agent(root, tmp_path / "a") as agent:  # same host, dead pid: stale at once
        assert await agent.sync_once() == 1


async def test_an_ack_deleted_or_changed_from_outside_is_rewritten(tmp_path: Path) -> None:
    root = tmp_path / "root"
    await _publish(root, 2)
    ack = root / "acks" / "e1.json"
    async with _agent(root, tmp_path / "a") as agent:
        assert await agent.sync_once() == 2
        ack.unlink()
        assert await agent.sync_once() == 2
        assert read_acks(root)["e1"].version == 2
        d = json.loads(ack.read_text())
        d["version"] = 1
        ack.write_text(json.dumps(d))
        assert await agent.sync_once() == 2
        assert read_acks(root)["e1"].version == 2


async def test_a_crash_between_the_engine_commit_and_the_ack_is_acked_at_restart(
    tmp_path: Path,
) -> None:
    """The engine holds the newest version but no ack says so: the restarted receiver acks."""
    root = tmp_path / "root"
    await _publish(root, 2)
    async with _agent(root, tmp_path / "a") as agent:
        assert await agent.sync_once() == 2
    (root / "acks" / "e1.json").unlink()
    async with _agent(root, tmp_path / "a") as agent:
        assert await agent.sync_once() == 2
    assert read_acks(root)["e1"].version == 2


# An unreadable lease file (FORMAT.md section 7.1): honoured while fresh, taken over once stale.
_UNREADABLE = {
    "empty": b"",
    "garbage": b"\x00\xff\xfe garbage \x80",
    "truncated": LeaseRecord("e1", "f" * 16, "other-host", 4242, 30.0, 0.0, 0.0).to_json()[:40],
    "other-format": json.dumps({"format": "someone-elses-lock", "owner": "x"}).encode(),
}


def _unreadable_lease(root: Path, data: bytes, age: float) -> Path:
    path = lease_path(root, "e1")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    t = time.time() - age
    os.utime(path, (t, t))
    return path


@pytest.mark.parametrize("kind", sorted(_UNREADABLE))
def test_an_unreadable_lease_is_refused_while_fresh_and_taken_over_when_stale(
    tmp_path: Path, kind: str
) -> None:
    path = _unreadable_lease(tmp_path, _UNREADABLE[kind], age=1.0)
    with pytest.raises(LockHeld, match=rf"lease file {path} is unreadable .*retry in \d+s"):
        EngineLease(tmp_path, "e1").acquire()
    assert path.read_bytes() == _UNREADABLE[kind]  # left as it was
    _unreadable_lease(tmp_path, _UNREADABLE[kind], age=120.0)
    lease = EngineLease(tmp_path, "e1")
    lease.acquire()
    found = read_lease(tmp_path, "e1")
    assert lease.held and found is not None and found[0].owner == lease.owner
    with pytest.raises(LockHeld, match="in use by"):  # the second live receiver still refused
        EngineLease(tmp_path, "e1").acquire()


def test_a_takeover_that_moved_a_lease_taken_meanwhile_puts_it_back(tmp_path: Path) -> None:
    from asyncsync.format.lease import UnreadableLease, inspect_lease

    _unreadable_lease(tmp_path, b"", age=120.0)
    judged = inspect_lease(tmp_path, "e1")
    assert isinstance(judged, UnreadableLease)
    winner, late = EngineLease(tmp_path, "e1"), EngineLease(tmp_path, "e1")
    winner.acquire()
    late._remove_stale(judged)  # judged the old file stale, moves the winner's lease: put back
    found = read_lease(tmp_path, "e1")
    assert found is not None and found[0].owner == winner.owner


_CONTENDER = """
import sys
from asyncsync.errors import LockHeld
from asyncsync.format.lease import EngineLease
lease = EngineLease(sys.argv[1], "e1")
sys.stdin.readline()  # go
try:
    lease.acquire()
    print("won", flush=True)
except LockHeld as exc:
    print("refused", exc, flush=True)
sys.stdin.readline()  # hold it until every contender answered
"""


def test_two_processes_taking_over_one_stale_unreadable_lease_give_one_winner(
    tmp_path: Path,
) -> None:
    for data in (b"", b"garbage"):
        _unreadable_lease(tmp_path, data, age=120.0)
        argv = [sys.executable, "-c", _CONTENDER, str(tmp_path)]
        procs = [
            subprocess.Popen(
                argv, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
            )
            for _ in range(2)
        ]
        try:
            time.sleep(1.0)  # both imported
            for p in procs:
                assert p.stdin is not None
                p.stdin.write("\n")
                p.stdin.flush()
            answers = [p.stdout.readline() for p in procs]  # type: ignore[union-attr]
        finally:
            for p in procs:
                p.communicate("\n", timeout=30)
        assert sorted(a.split()[0] for a in answers) == ["refused", "won"], answers
        assert "in use by" in next(a for a in answers if a.startswith("refused"))
        lease_path(tmp_path, "e1").unlink()  # both exited: free it for the next round


async def test_status_shows_an_unreadable_lease(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from asyncsync.ops.cli import main

    await _publish(tmp_path, 1)
    _unreadable_lease(tmp_path, b"", age=5.0)
    main(["status", str(tmp_path), "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert [b["engine_id"] for b in doc["unreadable_leases"]] == ["e1"]
    assert doc["unreadable_leases"][0]["reason"] == "empty file"
