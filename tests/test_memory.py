"""Large freed buffers go back to the OS: glibc's mmap threshold is fixed once per process."""

from __future__ import annotations

import subprocess
import sys

import pytest

CHECK = """
import ctypes, sys
from asyncsync import memory
ok = memory.release_large_buffers()
print(ok, memory.release_large_buffers())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_threshold_is_set_once_and_can_be_disabled() -> None:
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True"]  # applied, then idempotent
    env = {"ASYNCSYNC_MALLOPT": "0", "PATH": ""}
    out = subprocess.run(
        [sys.executable, "-c", CHECK], capture_output=True, text=True, check=True, env=env
    )
    assert out.stdout.split() == ["False", "False"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
@pytest.mark.parametrize(("setting", "retained_mib"), [("1", (0, 1)), ("0", (6, 9))])
def test_freed_buffers_leave_rss_only_with_the_fix(
    setting: str, retained_mib: tuple[int, int]
) -> None:
    """glibc's dynamic threshold keeps a freed 8 MiB buffer resident; the fixed one does not.
    (A range: the interpreter's own pages move RSS by a few hundred KiB either way.)"""
    script = """
import numpy as np
from asyncsync import memory
memory.release_large_buffers()
def rss():
    return int(open('/proc/self/statm').read().split()[1]) * 4096
base = rss()
for _ in range(3):
    a = np.ones(8 << 20, dtype=np.uint8); del a
print((rss() - base) >> 20)
"""
    env = {"ASYNCSYNC_MALLOPT": setting, "PATH": ""}
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, env=env
    )
    lo, hi = retained_mib
    assert lo <= int(out.stdout.strip()) <= hi


def test_freeze_startup_objects_takes_them_out_of_later_collections() -> None:
    """After it, a full collection walks only what was made since (in a child: freezing the
    test process would hide its objects from the tests that look for leaks)."""
    code = """
import gc
import torch
from asyncsync import memory
assert gc.get_freeze_count() == 0
memory.freeze_startup_objects()
frozen = gc.get_freeze_count()
assert frozen > 10_000, frozen
assert sum(gc.get_count()) < 1000
cycle = []  # made afterwards: collected as before
cycle.append(cycle); del cycle
assert gc.collect() >= 1
print("ok", frozen)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok")
