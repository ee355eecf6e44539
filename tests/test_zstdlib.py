"""zstd frames through the system's libzstd (asyncsync.codec.zstdlib): ordinary frames any reader
decodes, one context per thread, and None (python-zstandard's frames) where it cannot be used."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import zstandard

from asyncsync.codec import delta, zstdlib

Z = zstdlib
VALUES = delta._VALUES_LIBZSTD


def _lib_or_skip() -> None:
    if zstdlib.library() is None:
        pytest.skip("no libzstd.so.1 here")


def _data(n: int, seed: int) -> bytes:
    """Byte planes like a delta's: a noisy low plane, a mostly-zero high plane."""
    rng = np.random.default_rng(seed)
    low = rng.geometric(0.6, n).astype(np.uint8)
    high = (rng.random(n) < 0.01).astype(np.uint8)
    return low.tobytes() + high.tobytes()


@pytest.mark.parametrize("n", [0, 1, 4096, 100_000, 3 << 20])
def test_frames_declare_their_size_and_decode_with_any_reader(n: int) -> None:
    _lib_or_skip()
    compress = zstdlib.compressor(VALUES)
    assert compress is not None
    data = _data(n, n)
    for src in (data, memoryview(bytearray(data))):
        frame = compress(src)
        assert zstandard.frame_content_size(frame) == len(data)
        out = zstandard.ZstdDecompressor().decompress(frame, allow_extra_data=False) if n else b""
        assert out == data
        assert delta._unzstd(frame, (len(data),), "values") == data  # the receiver's check
    if n >= 4096:
        assert len(compress(data)) < 0.5 * len(data)  # literals Huffman-coded


def test_a_parameter_libzstd_refuses_gives_none() -> None:
    _lib_or_skip()
    assert zstdlib.compressor({Z.HASH_LOG: 99}) is None
    assert zstdlib.compressor({Z.HASH_LOG: 99}) is None  # (remembered, not retried)
    assert zstdlib.compressor(VALUES) is not None


def test_each_thread_has_its_own_context() -> None:
    """Eight threads compressing at once (a ZSTD_CCtx is not thread-safe): every frame is the
    one a single thread makes of the same bytes."""
    _lib_or_skip()
    inputs = [_data(200_000, s) for s in range(8)]
    compress = zstdlib.compressor(VALUES)
    assert compress is not None
    want = [compress(d) for d in inputs]

    def work(k: int) -> list[bytes]:
        c = zstdlib.compressor(VALUES)
        assert c is not None and c is not compress  # (another thread's context)
        return [c(inputs[k]) for _ in range(20)]

    with ThreadPoolExecutor(8) as pool:  # (an error in a thread is raised by the map)
        got = list(pool.map(work, range(8)))
    assert all(frames == [want[k]] * 20 for k, frames in enumerate(got))


def test_switched_off_or_missing_the_values_use_python_zstandard(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    code = "from asyncsync.codec import zstdlib; print(zstdlib.library() is None)"
    env = {**os.environ, "ASYNCSYNC_LIBZSTD": "0"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.stdout.strip() == "True", out.stderr
    monkeypatch.setattr(zstdlib, "library", lambda: None)
    assert zstdlib.compressor(VALUES) is None
    data = _data(50_000, 1)
    ref = zstandard.ZstdCompressor(
        compression_params=zstandard.ZstdCompressionParameters.from_level(1, **delta._VALUES_LEVEL1)
    ).compress(data)
    assert delta._zstd(data, 1, values=True) == ref


def test_a_context_whose_frames_do_not_read_back_is_not_used(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each context is checked on a probe when made: a libzstd that took the experimental
    literal-mode number for another parameter (a magicless frame, a frame without its size)
    would make shards no receiver accepts; such a context is dropped, python-zstandard kept."""
    _lib_or_skip()
    params = {**VALUES, Z.HASH_LOG: 7}  # (a parameter set no other test made a context of)
    real = zstdlib._Context.compress
    for bad in (lambda self, data: real(self, data)[4:], lambda self, data: real(self, data[1:])):
        monkeypatch.setattr(zstdlib._Context, "compress", bad)
        monkeypatch.setattr(zstdlib, "_local", threading.local())
        assert zstdlib.compressor(params) is None
    monkeypatch.setattr(zstdlib._Context, "compress", real)
    monkeypatch.setattr(zstdlib, "_local", threading.local())
    assert zstdlib.compressor(params) is not None


@pytest.mark.parametrize("n", [1, 4096, 300_000, 3 << 20])
def test_decompress_into_reads_exactly_one_frame_into_the_callers_buffer(n: int) -> None:
    """The decode's large values: one frame (any writer's) into a buffer the caller gives (the
    scratch pool's); a byte after the frame, a damaged frame, another size or a read-only
    output refused with ValueError, the output then not to be used."""
    _lib_or_skip()
    into = zstdlib.decompressor()
    assert into is not None
    data = _data(n, n)
    for frame in (
        zstandard.ZstdCompressor(level=3).compress(data),
        zstdlib.compressor(VALUES)(data),  # type: ignore[misc]
    ):
        out = np.empty(len(data), np.uint8)
        into(memoryview(frame), out)
        assert out.tobytes() == data
        bad: list[tuple[bytes, Any]] = [
            (frame + b"\0", np.empty(len(data), np.uint8)),  # a byte after the frame
            (frame + frame, np.empty(len(data), np.uint8)),  # a second frame
            (frame[:-3], np.empty(len(data), np.uint8)),  # cut short
            (frame, np.empty(len(data) + 1, np.uint8)),  # another size
            (frame, np.empty(len(data), np.uint8)[::-1]),  # not C-contiguous
        ]
        ro = np.empty(len(data), np.uint8)
        ro.flags.writeable = False
        bad.append((frame, ro))
        for blob, dst in bad:  # (len(data) >= 2: two planes)
            with pytest.raises(ValueError):
                into(blob, dst)


def test_large_values_decode_into_the_scratch_pool_as_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``delta._unzstd`` from the pool's smallest buffer up: through libzstd into a pooled
    buffer, the same bytes and the same FormatErrors as python-zstandard's path gives."""
    from asyncsync.codec import scratch
    from asyncsync.errors import FormatError

    _lib_or_skip()
    data = _data(scratch.MIN_BYTES, 7)  # two planes: 2x the pool's smallest buffer
    frame = zstandard.ZstdCompressor(level=3).compress(data)
    got = delta._unzstd(frame, (len(data),), "values")
    assert type(got) is memoryview and got == data
    for blob in (frame + b"\0", frame[:-3], frame + frame):
        with pytest.raises(FormatError, match="values"):
            delta._unzstd(blob, (len(data),), "values")
    monkeypatch.setattr(zstdlib, "decompressor", lambda: None)  # python-zstandard's path
    assert delta._unzstd(frame, (len(data),), "values") == data
    for blob in (frame + b"\0", frame[:-3]):
        with pytest.raises(FormatError, match="values"):
            delta._unzstd(blob, (len(data),), "values")
