"""The ``asyncsync-receiver`` console script.

The receiver's modules take a second or more to import (torch): a Ctrl-C meanwhile stops it
quietly (status 0, as after its signal handlers are installed), not with an import traceback.
This module imports nothing itself, and ``receiver`` imports its re-exports on first use.
"""

from __future__ import annotations


def main() -> int:
    try:
        from receiver.cli import main as run

        return run()
    except KeyboardInterrupt:  # before receiver.cli installed its handlers
        return 0
