"""Another process taking memory while a real SGLang server starts: what a bench or a second
test beside the server does on a shared host.

``python -m tests.sglang_env.memhog PREFIX NBYTES``: waits until the server (started with the
test fault plugin and ``ASYNCSYNC_TEST_HOLD_AFTER_BASELINE=PREFIX``) has taken its memory
baseline (``PREFIX.baseline``), allocates and touches NBYTES, lets the server go on
(``PREFIX.go``), holds the memory until ``PREFIX.release`` exists, then frees it and exits.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

PAGE = 4096
TIMEOUT = 600.0


def wait_file(path: Path) -> None:
    end = time.monotonic() + TIMEOUT
    while not path.exists():
        if time.monotonic() > end:
            raise SystemExit(f"memhog: {path} did not appear within {TIMEOUT:g}s")
        time.sleep(0.05)


def main(argv: list[str]) -> int:
    prefix, nbytes = argv[0], int(argv[1])
    wait_file(Path(prefix + ".baseline"))
    hog = bytearray(nbytes)  # zeroed lazily by the kernel: each page is written below
    hog[::PAGE] = b"\x01" * len(range(0, nbytes, PAGE))
    print(f"memhog: holding {nbytes} bytes", flush=True)
    Path(prefix + ".go").touch()
    wait_file(Path(prefix + ".release"))
    del hog
    print("memhog: released", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
