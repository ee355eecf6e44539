"""Encoding and decoding one tensor's change (the four encodings of :mod:`asyncsync.codec`).

Decoding validates everything and raises :class:`~asyncsync.errors.FormatError` on any
inconsistency; decompressed sizes are known in advance, so a hostile blob cannot make the
decoder allocate more than the tensor's size.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
import zstandard
from numpy.typing import NDArray

from asyncsync.codec import ef, native, scratch, zstdlib
from asyncsync.codec.patch import Patch
from asyncsync.codec.views import _NP_BY_WIDTH, _WIDTH_BY_INT, gather
from asyncsync.errors import ConfigError, FormatError
from asyncsync.format.names import DEFAULT_ENCODING, ENCODINGS

__all__ = [
    "DEFAULT_ENCODING",
    "DENSE_THRESHOLD",
    "ENCODINGS",
    "EncodedDelta",
    "decode_delta",
    "decode_xef_many",
    "decode_xef_positions",
    "encode_change",
    "encode_delta",
    "encoded_size",
]

# xef sends dense (no positions, the whole-tensor XOR) when changed/numel exceeds this. Measured
# (docs/CODEC.md): sparse is smaller below ~0.8 for bf16 Adam steps and ~0.99 for fp32 or random
# bytes, as dense pays for the zero pattern once per byte plane. Above 0.8 dense costs at most
# ~5 % more (nothing at 100 %) and skips the gather and Elias-Fano work, which dominate there.
DENSE_THRESHOLD = 0.8
_GAP_DTYPES: dict[int, np.dtype[Any]] = {w: np.dtype(f"<u{w}") for w in (2, 4, 8)}
_INDEX32_MAX = 2**31 - 1
_EF_ZSTD = 0x80
_EF_ZSTD_LEVEL = 1
_EF_SAMPLE = 16 << 10  # bytes of an xef positions payload tried with zstd before all of it
_EF_SAMPLE_GAIN = 0.02
_DELTAS_ZSTD_LEVEL = 1
#: The sparse xef values' zstd parameters at level 1 (the publisher's default): level 1's,
#: with the smallest hash table zstd allows. Byte planes of XORs are short-lived noise (a bf16
#: Adam step's low plane: ~2 bits of entropy a byte, geometric) in which level 1's 8192-slot
#: table finds chance matches of 6 bytes that cost more than the literals they replace; 64
#: slots find the runs that pay (the high plane's zeros) and skip the rest. Measured at 3 %
#: (the bench's state, BENCHMARKS.md, 26th session): values 14 % smaller, their zstd ~27 %
#: less CPU, the decompression no dearer. Any reader decodes the frame (FORMAT.md 4.2: any
#: level). Not for dense: there it gained ~1 % and its decode measured up to ~12 % dearer.
_VALUES_LEVEL1 = {"hash_log": 6}
#: ... and, where the system's libzstd is there (:mod:`asyncsync.codec.zstdlib`), zstd's
#: acceleration (``target_length`` 8: the match search steps over what does not match) with
#: the literals still Huffman-coded (which python-zstandard cannot ask for: ``target_length``
#: alone turned it off, and the frames grew 2-3x): as small, ~1.5x less CPU, decoded ~1.25x
#: faster (BENCHMARKS.md, thirty-fourth session). From :data:`_LIBZSTD_MIN` bytes of planes.
_VALUES_LIBZSTD = {
    zstdlib.COMPRESSION_LEVEL: 1,
    zstdlib.HASH_LOG: 6,
    zstdlib.MIN_MATCH: 7,
    zstdlib.TARGET_LENGTH: 8,
    zstdlib.LITERAL_MODE: zstdlib.LITERALS_HUFFMAN,
}
_LIBZSTD_MIN = 4 << 10

_Int64Array = NDArray[np.int64]


@dataclass(frozen=True)
class EncodedDelta:
    """One tensor's encoded change; ``mode == "dense"``: no positions, values cover all elements."""

    encoding: str
    mode: Literal["sparse", "dense"]
    changed: int
    positions: bytes
    values: bytes
    raw_bytes: int  # positions + values before any compression (for metrics)


def encode_delta(
    old: torch.Tensor,
    new: torch.Tensor,
    positions: torch.Tensor,
    encoding: str = DEFAULT_ENCODING,
    *,
    level: int = 3,
    values: torch.Tensor | None = None,
    xor: torch.Tensor | None = None,
) -> EncodedDelta:
    """Encode the change ``old -> new`` (int views) at ``positions`` (from changed_positions).

    ``values`` (``new`` at ``positions``) and ``xor`` (``old ^ new`` there), as a
    :class:`Change` from :func:`diff_tensors` holds them, spare the gathers when given; the
    result is byte-identical either way. With ``xor`` given (``positions`` then being exactly
    the changed elements) ``old`` is not read, so it may already have been advanced to ``new``.
    """
    _check_encoding(encoding)
    if old.dtype != new.dtype or old.dtype not in _WIDTH_BY_INT:
        raise ConfigError(f"old/new must be int views of one dtype, got {old.dtype}, {new.dtype}")
    if old.dim() != 1 or new.shape != old.shape:
        raise ConfigError(f"old/new must be 1-D of equal length, got {old.shape}, {new.shape}")
    if positions.dtype != torch.int64 or positions.dim() != 1:
        raise ConfigError(f"positions must be 1-D int64, got {positions.dtype}{positions.shape}")
    _check_level(level)
    numel, n = old.numel(), positions.numel()
    if n == 0:
        return EncodedDelta(encoding, "sparse", 0, b"", b"", 0)
    if n > numel:
        raise ConfigError(f"{n} positions for a tensor of {numel} elements")
    for what, given in (("values", values), ("xor", xor)):
        if given is not None and (given.dtype != old.dtype or given.shape != positions.shape):
            raise ConfigError(f"{what} must be {old.dtype}[{n}], got {given.dtype}{given.shape}")
    if xor is None and encoding == "xef" and n > DENSE_THRESHOLD * numel:
        return _dense(torch.bitwise_xor(new, old), level)
    return _encode(positions, values, xor, numel, encoding, level, (old, new))


def encode_change(
    positions: torch.Tensor,
    values: torch.Tensor,
    xor: torch.Tensor,
    numel: int,
    encoding: str = DEFAULT_ENCODING,
    *,
    level: int = 3,
) -> EncodedDelta:
    """:func:`encode_delta` of a change as a :class:`~asyncsync.codec.Change` holds it (sorted
    ``positions``, exactly the changed elements of a tensor of ``numel``; ``values`` and
    ``xor`` there, of its int-view dtype) without the tensors themselves: the same bytes.

    The publisher's path: for a MoE's thousands of small tensors, the int views and checks of
    the old and new tensors cost more than the encoding of a few changed elements.
    """
    _check_encoding(encoding)
    if positions.dtype != torch.int64 or positions.dim() != 1:
        raise ConfigError(f"positions must be 1-D int64, got {positions.dtype}{positions.shape}")
    if values.dtype not in _WIDTH_BY_INT or (values.dtype, values.shape) != (xor.dtype, xor.shape):
        raise ConfigError(
            f"values and xor must be of one int-view dtype, got {values.dtype}{values.shape}, "
            f"{xor.dtype}{xor.shape}"
        )
    if values.shape != positions.shape:
        raise ConfigError(f"{positions.numel()} positions but {values.numel()} values")
    if not 0 <= positions.numel() <= numel:
        raise ConfigError(f"{positions.numel()} positions for a tensor of {numel} elements")
    _check_level(level)
    return _encode(positions, values, xor, numel, encoding, level)


def _encode(
    positions: torch.Tensor,
    values: torch.Tensor | None,
    xor: torch.Tensor | None,
    numel: int,
    encoding: str,
    level: int,
    tensors: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> EncodedDelta:
    """The encoding of checked changes; ``xor`` (xef) or ``values`` (the others) not given are
    gathered from ``tensors`` (old, new) once the positions are known to be valid."""
    n = positions.numel()
    if n == 0:
        return EncodedDelta(encoding, "sparse", 0, b"", b"", 0)
    if encoding == "xef" and n > DENSE_THRESHOLD * numel:
        assert xor is not None
        dense = torch.zeros(numel, dtype=xor.dtype, device=xor.device)
        dense[positions.to(xor.device)] = xor
        return _dense(dense, level)
    idx: _Int64Array = np.ascontiguousarray(positions.cpu().numpy(), dtype=np.int64)
    if encoding == "xef":
        pblob, praw = _ef_encode(idx, numel)  # checks the positions (ConfigError)
        if xor is None:
            assert tensors is not None
            old, new = tensors
            pos = positions.to(old.device)
            xor = torch.bitwise_xor(gather(new, pos, idx), gather(old, pos, idx))
        vblob = _zstd(_planes(xor), level, values=True)
        return EncodedDelta(encoding, "sparse", n, pblob, vblob, praw + n * xor.element_size())
    if idx[0] < 0 or idx[-1] >= numel or not bool(np.all(idx[1:] > idx[:-1])):
        raise ConfigError("positions must be strictly increasing and within the tensor")
    if values is None:
        assert tensors is not None
        values = gather(tensors[1], positions.to(tensors[1].device), idx)
    width = values.element_size()
    vblob = values.cpu().numpy().astype(_NP_BY_WIDTH[width], copy=False).tobytes()
    if encoding == "indices":
        pblob = idx.astype("<i4" if numel <= _INDEX32_MAX else "<i8").tobytes()
        return EncodedDelta(encoding, "sparse", n, pblob, vblob, len(pblob) + len(vblob))
    gaps = np.diff(idx, prepend=-1) - 1
    top = int(gaps.max())
    gwidth = 2 if top <= 0xFFFF else 4 if top <= 0xFFFF_FFFF else 8
    pblob = gaps.astype(_GAP_DTYPES[gwidth]).tobytes()
    raw = len(pblob) + len(vblob)
    if encoding == "deltas_zstd":
        pblob = _zstd(pblob, _DELTAS_ZSTD_LEVEL)
    return EncodedDelta(encoding, "sparse", n, pblob, vblob, raw)


def _dense(dense: torch.Tensor, level: int) -> EncodedDelta:
    """The dense xef of a whole tensor's ``old ^ new``."""
    n = int(torch.count_nonzero(dense))  # exact even if positions held unchanged elements
    raw = dense.numel() * dense.element_size()
    return EncodedDelta("xef", "dense", n, b"", _zstd(_planes(dense), level), raw)


def _check_level(level: int) -> None:
    if not zstandard.MAX_COMPRESSION_LEVEL >= level >= -(1 << 17):
        raise ConfigError(f"zstd level {level} out of range")


def decode_delta(
    encoding: str,
    mode: str,
    positions: bytes | memoryview,
    values: bytes | memoryview,
    *,
    changed: int,
    numel: int,
    dtype: torch.dtype,
) -> Patch:
    """Decode one encoded delta into a CPU :class:`Patch` for an int view of ``dtype``.

    Raises ConfigError for an unknown encoding or a non-int-view dtype, FormatError for
    anything in the blobs (or mode/changed/numel) that is inconsistent.
    """
    _check_encoding(encoding)
    width = _WIDTH_BY_INT.get(dtype)
    if width is None:
        raise ConfigError(f"dtype must be an int-view dtype (uint8/int16/int32/int64), got {dtype}")
    if numel < 0 or not 0 <= changed <= numel:
        raise FormatError(f"changed={changed} impossible for numel={numel}")
    op: Literal["set", "xor"] = "xor" if encoding == "xef" else "set"
    if mode == "dense":
        if encoding != "xef" or positions:
            raise FormatError(f"dense mode is only for xef and has no positions ({encoding})")
        xor, nonzero = _unplanes(_unzstd(values, (numel * width,), "dense values"), numel, width)
        if nonzero != changed:
            raise FormatError(f"dense values change {nonzero}, not {changed}")
        return Patch(op, None, xor)
    if mode != "sparse":
        raise FormatError(f"unknown mode {mode!r}")
    if changed == 0:
        if positions or values:
            raise FormatError("changed == 0 but the blobs are not empty")
        return Patch(op, torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=dtype))
    if encoding == "xef":
        idx = _ef_decode(positions, changed, numel)
        raw = _unzstd(values, (changed * width,), "values")
        varr, nonzero = _unplanes_np(raw, changed, width)
        if nonzero != changed:  # a listed position must change
            raise FormatError("sparse xef values hold a zero XOR: a position that did not change")
        pos_t, vals_t = torch.from_numpy(idx), torch.from_numpy(varr)
        return Patch.of_xef(op, pos_t, vals_t, positions, (idx, varr))
    idx = _baseline_positions(encoding, positions, changed, numel)
    if len(values) != changed * width:
        raise FormatError(f"values blob is {len(values)} bytes, want {changed * width}")
    vals = torch.from_numpy(np.frombuffer(values, _NP_BY_WIDTH[width]).copy())
    return Patch(op, torch.from_numpy(idx), vals)


def decode_xef_many(
    deltas: Sequence[tuple[bytes | memoryview, bytes | memoryview, int, int]], dtype: torch.dtype
) -> list[Patch] | None:
    """:func:`decode_delta` of many sparse xef deltas, each ``(positions, values, changed,
    numel)``, for int views of one ``dtype``, in one call of the C kernel ``xef_decode_many``:
    the same Patches, byte for byte (their positions and values views of one array each).

    None when the kernel is not loaded or any delta is not valid (or ``changed == 0``): the
    caller then decodes them one by one with :func:`decode_delta`, whose errors say what is
    wrong. For small tensors (a MoE's thousands of experts): :func:`decode_delta` costs ~5x
    its kernels' work in glue at 4 KiB.
    """
    kernels, width = native.kernels, _WIDTH_BY_INT.get(dtype)
    if kernels is None or width is None or not hasattr(kernels, "xef_decode_many") or not deltas:
        return None
    blobs: list[bytes | memoryview] = []
    raws: list[bytes | memoryview] = []
    try:
        for positions, values, changed, numel in deltas:
            if changed < 1 or not positions:
                return None
            if positions[0] & _EF_ZSTD:  # (the kernel takes the payload after its header)
                payload = _ef_payload(positions, changed, numel, ef.low_bits(changed, numel))
                positions = bytes([positions[0] & ~_EF_ZSTD]) + payload
            blobs.append(positions)
            raws.append(_unzstd(values, (changed * width,), "values"))
        counts = np.array([d[2] for d in deltas], np.int64)
        numels = np.array([d[3] for d in deltas], np.int64)
    except (ConfigError, FormatError, OverflowError):
        return None
    total = int(counts.sum())
    pos_out, val_out = scratch.empty(total, np.int64), scratch.empty(total * width, np.uint8)
    try:
        kernels.xef_decode_many(blobs, raws, counts, numels, width, pos_out, val_out)
    except (ValueError, TypeError, BufferError):
        return None
    vals = val_out.view(_NP_BY_WIDTH[width])
    out: list[Patch] = []
    start = 0
    for (blob, *_), end in zip(deltas, np.cumsum(counts).tolist(), strict=True):
        idx, varr = pos_out[start:end], vals[start:end]
        out.append(
            Patch.of_xef("xor", torch.from_numpy(idx), torch.from_numpy(varr), blob, (idx, varr))
        )
        start = end
    return out


def decode_xef_positions(blob: bytes | memoryview, n: int, numel: int) -> NDArray[np.int64]:
    """The ``n`` positions (int64, strictly increasing within ``[0, numel)``) of a sparse xef
    positions blob, as :func:`decode_delta` reads them; FormatError if it is not valid."""
    return _ef_decode(blob, n, numel)


def encoded_size(enc: EncodedDelta) -> int:
    """Wire bytes of ``enc``: positions plus values."""
    return len(enc.positions) + len(enc.values)


# ---------------------------------------------------------------------------------------------


def _check_encoding(encoding: str) -> None:
    if encoding not in ENCODINGS:
        raise ConfigError(f"unknown encoding {encoding!r}; use one of {', '.join(ENCODINGS)}")


_contexts = threading.local()  # each thread's zstd contexts (by level and kind: not thread-safe)


def _zstd(data: bytes | memoryview, level: int, *, values: bool = False) -> bytes:
    """One zstd frame of ``data`` (``values``: a sparse xef's values, at level 1 with
    :data:`_VALUES_LIBZSTD` through libzstd where it loads, else :data:`_VALUES_LEVEL1`;
    under :data:`_LIBZSTD_MIN` bytes always the latter). A compressor is kept per thread and
    level: making one per call cost ~15 us, ~10 ms per GiB of a model's deltas (hundreds of
    tensors, two calls each)."""
    by_level = getattr(_contexts, "compressors", None)
    if by_level is None:
        by_level = _contexts.compressors = {}
    key = (level, values and level == 1)
    if key[1] and len(data) >= _LIBZSTD_MIN and (fast := zstdlib.compressor(_VALUES_LIBZSTD)):
        return fast(data)
    c = by_level.get(key)
    if c is None:
        if key[1]:
            params = zstandard.ZstdCompressionParameters.from_level(1, **_VALUES_LEVEL1)
            c = zstandard.ZstdCompressor(compression_params=params)
        else:
            c = zstandard.ZstdCompressor(level=level)
        by_level[key] = c
    return c.compress(data)


def _decompressor() -> zstandard.ZstdDecompressor:
    """This thread's zstd decompressor (one per call cost ~14 us)."""
    d = getattr(_contexts, "decompressor", None)
    if d is None:
        d = _contexts.decompressor = zstandard.ZstdDecompressor()
    return d


def _unzstd(blob: bytes | memoryview, sizes: tuple[int, ...], what: str) -> bytes | memoryview:
    """Decompress one zstd frame whose declared content size must be one of ``sizes``; any
    byte after the frame is refused (FORMAT.md 4.2). From :data:`scratch.MIN_BYTES
    <asyncsync.codec.scratch.MIN_BYTES>` bytes out, into a buffer of the scratch pool through
    libzstd where it loads (a fresh buffer that size is mapped anew and faulted in page by
    page, ~3 us a page in a VM: ~1,900 faults a version at 1 GiB)."""
    try:
        declared = zstandard.frame_content_size(blob)
        if declared not in sizes:  # also rejects frames of unknown size (-1): unbounded
            raise FormatError(f"{what}: zstd frame declares {declared} bytes, want {sizes}")
        if declared >= scratch.MIN_BYTES and (into := zstdlib.decompressor()) is not None:
            return _unzstd_into(into, blob, declared, what)
        out = _decompressor().decompress(blob, allow_extra_data=False) if declared else b""
    except zstandard.ZstdError as exc:
        raise FormatError(f"{what}: corrupt zstd data: {exc}") from exc
    if len(out) != declared:
        raise FormatError(f"{what}: decompressed {len(out)} bytes, frame declares {declared}")
    return out


def _unzstd_into(into: Any, blob: bytes | memoryview, size: int, what: str) -> memoryview:
    """One frame of ``size`` bytes through libzstd into a buffer of the scratch pool."""
    out = scratch.empty(size, np.uint8)
    try:
        into(blob, out)
    except ValueError as exc:
        raise FormatError(f"{what}: corrupt zstd data: {exc}") from exc
    return out.data


#: below this many bytes a CPU tensor's planes are NumPy's transposed copy (its ``tobytes``):
#: 1.8 against the C kernel's 2.7 us at 256 bytes, level at 4 KiB, 19.6 against 4.3 us at
#: 64 KiB (BENCHMARKS.md, thirty-second session)
_SMALL_PLANES = 4 << 10
#: ... and values are unplaned by NumPy below this many bytes: none, the kernel (its output
#: from the scratch pool) is quicker at every size (1.1 against 1.8 us at 256 bytes, 5.7
#: against 111 us at 64 KiB, where NumPy's was taken: ~20 ms a version at 1 GiB)
_SMALL_UNPLANES = 0


def _planes(v: torch.Tensor) -> bytes | memoryview:
    """A 1-D int tensor's bytes as byte planes (all byte 0s, then all byte 1s, ...), on CPU."""
    width = v.element_size()
    if v.device.type == "cpu" and v.numel() * width < _SMALL_PLANES and v.is_contiguous():
        return v.numpy().view(np.uint8).reshape(-1, width).T.tobytes()
    u8 = v.contiguous().view(torch.uint8)
    k = native.kernels
    if width > 1 and u8.device.type == "cpu" and k is not None and hasattr(k, "planes"):
        out = scratch.empty(u8.numel(), np.uint8)
        k.planes(u8.numpy(), width, out)
        return out.data
    if width > 1:  # one strided copy per plane: several times faster than a transpose copy
        planes = torch.empty((width, v.numel()), dtype=torch.uint8, device=v.device)
        for k in range(width):
            planes[k].copy_(u8[k::width])
        u8 = planes.view(-1)
    return u8.cpu().numpy().data


def _unplanes(raw: bytes | memoryview, n: int, width: int) -> tuple[torch.Tensor, int]:
    """Inverse of :func:`_planes`: a writable (n,) tensor of the int-view dtype that nothing
    else refers to (from the scratch pool), and how many of its elements are not zero (the C
    kernel counts them in its own pass)."""
    arr, nonzero = _unplanes_np(raw, n, width)
    return torch.from_numpy(arr), nonzero


def _unplanes_np(raw: bytes | memoryview, n: int, width: int) -> tuple[NDArray[Any], int]:
    """:func:`_unplanes` as the NumPy array (the tensor is made from it without a copy)."""
    src = np.frombuffer(raw, np.uint8)
    if width > 1 and n * width < _SMALL_UNPLANES:
        small = src.reshape(width, n).T.copy().view(_NP_BY_WIDTH[width])[:, 0]
        return small, int(np.count_nonzero(small))
    out = scratch.empty(n * width, np.uint8)
    kernels = native.kernels
    if width > 1 and kernels is not None and hasattr(kernels, "unplanes"):
        zeros = kernels.unplanes(src, width, out)
        arr = out.view(_NP_BY_WIDTH[width])
        return arr, (n - zeros if isinstance(zeros, int) else int(np.count_nonzero(arr)))
    for k in range(width):
        out[k::width] = src[k * n : (k + 1) * n]
    arr = out.view(_NP_BY_WIDTH[width])
    return arr, int(np.count_nonzero(arr))


def _ef_encode(idx: _Int64Array, numel: int) -> tuple[bytes, int]:
    """The xef positions blob of sorted ``idx``, and the size of its uncompressed payload.

    The payload is zstd-compressed when that is smaller. Scattered positions (a few % of the
    elements changed by an optimizer step) give a payload zstd cannot shrink, and trying costs
    ~40 % of the Elias-Fano encode: above ``2 * _EF_SAMPLE`` bytes, a sample of each part
    (the start of the low fields, the start of the high bitvector) is tried first, and the
    whole payload only when the sample shrank by ``_EF_SAMPLE_GAIN`` or more."""
    blob, low_bits = ef.encode(idx, numel, headed=True)  # (the uncompressed blob)
    payload = memoryview(blob)[1:]
    if len(payload) > 2 * _EF_SAMPLE:
        low = ef.sizes(len(idx), numel, low_bits)[0]
        half = _EF_SAMPLE // 2
        sample = b"".join((payload[: min(half, low)], payload[low : low + half]))
        if len(_zstd(sample, _EF_ZSTD_LEVEL)) > (1 - _EF_SAMPLE_GAIN) * len(sample):
            return blob, len(payload)
    packed = _zstd(payload, _EF_ZSTD_LEVEL)
    if len(packed) < len(payload):
        return bytes([low_bits | _EF_ZSTD]) + packed, len(payload)
    return blob, len(payload)


def _ef_decode(blob: bytes | memoryview, n: int, numel: int) -> _Int64Array:
    """The ``n`` positions of an xef positions blob (FormatError if it is not valid)."""
    low_bits = ef.low_bits(n, numel)
    if not blob or blob[0] & ~_EF_ZSTD != low_bits:
        raise FormatError(f"Elias-Fano header {bytes(blob[:1])!r} does not match L={low_bits}")
    return ef.decode(_ef_payload(blob, n, numel, low_bits), n, numel)


def _ef_payload(blob: bytes | memoryview, n: int, numel: int, low_bits: int) -> bytes | memoryview:
    """The Elias-Fano payload after an xef positions blob's header byte, decompressed where the
    header says zstd (to the size ``n`` positions in ``[0, numel)`` take)."""
    if blob[0] & _EF_ZSTD:
        return _unzstd(blob[1:], (sum(ef.sizes(n, numel, low_bits)),), "positions")
    return memoryview(blob)[1:]


def _baseline_positions(encoding: str, blob: bytes | memoryview, n: int, numel: int) -> _Int64Array:
    if encoding == "deltas_zstd":
        blob = _unzstd(blob, (2 * n, 4 * n, 8 * n), "positions")
    width, rest = divmod(len(blob), n)
    if rest or width not in ((4, 8) if encoding == "indices" else (2, 4, 8)):
        raise FormatError(f"{encoding} positions blob of {len(blob)} bytes for {n} positions")
    if encoding == "indices":
        idx: _Int64Array = np.frombuffer(blob, f"<i{width}").astype(np.int64)
        _check_increasing(idx, numel)
        return idx
    steps = np.frombuffer(blob, _GAP_DTYPES[width]).astype(np.uint64) + np.uint64(1)
    upos = np.cumsum(steps, dtype=np.uint64) - np.uint64(1)  # a uint64 wrap shows as a decrease
    _check_increasing(upos, numel)
    return upos.astype(np.int64)


def _check_increasing(idx: NDArray[Any], numel: int) -> None:
    if idx[0] < 0 or idx[-1] >= numel or not bool(np.all(idx[1:] > idx[:-1])):
        raise FormatError(f"positions not strictly increasing within [0, {numel})")
