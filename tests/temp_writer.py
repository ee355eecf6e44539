"""A writer held in the middle of an atomic write, for the tests of left temp files.

``python -m tests.temp_writer PATH SKEW``: writes ``PATH`` with :func:`asyncsync.fsio.atomic_write`.
Once its temp file is open it dates it ``SKEW`` seconds off this host's clock (negative: its
clock runs behind), as an object-store mount (rclone, s3fs, gcsfuse) keeps a writer's mtimes
(``os.utime``, which rclone keeps), prints ``writing TEMP`` and waits for a line on stdin; then
writes ``PATH``'s name as its content, renames and prints ``done``, or ``failed ERROR``.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from asyncsync.fsio import atomic_write


def _data(path: Path, skew: float) -> Iterator[bytes]:
    prefix = f".tmp.{path.name}."  # atomic_write's temp: .tmp.<name>.<12 hex>
    (temp,) = (p for p in path.parent.iterdir() if p.name.startswith(prefix))
    t = time.time() + skew
    os.utime(temp, (t, t))
    print("writing", temp.name, flush=True)
    sys.stdin.readline()
    yield path.name.encode()


def main() -> int:
    path, skew = Path(sys.argv[1]), float(sys.argv[2])
    try:
        atomic_write(path, _data(path, skew))
    except OSError as exc:
        print("failed", exc, flush=True)
    else:
        print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
