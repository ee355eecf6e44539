"""The manifest log: ``ROOT/log.jsonl``, one JSON line per committed version, append-only.

It is for operators (``asyncsync tail -f``); receivers never depend on it. A line is appended
after the manifest is durable, so the log may lag a crash by one version but never lists a
version that is not committed. Lines that do not parse (a torn last line after a crash) are
skipped by readers.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiofiles

from asyncsync.format import LOG_NAME, Manifest
from asyncsync.fsio import append_line

__all__ = ["append_manifest", "follow_log", "read_log"]

logger = logging.getLogger(__name__)


def append_manifest(root: Path, manifest: Manifest) -> None:
    append_line(root / LOG_NAME, json.dumps(manifest.log_record(), allow_nan=False))


def _parse_lines(lines: list[str]) -> Iterator[dict[str, Any]]:
    for line in lines:
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            logger.debug("skipping unreadable log line %r", line[:80])
            continue
        if isinstance(rec, dict):
            yield rec


def read_log(root: Path) -> list[dict[str, Any]]:
    try:
        text = (root / LOG_NAME).read_text()
    except FileNotFoundError:
        return []
    return list(_parse_lines(text.splitlines()))


async def follow_log(
    root: Path, *, poll_interval: float = 0.5, from_start: bool = True
) -> AsyncIterator[dict[str, Any]]:
    """Yield log records as they are appended (polling: works on NFS and FUSE too)."""
    path = root / LOG_NAME
    offset = 0
    buf = b""
    if not from_start and path.exists():
        offset = path.stat().st_size
    while True:
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            size = 0
        if size < offset:  # the log was replaced: start over
            offset, buf = 0, b""
        if size > offset:
            async with aiofiles.open(path, "rb") as f:
                await f.seek(offset)
                chunk = await f.read(size - offset)
            offset += len(chunk)
            buf += chunk
            *complete, buf = buf.split(b"\n")
            lines = [line.decode("utf-8", errors="replace") for line in complete]
            for rec in _parse_lines(lines):
                yield rec
        await asyncio.sleep(poll_interval)
