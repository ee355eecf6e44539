"""The ``asyncsync-receiver`` console script.

The receiver's modules take a second or more to import (torch). A stop signal meanwhile
(Ctrl-C, SIGTERM, SIGHUP unless ignored: nohup) is held until they are imported (blocked: a
KeyboardInterrupt inside an extension module's import leaves it half made, and the next import
of it fails with an ImportError traceback; SIGTERM or SIGHUP killed the process silently,
status 143 or 129), and ``receiver.cli`` keeps it held until its own handlers are installed:
then it stops the receiver as one after start-up does (one line, "stopped before it started",
status 0; ``--once``: interrupted, 130 for Ctrl-C). This module imports nothing heavy itself,
and ``receiver`` imports its re-exports on first use.
"""

from __future__ import annotations

import signal

__all__ = ["main", "stop_signals"]


def stop_signals() -> set[signal.Signals]:
    """The signals that stop a running receiver: SIGINT, SIGTERM, and SIGHUP unless ignored
    (``nohup`` asked for it to be: left so)."""
    sigs = {signal.SIGINT, signal.SIGTERM}
    hangup: signal.Signals | None = getattr(signal, "SIGHUP", None)
    if hangup is not None and signal.getsignal(hangup) is not signal.SIG_IGN:
        sigs.add(hangup)  # the terminal closed, a supervisor's hang-up: a stop
    return sigs


def main() -> int:
    held = signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals())
    try:
        from receiver.cli import main as run

        return run()  # (it unblocks them once its handlers are installed)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
