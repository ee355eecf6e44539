"""Temp files in ``.rendezvous/`` when the ranks' clocks disagree (FORMAT.md 10): on an
object-store FUSE mount (rclone, s3fs, gcsfuse) a temp's mtime is its writer's clock. Rank 0
judges them by what it sees on its own clock: one goes once seen unchanged long enough."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from asyncsync import FileRendezvous, Publisher
from asyncsync.format.store import list_versions
from asyncsync.publish import rendezvous as rendezvous_mod
from asyncsync.publish.rendezvous import RENDEZVOUS_DIR
from tests.conftest import mixed_state, mutate
from tests.test_lease_temps import MINUTES, _left, in_flight


async def test_rank_0_leaves_the_temp_of_a_rank_whose_clock_runs_behind_to_it(
    tmp_path: Path,
) -> None:
    """Rank 1, on a host whose clock runs 10 minutes behind, is writing its heartbeat when
    rank 0 (re)starts the group: its temp looked 10 minutes old, past ``max(60 s, 2 x
    timeout)``, and rank 0 removed it under it (its rename failed: `No such file or
    directory`). Now rank 0 removes a temp only once it has seen it unchanged that long."""
    path = tmp_path / RENDEZVOUS_DIR / "beat-r0001.json"
    with in_flight(path, -MINUTES) as finish:
        await FileRendezvous(tmp_path, 0, 2, timeout=1.0).open()
        assert finish() == "done"
    assert path.read_bytes() == path.name.encode()


async def test_rank_0_removes_the_temps_of_dead_writers_at_a_later_plan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ranks killed in a write, one on a host whose clock ran 10 minutes ahead: its temp was
    dated in the future and never removed. Rank 0 sees both at its start and removes them at
    the first plan after it saw them unchanged for ``max(floor, 2 x timeout)``."""
    monkeypatch.setattr(rendezvous_mod, "LEFT_TEMP_FLOOR", 0.5)  # (60 s)
    d = tmp_path / RENDEZVOUS_DIR
    left = [
        _left(d / ".tmp.beat-r0001.json.0123456789ab", MINUTES),
        _left(d / ".tmp.plan-r0001.json.0123456789ab", 0.0),
    ]
    states = [mixed_state(0)]
    rdv = FileRendezvous(tmp_path, 0, 1, timeout=0.25)
    async with Publisher(tmp_path, coordinator=rdv, keyframe_interval=0) as pub:
        await pub.seed(states[0])
        assert all(p.exists() for p in left)  # seen, perhaps writes in flight
        time.sleep(0.6)
        await pub.publish(mutate(states[0], 0.03, seed=1))
        assert [p.name for p in left if p.exists()] == []
    assert list_versions(tmp_path) == [0, 1]
