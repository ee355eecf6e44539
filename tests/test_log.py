"""The manifest log: appended lines are followed as they land; torn lines wait to be whole."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncsync.errors import ConfigError, shown
from asyncsync.format import LOG_NAME
from asyncsync.format import log as log_module
from asyncsync.format.log import MAX_LINE_BYTES, follow_log, read_log
from tests.conftest import eventually


class RecordedReads:
    """Stands in for ``_read_at`` in ``asyncsync.format.log``: every read ``follow_log`` makes,
    with the versions it had yielded when the read began. The follower reads the file again
    only after it has dealt with the bytes of its previous read, so the next read's record says
    what those bytes made it yield; no test has to guess how long that takes."""

    def __init__(self, got: list[dict[str, Any]]) -> None:
        self.got = got
        self.reads: list[tuple[bytes, list[object]]] = []
        self._real = log_module._read_at

    def __call__(self, path: Path, root: Path, offset: int, n: int) -> bytes:
        before = [r["version"] for r in self.got]  # runs in a thread while the loop waits
        data = self._real(path, root, offset, n)
        self.reads.append((data, before))
        return data

    def read_bytes(self) -> int:
        return sum(len(data) for data, _ in self.reads)


async def test_follow_sees_appends_and_waits_for_whole_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / LOG_NAME
    log.write_bytes(b'{"version": 0}\n{"version": 1, "note": "\xc3\xa9t\xc3\xa9"}\n')
    got: list[dict[str, Any]] = []
    rec = RecordedReads(got)
    monkeypatch.setattr(log_module, "_read_at", rec)

    async def follow() -> None:
        async for r in follow_log(tmp_path, poll_interval=0.01):
            got.append(r)
            if len(got) == 4:
                return

    task = asyncio.create_task(follow())
    await eventually(lambda: len(got) == 2, "the two lines already in the log")
    with open(log, "ab") as f:
        f.write(b'{"version": 2')  # a torn line: not yielded until its newline lands
        f.flush()
        size = log.stat().st_size
        await eventually(lambda: rec.read_bytes() == size, "the follower to read the torn line")
        after_torn = len(rec.reads)
        f.write(b'}\nnot json\n{"version": 3}\n')
    await asyncio.wait_for(task, 10)
    assert rec.reads[after_torn][1] == [0, 1]  # what the torn line made it yield: nothing
    assert [r["version"] for r in got] == [0, 1, 2, 3]
    assert got[1]["note"] == "été"
    assert [r["version"] for r in read_log(tmp_path)] == [0, 1, 2, 3]


#: lines a hostile or broken writer of the root may append (found by an attack: each one
#: ended `asyncsync inspect`, `tail`, `tail -f` and `gc` in a traceback, and `gc` after it had
#: deleted versions; the deep one stopped the publisher from opening the root)
FORGED = [
    b'{"version": 4, "density": "abc"}',
    b'{"version": 4, "committed_at": 1e300}',
    b'{"version": 4, "committed_at": -1e20}',
    b'{"version": 4, "committed_at": NaN}',
    b'{"version": 4, "wire_bytes": "x"}',
    b'{"version": 4, "base_version": true}',
    b'{"version": -4}',
    b"[" * 100_000 + b"]" * 100_000,
]


@pytest.mark.parametrize("line", FORGED, ids=range(len(FORGED)))
async def test_a_forged_log_line_is_skipped_by_every_reader(tmp_path: Path, line: bytes) -> None:
    import torch

    from asyncsync import Publisher
    from asyncsync.ops.cli import main as cli_main

    sd = {"w": torch.arange(64, dtype=torch.float32)}
    async with Publisher(tmp_path, keyframe_interval=0) as pub:
        await pub.seed(sd)
        for v in (1, 2):
            sd["w"][v] += 1
            await pub.publish(sd)
    with open(tmp_path / LOG_NAME, "ab") as f:
        f.write(line + b"\n")
    assert [r["version"] for r in read_log(tmp_path)] == [0, 1, 2]
    got: list[int] = []
    async for r in follow_log(tmp_path, poll_interval=0.01):
        got.append(r["version"])
        if len(got) == 3:
            break
    assert got == [0, 1, 2]
    for cmd in (["inspect", str(tmp_path)], ["tail", str(tmp_path)]):
        assert await asyncio.to_thread(cli_main, cmd) == 0, cmd
    assert await asyncio.to_thread(cli_main, ["gc", str(tmp_path), "--keep-versions", "1"]) == 0
    assert [r["version"] for r in read_log(tmp_path)] == [0, 1, 2]  # v0 is the chain's keyframe
    async with Publisher(tmp_path, keyframe_interval=0) as pub:  # its recovery reads the log
        await pub.seed(sd)
        sd["w"][0] += 1
        assert (await pub.publish(sd)).changed == 1


def _lines(run: str, versions: range, **extra: object) -> bytes:
    return b"".join(
        json.dumps({"version": v, "run_id": run, **extra}).encode() + b"\n" for v in versions
    )


async def test_follow_shows_a_new_run_after_the_root_is_made_again(tmp_path: Path) -> None:
    """The root wiped and seeded again by another run: its v0..v5 are all shown, after one
    notice (`tail -f` skipped every version up to the old run's newest, found by an attack)."""
    root = tmp_path / "root"
    root.mkdir()
    (root / LOG_NAME).write_bytes(_lines("old", range(3)))
    got: list[tuple[str, int]] = []
    notices: list[str] = []

    async def follow() -> None:
        async for r in follow_log(root, poll_interval=0.01, notice=notices.append):
            got.append((r["run_id"], r["version"]))
            if len(got) == 9:
                return

    task = asyncio.create_task(follow())
    await eventually(lambda: len(got) == 3, "the old run's three lines")
    shutil.rmtree(root)
    root.mkdir()
    (root / LOG_NAME).write_bytes(_lines("new", range(2), kind="full-seeded"))
    await eventually(lambda: len(got) == 5, "the new run's first two lines")
    with open(root / LOG_NAME, "ab") as f:
        f.write(_lines("new", range(2, 6)))
    await asyncio.wait_for(task, 10)
    assert got == [("old", 0), ("old", 1), ("old", 2)] + [("new", v) for v in range(6)]
    assert notices == [f"{LOG_NAME} was replaced (new run new)"]


async def test_a_forged_line_does_not_hide_the_lines_after_it(tmp_path: Path) -> None:
    log = tmp_path / LOG_NAME
    log.write_bytes(_lines("run", range(3)) + b'{"version": 42}\n')
    got: list[int] = []

    async def follow() -> None:
        async for r in follow_log(tmp_path, poll_interval=0.01):
            got.append(r["version"])
            if len(got) == 6:
                return

    task = asyncio.create_task(follow())
    await eventually(lambda: len(got) == 4, "the lines already there")
    with open(log, "ab") as f:
        f.write(_lines("run", range(3, 5)))
    await asyncio.wait_for(task, 10)
    assert got == [0, 1, 2, 42, 3, 4]


async def test_follow_says_when_it_skips_a_line_that_is_no_record(tmp_path: Path) -> None:
    """(helper-25) A line that is no log record (a raw ESC inside a JSON string is invalid
    JSON) was dropped without a word: one notice now, the line's start shown escaped; the
    lines around it are followed, and a replaced log does not repeat the notice."""
    log = tmp_path / LOG_NAME
    bad = b'{"version": 5, "kind": "d\x1b[31mRED"}\n'  # a raw ESC byte: not JSON
    log.write_bytes(_lines("run", range(2)) + bad + _lines("run", range(2, 3)))
    got: list[int] = []
    notices: list[str] = []

    async def follow() -> None:
        async for r in follow_log(tmp_path, poll_interval=0.01, notice=notices.append):
            got.append(r["version"])
            if len(got) == 4:
                return

    task = asyncio.create_task(follow())
    await eventually(lambda: len(got) == 3, "the lines already there")
    tmp = tmp_path / "log.tmp"
    tmp.write_bytes(log.read_bytes() + _lines("run", range(3, 4)))
    tmp.replace(log)  # replaced by a longer copy: the bad line again, the notice not
    await asyncio.wait_for(task, 10)
    assert got == [0, 1, 2, 3]
    assert len(notices) == 1 and "not a log record" in notices[0], notices
    assert "\\x1b" in notices[0] and "\x1b" not in notices[0]


async def test_follow_skips_an_overlong_line_without_holding_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 40 MiB line without a newline: the follower holds at most MAX_LINE_BYTES of it (it
    kept every byte until a newline came, re-splitting them at every poll: `tail -f` grew by
    600 MB for a 200 MB line), skips it with one notice, and goes on with the next line. It
    holds one 4 MiB read at a time (helper-33: it held the last read while making the next, 8
    MiB, and under load an executor worker late to drop its result held a third and a fourth:
    the test's old 16 MiB bound failed about one run in 13)."""
    log = tmp_path / LOG_NAME
    log.write_bytes(_lines("run", range(1)))
    got: list[int] = []
    notices: list[str] = []
    read = [0]  # bytes the follower has read (RecordedReads would hold them)
    real = log_module._read_at

    def counted(path: Path, root: Path, offset: int, n: int) -> bytes:
        data = real(path, root, offset, n)
        read[0] += len(data)
        return data

    monkeypatch.setattr(log_module, "_read_at", counted)

    async def follow() -> None:
        async for r in follow_log(tmp_path, poll_interval=0.01, notice=notices.append):
            got.append(r["version"])
            if len(got) == 2:
                return

    task = asyncio.create_task(follow())
    await eventually(lambda: got == [0], "the first line")
    tracemalloc.start()
    try:
        with open(log, "ab") as f:
            for _ in range(40):
                f.write(b'{"version": 7, "x": "' + b"A" * (1 << 20))
        size = log.stat().st_size
        await eventually(lambda: read[0] >= size, "the follower to read the long line")
        await asyncio.sleep(0.05)  # a few more polls
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # one read (4 MiB) and the start of the overlong line it hashes (1 MiB), 1 MiB to spare:
    # a second read held is 8 MiB
    assert peak < log_module._READ_BYTES + 2 * MAX_LINE_BYTES, f"the follower held {peak} bytes"
    with open(log, "ab") as f:
        f.write(b'"}\n' + _lines("run", range(1, 2)))
    await asyncio.wait_for(task, 10)
    assert got == [0, 1]
    assert notices == [f"{LOG_NAME}: skipped a line longer than 1048576 bytes (at byte 32)"]


async def test_an_overlong_line_is_said_once_across_replacements(tmp_path: Path) -> None:
    """(helper-26) After the log was replaced (a trim: the kept lines at other offsets), a line
    longer than MAX_LINE_BYTES that was already reported was reported again, at every
    replacement; a line that is no record was not. Now it is said once; another overlong line
    after the replacement is still said."""
    log = tmp_path / LOG_NAME
    long = b'{"version": 1, "x": "' + b"A" * (MAX_LINE_BYTES + 10) + b'"}\n'
    log.write_bytes(_lines("run", range(1)) + long + _lines("run", range(2, 3)))
    got: list[int] = []
    notices: list[str] = []

    async def follow() -> None:
        async for r in follow_log(tmp_path, poll_interval=0.01, notice=notices.append):
            got.append(r["version"])
            if len(got) == 4:
                return

    task = asyncio.create_task(follow())
    await eventually(lambda: got == [0, 2], "the lines already there")
    tmp = tmp_path / "log.tmp"
    tmp.write_bytes(long + _lines("run", range(2, 4)))  # trimmed: v0 dropped, the rest moved
    tmp.replace(log)
    await eventually(lambda: got == [0, 2, 3], "the line after the replacement")
    other = b'{"version": 5, "x": "' + b"B" * (MAX_LINE_BYTES + 10) + b'"}\n'
    with open(log, "ab") as f:
        f.write(other + _lines("run", range(4, 5)))
    await asyncio.wait_for(task, 10)
    assert got == [0, 2, 3, 4]
    at = len(long) + len(_lines("run", range(2, 4)))
    assert notices == [
        f"{LOG_NAME}: skipped a line longer than {MAX_LINE_BYTES} bytes (at byte 32)",
        f"{LOG_NAME}: skipped a line longer than {MAX_LINE_BYTES} bytes (at byte {at})",
    ], notices


async def test_tail_without_f_skips_an_overlong_line_with_one_notice(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """(helper-30) `tail` without -f parsed a line longer than MAX_LINE_BYTES like any other
    (a forged 40 MiB record was shown, its bytes read whole and decoded); it skips it now with
    the notice `tail -f` gives, holding at most a read's worth of it, as -f does. An
    unfinished overlong last line is said too, as -f says it."""
    from asyncsync import Publisher
    from asyncsync.ops.cli import main

    async with Publisher(tmp_path) as pub:
        await pub.seed({"w": torch.zeros(4)})  # v0, its log line
    log = tmp_path / LOG_NAME
    first, big = log.stat().st_size, 40 << 20
    with open(log, "ab") as f:
        f.write(b'{"version": 7, "x": "' + b"A" * big + b'"}\n')  # parses: a record
        f.write(_lines("run", range(1, 2)))
        last = f.tell()
        f.write(b'{"version": 8, "x": "' + b"B" * (MAX_LINE_BYTES + 1))  # unfinished
    notices: list[str] = []
    tracemalloc.start()
    try:
        got = [r["version"] for r in read_log(tmp_path, notice=notices.append)]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert got == [0, 1]
    assert notices == [
        f"{LOG_NAME}: skipped a line longer than {MAX_LINE_BYTES} bytes (at byte {first})",
        f"{LOG_NAME}: skipped a line longer than {MAX_LINE_BYTES} bytes (at byte {last})",
    ], notices
    assert peak < 16 << 20, f"read_log held {peak} bytes"
    assert main(["tail", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert [line.split()[0] for line in out.splitlines()] == ["v0", "v1"], out
    assert err.splitlines() == [f"asyncsync tail: {n}" for n in notices], err


async def test_a_line_torn_by_a_crash_does_not_swallow_the_next_version(tmp_path: Path) -> None:
    """(helper-26) A machine crash can leave the log's last line torn, without its newline; the
    next version's line was appended right after it, the two made one line that is no record,
    and every reader lost that version. It goes on a line of its own now."""
    from asyncsync import Publisher
    from tests.conftest import mixed_state, mutate

    root = tmp_path / "root"
    async with Publisher(root, keyframe_interval=0) as pub:
        await pub.seed(mixed_state(0))
        with (root / LOG_NAME).open("ab") as f:
            f.write(b'{"version": 1, "kind": "del')  # torn mid-append
        await pub.publish(mutate(mixed_state(0), 0.03, seed=1))
    assert [r["version"] for r in read_log(root)] == [0, 1]
    assert (root / LOG_NAME).read_bytes().endswith(b"}\n")


async def test_tail_f_prints_an_ack_after_its_versions_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """(helper-32, helper-33) A receiver may ack a version before the publisher appends its log
    line, and `tail -f` polled acks apart from the log: it printed ``ack engine=e1 version=1``
    before the line of v1. An ack now waits for its version's line; one whose line is shown
    is printed at once."""
    from asyncsync import Publisher
    from asyncsync.ops.cli import versions
    from receiver import ReceiverAgent
    from receiver.engines import LocalCheckpoint

    root = tmp_path / "root"
    async with Publisher(root) as pub:
        await pub.seed({"w": torch.zeros(4)})
        async with ReceiverAgent(root, LocalCheckpoint(tmp_path / "c0"), "e0") as agent:
            assert await agent.sync_once() == 0
        await pub.publish({"w": torch.ones(4)})
    log = root / LOG_NAME
    v0, v1 = log.read_bytes().splitlines(keepends=True)
    log.write_bytes(v0)  # v1 is committed, its log line not appended yet
    async with ReceiverAgent(root, LocalCheckpoint(tmp_path / "c1"), "e1") as agent:
        assert await agent.sync_once() == 1
    polls = [0]
    real = versions.read_acks

    def counted(r: Path) -> Any:
        polls[0] += 1
        return real(r)

    monkeypatch.setattr(versions, "read_acks", counted)
    out: list[str] = []

    def printed() -> list[str]:
        out.append(capsys.readouterr().out)
        return [line.split("  ")[0] for line in "".join(out).splitlines()]

    task = asyncio.create_task(versions._follow(root, 0.01, lambda message: None))
    try:
        await eventually(lambda: printed() and polls[0] >= 3, "v0's line and a few ack polls")
        assert printed() == ["v0", "ack engine=e0 version=0"]  # e1's ack waits for v1's line
        with open(log, "ab") as f:
            f.write(v1)
        await eventually(lambda: len(printed()) == 4, "v1's line and e1's ack")
        await asyncio.sleep(0.05)  # a few more polls
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert printed() == ["v0", "ack engine=e0 version=0", "v1", "ack engine=e1 version=1"]


@pytest.mark.parametrize("value", [float("nan"), -1, True, 10**400, 1e300, float("inf"), 0, "5"],
                         ids=shown)  # fmt: skip
def test_follow_log_refuses_a_poll_interval_no_wait_can_take_at_the_call(
    tmp_path: Path, value: Any
) -> None:
    """The interval reached ``asyncio.sleep`` after the first poll, unchecked (10**400
    overflowed there, nan slept for ever, 0 spun on the log): refused as the call is made,
    not when the generator is first iterated."""
    with pytest.raises(ConfigError, match="follow_log: poll_interval"):
        follow_log(tmp_path, poll_interval=value)


@pytest.mark.parametrize("then", ["new log", "no log yet"])
async def test_lines_appended_just_before_a_rotation_are_shown(tmp_path: Path, then: str) -> None:
    """(attack-42) A line appended to the log, then the log renamed away (logrotate, an
    operator's ``mv``) before the follower's next poll: ``tail -f`` followed the path and
    never read the rest of the file it was reading; that version was never printed. The file
    read is held now, and read to its end once its path names another file or none."""
    root = tmp_path / "root"
    root.mkdir()
    log = root / LOG_NAME
    log.write_bytes(_lines("r", range(2)))
    got: list[int] = []

    async def follow() -> None:
        async for r in follow_log(root, poll_interval=0.5):
            got.append(r["version"])
            if len(got) == 4:
                return

    task = asyncio.create_task(follow())
    await eventually(lambda: len(got) == 2, "the first two lines")
    with open(log, "ab") as f:  # between two polls: the append, then the rotation
        f.write(_lines("r", range(2, 3)))
    log.rename(root / f"{LOG_NAME}.1")
    if then == "no log yet":
        await asyncio.sleep(1.2)  # polls find no log: the held file is read meanwhile
        assert got == [0, 1, 2]
    log.write_bytes(_lines("r", range(3, 4)))  # the publisher's next line, a new file
    await asyncio.wait_for(task, 10)
    assert got == [0, 1, 2, 3]


async def test_a_flood_of_lines_that_are_no_records_is_said_in_21_lines(tmp_path: Path) -> None:
    """(helper-64) 3 MB of random bytes appended to the log gave `tail` and `tail -f` ~11,000
    "skipped a line" notices on stderr, one per line. Each read says the first
    MAX_SKIP_NOTICES now, then one line with how many more it skipped."""
    import random

    cap = log_module.MAX_SKIP_NOTICES
    junk = b"".join(b"junk %d\n" % i for i in range(1000))
    (tmp_path / LOG_NAME).write_bytes(_lines("run", range(1)) + junk + _lines("run", range(1, 2)))
    said = [f"{LOG_NAME}: skipped a line that is not a log record: b'junk {i}'" for i in range(cap)]
    more = f"{LOG_NAME}: and {1000 - cap} more lines skipped (no log records, or too long)"
    notices: list[str] = []
    assert [r["version"] for r in read_log(tmp_path, notice=notices.append)] == [0, 1]
    assert notices == [*said, more], notices[cap:]
    followed: list[str] = []

    async def follow() -> None:
        async for _ in follow_log(tmp_path, poll_interval=0.01, notice=followed.append):
            pass

    task = asyncio.create_task(follow())
    try:
        await eventually(lambda: len(followed) > cap, "the poll's summary line")
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert followed == [*said, more], followed[cap:]
    with open(tmp_path / LOG_NAME, "ab") as f:
        f.write(random.Random(64).randbytes(3 << 20))  # the reported case
    notices.clear()
    read_log(tmp_path, notice=notices.append)
    assert len(notices) == cap + 1 and "more lines skipped" in notices[-1], notices[cap:]
