"""Take the server lock of ``URL`` and hold it until stdin closes or gives a line:
``main([URL, CHECKPOINT])`` prints ``took``, ``refused: <the error>`` (held) or ``error: <it>``
(tests/test_server_lock.py, run under another uid by tests/as_user.py)."""

from __future__ import annotations

import sys

from yarl import URL

from asyncsync.errors import ConfigError, LockHeld
from receiver.engines.server_lock import ServerLock


def main(args: list[str]) -> int:
    try:
        lock = ServerLock.take("sglang", URL(args[0]), args[1])
    except LockHeld as exc:
        print(f"refused: {exc}", flush=True)
        return 1
    except ConfigError as exc:
        print(f"error: {exc}", flush=True)
        return 1
    print("took", flush=True)
    sys.stdin.readline()
    lock.release()
    return 0
