"""Lossless sparse-delta codecs: how one tensor's change between two versions goes on the wire.

Everything works on *int views* (:func:`int_view`): a tensor's bytes seen as the integer dtype of
the same width, so a delta is bitwise exact for every dtype (NaN payloads, ``-0.0``, float8 and
bool included) and float values are never compared. All byte layouts are little-endian (the
hosts we run on are). Encodings, per tensor, with ``n`` changed elements out of ``numel``:

``indices``      positions as int32 absolute indices (int64 when numel > 2**31-1); values raw.
``deltas``       positions as gaps ``idx[k] - idx[k-1] - 1`` (``idx[-1] = -1``) in the narrowest
                 of uint16/uint32/uint64 holding the largest gap; values raw.
``deltas_zstd``  the ``deltas`` positions blob compressed with zstd level 1; values raw.
``xef``          (default) Elias-Fano positions; values are ``new ^ old`` (the receiver holds
                 old) split into byte planes (all byte 0s, then all byte 1s, ...) and zstd'd.
                 The high planes of a small float update's XOR are almost all zero, so they
                 vanish under zstd. Above :data:`DENSE_THRESHOLD` changed/numel, no positions
                 are stored and the whole-tensor XOR (zero where unchanged) is sent instead.

The first three are the generation-1 baselines of the slime project: always mode "sparse",
patch op "set". xef patches XOR. A sparse xef positions blob is one header byte
(``L | 0x80`` when the rest is zstd-compressed, which is kept only when smaller) followed by the
Elias-Fano payload of :mod:`asyncsync.ef` (about ``L + 2`` bits per position).

``changed == 0`` encodes as two empty blobs in every encoding. Decoding validates everything and
raises :class:`~asyncsync.errors.FormatError` on any inconsistency; decompressed sizes are known
in advance, so a hostile blob cannot make the decoder allocate more than the tensor's size.

On CPU the diff (:func:`diff_tensors`), the sparse patch (:func:`apply_patch`) and the
Elias-Fano coder run in the optional C extension ``asyncsync._native`` (``asyncsync/_native.c``):
one pass over the 8-byte words of old and new that writes each differing element's position,
new value and ``old ^ new`` (about one ``torch.ne``; the NumPy path's ``!=``, ``flatnonzero``
and two ``take`` gathers cost ~3x), and one loop that saves the old values and patches.
:data:`NATIVE` says whether it is in use (not when it did not build or ``ASYNCSYNC_NATIVE=0``);
the switch is :data:`asyncsync.native.kernels`, read at call time, and the NumPy fallback's
results are byte-identical. Accelerator tensors always take the torch path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
import zstandard
from numpy.typing import NDArray

from asyncsync import ef, native
from asyncsync.errors import ConfigError, FormatError

__all__ = [
    "DEFAULT_ENCODING",
    "DENSE_THRESHOLD",
    "ENCODINGS",
    "NATIVE",
    "Change",
    "EncodedDelta",
    "Patch",
    "apply_patch",
    "changed_positions",
    "decode_delta",
    "diff_tensors",
    "encode_delta",
    "encoded_size",
    "gather",
    "int_view",
]

ENCODINGS: tuple[str, ...] = ("xef", "indices", "deltas", "deltas_zstd")
DEFAULT_ENCODING = "xef"
# xef sends dense (no positions, the whole-tensor XOR) when changed/numel exceeds this. Measured
# (docs/CODEC.md): sparse is smaller below ~0.8 for bf16 Adam steps and ~0.99 for fp32 or random
# bytes, as dense pays for the zero pattern once per byte plane. Above 0.8 dense costs at most
# ~5 % more (nothing at 100 %) and skips the gather and Elias-Fano work, which dominate there.
DENSE_THRESHOLD = 0.8

_INT_BY_WIDTH: dict[int, torch.dtype] = {
    1: torch.uint8,
    2: torch.int16,
    4: torch.int32,
    8: torch.int64,
}
_WIDTH_BY_INT: dict[torch.dtype, int] = {v: k for k, v in _INT_BY_WIDTH.items()}
_NP_BY_WIDTH: dict[int, np.dtype[Any]] = {w: np.dtype(f"<i{w}") for w in (2, 4, 8)}
_NP_BY_WIDTH[1] = np.dtype(np.uint8)
_GAP_DTYPES: dict[int, np.dtype[Any]] = {w: np.dtype(f"<u{w}") for w in (2, 4, 8)}
_INDEX32_MAX = 2**31 - 1
_EF_ZSTD = 0x80
_EF_ZSTD_LEVEL = 1
_DELTAS_ZSTD_LEVEL = 1

_Int64Array = NDArray[np.int64]
NATIVE: bool = native.kernels is not None  # the C kernels run on CPU (see the module docstring)


@dataclass(frozen=True)
class EncodedDelta:
    """One tensor's encoded change; ``mode == "dense"``: no positions, values cover all elements."""

    encoding: str
    mode: Literal["sparse", "dense"]
    changed: int
    positions: bytes
    values: bytes
    raw_bytes: int  # positions + values before any compression (for metrics)


@dataclass(frozen=True)
class Patch:
    """A decoded delta. ``set``: ``flat[pos] = values``; ``xor``: ``flat[pos] ^= values``.

    ``positions`` is sorted int64, or ``None`` for every element (dense); ``values`` has the
    target's int-view dtype.
    """

    op: Literal["set", "xor"]
    positions: torch.Tensor | None
    values: torch.Tensor


@dataclass(frozen=True)
class Change:
    """Where and how one tensor changed: sorted int64 ``positions``, the new elements there
    (``values``) and ``old ^ new`` there (``xor``), both of the tensor's int-view dtype."""

    positions: torch.Tensor
    values: torch.Tensor
    xor: torch.Tensor


def int_view(t: torch.Tensor) -> torch.Tensor:
    """Flat 1-D contiguous view of ``t``'s bytes as the integer dtype of the same element width.

    1 byte -> uint8, 2 -> int16, 4 -> int32, 8 -> int64. Copies only when ``t`` is not
    contiguous; stays on ``t``'s device. A 0-d tensor gives one element.
    """
    target = _INT_BY_WIDTH.get(t.element_size())
    if target is None:
        raise ConfigError(f"no integer view for {t.dtype} ({t.element_size()}-byte elements)")
    flat = t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)
    return flat if flat.dtype == target else flat.view(target)


def changed_positions(
    olds: Sequence[torch.Tensor], news: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """Sorted int64 flat positions where each ``new`` differs bytewise from its ``old``.

    On CPU with the native kernel: its positions-only pass, tensor by tensor. Otherwise all
    pairs share one bool mask buffer and one extraction of its set positions, split at the
    tensor boundaries with one host sync; positions are relative to each tensor's start. On
    CPU the compare and the extraction run in NumPy (``!=`` then ``flatnonzero``), which on
    the machines we measured is about 3x faster than ``torch.ne`` + ``torch.nonzero``; on an
    accelerator they run in torch (one ``torch.nonzero``).
    """
    numels = _check_pairs(olds, news)
    if not olds:
        return []
    if olds[0].device.type != "cpu":
        return _changed_positions_torch(olds, news, numels)
    if native.kernels is not None:
        return [
            torch.from_numpy(_native_diff(o, n, False)[0]) for o, n in zip(olds, news, strict=True)
        ]
    return _changed_positions_numpy(olds, news, numels)


def diff_tensors(olds: Sequence[torch.Tensor], news: Sequence[torch.Tensor]) -> list[Change]:
    """The :class:`Change` of each ``old -> new`` pair (any dtype; compared bytewise).

    On CPU with the native kernel, one fused pass per tensor finds the positions and gathers
    the new values and XORs; otherwise :func:`changed_positions` and then two gathers.
    """
    numels = _check_pairs(olds, news)
    if not olds:
        return []
    cpu = olds[0].device.type == "cpu"
    if cpu and native.kernels is not None:
        return [
            Change(*map(torch.from_numpy, _native_diff(o, n, True)))
            for o, n in zip(olds, news, strict=True)
        ]
    ov, nv = [int_view(o) for o in olds], [int_view(n) for n in news]
    positions = (_changed_positions_numpy if cpu else _changed_positions_torch)(ov, nv, numels)
    out = []
    for o, n, pos in zip(ov, nv, positions, strict=True):
        values = gather(n, pos)
        out.append(Change(pos, values, gather(o, pos).bitwise_xor_(values)))
    return out


def _native_diff(old: torch.Tensor, new: torch.Tensor, values: bool) -> list[NDArray[Any]]:
    """One CPU pair through the C diff kernel (:func:`asyncsync.native.diff`)."""
    return native.diff(int_view(old).numpy(), int_view(new).numpy(), values)


def _check_pairs(olds: Sequence[torch.Tensor], news: Sequence[torch.Tensor]) -> list[int]:
    """Each pair's numel, after checking the pairs match in dtype, shape and device."""
    if len(olds) != len(news):
        raise ConfigError(f"{len(olds)} old tensors but {len(news)} new ones")
    numels: list[int] = []
    for i, (old, new) in enumerate(zip(olds, news, strict=True)):
        if old.dtype != new.dtype or old.shape != new.shape:
            raise ConfigError(
                f"tensor {i}: old is {old.dtype}{list(old.shape)}, new is {new.dtype}"
                f"{list(new.shape)}; they must match"
            )
        if old.device != olds[0].device or new.device != olds[0].device:
            raise ConfigError(f"tensor {i}: all tensors must be on {olds[0].device}")
        numels.append(old.numel())
    return numels


def _changed_positions_torch(
    olds: Sequence[torch.Tensor], news: Sequence[torch.Tensor], numels: list[int]
) -> list[torch.Tensor]:
    device = olds[0].device
    mask = torch.empty(sum(numels), dtype=torch.bool, device=device)
    start = 0
    for old, new, numel in zip(olds, news, numels, strict=True):
        torch.ne(int_view(old), int_view(new), out=mask[start : start + numel])
        start += numel
    pos = torch.nonzero(mask).view(-1)
    if len(numels) == 1:
        return [pos]
    ends = torch.tensor(numels, dtype=torch.int64).cumsum(0).to(device)
    cuts = torch.searchsorted(pos, ends)  # number of positions before each tensor's end
    counts = torch.diff(cuts, prepend=cuts.new_zeros(1))
    starts = ends - torch.tensor(numels, dtype=torch.int64, device=device)
    rel = pos - starts[torch.searchsorted(ends, pos, right=True)]
    return list(torch.split(rel, counts.tolist()))


def _changed_positions_numpy(
    olds: Sequence[torch.Tensor], news: Sequence[torch.Tensor], numels: list[int]
) -> list[torch.Tensor]:
    mask = np.empty(sum(numels), dtype=np.bool_)
    start = 0
    for old, new, numel in zip(olds, news, numels, strict=True):
        np.not_equal(int_view(old).numpy(), int_view(new).numpy(), out=mask[start : start + numel])
        start += numel
    pos = np.flatnonzero(mask)
    ends = np.cumsum(numels)
    cuts = np.searchsorted(pos, ends)
    out, lo, begin = [], 0, 0
    for cut, numel in zip(cuts.tolist(), numels, strict=True):
        out.append(torch.from_numpy(pos[lo:cut] - begin))
        lo, begin = cut, begin + numel
    return out


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
    result is byte-identical either way.
    """
    _check_encoding(encoding)
    if old.dtype != new.dtype or old.dtype not in _WIDTH_BY_INT:
        raise ConfigError(f"old/new must be int views of one dtype, got {old.dtype}, {new.dtype}")
    if old.dim() != 1 or new.shape != old.shape:
        raise ConfigError(f"old/new must be 1-D of equal length, got {old.shape}, {new.shape}")
    if positions.dtype != torch.int64 or positions.dim() != 1:
        raise ConfigError(f"positions must be 1-D int64, got {positions.dtype}{positions.shape}")
    if not zstandard.MAX_COMPRESSION_LEVEL >= level >= -(1 << 17):
        raise ConfigError(f"zstd level {level} out of range")
    numel, n, width = old.numel(), positions.numel(), old.element_size()
    if n == 0:
        return EncodedDelta(encoding, "sparse", 0, b"", b"", 0)
    if n > numel:
        raise ConfigError(f"{n} positions for a tensor of {numel} elements")
    for what, given in (("values", values), ("xor", xor)):
        if given is not None and (given.dtype != old.dtype or given.shape != positions.shape):
            raise ConfigError(f"{what} must be {old.dtype}[{n}], got {given.dtype}{given.shape}")
    if encoding == "xef" and n > DENSE_THRESHOLD * numel:
        dense = torch.bitwise_xor(new, old)
        n = int(torch.count_nonzero(dense))  # exact even if positions held unchanged elements
        return EncodedDelta(encoding, "dense", n, b"", _zstd(_planes(dense), level), numel * width)
    pos = positions.to(old.device)
    idx: _Int64Array = np.ascontiguousarray(positions.cpu().numpy(), dtype=np.int64)
    if encoding == "xef":
        pblob, praw = _ef_encode(idx, numel)  # checks the positions (ConfigError)
        if xor is None:
            xor = torch.bitwise_xor(gather(new, pos, idx), gather(old, pos, idx))
        vblob = _zstd(_planes(xor), level)
        return EncodedDelta(encoding, "sparse", n, pblob, vblob, praw + n * width)
    if idx[0] < 0 or idx[-1] >= numel or not bool(np.all(idx[1:] > idx[:-1])):
        raise ConfigError("positions must be strictly increasing and within the tensor")
    if values is None:
        values = gather(new, pos, idx)
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


def gather(
    flat: torch.Tensor, positions: torch.Tensor, idx: NDArray[np.int64] | None = None
) -> torch.Tensor:
    """``flat[positions]`` as a new tensor; on CPU through NumPy's ``take`` (~2x torch's gather).

    ``idx`` is the same positions as a NumPy array when the caller already has one.
    """
    if flat.device.type != "cpu":
        return flat[positions.to(flat.device)]
    if idx is None:
        idx = positions.numpy()
    return torch.from_numpy(np.take(flat.numpy(), idx))


def decode_delta(
    encoding: str,
    mode: str,
    positions: bytes,
    values: bytes,
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
        xor = _unplanes(_unzstd(values, (numel * width,), "dense values"), numel, width)
        if int(torch.count_nonzero(xor)) != changed:
            raise FormatError(f"dense values change {int(torch.count_nonzero(xor))}, not {changed}")
        return Patch(op, None, xor)
    if mode != "sparse":
        raise FormatError(f"unknown mode {mode!r}")
    if changed == 0:
        if positions or values:
            raise FormatError("changed == 0 but the blobs are not empty")
        return Patch(op, torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=dtype))
    if encoding == "xef":
        idx = _ef_decode(positions, changed, numel)
        vals = _unplanes(_unzstd(values, (changed * width,), "values"), changed, width)
    else:
        idx = _baseline_positions(encoding, positions, changed, numel)
        if len(values) != changed * width:
            raise FormatError(f"values blob is {len(values)} bytes, want {changed * width}")
        vals = torch.from_numpy(np.frombuffer(values, _NP_BY_WIDTH[width]).copy())
    return Patch(op, torch.from_numpy(idx), vals)


def apply_patch(flat: torch.Tensor, patch: Patch, *, old_out: torch.Tensor | None = None) -> None:
    """Apply ``patch`` in place to ``flat`` (a 1-D int view, on any device).

    ``old_out``: first save there the values the patch overwrites: ``flat[positions]`` (one per
    position) or, for a dense patch, all of ``flat``; it must have ``flat``'s dtype. On CPU with
    the native kernel a sparse patch saves and patches in one pass.
    """
    if flat.dim() != 1 or flat.dtype != patch.values.dtype:
        raise ConfigError(
            f"patch of {patch.values.dtype} cannot apply to {flat.dtype}{list(flat.shape)}"
        )
    if patch.op not in ("set", "xor"):
        raise ConfigError(f"unknown patch op {patch.op!r}")
    pos, values = patch.positions, patch.values.to(flat.device)
    want = flat.numel() if pos is None else pos.numel()
    if old_out is not None and (old_out.dtype != flat.dtype or old_out.shape != (want,)):
        raise ConfigError(
            f"old_out must be {flat.dtype}[{want}], got {old_out.dtype}{old_out.shape}"
        )
    if pos is None:
        if values.numel() != flat.numel():
            raise ConfigError(f"dense patch of {values.numel()} values for {flat.numel()}")
        if old_out is not None:
            old_out.copy_(flat)
        if patch.op == "set":
            flat.copy_(values)
        else:
            flat.bitwise_xor_(values)
        return
    if pos.numel() != values.numel():
        raise ConfigError(f"{pos.numel()} positions but {values.numel()} values")
    if pos.numel() == 0:
        return
    if pos.device.type == "cpu" and int(pos[-1]) >= flat.numel():
        raise ConfigError(f"position {int(pos[-1])} outside a tensor of {flat.numel()}")
    if native.kernels is not None and _native_patch(flat, patch.op, pos, values, old_out):
        return
    if old_out is not None:
        old_out.copy_(gather(flat, pos))
    if flat.device.type == "cpu":  # NumPy fancy indexing: no intra-op thread pool to contend on
        arr, idx, vals = flat.numpy(), pos.numpy(), values.numpy()
        if patch.op == "set":
            arr[idx] = vals
        else:
            arr[idx] ^= vals
        return
    pos = pos.to(flat.device)
    if patch.op == "set":
        flat.index_copy_(0, pos, values)
    else:
        flat.index_put_((pos,), flat.index_select(0, pos).bitwise_xor_(values))


def _native_patch(
    flat: torch.Tensor, op: str, pos: torch.Tensor, values: torch.Tensor, old: torch.Tensor | None
) -> bool:
    """Save-and-patch in the C kernel; False (nothing done) when a tensor does not suit it."""
    tensors = (flat, pos, values) if old is None else (flat, pos, values, old)
    if pos.dtype != torch.int64 or any(
        t.device.type != "cpu" or not t.is_contiguous() for t in tensors
    ):
        return False
    kernel = native.kernels.set_patch if op == "set" else native.kernels.xor_patch
    kernel(
        flat.numpy(),
        flat.element_size(),
        pos.numpy(),
        values.numpy(),
        None if old is None else old.numpy(),
    )
    return True


def encoded_size(enc: EncodedDelta) -> int:
    """Wire bytes of ``enc``: positions plus values."""
    return len(enc.positions) + len(enc.values)


# ---------------------------------------------------------------------------------------------


def _check_encoding(encoding: str) -> None:
    if encoding not in ENCODINGS:
        raise ConfigError(f"unknown encoding {encoding!r}; use one of {', '.join(ENCODINGS)}")


def _zstd(data: bytes | memoryview, level: int) -> bytes:
    return zstandard.ZstdCompressor(level=level).compress(data)


def _unzstd(blob: bytes, sizes: tuple[int, ...], what: str) -> bytes:
    """Decompress one zstd frame whose declared content size must be one of ``sizes``."""
    try:
        declared = zstandard.frame_content_size(blob)
        if declared not in sizes:  # also rejects frames of unknown size (-1): unbounded
            raise FormatError(f"{what}: zstd frame declares {declared} bytes, want {sizes}")
        out = zstandard.ZstdDecompressor().decompress(blob) if declared else b""
    except zstandard.ZstdError as exc:
        raise FormatError(f"{what}: corrupt zstd data: {exc}") from exc
    if len(out) != declared:
        raise FormatError(f"{what}: decompressed {len(out)} bytes, frame declares {declared}")
    return out


def _planes(v: torch.Tensor) -> memoryview:
    """A 1-D int tensor's bytes as byte planes (all byte 0s, then all byte 1s, ...), on CPU."""
    width, u8 = v.element_size(), v.contiguous().view(torch.uint8)
    if width > 1:  # one strided copy per plane: several times faster than a transpose copy
        planes = torch.empty((width, v.numel()), dtype=torch.uint8, device=v.device)
        for k in range(width):
            planes[k].copy_(u8[k::width])
        u8 = planes.view(-1)
    return u8.cpu().numpy().data


def _unplanes(raw: bytes, n: int, width: int) -> torch.Tensor:
    """Inverse of :func:`_planes`: an owned, writable (n,) tensor of the int-view dtype."""
    src = np.frombuffer(raw, np.uint8)
    out = np.empty(n * width, dtype=np.uint8)
    for k in range(width):
        out[k::width] = src[k * n : (k + 1) * n]
    return torch.from_numpy(out.view(_NP_BY_WIDTH[width]))


def _ef_encode(idx: _Int64Array, numel: int) -> tuple[bytes, int]:
    """The xef positions blob of sorted ``idx``, and the size of its uncompressed payload."""
    payload, low_bits = ef.encode(idx, numel)
    packed = _zstd(payload, _EF_ZSTD_LEVEL)
    if len(packed) < len(payload):
        return bytes([low_bits | _EF_ZSTD]) + packed, len(payload)
    return bytes([low_bits]) + payload, len(payload)


def _ef_decode(blob: bytes, n: int, numel: int) -> _Int64Array:
    """The ``n`` positions of an xef positions blob (FormatError if it is not valid)."""
    low_bits = ef.low_bits(n, numel)
    if not blob or blob[0] & ~_EF_ZSTD != low_bits:
        raise FormatError(f"Elias-Fano header {blob[:1]!r} does not match L={low_bits}")
    payload: bytes | memoryview = memoryview(blob)[1:]
    if blob[0] & _EF_ZSTD:
        payload = _unzstd(blob[1:], (sum(ef.sizes(n, numel, low_bits)),), "positions")
    return ef.decode(payload, n, numel)


def _baseline_positions(encoding: str, blob: bytes, n: int, numel: int) -> _Int64Array:
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
