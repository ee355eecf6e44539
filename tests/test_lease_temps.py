"""Temp files a writer left in ``leases/`` and ``acks/`` when the hosts' clocks disagree
(FORMAT.md 7.1): on an object-store FUSE mount (rclone, s3fs, gcsfuse) a temp's mtime is its
writer's clock. The taker of an id judges the id's temps by what it sees on its own clock: one
is removed once seen unchanged for the ttl, whatever its date says."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from asyncsync.format.lease import claim_path
from receiver.acking import RootPresence
from receiver.engines.checkpoint import LocalCheckpoint
from tests.test_lease import _publish

REPO = Path(__file__).resolve().parent.parent
MINUTES = 600.0


@contextlib.contextmanager
def in_flight(path: Path, skew: float) -> Iterator[Callable[[], str]]:
    """A live writer (another process) in the middle of an atomic write of ``path``, its temp
    dated by a clock ``skew`` seconds off ours; the block gets a call that lets it finish and
    returns what it said (``done``, or ``failed ...``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    p = subprocess.Popen(
        [sys.executable, "-m", "tests.temp_writer", str(path), str(skew)],
        cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert p.stdin is not None and p.stdout is not None
    try:
        said = p.stdout.readline().split()
        assert said[:1] == ["writing"], said
        temp = path.parent / said[1]
        assert abs(os.lstat(temp).st_mtime - time.time() - skew) < 60

        def finish() -> str:
            assert p.stdin is not None and p.stdout is not None
            p.stdin.write("go\n")
            p.stdin.flush()
            return p.stdout.readline().strip()

        yield finish
    finally:
        p.communicate("", timeout=60)


def _left(path: Path, skew: float) -> Path:
    """The temp a writer killed before its rename left, dated by a clock ``skew`` s off ours."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"{")
    t = time.time() + skew
    os.utime(path, (t, t))
    return path


def _presence(tmp_path: Path, root: Path, ttl: float) -> RootPresence:
    """A receiver's hold on engine id ``e1`` of ``root``."""
    return RootPresence(
        root, "e1", LocalCheckpoint(tmp_path / "ck"), lease_ttl=ttl, lease_settle=0.0
    )


@pytest.mark.parametrize("what", ["claim", "ack"])
async def test_the_temp_of_a_live_writer_whose_clock_runs_behind_is_left_to_it(
    tmp_path: Path, what: str
) -> None:
    """A rival taker writing its claim, or the id's previous receiver finishing its ack, on a
    host whose clock runs 10 minutes behind: its temp looks 10 minutes old. The taker removed
    it under the writer as left over (its rename failed: `No such file or directory`). Now a
    temp goes only once the taker saw it unchanged for the ttl: the write ends well before."""
    root = tmp_path / "root"
    await _publish(root, 1)
    path = claim_path(root, "e1", "f" * 16) if what == "claim" else root / "acks/e1.json"
    presence = _presence(tmp_path, root, 5.0)
    with in_flight(path, -MINUTES) as finish:
        await presence.hold()
        assert presence.lease.held
        assert finish() == "done"
    assert path.read_bytes() == path.name.encode()
    await presence.renew()  # the temp it saw is gone: forgotten
    assert path.read_bytes() == path.name.encode()
    await presence.release()


async def test_temps_of_a_dead_writer_whose_clock_ran_ahead_are_removed(tmp_path: Path) -> None:
    """A receiver killed in a write of its lease, claim and ack, its clock 10 minutes ahead:
    its temps are dated in the future and were never removed (one more at each crash). They go
    at the first heartbeat after the taker saw them unchanged for its ttl; another id's stay."""
    root = tmp_path / "root"
    await _publish(root, 1)
    leases, acks = root / "leases", root / "acks"
    left = [
        _left(leases / ".tmp.e1.json.0123456789ab", MINUTES),
        _left(leases / f".tmp.e1.{'c' * 16}.claim.0123456789ab", MINUTES),
        _left(leases / ".tmp.clock.0123456789ab", MINUTES),
        _left(acks / ".tmp.e1.json.0123456789ab", MINUTES),
        _left(acks / ".tmp.e1.json.00000000000f", 0.0),  # dated now: as dead
    ]
    kept = [_left(acks / ".tmp.e2.json.0123456789ab", MINUTES)]
    presence = _presence(tmp_path, root, 1.0)
    await presence.hold()
    assert all(p.exists() for p in left)  # first seen now: perhaps writes in flight
    time.sleep(1.2)
    await presence.renew()
    assert [p.name for p in left if p.exists()] == []
    assert all(p.exists() for p in kept)
    await presence.release()
