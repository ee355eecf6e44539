"""zstd frames through the system's libzstd (``ctypes``): parameters python-zstandard leaves out.

The sparse xef values (byte planes of XORs, :mod:`asyncsync.codec.delta`) are mostly noise
that Huffman codes well and a match finder rarely matches: zstd's "fast" strategy with a
``targetLength`` (its acceleration: a step that grows while no match is found) skips most of
that search, but zstd then also stops Huffman-coding the literals, unless its literal
compression mode is set to compress them (``ZSTD_c_literalCompressionMode``, an experimental
parameter since zstd 1.4.0 that python-zstandard 0.25 does not expose). With both, the
bench's values at level 1 come out as small as today's frames in 1.5x less CPU, and decode
~1.25x faster (BENCHMARKS.md, thirty-fourth session).

The frames are ordinary zstd frames that declare their content size: any zstd reader decodes
them (FORMAT.md 4.2 asks no level or parameter). Where ``libzstd.so.1`` cannot be loaded, is
older than 1.4.0 or refuses a parameter, :func:`compressor` gives None and the caller keeps
python-zstandard's frames; ``ASYNCSYNC_LIBZSTD=0`` does the same on purpose. A context per
thread and parameter set (a ``ZSTD_CCtx`` is not thread-safe), each checked when made on a
probe that python-zstandard must read back (a later libzstd that numbered its experimental
parameter otherwise is then not used); the call releases the GIL.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import zstandard

from asyncsync.codec import scratch

__all__ = ["COMPRESSION_LEVEL", "HASH_LOG", "LITERAL_MODE", "MIN_MATCH", "TARGET_LENGTH",
           "compressor", "decompressor", "library"]  # fmt: skip

logger = logging.getLogger(__name__)

# ZSTD_cParameter values (zstd.h; stable since 1.4.0)
COMPRESSION_LEVEL, HASH_LOG, MIN_MATCH, TARGET_LENGTH = 100, 102, 105, 106
#: ZSTD_c_literalCompressionMode (ZSTD_c_experimentalParam5); 1: always Huffman-code literals
LITERAL_MODE, LITERALS_HUFFMAN = 1002, 1
_MIN_VERSION = 10400  # 1.4.0: ZSTD_compress2 and the literal compression mode


@functools.cache
def library() -> Any:
    """The loaded ``libzstd.so.1`` (a ctypes library with its prototypes set), or None."""
    if os.environ.get("ASYNCSYNC_LIBZSTD", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    try:
        lib = ctypes.CDLL("libzstd.so.1")
        lib.ZSTD_versionNumber.restype = ctypes.c_uint
        if lib.ZSTD_versionNumber() < _MIN_VERSION:
            return None
        lib.ZSTD_createCCtx.restype = ctypes.c_void_p
        lib.ZSTD_freeCCtx.argtypes = [ctypes.c_void_p]
        lib.ZSTD_CCtx_setParameter.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        lib.ZSTD_CCtx_setParameter.restype = ctypes.c_size_t
        lib.ZSTD_compress2.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                       ctypes.c_void_p, ctypes.c_size_t]  # fmt: skip
        lib.ZSTD_compress2.restype = ctypes.c_size_t
        lib.ZSTD_compressBound.argtypes = [ctypes.c_size_t]
        lib.ZSTD_compressBound.restype = ctypes.c_size_t
        lib.ZSTD_isError.argtypes = [ctypes.c_size_t]
        lib.ZSTD_isError.restype = ctypes.c_uint
    except (OSError, AttributeError) as exc:
        logger.debug("libzstd not used: %s", exc)
        return None
    return lib


class _Context:
    """One thread's ``ZSTD_CCtx`` with ``params`` set (freed with the thread's local data)."""

    def __init__(self, lib: Any, params: tuple[tuple[int, int], ...]) -> None:
        self.lib = lib
        self.ptr = lib.ZSTD_createCCtx()
        if not self.ptr:
            raise MemoryError("ZSTD_createCCtx failed")
        for key, value in params:
            if lib.ZSTD_isError(lib.ZSTD_CCtx_setParameter(self.ptr, key, value)):
                lib.ZSTD_freeCCtx(self.ptr)
                self.ptr = None
                raise ValueError(f"libzstd refuses parameter {key}={value}")
        probe = bytes(range(256)) * 64 + bytes(4096)
        frame = self.compress(probe)  # a frame python-zstandard reads back, its size declared
        if zstandard.frame_content_size(frame) != len(probe) or (
            zstandard.ZstdDecompressor().decompress(frame, allow_extra_data=False) != probe
        ):
            raise ValueError(f"libzstd with {params} makes frames zstandard does not read back")

    def __del__(self) -> None:
        if getattr(self, "ptr", None):
            self.lib.ZSTD_freeCCtx(self.ptr)

    def compress(self, data: bytes | memoryview) -> bytes:
        src = np.frombuffer(data, np.uint8)
        lib = self.lib
        out = scratch.empty(lib.ZSTD_compressBound(src.size), np.uint8)
        n = lib.ZSTD_compress2(self.ptr, out.ctypes.data, out.size, src.ctypes.data, src.size)
        if lib.ZSTD_isError(n):
            raise RuntimeError(f"ZSTD_compress2 failed (code {n})")
        return out[:n].tobytes()


class _DContext:
    """One thread's ``ZSTD_DCtx``, checked when made on a frame python-zstandard wrote."""

    def __init__(self, lib: Any) -> None:
        self.lib = lib
        # (set here, not in :func:`library`: a libzstd without them still compresses)
        lib.ZSTD_getErrorName.argtypes = [ctypes.c_size_t]
        lib.ZSTD_getErrorName.restype = ctypes.c_char_p
        lib.ZSTD_createDCtx.restype = ctypes.c_void_p
        lib.ZSTD_freeDCtx.argtypes = [ctypes.c_void_p]
        lib.ZSTD_decompressDCtx.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                            ctypes.c_void_p, ctypes.c_size_t]  # fmt: skip
        lib.ZSTD_decompressDCtx.restype = ctypes.c_size_t
        lib.ZSTD_findFrameCompressedSize.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.ZSTD_findFrameCompressedSize.restype = ctypes.c_size_t
        self.ptr = lib.ZSTD_createDCtx()
        if not self.ptr:
            raise MemoryError("ZSTD_createDCtx failed")
        probe = bytes(range(256)) * 64 + bytes(4096)
        out = np.empty(len(probe), np.uint8)
        self.decompress_into(zstandard.ZstdCompressor(level=3).compress(probe), out)
        if out.tobytes() != probe:
            raise ValueError("libzstd decompresses a frame otherwise than zstandard")

    def __del__(self) -> None:
        if getattr(self, "ptr", None):
            self.lib.ZSTD_freeDCtx(self.ptr)

    def decompress_into(self, frame: bytes | memoryview, out: np.ndarray[Any, Any]) -> None:
        """Decompress ``frame``, exactly one zstd frame of ``out.nbytes`` bytes, into ``out``
        (a writable C-contiguous array); ValueError saying what is wrong otherwise (a byte
        after the frame, a corrupt frame, another size)."""
        lib = self.lib
        src = np.frombuffer(frame, np.uint8)
        size = lib.ZSTD_findFrameCompressedSize(src.ctypes.data, src.size)
        if lib.ZSTD_isError(size):
            raise ValueError(lib.ZSTD_getErrorName(size).decode(errors="replace"))
        if size != src.size:
            raise ValueError(f"{src.size - size} bytes after the frame")
        if not (out.flags.c_contiguous and out.flags.writeable):
            raise ValueError("the output must be a writable C-contiguous array")
        got = lib.ZSTD_decompressDCtx(self.ptr, out.ctypes.data, out.nbytes, src.ctypes.data,
                                      src.size)  # fmt: skip
        if lib.ZSTD_isError(got):
            raise ValueError(lib.ZSTD_getErrorName(got).decode(errors="replace"))
        if got != out.nbytes:
            raise ValueError(f"decompressed {got} bytes, want {out.nbytes}")


_local = threading.local()


def compressor(params: Mapping[int, int]) -> Callable[[bytes | memoryview], bytes] | None:
    """This thread's ``compress(data) -> frame`` with ``params`` (``ZSTD_cParameter`` ->
    value), or None where libzstd is not there or refuses one of them (then for good)."""
    lib = library()
    if lib is None:
        return None
    key = tuple(sorted(params.items()))
    made: dict[tuple[tuple[int, int], ...], _Context | None] | None
    made = getattr(_local, "contexts", None)
    if made is None:
        made = _local.contexts = {}
    if key not in made:
        try:
            made[key] = _Context(lib, key)
        except (ValueError, MemoryError, RuntimeError, zstandard.ZstdError) as exc:
            logger.debug("libzstd not used for %s: %s", key, exc)
            made[key] = None
    ctx = made[key]
    return None if ctx is None else ctx.compress


def decompressor() -> Callable[[bytes | memoryview, np.ndarray[Any, Any]], None] | None:
    """This thread's ``decompress_into(frame, out)`` (:meth:`_DContext.decompress_into`: one
    frame into a buffer of the caller's, e.g. the scratch pool's, whose pages are already
    faulted in), or None where libzstd is not there or fails its check (then for good)."""
    lib = library()
    if lib is None:
        return None
    if not hasattr(_local, "dcontext"):
        made: _DContext | None = None
        try:
            made = _DContext(lib)
        except (ValueError, MemoryError, zstandard.ZstdError, AttributeError) as exc:
            logger.debug("libzstd not used to decompress: %s", exc)
        _local.dcontext = made
    ctx: _DContext | None = _local.dcontext
    return None if ctx is None else ctx.decompress_into
