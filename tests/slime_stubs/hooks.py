"""slime pre-push / post-write hooks for the tests: ``hook(args, version_dir, rollout_engines)``.

Each call appends ``{"pid", "version_dir", "committed", "files", "engines"}`` to the JSON-lines
file ``args.hook_log`` (``committed``: whether the directory's last file, asyncsync's
``manifest.json`` or slime's ``model.safetensors.index.json``, existed when it ran).
:func:`pre_read` is gen2a's read-side hook ``hook(disk_dir, target_version)``.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import threading
import time
from typing import Any


def record(args: Any, version_dir: str, rollout_engines: list[Any]) -> None:
    line = {
        "pid": os.getpid(),
        "version_dir": os.path.basename(version_dir),
        "committed": any(
            os.path.exists(os.path.join(version_dir, last))
            for last in ("manifest.json", "model.safetensors.index.json")
        ),
        "files": sorted(os.listdir(version_dir)) if os.path.isdir(version_dir) else [],
        "engines": len(rollout_engines),
    }
    with open(args.hook_log, "a") as f:
        f.write(json.dumps(line) + "\n")


def deferred(
    args: Any, version_dir: str, rollout_engines: list[Any]
) -> concurrent.futures.Future[None]:
    """Returns a Future that a thread resolves later (slime gen1 lets a hook do that)."""
    fut: concurrent.futures.Future[None] = concurrent.futures.Future()

    def finish() -> None:
        time.sleep(0.2)
        record(args, version_dir, rollout_engines)
        fut.set_result(None)

    threading.Thread(target=finish, daemon=True).start()
    return fut


def pre_read(disk_dir: str, target_version: int) -> None:
    """gen2a's ``--custom-delta-pre-read-path`` hook: appends to ``<disk_dir>.pre_read.jsonl``."""
    with open(disk_dir.rstrip("/") + ".pre_read.jsonl", "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "target_version": target_version}) + "\n")
