"""The ``asyncsync-receiver`` console script.

The receiver's modules take a second or more to import (torch). A Ctrl-C meanwhile is held
until they are imported (SIGINT blocked: a KeyboardInterrupt inside an extension module's
import leaves it half made, and the next import of it fails with an ImportError traceback),
then stops the receiver quietly (status 0, as after its own signal handlers are installed).
This module imports nothing heavy itself, and ``receiver`` imports its re-exports on first use.
"""

from __future__ import annotations

import signal


def main() -> int:
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        from receiver.cli import main as run
    finally:
        interrupted = signal.SIGINT in signal.sigpending()
        if not interrupted:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
    if interrupted:  # (it stays pending, blocked, while the process exits)
        return 0
    try:
        return run()
    except KeyboardInterrupt:  # before receiver.cli installed its handlers
        return 0
