"""One live receiver per engine id, across hosts; acks rewritten when changed from outside
(issue 13, failure 4; FORMAT.md section 7.1)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from asyncsync import ConfigError, LockHeld, Publisher
from asyncsync.format.acks import read_acks
from asyncsync.format.lease import (
    EngineLease,
    LeaseRecord,
    claim_path,
    default_settle,
    filesystem_type,
    lease_path,
    read_lease,
)
from receiver import ReceiverAgent
from receiver.engines.checkpoint import LocalCheckpoint
from tests.conftest import eventually, mixed_state, mutate, sync_to

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


@contextlib.contextmanager
def renewing(
    path: Path, data: Callable[[], bytes], every: float, behind: float = 0.0
) -> Iterator[None]:
    """A live writer on another host: writes ``data()`` at ``path`` (temp, rename) every
    ``every`` seconds until the block ends. ``behind``: its clock runs that many seconds behind
    ours, and its files keep its clock's mtimes (as on an object-store mount)."""
    stop = threading.Event()

    def beat() -> None:
        while True:
            tmp = path.with_name(f".tmp.{path.name}.beat")
            tmp.write_bytes(data())
            if behind:
                t = time.time() - behind
                os.utime(tmp, (t, t))
            os.replace(tmp, path)
            if stop.wait(every):
                return

    path.parent.mkdir(parents=True, exist_ok=True)
    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def heartbeats(rec: LeaseRecord) -> Callable[[], bytes]:
    """The records a live holder writes: ``rec`` with a new ``heartbeat_at`` each time."""
    return lambda: replace(rec, heartbeat_at=time.time()).to_json()


def _foreign_lease(root: Path, age: float, ttl: float = 30.0) -> None:
    rec = LeaseRecord("e1", "f" * 16, "other-host", 4242, ttl, 0.0, 0.0)
    path = lease_path(root, "e1")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(rec.to_json())
    t = time.time() - age
    os.utime(path, (t, t))


@pytest.mark.parametrize("made_again", ["empty", "not-a-root"])
async def test_the_heartbeat_writes_nothing_in_a_root_made_again(
    tmp_path: Path, made_again: str
) -> None:
    """The root is replaced under a running receiver (removed and made again empty, a bare
    mountpoint, a directory that is no root): the heartbeat wrote ``leases/`` and a claim into
    it (the lease file was missing, so it took the lease again there), where a receiver must
    create nothing. Now it writes nothing: an empty root is waited for (the lease taken again
    once it is a root), another directory is refused with the startup's error."""
    root = tmp_path / "root"
    await _publish(root, 1)
    async with _agent(root, tmp_path / "ckpt") as agent:
        assert await agent.sync_once() == 1
        presence = agent._presence
        os.rename(root, tmp_path / "old-root")
        root.mkdir()
        if made_again == "not-a-root":
            (root / "model.safetensors").write_bytes(b"x")
        if made_again == "empty":
            await presence.renew()
            assert presence.lease.held is False
        else:
            with pytest.raises(ConfigError, match="is not an asyncsync root"):
                await presence.renew()
        assert sorted(p.name for p in root.iterdir()) == (
            [] if made_again == "empty" else ["model.safetensors"]
        )
        if made_again == "empty":  # a publisher opens it: the lease is taken there again
            await _publish(root, 1)
            assert await agent.sync_once() == 1
            assert read_lease(root, "e1") is not None


async def test_a_renewed_lease_of_another_host_is_refused_a_silent_one_taken_over(
    tmp_path: Path,
) -> None:
    """Judged by what the taker sees (FORMAT.md 7.1), never by the lease's mtime: a lease its
    holder renews is refused, one seen unchanged for its ttl is taken over."""
    root = tmp_path / "root"
    await _publish(root, 1)
    rec = LeaseRecord("e1", "f" * 16, "other-host", 4242, 1.0, 0.0, 0.0)
    with (
        renewing(lease_path(root, "e1"), heartbeats(rec), every=0.2),
        pytest.raises(LockHeld, match=r"host other-host pid 4242.*renews its lease"),
    ):
        await _agent(root, tmp_path / "a", lease_ttl=1.0).open()
    t0 = time.monotonic()
    async with _agent(root, tmp_path / "a", lease_ttl=1.0) as agent:
        assert time.monotonic() - t0 >= 1.0  # watched for its ttl first
        found = read_lease(root, "e1")
        assert found is not None and found[0].host == socket.gethostname()
        assert await agent.sync_once() == 1


def test_only_one_of_two_contenders_takes_a_stale_lease(tmp_path: Path) -> None:
    _foreign_lease(tmp_path, age=120.0, ttl=1.0)
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


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_heartbeat_takes_again_a_lease_whose_other_owner_is_gone(tmp_path: Path) -> None:
    """A root restored with its leases/ names a holder that is gone: the running holder takes
    the id again at its heartbeat, as a freshly started one would, instead of stopping for
    good; a live other holder still makes it stop."""
    a = EngineLease(tmp_path, "e1", ttl=30.0, settle=0.0)
    a.acquire()
    gone = _own_record(owner="9" * 16, pid=_dead_pid(), nonce="0" * 16)
    lease_path(tmp_path, "e1").write_bytes(gone.to_json())
    claim_path(tmp_path, "e1", gone.owner).write_bytes(gone.to_json())
    a.renew()
    found = read_lease(tmp_path, "e1")
    assert a.held and found is not None and found[0].owner == a.owner
    assert not claim_path(tmp_path, "e1", gone.owner).exists()  # the dead claim removed
    alive = LeaseRecord("e1", "8" * 16, "other-host", 1, 30.0, 0.0, 0.0)  # fresh mtime: live
    lease_path(tmp_path, "e1").write_bytes(alive.to_json())
    with pytest.raises(LockHeld, match="taken over by host other-host"):
        a.renew()
    assert not a.held


async def test_a_running_receiver_keeps_its_id_when_a_dead_owners_lease_is_restored(
    tmp_path: Path,
) -> None:
    """(helper-22's finding 5) The root's leases/ restored from a backup under a running
    receiver: its heartbeat finds a dead receiver's lease and keeps syncing (it stopped for
    good before, while a receiver started then took the id at once)."""
    root = tmp_path / "root"
    stop = asyncio.Event()
    agent = _agent(root, tmp_path / "ckpt", lease_ttl=0.6, poll_interval=0.05)
    async with (
        Publisher(root, bucket_bytes=8192, keyframe_interval=0) as pub,
        asyncio.TaskGroup() as tg,
    ):
        await pub.seed(mixed_state(0))
        tg.create_task(agent.run(stop=stop))
        await _wait_for_ack(root, 0)
        gone = _own_record(owner="9" * 16, pid=_dead_pid(), nonce="0" * 16)
        lease_path(root, "e1").write_bytes(gone.to_json())
        await asyncio.sleep(1.0)  # several heartbeats
        await pub.publish(mutate(mixed_state(0), 0.03, seed=7))
        await _wait_for_ack(root, 1)
        found = read_lease(root, "e1")
        assert found is not None and found[0].owner == agent._presence.lease.owner
        assert agent._presence.lost is None
        stop.set()
    await agent.close()


async def test_a_receiver_that_lost_its_id_takes_it_again_once_the_other_lease_is_stale(
    tmp_path: Path,
) -> None:
    """(attack 27, finding 1) A lease naming another host, written with a fresh mtime (a
    leases/ restored from a backup by `cp -r`), makes a running receiver lose its id; nobody
    renews that lease. It stopped syncing for good while its process stayed up (a supervisor
    never restarted it); now it takes the id again once that lease is a ttl old, and acks the
    versions published meanwhile."""
    root = tmp_path / "root"
    stop = asyncio.Event()
    agent = _agent(root, tmp_path / "ckpt", lease_ttl=0.9, poll_interval=0.05)
    async with (
        Publisher(root, bucket_bytes=8192, keyframe_interval=0) as pub,
        asyncio.TaskGroup() as tg,
    ):
        await pub.seed(mixed_state(0))
        tg.create_task(agent.run(stop=stop))
        await _wait_for_ack(root, 0)
        other = LeaseRecord("e1", "8" * 16, "oldhost", 4242, 0.9, 0.0, 0.0)  # fresh: "live"
        lease_path(root, "e1").write_bytes(other.to_json())
        deadline = time.monotonic() + 10
        while agent._presence.lost is None:  # the heartbeat finds it (within ttl / 3)
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        await pub.publish(mutate(mixed_state(0), 0.03, seed=7))
        await _wait_for_ack(root, 1)  # once the other lease is 0.9 s old: taken again
        found = read_lease(root, "e1")
        assert found is not None and found[0].owner == agent._presence.lease.owner
        assert agent._presence.lost is None and agent.version == 1
        stop.set()
    await agent.close()


async def _wait_for_ack(root: Path, version: int) -> None:
    deadline = time.monotonic() + 30
    while (ack := read_acks(root).get("e1")) is None or ack.version < version:
        assert time.monotonic() < deadline, ack
        await asyncio.sleep(0.05)


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


# An unreadable lease file (FORMAT.md section 7.1): honoured while it changes, taken over once
# seen unchanged for the taker's ttl.
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
def test_an_unreadable_lease_is_refused_while_it_changes_and_taken_over_when_still(
    tmp_path: Path, kind: str
) -> None:
    path = lease_path(tmp_path, "e1")
    with (
        renewing(path, lambda: _UNREADABLE[kind], every=0.2),
        pytest.raises(LockHeld, match=rf"lease file {path} is unreadable .*changed while"),
    ):  # rewritten: a new inode each
        EngineLease(tmp_path, "e1", ttl=1.0).acquire()
    assert path.read_bytes() == _UNREADABLE[kind]  # left as it was
    lease = EngineLease(tmp_path, "e1", ttl=1.0)
    lease.acquire()  # seen unchanged for the ttl
    found = read_lease(tmp_path, "e1")
    assert lease.held and found is not None and found[0].owner == lease.owner
    with pytest.raises(LockHeld, match="in use by"):  # the second live receiver still refused
        EngineLease(tmp_path, "e1").acquire()


def _foreign_claim(root: Path, age: float, owner: str = "f" * 16, ttl: float = 30.0) -> Path:
    rec = LeaseRecord("e1", owner, "other-host", 4242, ttl, 0.0, 0.0, "other-boot", "pid:[1]", "n")
    path = claim_path(root, "e1", owner)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(rec.to_json())
    t = time.time() - age
    os.utime(path, (t, t))
    return path


def test_a_live_rival_claim_keeps_a_taker_out_and_a_dead_one_is_ignored_and_removed(
    tmp_path: Path,
) -> None:
    """A concurrent taker's claim (no lease yet) is not overridden while it may be live (not
    seen unchanged for its ttl, here 30 s): the taker backs off and refuses once its contention
    budget is spent; a claim seen unchanged for its ttl is removed."""
    claim = _foreign_claim(tmp_path, age=0.0, owner="0" * 16)  # smaller: we yield to it
    t0 = time.monotonic()
    with pytest.raises(LockHeld, match=r"at the same time .*host other-host pid 4242"):
        EngineLease(tmp_path, "e1", ttl=2.0, settle=0.0).acquire()
    assert time.monotonic() - t0 >= 2.0  # it retried for the ttl before refusing
    assert lease_path(tmp_path, "e1").exists() is False
    assert [p.name for p in (tmp_path / "leases").iterdir()] == [claim.name]  # withdrew its own
    _foreign_claim(tmp_path, age=120.0, owner="0" * 16, ttl=1.0)  # its taker died
    lease = EngineLease(tmp_path, "e1", ttl=1.0, settle=0.0)
    lease.acquire()
    assert sorted(p.name for p in (tmp_path / "leases").iterdir()) == sorted(
        ["e1.json", lease.claim.name]
    )
    lease.release()
    assert list((tmp_path / "leases").iterdir()) == []


def test_a_lease_settle_above_a_quarter_of_the_ttl_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="quarter of the lease ttl"):
        EngineLease(tmp_path, "e1", ttl=8.0, settle=3.0)
    assert default_settle(tmp_path) == 0.0  # tmp is a local filesystem here
    assert filesystem_type("/proc") == "proc"


def _own_record(**kw: object) -> LeaseRecord:
    from asyncsync.format import lease as mod

    base = dict(engine_id="e1", owner="a" * 16, host=socket.gethostname(), pid=os.getpid(),
                ttl=30.0, acquired_at=0.0, heartbeat_at=0.0, boot_id=mod._boot_id(),
                pid_ns=mod._pid_ns(), nonce=mod._NONCE)  # fmt: skip
    return LeaseRecord(**{**base, **kw})  # type: ignore[arg-type]


def test_the_pid_shortcut_needs_the_same_boot_and_pid_namespace(tmp_path: Path) -> None:
    """(issue 20, failure 5) A lease is judged by its pid only when its holder runs in this
    kernel boot and this pid namespace; a previous life with our pid has another nonce."""
    lease = EngineLease(tmp_path, "e1")
    (tmp_path / "leases").mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    dead_pid = int(dead.stdout)
    assert lease._by_pid(_own_record(pid=dead_pid)) is True  # same namespace, gone: free now
    assert lease._by_pid(_own_record(nonce="0" * 16)) is True  # our pid, another process: gone
    assert lease._by_pid(_own_record()) is True  # this process, a lease it does not hold
    # another pid namespace (another container on this host), or no identity (a version 1
    # record): the pid says nothing; what the taker sees decides
    for i, other in enumerate((_own_record(pid_ns="pid:[1]", pid=dead_pid),
                               _own_record(pid_ns="", pid=dead_pid),
                               _own_record(boot_id="x", nonce="0" * 16))):  # fmt: skip
        assert lease._by_pid(other) is None
        assert lease.judge(tmp_path / f"r{i}", (other, 0.0)) == "watching"


def _can_unshare_pid() -> str | None:
    if os.geteuid() != 0:
        return "needs root for unshare --pid"
    r = subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True, text=True)
    return None if r.returncode == 0 else f"unshare --pid failed: {r.stderr.strip()}"


def _takers(root: Path, n: int, prefix: tuple[str, ...] = ()) -> list[subprocess.Popen[str]]:
    argv = [*prefix, sys.executable, "-m", "tests.lease_taker", str(root)]
    procs = [subprocess.Popen(argv, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True) for _ in range(n)]  # fmt: skip
    for p in procs:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return procs


def _go(p: subprocess.Popen[str]) -> str:
    assert p.stdin is not None and p.stdout is not None
    p.stdin.write("go\n")
    p.stdin.flush()
    return p.stdout.readline().strip()


def test_two_receivers_as_pid_1_of_their_own_pid_namespaces_do_not_displace_each_other(
    tmp_path: Path,
) -> None:
    """(issue 20, failure 5) Two containers sharing a hostname, each its receiver as pid 1 in its
    own pid namespace: the second must not take the first's live lease."""
    why = _can_unshare_pid()
    if why:
        pytest.skip(why)
    ns = ("unshare", "--pid", "--fork", "--kill-child")
    procs = _takers(tmp_path, 2, prefix=ns)
    try:
        assert _go(procs[0]).startswith("won")
        found = read_lease(tmp_path, "e1")
        assert found is not None and found[0].pid == 1 and found[0].host == socket.gethostname()
        answer = _go(procs[1])
        assert answer.startswith("refused") and "pid 1 " in answer, answer
        assert read_lease(tmp_path, "e1")[0].owner == found[0].owner  # type: ignore[index]
    finally:
        for p in procs:
            p.communicate("", timeout=60)


@pytest.mark.heavy  # ~22 s on 2 shared cores
def test_six_concurrent_takers_give_one_winner(tmp_path: Path) -> None:
    for _ in range(2):
        procs = _takers(tmp_path, 6)
        try:
            for p in procs:
                assert p.stdin is not None
                p.stdin.write("go\n")
                p.stdin.flush()
            answers = [p.stdout.readline().strip() for p in procs]  # type: ignore[union-attr]
        finally:
            for p in procs:
                p.communicate("", timeout=60)
        assert sum(a.startswith("won") for a in answers) == 1, answers
        assert read_lease(tmp_path, "e1") is None  # the winner released it at exit


_CONTENDER = """
import sys
import threading
from asyncsync.errors import LockHeld
from asyncsync.format.lease import EngineLease
lease = EngineLease(sys.argv[1], "e1", ttl=2.0)
sys.stdin.readline()  # go
try:
    lease.acquire()
    print("won", flush=True)
except LockHeld as exc:
    print("refused", exc, flush=True)
    sys.stdin.readline()
    sys.exit(0)
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.readline(), done.set()), daemon=True).start()
while not done.wait(2.0 / 3):  # a live holder renews, until every contender answered
    lease.renew()
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


async def test_a_receiver_paused_mid_apply_past_its_ttl_does_not_ack_over_the_new_holder(
    tmp_path: Path,
) -> None:
    """(helper-25) A receiver paused (SIGSTOP) in the middle of an apply for longer than its
    lease's ttl, while another receiver took the engine id over: when it resumes and commits,
    it wrote its ack over the new holder's, the lease being checked only at a sync's start.
    Now an overdue heartbeat is renewed before the ack, which finds the new holder."""
    root = tmp_path / "root"
    await _publish(root, 1)
    agent = _agent(root, tmp_path / "ckpt", lease_ttl=3.0)
    async with agent:
        await sync_to(agent, root, 0)
        engine = agent.engine
        real = engine.commit

        async def paused_then_commit() -> str:
            # the pause: the heartbeat is overdue, and another receiver holds the id now
            agent._presence._renewed -= 10.0
            other = LeaseRecord("e1", "8" * 16, "other-host", 1, 30.0, 0.0, 0.0)  # fresh: live
            lease_path(root, "e1").write_bytes(other.to_json())
            return await real()

        engine.commit = paused_then_commit  # type: ignore[method-assign]
        with pytest.raises(LockHeld, match="taken over by host other-host"):
            await agent.sync_once()
        assert read_acks(root)["e1"].version == 0  # not the resumed receiver's v1
        found = read_lease(root, "e1")
        assert found is not None and found[0].host == "other-host"


async def test_a_lost_engine_id_is_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """(helper-26) A running receiver whose lease another live receiver took over logged the
    loss twice or three times: at the heartbeat that found it (and at a sync's renew racing
    it), then as the next sync's failure. Now once, as it is found; the syncs still stop."""
    root = tmp_path / "root"
    await _publish(root, 1)
    stop = asyncio.Event()
    agent = _agent(root, tmp_path / "ckpt", lease_ttl=0.6, poll_interval=0.05)
    caplog.set_level(logging.ERROR)
    async with agent, asyncio.TaskGroup() as tg:
        tg.create_task(agent.run(stop=stop))
        await _wait_for_ack(root, 1)
        other = LeaseRecord("e1", "8" * 16, "other-host", 1, 30.0, 0.0, 0.0)  # fresh: live
        lease_path(root, "e1").write_bytes(other.to_json())
        # (0.5 s on a quiet host; the CI's run beside other work passed 10 s)
        await eventually(lambda: agent.status().failures >= 3, "syncs refused after the loss",
                         timeout=90)  # fmt: skip
        stop.set()
    lost = [r.getMessage() for r in caplog.records if "taken over by" in r.getMessage()]
    assert len(lost) == 1 and lost[0].endswith("; no syncs until no live receiver holds it"), lost
    assert agent.status().last_error is not None and "taken over" in agent.status().last_error
