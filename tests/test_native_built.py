"""The C kernels are built, and built from this source.

The extension is optional (a platform without a compiler falls back to the byte-identical NumPy
paths), so a compile that fails is silent: without this check a broken ``_native.c`` would
pass CI on the fallback (the kernel tests skip), and an edited one would be tested through the
build of the file before the edit. ``ASYNCSYNC_NATIVE=0`` (the fallback on purpose) or
``ASYNCSYNC_ALLOW_NO_NATIVE=1`` (a platform without a compiler) skip it.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

import asyncsync.codec

REBUILD = "`.venv/bin/pip install -v -e . --no-deps --no-build-isolation` shows the compiler"


def test_the_c_kernels_are_built_from_this_source() -> None:
    if os.environ.get("ASYNCSYNC_NATIVE", "1").strip() == "0":
        pytest.skip("ASYNCSYNC_NATIVE=0: the NumPy fallback on purpose")
    if os.environ.get("ASYNCSYNC_ALLOW_NO_NATIVE") == "1":
        pytest.skip("ASYNCSYNC_ALLOW_NO_NATIVE=1")
    spec = importlib.util.find_spec("asyncsync.codec._native")
    assert spec is not None and spec.origin, f"asyncsync.codec._native did not build: {REBUILD}"
    here = Path(asyncsync.codec.__file__).parent
    built = os.path.getmtime(spec.origin)
    for source in ("_native.c", "xxhash.h"):
        assert built >= os.path.getmtime(here / source), (
            f"{spec.origin} is older than {source}: a stale build (the last compile failed, or "
            f"none ran since the edit); {REBUILD}"
        )
    from asyncsync.codec import native

    assert native.kernels is not None, "built, but it does not import"
