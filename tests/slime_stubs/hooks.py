"""slime pre-push / post-write hooks for the tests: ``hook(args, version_dir, rollout_engines)``.

Each call appends ``{"pid", "version_dir", "committed", "engines"}`` to the JSON-lines file
``args.hook_log`` (``committed``: whether the version's manifest existed when it ran).
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
        "committed": os.path.exists(os.path.join(version_dir, "manifest.json")),
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
