"""The record of what a reloading engine's server holds:
``<checkpoint>/.asyncsync/engine-<kind>.json`` (host-local, not shared; see
:mod:`receiver.engines.reloading`)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from asyncsync import fsio
from asyncsync.errors import EngineStateError
from receiver.engines.base import EngineState

__all__ = ["RECORD_FORMAT", "read_record", "record_of", "write_record"]

RECORD_FORMAT = "asyncsync-server-state"


def record_of(kind: str, url: str, model_path: str, s: EngineState) -> dict[str, Any]:
    """The record of a server at ``url`` (loading ``model_path``) holding ``s``."""
    return {
        "format": RECORD_FORMAT,
        "format_version": 1,
        "engine": kind,
        "url": url,
        "model_path": model_path,
        "version": s.version,
        "run_id": s.run_id,
        "fingerprint": s.fingerprint,
    }


def read_record(path: Path) -> dict[str, Any] | None:
    """The record at ``path`` without its ``updated_at``; None when missing or not an object."""
    try:
        d = json.loads(fsio.read_bytes(path, limit=1 << 20))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise EngineStateError(
            f"cannot read {path}: {exc}; remove it (the receiver then reloads "
            "the checkpoint into the server once)"
        ) from exc
    if not isinstance(d, dict):
        return None
    d.pop("updated_at", None)
    return d


def write_record(path: Path, record: dict[str, Any]) -> None:
    """Replace the record at ``path`` atomically, stamped with ``updated_at``."""
    data = json.dumps({**record, "updated_at": time.time()}, indent=1) + "\n"
    fsio.atomic_write(path, data.encode())
