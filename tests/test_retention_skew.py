"""Retention and ``asyncsync status`` when a receiver's clock disagrees with the others' (FORMAT.md
7): on an object-store FUSE mount (rclone, s3fs, gcsfuse) its ack's and its lease's mtimes are
its own clock. Whether it is live is judged by its lease's heartbeat as the reader sees it, on
the reader's clock. Two real rclone mounts: the receiver's files go through one (dated by its
clock with ``os.utime``, which rclone keeps), gc and status read through the other."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from asyncsync.format.acks import write_ack
from asyncsync.format.lease import LeaseRecord, lease_path
from asyncsync.format.store import list_versions, read_manifest, read_root_info
from asyncsync.ops.cli import main as cli_main
from tests.mounts import RCLONE_SETTLE, rclone_mounts
from tests.test_clock_and_log import _chain
from tests.test_rclone import _go, _stop, _takers, _wait_for

HOUR = 3600.0
TTL = 4 * RCLONE_SETTLE


def _ack(
    mount: Path, src: Path, engine: str, version: int, behind: float, readable: bool = True
) -> None:
    """The ack a receiver whose clock runs ``behind`` seconds behind writes through ``mount``
    (``readable=False``: bytes that are no record, as one of a newer format would be)."""
    if readable:
        fp = read_manifest(src, version).fingerprint
        write_ack(mount, engine, version, fp, read_root_info(src).run_id)  # type: ignore[union-attr]
    else:
        (mount / "acks").mkdir(exist_ok=True)
        (mount / "acks" / f"{engine}.json").write_bytes(b"\x00\xff not json")
    t = time.time() - behind
    os.utime(mount / "acks" / f"{engine}.json", (t, t))
    _wait_for(lambda: abs(_mtime(src / "acks" / f"{engine}.json") - t) < 2)


def _mtime(path: Path) -> float:
    try:
        return os.stat(path).st_mtime
    except FileNotFoundError:  # not uploaded yet
        return 0.0


@pytest.mark.heavy
@pytest.mark.parametrize("readable", [True, False])
async def test_gc_keeps_what_a_live_engine_whose_clock_runs_behind_needs(
    tmp_path: Path, readable: bool
) -> None:
    """Its ack and lease look two hours old (ack_ttl 600 s): gc deleted the versions it was
    about to replay. Its lease is seen renewed now: they are kept. An ack of it that cannot be
    read (whose version it pins is unknown) pinned nothing by that date, and gc deleted all
    but the newest keyframe's chain: now its lease keeps every version."""
    src = tmp_path / "src"
    await _chain(src, 9)  # keyframes 0, 4, 8
    with rclone_mounts(src, tmp_path / "a", tmp_path / "b") as (a, b):
        holder = _takers([b], ttl=TTL, clock_behind=2 * HOUR)
        try:
            assert _go(holder)[0].startswith("won")
            _ack(b, src, "e1", 2, behind=2 * HOUR, readable=readable)
            argv = ["gc", str(a), "--keep-versions", "1", "--ack-ttl", "600"]
            assert cli_main(argv) == 0
            assert list_versions(src) == list(range(3 if readable else 0, 10))  # e1 at 2: 3..9
        finally:
            _stop(holder)


@pytest.mark.heavy
async def test_status_counts_a_silent_engine_with_an_ack_dated_ahead_as_a_straggler(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two engines one version behind, their clocks an hour ahead (acks dated in the future:
    age unknown): ``e1`` renews its lease, ``e2``'s receiver is gone (its lease left, silent).
    status flagged the date and counted neither as a straggler; now ``e2`` is one."""
    src = tmp_path / "src"
    await _chain(src, 9)
    with rclone_mounts(src, tmp_path / "a", tmp_path / "b") as (a, b):
        holder = _takers([b], ttl=TTL, clock_behind=-HOUR)
        try:
            assert _go(holder)[0].startswith("won")
            _ack(b, src, "e1", 8, behind=-HOUR)
            gone = LeaseRecord("e2", "2" * 16, "other-host", 4242, TTL, 0.0, 0.0, "boot", "pid:[1]")
            lease_path(b, "e2").write_bytes(gone.to_json())
            t = time.time() + HOUR
            os.utime(lease_path(b, "e2"), (t, t))
            _ack(b, src, "e2", 8, behind=-HOUR)
            assert cli_main(["status", str(a), "--json"]) == 3
            doc = json.loads(capsys.readouterr().out)
            assert doc["stragglers"] == ["e2"], doc
            assert all(r["ack_ahead_seconds"] > HOUR / 2 for r in doc["engines"]), doc
        finally:
            _stop(holder)
