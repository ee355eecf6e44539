"""Structured logs: --log-format json gives one JSON object per record."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from asyncsync import Publisher
from asyncsync.console.logsetup import JsonFormatter, setup_logging
from asyncsync.ops.cli import main
from tests.conftest import mixed_state, mutate


def test_json_formatter_keeps_extra_fields_and_exceptions() -> None:
    rec = logging.LogRecord("asyncsync.x", logging.ERROR, __file__, 1, "v%d failed", (7,), None)
    rec.engine_id = "gpu0"
    try:
        raise ValueError("boom")
    except ValueError:
        import sys

        rec.exc_info = sys.exc_info()
    doc = json.loads(JsonFormatter().format(rec))
    assert doc["msg"] == "v7 failed" and doc["level"] == "ERROR" and doc["engine_id"] == "gpu0"
    assert "ValueError: boom" in doc["exc"] and doc["ts"].endswith("Z")


async def test_cli_log_format_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sd = mixed_state(0)
    async with Publisher(tmp_path, keyframe_interval=2) as pub:
        await pub.seed(sd)
        for i in range(1, 5):
            await pub.publish(mutate(sd, 0.02, seed=i))
    capsys.readouterr()
    argv = [
        "gc",
        str(tmp_path),
        "--keep-versions",
        "1",
        "--log-format",
        "json",
        "--log-level",
        "INFO",
    ]
    assert main(argv) == 0
    records = [json.loads(line) for line in capsys.readouterr().err.strip().splitlines()]
    assert any(
        r["logger"] == "asyncsync.publish.retention" and "deleted" in r["msg"] for r in records
    )
    with pytest.raises(ValueError):
        setup_logging("INFO", "xml")
    setup_logging("WARNING", "text")


def test_the_text_log_escapes_control_characters_in_paths(tmp_path: Path) -> None:
    """(fix-47) The text log printed a path's control characters raw: an escape sequence in a
    checkpoint's directory name reached the operator's terminal from the INFO lines ("open
    at version", "committed"), and a newline in it forged a log line. Every line of the text
    log is escaped as a command's error line is (``\\x1b``, ``\\n``), once: a message already
    escaped is left as it is. So is the path ``--once`` prints on stdout."""
    import asyncio
    import subprocess
    import sys

    weird = "c\x1b[31mRED\nX"
    root = tmp_path / f"root{weird}"

    async def seed() -> None:
        async with Publisher(root) as pub:
            await pub.seed(mixed_state(0))

    asyncio.run(seed())
    argv = [sys.executable, "-m", "receiver.cli", "--root", str(root), "--engine-id", "e1",
            "--checkpoint", str(tmp_path / weird), "--once", "--log-level", "INFO"]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "\x1b" not in proc.stderr, proc.stderr
    lines = proc.stderr.splitlines()
    assert lines and all(line[:2] == "20" for line in lines), lines  # each a record's own
    assert f"{tmp_path}/c\\x1b[31mRED\\nX: committed full v0" in proc.stderr, proc.stderr
    assert "\\\\x1b" not in proc.stderr  # escaped once
    empty = tmp_path / f"empty{weird}"
    empty.mkdir()
    argv[4] = str(empty)
    argv[8] = str(tmp_path / "c2")
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert "\x1b" not in proc.stdout + proc.stderr, (proc.stdout, proc.stderr)
    from asyncsync.console.logsetup import printable

    for s in (weird, "a\u2028b\u202ec\x7f\x9b", "plain", "\\x1b already"):
        assert printable(printable(s)) == printable(s)  # idempotent: never escaped twice
    assert printable("a\u2028b\u202e\x9b\tz") == "a\\u2028b\\u202e\\x9b\\tz"
