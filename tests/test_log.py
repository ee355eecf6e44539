"""The manifest log: appended lines are followed as they land; torn lines wait to be whole."""

from __future__ import annotations

import asyncio
from pathlib import Path

from asyncsync.format import LOG_NAME
from asyncsync.format.log import follow_log, read_log


async def test_follow_sees_appends_and_waits_for_whole_lines(tmp_path: Path) -> None:
    log = tmp_path / LOG_NAME
    log.write_bytes(b'{"version": 0}\n{"version": 1, "note": "\xc3\xa9t\xc3\xa9"}\n')
    got: list[dict[str, object]] = []

    async def follow() -> None:
        async for rec in follow_log(tmp_path, poll_interval=0.01):
            got.append(rec)
            if len(got) == 4:
                return

    task = asyncio.create_task(follow())
    await asyncio.sleep(0.05)
    with open(log, "ab") as f:
        f.write(b'{"version": 2')  # a torn line: not yielded until its newline lands
        f.flush()
        await asyncio.sleep(0.05)
        assert [r["version"] for r in got] == [0, 1]
        f.write(b'}\nnot json\n{"version": 3}\n')
    await asyncio.wait_for(task, 5)
    assert [r["version"] for r in got] == [0, 1, 2, 3]
    assert got[1]["note"] == "été"
    assert [r["version"] for r in read_log(tmp_path)] == [0, 1, 2, 3]
