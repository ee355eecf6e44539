"""``python -m asyncsync ...``: the same operator CLI as the ``asyncsync`` console script."""

from __future__ import annotations

import sys

from asyncsync.ops.cli import main

if __name__ == "__main__":
    sys.exit(main())
