"""Retention ages on one clock, skew shown in status (issue 13, failure 8); log.jsonl trimmed
with retention (failure 9)."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import pytest

from asyncsync import Publisher
from asyncsync.format.acks import AckRecord, ack_ages, read_acks
from asyncsync.format.log import follow_log, read_log, trim_log
from asyncsync.format.store import list_versions, read_root_info
from asyncsync.ops.cli import main as cli_main
from asyncsync.publish.retention import RetentionPolicy, collect
from tests.conftest import mixed_state, mutate

HOUR = 3600.0


async def _chain(root: Path, n: int, **kw: object) -> None:
    sd = mixed_state(0)
    async with Publisher(root, bucket_bytes=8192, keyframe_interval=4, **kw) as pub:  # type: ignore[arg-type]
        await pub.seed(sd)
        for i in range(1, n + 1):
            sd = mutate(sd, 0.02, seed=i)
            await pub.publish(sd)


def _ack(
    root: Path, engine: str, version: int, applied_at: float, mtime: float | None = None
) -> None:
    rec = AckRecord(engine, version, "ab" * 16, read_root_info(root).run_id, applied_at, "h")  # type: ignore[union-attr]
    p = root / "acks" / f"{engine}.json"
    p.parent.mkdir(exist_ok=True)
    p.write_text(rec.to_json())
    if mtime is not None:
        os.utime(p, (mtime, mtime))


async def test_a_live_engine_with_a_slow_clock_keeps_its_versions(tmp_path: Path) -> None:
    await _chain(tmp_path, 9)  # keyframes 0, 4, 8
    _ack(tmp_path, "slow", 2, applied_at=time.time() - 2 * HOUR)  # written now, clock 2 h behind
    collect(tmp_path, RetentionPolicy(keep_versions=1, ack_ttl=600))
    assert list_versions(tmp_path) == list(range(3, 10))


async def test_an_ack_dated_in_the_future_does_not_pin_forever(tmp_path: Path) -> None:
    await _chain(tmp_path, 9)
    future = time.time() + 10 * 365 * 24 * HOUR
    _ack(tmp_path, "future", 2, applied_at=future, mtime=time.time() - 2 * HOUR)
    collect(tmp_path, RetentionPolicy(keep_versions=1, ack_ttl=600))
    assert list_versions(tmp_path) == [8, 9]


async def test_status_flags_an_ack_dated_in_the_future_and_gc_asks_its_lease(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """(helper-64) An ack whose mtime is in the future of the root's clock (a clock stepped
    back on the file server, a hostile utime) had its age clamped to 0: `status` showed "age
    0.0", as for an ack just written, and --stale could never fire. It says so now, in a line
    and in the JSON. gc keeps what the engine needs while the ack is dated within ack_ttl
    ahead; further ahead, its lease decides (attack-85: none here, so it pins nothing)."""
    await _chain(tmp_path, 9)  # keyframes 0, 4, 8
    _ack(tmp_path, "ahead", 2, applied_at=time.time(), mtime=time.time() + 2 * HOUR)
    assert cli_main(["status", str(tmp_path), "--json"]) == 3  # behind by 7: a straggler
    row = json.loads(capsys.readouterr().out)["engines"][0]
    # the root's clock is a probe file's mtime, which the kernel stamps from its coarse clock
    # (a tick, up to ~10 ms, behind time.time()): the CI once read 7200.001
    assert 1.9 * HOUR < row["ack_ahead_seconds"] <= 2 * HOUR + 1, row
    assert cli_main(["status", str(tmp_path)]) == 3
    out = capsys.readouterr().out
    said = [line for line in out.splitlines() if "in the future" in line]
    assert len(said) == 1 and said[0].startswith("ack of ahead dated 7"), out
    assert "age unknown" in said[0] and "gc too, once it is dated more" in said[0], said
    collect(tmp_path, RetentionPolicy(keep_versions=1, ack_ttl=3 * HOUR))
    assert list_versions(tmp_path) == list(range(3, 10))
    collect(tmp_path, RetentionPolicy(keep_versions=1, ack_ttl=600))
    assert list_versions(tmp_path) == [8, 9]


async def test_status_shows_age_on_the_root_clock_and_the_skew(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    await _chain(tmp_path, 2)
    _ack(tmp_path, "future", 2, applied_at=time.time() + 10 * 365 * 24 * HOUR,
         mtime=time.time() - 100)  # fmt: skip
    ages = ack_ages(tmp_path, read_acks(tmp_path))
    assert 99 < ages["future"].age < 200 and ages["future"].skew > 9 * 365 * 24 * HOUR
    assert cli_main(["status", str(tmp_path), "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["engines"][0]
    assert row["ack_age_seconds"] > 99 and row["clock_skew_seconds"] > 9 * 365 * 24 * HOUR
    assert cli_main(["status", str(tmp_path)]) == 0
    assert "skew s" in capsys.readouterr().out


async def test_the_log_is_trimmed_with_retention(tmp_path: Path) -> None:
    await _chain(tmp_path, 11, retention=RetentionPolicy(keep_versions=1, ack_ttl=None))
    kept = list_versions(tmp_path)
    assert kept == [8, 9, 10, 11]
    assert [r["version"] for r in read_log(tmp_path)] == kept


def test_trim_keeps_lines_appended_meanwhile_and_a_torn_tail(tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps({"version": v}) + "\n" for v in range(5)) + '{"vers')
    assert trim_log(tmp_path, 3) == 3
    assert log.read_text().splitlines() == ['{"version": 3}', '{"version": 4}', '{"vers']
    assert trim_log(tmp_path, 3) == 0


async def test_follow_log_does_not_repeat_lines_after_a_trim(tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps({"version": v}) + "\n" for v in range(4)))
    seen: list[int] = []
    got_four = asyncio.Event()

    async def follow() -> None:
        async for rec in follow_log(tmp_path, poll_interval=0.01):
            seen.append(rec["version"])
            if rec["version"] == 3:
                got_four.set()
            if rec["version"] == 4:
                return

    task = asyncio.create_task(follow())
    await got_four.wait()
    trim_log(tmp_path, 2)
    with log.open("a") as f:
        f.write(json.dumps({"version": 4}) + "\n")
    await asyncio.wait_for(task, 10)
    assert seen == [0, 1, 2, 3, 4]


async def test_status_and_gc_dry_run_write_one_clock_probe_and_nothing_else(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """(helper-64) `status` and `gc --dry-run` read the root, save the one temp file that reads
    the file server's clock (asyncsync.ops.cli says why). `status` made two (one for the ack
    ages, one for the leases'), `gc --dry-run` one more per unreadable ack; one each now, seen
    by inotify on the root, and the root holds the same names after."""
    from receiver.inotify import DirectoryWatch, available

    if not available():
        pytest.skip("no inotify here: the probe files cannot be seen")
    await _chain(tmp_path, 9)
    _ack(tmp_path, "e", 2, applied_at=time.time())
    (tmp_path / "acks" / "bad.json").write_bytes(b"{")  # unreadable: gc measures its age
    before = sorted(os.listdir(tmp_path))
    for argv in (["status", str(tmp_path)], ["gc", str(tmp_path), "--dry-run"]):
        watch = DirectoryWatch(tmp_path)
        try:
            cli_main(argv)
            names = _names(watch)
        finally:
            watch.close()
        assert len({n for n in names if n.startswith(".tmp.clock.")}) == 1, (argv, names)
        assert {n for n in names if not n.startswith(".tmp.clock.")} == set(), (argv, names)
        assert sorted(os.listdir(tmp_path)) == before
    capsys.readouterr()


def _names(watch: object) -> list[str]:
    """The entry names of the events a receiver.inotify.DirectoryWatch holds, in order."""
    names: list[str] = []

    def keep(name: str) -> bool:
        names.append(name)
        return False  # never "wanted": every event's name is passed on

    watch.read(keep)  # type: ignore[attr-defined]
    return names
