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
