"""Signals an operator sends to the command-line tools (attack-42): an interrupted ``--once``
says so in its exit status."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from asyncsync import Publisher
from receiver import cli as receiver_cli
from tests.conftest import mixed_state


async def _interrupted(_args: object) -> int | None:
    raise KeyboardInterrupt  # what asyncio.run raises on a Ctrl-C inside the sync


def test_an_interrupted_once_is_not_a_success(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Ctrl-C (SIGINT) during ``--once`` ended it with status 0 and nothing on stdout or
    stderr: "0: --once done" to a script (``asyncsync-receiver --once && start-engine``),
    while the checkpoint held an older version, a version in flight left to undo. It is status
    130 now, with one line saying the sync was interrupted."""

    async def seed() -> None:
        async with Publisher(tmp_path / "root") as pub:
            await pub.seed(mixed_state(0))

    asyncio.run(seed())
    monkeypatch.setattr(receiver_cli, "_once", _interrupted)
    status = receiver_cli.main(
        ["--root", str(tmp_path / "root"), "--engine-id", "e1",
         "--checkpoint", str(tmp_path / "c"), "--once"]
    )  # fmt: skip
    out, err = capsys.readouterr()
    assert status == 130, (status, out, err)
    assert out == ""
    assert "interrupted" in err and len(err.strip().splitlines()) == 1, err
