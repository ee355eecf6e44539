"""A lease or claim dated in the future: the root's filesystem clock was set back (an NFS
server's), so a record written before reads as written later than now (FORMAT.md 7.1).

Its age on the filesystem's clock is negative: it is honoured as live until that clock passes
its mtime by its ttl. That is the safe direction (a takeover waits; two receivers never hold
one id), and the refusal says so: when it will be taken over, and what to do meanwhile."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

from asyncsync import LockHeld
from asyncsync.format.lease import EngineLease, LeaseRecord, claim_path, lease_path, read_lease

AHEAD = 3600.0  # the record's mtime is an hour past the filesystem's clock


def _plant(path: Path, owner: str, ahead: float, ttl: float = 30.0) -> Path:
    """A record of a receiver on another host (another boot: judged by its mtime only)."""
    rec = LeaseRecord("e1", owner, "other-host", 4242, ttl, 0.0, 0.0, "other-boot", "pid:[1]", "n")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(rec.to_json())
    t = time.time() + ahead
    os.utime(path, (t, t))
    return path


def _ahead_by(said: str) -> int:
    found = re.search(r"(\d+)s in the future", said)
    assert found is not None, said
    return int(found.group(1))


def test_a_lease_dated_in_the_future_blocks_a_takeover_until_the_clock_catches_up(
    tmp_path: Path,
) -> None:
    path = _plant(lease_path(tmp_path, "e1"), "f" * 16, AHEAD)
    planted = path.read_bytes()
    with pytest.raises(LockHeld) as info:
        EngineLease(tmp_path, "e1", settle=0.0).acquire()
    said = str(info.value)
    assert "host other-host pid 4242" in said
    assert 3590 <= _ahead_by(said) <= 3601, said  # its mtime on the filesystem's clock
    assert "clock" in said and "set back" in said  # why
    assert "safe" in said  # the direction it errs in, by design
    waits = re.search(r"taken over in (\d+)s", said)
    assert waits is not None and 3625 <= int(waits.group(1)) <= 3635, said  # ahead + ttl
    assert str(path) in said and "remove" in said  # what to do if no receiver of the id runs
    assert path.read_bytes() == planted  # left as it was
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no claim left behind
    # the filesystem's clock has caught up (its mtime is now older than its ttl): taken over
    t = time.time() - 31.0
    os.utime(path, (t, t))
    lease = EngineLease(tmp_path, "e1", settle=0.0)
    lease.acquire()
    found = read_lease(tmp_path, "e1")
    assert found is not None and found[0].owner == lease.owner
    lease.release()


def test_a_rival_claim_dated_in_the_future_says_so(tmp_path: Path) -> None:
    """A claim (a taker's, before its lease) dated in the future keeps a taker out as a live
    rival does; refusing, the taker says the claim is dated in the future, not only that
    another receiver is taking the id "at the same time"."""
    claim = _plant(claim_path(tmp_path, "e1", "0" * 16), "0" * 16, AHEAD, ttl=2.0)
    with pytest.raises(LockHeld) as info:
        EngineLease(tmp_path, "e1", ttl=2.0, settle=0.0).acquire()
    said = str(info.value)
    assert "host other-host pid 4242" in said
    assert 3590 <= _ahead_by(said) <= 3601 and "set back" in said, said
    assert str(claim) in said and "remove" in said
    assert [p.name for p in claim.parent.iterdir()] == [claim.name]  # withdrew its own
