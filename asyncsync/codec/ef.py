"""Elias-Fano coding of sorted positions: the payload of an ``xef`` positions blob. Pure, no I/O.

For ``n`` strictly increasing positions ``idx`` in ``[0, numel)`` and ``L = low_bits(n, numel)``
(``floor(log2(numel // n))``), the payload (docs/FORMAT.md section 4.2) is

* the low parts ``idx & (2**L - 1)`` as an L-bit field array: bit ``j`` of element ``k`` at bit
  ``k*L + j``, bits numbered LSB-first within each byte, ``ceil(n*L/8)`` bytes; then
* the high parts as a bitvector of ``n + (numel >> L) + 1`` bits (LSB-first, ``ceil(bits/8)``
  bytes) with bit ``(idx[k] >> L) + k`` set for each ``k`` and no other bit set,

about ``L + 2`` bits per position. The blob's header byte and optional zstd step are
:mod:`asyncsync.codec`'s. Both directions run in the C kernels ``ef_encode``/``ef_decode`` when
:data:`asyncsync.codec.native.kernels` has them, else in NumPy; the payloads, and the errors on
a bad payload (same order of checks, same messages), are identical.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from asyncsync.codec import native, scratch
from asyncsync.errors import ConfigError, FormatError

__all__ = ["decode", "encode", "low_bits", "sizes"]

_Int64Array = NDArray[np.int64]


def low_bits(n: int, numel: int) -> int:
    """``L``, the low bits per position: ``floor(log2(numel // n))``, for ``1 <= n <= numel``."""
    if not 1 <= n <= numel:
        raise ConfigError(f"Elias-Fano needs 1 <= n <= numel, got n={n}, numel={numel}")
    return (numel // n).bit_length() - 1


def sizes(n: int, numel: int, low_bits: int) -> tuple[int, int]:
    """Bytes of the low part and of the high bitvector."""
    return (n * low_bits + 7) // 8, (n + (numel >> low_bits) + 1 + 7) // 8


def encode(idx: _Int64Array, numel: int, *, headed: bool = False) -> tuple[bytes, int]:
    """The payload of ``idx`` (1-D int64, strictly increasing within ``[0, numel)``) and its L.

    ``headed``: the payload after one byte L (the header of an uncompressed xef positions blob)
    in the bytes returned, which the kernel writes in place: prepending it after would copy
    the payload (~13 MB per GiB of bf16 at 3 %). Raises ConfigError, naming the first bad
    index, when ``idx`` is not such an array or empty.
    """
    if idx.dtype != np.int64 or idx.ndim != 1:
        raise ConfigError(f"positions must be 1-D int64, got {idx.dtype}{list(idx.shape)}")
    n = idx.size
    bits = low_bits(n, numel)
    idx = np.ascontiguousarray(idx)
    if native.kernels is not None:
        try:
            return native.kernels.ef_encode(idx, numel, bits, *((bits,) if headed else ())), bits
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    if idx[0] < 0 or idx[-1] >= numel or not bool(np.all(idx[1:] > idx[:-1])):
        bad = (idx < 0) | (idx >= numel)
        bad[1:] |= idx[1:] <= idx[:-1]
        j = int(np.argmax(bad))
        raise ConfigError(
            f"positions[{j}] = {idx[j]}: positions must be strictly increasing within [0, {numel})"
        )
    parts: list[bytes] = [bytes([bits])] if headed else []
    if bits:
        parts.append(_pack_fields(idx.view(np.uint64) & np.uint64((1 << bits) - 1), bits))
    unary = np.zeros(n + (numel >> bits) + 1, dtype=np.bool_)
    ones = idx >> bits
    ones += np.arange(n)
    unary[ones] = True
    parts.append(np.packbits(unary, bitorder="little").tobytes())
    return b"".join(parts), bits


def decode(payload: bytes | bytearray | memoryview, n: int, numel: int) -> _Int64Array:
    """The ``n`` positions (a new int64 array) that ``payload`` codes within ``[0, numel)``.

    Raises FormatError unless the payload is exactly what :func:`encode` makes of some valid
    positions: exact size, no bit set past either part, ``n`` set high bits, positions strictly
    increasing within ``[0, numel)``. Never reads or allocates beyond the payload's own size
    and ``n`` positions.
    """
    if not 1 <= n <= numel:
        raise FormatError(f"{n} Elias-Fano positions impossible for numel={numel}")
    bits = low_bits(n, numel)
    low_len, high_len = sizes(n, numel, bits)
    if (size := memoryview(payload).nbytes) != low_len + high_len:
        raise FormatError(f"positions blob is {size} bytes, want {low_len + high_len}")
    if native.kernels is not None:
        out: _Int64Array = scratch.empty(n, np.int64)
        try:
            native.kernels.ef_decode(payload, n, numel, bits, out)
        except ValueError as exc:
            raise FormatError(str(exc)) from None
        return out
    buf = np.frombuffer(payload, np.uint8)
    for what, part, nbits in (
        ("low part", buf[:low_len], n * bits),
        ("high part", buf[low_len:], n + (numel >> bits) + 1),
    ):
        if nbits % 8 and int(part[-1]) >> (nbits % 8):
            raise FormatError(f"Elias-Fano {what} has bits set past its {nbits} bits")
    idx: _Int64Array = np.flatnonzero(
        np.unpackbits(buf[low_len:], bitorder="little").view(np.bool_)
    )
    if idx.size != n:
        raise FormatError(f"Elias-Fano high bits hold {idx.size} positions, want {n}")
    idx -= np.arange(n)  # the high parts: non-decreasing
    if idx[-1] <= numel >> bits:  # else (high << L) >= numel, and the shift could overflow
        if bits:
            idx <<= bits
            idx |= _unpack_fields(buf[:low_len], n, bits)
        if idx[-1] < numel and bool(np.all(idx[1:] > idx[:-1])):
            return idx
    raise FormatError(f"positions not strictly increasing within [0, {numel})")


def _field_pairs(bits: int) -> list[tuple[int, int, int]]:
    """(element j of a group of 8, byte k of the group's ``bits`` bytes, bit shift of the
    element within that byte) for every element/byte overlap of an L-bit field array."""
    return [
        (j, k, j * bits - 8 * k)
        for j in range(8)
        for k in range(j * bits // 8, (j * bits + bits - 1) // 8 + 1)
    ]


def _field_dtype(bits: int) -> type[np.unsignedinteger[Any]]:
    """The narrowest unsigned dtype that holds a field (shifted-out bits are never needed)."""
    return np.uint16 if bits <= 16 else np.uint32 if bits <= 32 else np.uint64


def _pack_fields(low: NDArray[np.uint64], bits: int) -> bytes:
    """Pack values < 2**bits as an LSB-first L-bit field array: 8 values -> L bytes.

    Works on the transposed groups (row j: element j of every group of 8), so that every
    shift/or pass is over contiguous memory: about 3x faster than strided columns.
    """
    n, groups, dt = low.size, -(-low.size // 8), _field_dtype(bits)
    vals = np.zeros(groups * 8, dtype=dt)
    vals[:n] = low
    rows = np.ascontiguousarray(vals.reshape(groups, 8).T)
    out = np.zeros((bits, groups), dtype=np.uint8)
    for j, k, shift in _field_pairs(bits):
        part = rows[j] << dt(shift) if shift >= 0 else rows[j] >> dt(-shift)
        out[k] |= part.astype(np.uint8)  # keeps the low byte
    return out.T.tobytes()[: (n * bits + 7) // 8]


def _unpack_fields(buf: NDArray[np.uint8], n: int, bits: int) -> NDArray[np.int64]:
    """Inverse of :func:`_pack_fields`: the first ``n`` fields."""
    groups, dt = -(-n // 8), _field_dtype(bits)
    raw = np.zeros(groups * bits, dtype=np.uint8)
    raw[: buf.size] = buf
    rows = np.ascontiguousarray(raw.reshape(groups, bits).T)
    out = np.zeros((8, groups), dtype=dt)
    for j, k, shift in _field_pairs(bits):
        part = rows[k].astype(dt)
        out[j] |= part >> dt(shift) if shift >= 0 else part << dt(-shift)
    out &= dt((1 << bits) - 1)
    return out.T.reshape(-1)[:n].astype(np.int64)
