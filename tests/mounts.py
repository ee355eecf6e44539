"""Real FUSE mounts for tests: two ``rclone mount`` views of one directory.

rclone, like gcsfuse and s3fs, has no ``link()`` and no create or rename that excludes across
mounts. The mounts need root, ``/dev/fuse``, rclone and fuse3 (``.ci/run`` installs them); a
test skips with the reason when any is missing or the mount fails.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

# A short directory cache and write-back delay: a file written through one mount shows in the
# other within about 1 s (measured; at most write-back + dir cache + attr cache, 3 s). The
# defaults (a 5 min directory cache) hide every version and lease from the other mount for
# minutes. Not `--vfs-write-back 0s`: rclone 1.60 then starts the upload at close and loses a
# file renamed right after (every atomic write): "corrupted on transfer", never uploaded.
RCLONE_FLAGS = ("--vfs-cache-mode", "writes", "--dir-cache-time", "1s", "--vfs-write-back", "1s")
RCLONE_SETTLE = 4.0  # the lease settle for those mounts: above their 3 s visibility bound


def why_no_fuse(tool: str) -> str | None:
    if os.geteuid() != 0:
        return "needs root to mount"
    if not shutil.which(tool):
        package = "fuse3" if tool == "fusermount3" else tool
        return f"{tool} is not installed (.ci/run installs {package})"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    return None


@contextlib.contextmanager
def rclone_mounts(src: Path, *dsts: Path) -> Iterator[tuple[Path, ...]]:
    """Mount ``src`` at each of ``dsts`` with rclone (a local remote, ``RCLONE_FLAGS``)."""
    why = why_no_fuse("rclone") or why_no_fuse("fusermount3")  # mounts and unmounts with it
    if why:
        pytest.skip(why)
    src.mkdir(parents=True, exist_ok=True)
    mounted: list[Path] = []
    try:
        for i, dst in enumerate(dsts):
            dst.mkdir(parents=True, exist_ok=True)
            cache = src.parent / f".rclone-cache-{dst.name}-{i}"
            r = subprocess.run(
                ["rclone", "mount", str(src), str(dst), *RCLONE_FLAGS, "--cache-dir", str(cache),
                 "--daemon", "--log-level", "ERROR"],
                capture_output=True, text=True, timeout=60, env={**os.environ, "RCLONE_CONFIG": ""},
            )  # fmt: skip
            if r.returncode or not os.path.ismount(dst):
                pytest.skip(f"rclone mount failed: {r.stderr.strip() or r.returncode}")
            mounted.append(dst)
        yield dsts
    finally:
        for dst in mounted:
            if subprocess.run(["fusermount3", "-u", str(dst)], capture_output=True).returncode:
                subprocess.run(["umount", "-l", str(dst)], check=False, capture_output=True)
        deadline = time.monotonic() + 10
        while any(os.path.ismount(d) for d in mounted) and time.monotonic() < deadline:
            time.sleep(0.1)
