"""A lease or claim whose mtime disagrees with the reader's clock (FORMAT.md 7.1): on an
object-store mount (rclone, s3fs, gcsfuse) the mtime is the writer's clock, and a file server's
clock may be set back. No mtime decides: a record is live once the taker sees it change, dead
once it sees it unchanged for its ttl, whatever its date. (tests/test_lease_skew.py: the same
through two real rclone mounts.)"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest

from asyncsync import LockHeld
from asyncsync.format.lease import EngineLease, LeaseRecord, claim_path, lease_path, read_lease
from tests.test_lease import heartbeats, renewing

HOUR = 3600.0


def _plant(path: Path, owner: str, ahead: float, ttl: float = 1.0) -> Path:
    """A record of a receiver on another host (another boot: judged by what is seen only)."""
    rec = LeaseRecord("e1", owner, "other-host", 4242, ttl, 0.0, 0.0, "other-boot", "pid:[1]", "n")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(rec.to_json())
    t = time.time() + ahead
    os.utime(path, (t, t))
    return path


@pytest.mark.parametrize("ahead", [HOUR, -HOUR])
def test_a_silent_lease_is_taken_once_seen_unchanged_for_its_ttl_whatever_its_date(
    tmp_path: Path, ahead: float, caplog: pytest.LogCaptureFixture
) -> None:
    """Dated an hour in the future (a clock set back, a writer's clock ahead): it was refused
    until the reader's clock passed its mtime by its ttl, an hour. Dated an hour ago: it was
    taken at once. Both are taken once seen unchanged for the ttl now."""
    _plant(lease_path(tmp_path, "e1"), "f" * 16, ahead)
    lease = EngineLease(tmp_path, "e1", ttl=1.0, settle=0.0)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING):
        lease.acquire()
    assert time.monotonic() - t0 >= 1.0  # watched for its ttl
    assert "taking over the dead lease of host other-host pid 4242" in caplog.text
    found = read_lease(tmp_path, "e1")
    assert found is not None and found[0].owner == lease.owner
    lease.release()


@pytest.mark.parametrize("behind", [HOUR, -HOUR])
def test_a_renewed_lease_is_refused_whatever_its_date(tmp_path: Path, behind: float) -> None:
    """Its holder's clock an hour behind (it looked an hour old: taken while live) or ahead."""
    path = lease_path(tmp_path, "e1")
    rec = LeaseRecord("e1", "f" * 16, "other-host", 4242, 1.0, 0.0, 0.0, "other-boot", "pid:[1]")
    with (
        renewing(path, heartbeats(rec), every=0.2, behind=behind),
        pytest.raises(LockHeld, match=r"host other-host pid 4242.*renews its lease"),
    ):
        EngineLease(tmp_path, "e1", ttl=1.0, settle=0.0).acquire()
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no claim left behind


def test_a_rival_claim_dated_in_the_future_is_judged_by_what_is_seen(tmp_path: Path) -> None:
    """A claim dated an hour ahead kept every taker out for an hour (then said so); a silent
    one is dead once seen unchanged for its ttl, and removed."""
    claim = _plant(claim_path(tmp_path, "e1", "0" * 16), "0" * 16, HOUR)
    lease = EngineLease(tmp_path, "e1", ttl=1.0, settle=0.0)
    lease.acquire()
    assert lease.held and not claim.exists()
    lease.release()
