"""The engine-id lease and the receiver on two real ``rclone mount`` views of one directory
(issue 20, failure 1; FORMAT.md section 7.1).

rclone (like gcsfuse and s3fs) has no ``link()``, and neither ``O_CREAT|O_EXCL`` nor ``mkdir``
excludes across mounts: the first test shows it on the real mount. The lease is taken with
claims and a settle time instead; the other tests take it with concurrent real processes
through both mounts and run the real receiver through one. Mount flags: tests/mounts.py.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from asyncsync import Publisher
from asyncsync.format.acks import read_acks
from asyncsync.format.lease import read_lease
from receiver.engines.checkpoint import LocalCheckpoint
from tests.conftest import mixed_state, mutate, same_bytes
from tests.mounts import RCLONE_SETTLE, rclone_mounts

REPO = Path(__file__).resolve().parent.parent


def _wait_for(cond: object, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_rclone_has_no_link_and_its_creates_do_not_exclude_across_mounts(tmp_path: Path) -> None:
    src = tmp_path / "src"
    with rclone_mounts(src, tmp_path / "a", tmp_path / "b") as (a, b):
        (a / "d").mkdir()
        _wait_for(lambda: (b / "d").is_dir())
        (a / "d" / "f").write_bytes(b"x")
        with pytest.raises(OSError) as ei:
            os.link(a / "d" / "f", a / "d" / "g")
        assert ei.value.errno == errno.EIO  # the error the receiver died of before the claims
        os.listdir(b / "d")  # b lists the directory (and caches the listing) first
        flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY
        os.close(os.open(a / "d" / "x", flags))
        with pytest.raises(FileExistsError):  # exclusive within one mount...
            os.open(a / "d" / "x", flags)
        os.close(os.open(b / "d" / "x", flags))  # ...but not across mounts: no EEXIST
        os.mkdir(a / "d" / "m")
        os.mkdir(b / "d" / "m")  # the same for mkdir


def _takers(
    roots: Sequence[Path], *, ttl: float, prefix: Sequence[str] = (), clock_behind: float = 0.0
) -> list[subprocess.Popen[str]]:
    procs = []
    for root in roots:
        argv = [*prefix, sys.executable, "-m", "tests.lease_taker", str(root),
                "--settle", str(RCLONE_SETTLE), "--ttl", str(ttl),
                "--clock-behind", str(clock_behind)]  # fmt: skip
        p = subprocess.Popen(
            argv, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        procs.append(p)
    for p in procs:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return procs


def _go(procs: Sequence[subprocess.Popen[str]]) -> list[str]:
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    return [p.stdout.readline().strip() for p in procs]  # type: ignore[union-attr]


def _stop(procs: Sequence[subprocess.Popen[str]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.communicate("", timeout=60)
        for pipe in (p.stdin, p.stdout):  # those of a killed taker too (no ResourceWarning)
            if pipe is not None and not pipe.closed:
                pipe.close()


@pytest.mark.heavy
def test_concurrent_takers_through_two_rclone_mounts_give_one_winner_and_a_dead_one_is_taken_over(
    tmp_path: Path,
) -> None:
    src = tmp_path / "src"
    ttl = 4 * RCLONE_SETTLE
    with rclone_mounts(src, tmp_path / "a", tmp_path / "b") as (a, b):
        for trial in range(2):
            procs = _takers([a, b, a, b], ttl=ttl)
            try:
                answers = _go(procs)
                winners = [i for i, ans in enumerate(answers) if ans.startswith("won")]
                assert len(winners) == 1, answers
                # a loser reads the winner's lease, or its claim, or (through the other mount)
                # the lease file while its upload is half done: honoured as a live lease
                refusals = ("in use by", "at the same time", "is unreadable")
                assert all(
                    any(r in ans for r in refusals)
                    for i, ans in enumerate(answers) if i != winners[0]
                ), answers  # fmt: skip
                owner = answers[winners[0]].split()[1]
                _wait_for(
                    lambda o=owner: (f := read_lease(src, "e1")) is not None and f[0].owner == o
                )
                winner = procs[winners[0]]
                winner.send_signal(signal.SIGKILL)  # its lease and claim stay behind
                winner.wait()
                # taken over through the other mount: same boot and pid namespace, dead pid
                other = b if [a, b, a, b][winners[0]] == a else a
                again = _takers([other], ttl=ttl)
                procs += again
                ans = _go(again)[0]
                assert ans.startswith("won"), (trial, ans)
                # rclone 1.60 still uploads a file removed while its upload is pending: let the
                # new lease reach the backend before it is released
                time.sleep(3)
            finally:
                _stop(procs)
            _wait_for(lambda: read_lease(src, "e1") is None)  # released


@pytest.mark.heavy
def test_a_dead_holder_in_another_pid_namespace_is_taken_over_by_its_heartbeat_age(
    tmp_path: Path,
) -> None:
    """Through the mounts, a holder that cannot be judged by its pid (another pid namespace)
    stays the holder while it heartbeats and is taken over once a taker has seen its lease
    unchanged for its ttl."""
    if not _has_unshare():
        pytest.skip("unshare --pid is not available")
    src = tmp_path / "src"
    ttl = 4 * RCLONE_SETTLE
    with rclone_mounts(src, tmp_path / "a", tmp_path / "b") as (a, b):
        holder = _takers([a], ttl=ttl, prefix=("unshare", "--pid", "--fork", "--kill-child"))
        procs = list(holder)
        try:
            assert _go(holder)[0].startswith("won")
            time.sleep(ttl)  # it heartbeats meanwhile: a taker after a full ttl is refused
            late = _takers([b], ttl=ttl)
            procs += late
            assert _refused_as_held(ans := _go(late)[0]), ans
            os.kill(holder[0].pid, signal.SIGKILL)  # unshare; --kill-child: its pid 1 dies too
            holder[0].wait()
            t0 = time.monotonic()
            while True:
                taker = _takers([b], ttl=ttl)
                procs += taker
                ans = _go(taker)[0]
                if ans.startswith("won"):
                    break
                assert _refused_as_held(ans) and time.monotonic() - t0 < 3 * ttl, ans
                time.sleep(1.0)
            assert time.monotonic() - t0 > ttl / 3  # waited for the heartbeat to age
        finally:
            _stop(procs)


def _refused_as_held(said: str) -> bool:
    """A taker of a live holder's id is refused either way: the holder named, or (rclone answers
    EIO while the holder's heartbeat rewrites the file through the other mount: the CI runs of
    a81c716 and 740ac2a saw it) the lease unreadable and seen changing, so taken for held."""
    return "in use by" in said or (
        "is unreadable ([Errno 5] Input/output error) and changed while this receiver watched it"
        in said
    )


def _has_unshare() -> bool:
    if os.geteuid() != 0:
        return False
    return (
        subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True).returncode == 0
    )


async def test_the_receiver_syncs_bit_exact_through_an_rclone_mount(tmp_path: Path) -> None:
    src = tmp_path / "src"
    with rclone_mounts(src, tmp_path / "a", tmp_path / "b") as (a, b):
        ckpt = tmp_path / "ckpt"
        argv = [sys.executable, "-m", "receiver.cli", "--root", str(b), "--engine-id", "e1",
                "--checkpoint", str(ckpt), "--poll-interval", "0.3", "--force-polling",
                "--lease-settle", str(RCLONE_SETTLE)]  # fmt: skip
        sd = mixed_state(0)
        async with Publisher(a, bucket_bytes=8192, keyframe_interval=0) as pub:
            await pub.seed(sd)
            child = subprocess.Popen(argv, cwd=REPO, stderr=subprocess.PIPE, text=True)
            try:
                for i in range(1, 4):
                    sd = mutate(sd, 0.05, seed=i)
                    r = await pub.publish(sd)
                    await pub.wait_acked(r.version, engines=["e1"], timeout=90)
                # a second receiver of the id, through the other mount, is refused
                second = argv.copy()
                second[second.index(str(b))] = str(a)
                second[second.index(str(ckpt))] = str(tmp_path / "ckpt2")
                r2 = subprocess.run([*second, "--once"], cwd=REPO, capture_output=True, text=True,
                                    timeout=120)  # fmt: skip
                assert r2.returncode == 1 and _refused_as_held(r2.stderr), r2.stderr
            finally:
                child.send_signal(signal.SIGTERM)
                _, err = child.communicate(timeout=120)
            assert child.returncode == 0, err
        assert read_acks(src)["e1"].version == 3
        held = LocalCheckpoint(ckpt).load_state_dict()
        assert sorted(held) == sorted(sd)
        assert all(same_bytes(held[k], v) for k, v in sd.items())
