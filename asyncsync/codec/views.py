"""Int views: a tensor's bytes seen as the integer dtype of the same width, and gathers.

Every diff, encoding and patch works on int views, so a delta is bitwise exact for every dtype
(NaN payloads, ``-0.0``, float8 and bool included) and float values are never compared.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray

from asyncsync.codec import native
from asyncsync.errors import ConfigError
from asyncsync.format.names import DTYPES, SAFETENSORS_CODES

__all__ = ["BY_CODE", "gather", "int_dtype", "int_view", "raw_clone", "raw_view"]

_INT_BY_WIDTH: dict[int, torch.dtype] = {
    1: torch.uint8,
    2: torch.int16,
    4: torch.int32,
    8: torch.int64,
}
_WIDTH_BY_INT: dict[torch.dtype, int] = {v: k for k, v in _INT_BY_WIDTH.items()}
_NP_BY_WIDTH: dict[int, np.dtype[Any]] = {w: np.dtype(f"<i{w}") for w in (2, 4, 8)}
_NP_BY_WIDTH[1] = np.dtype(np.uint8)


def int_dtype(dtype: torch.dtype) -> torch.dtype:
    """The integer dtype :func:`int_view` gives a tensor of ``dtype`` (a dict lookup: the engines
    ask once per tensor and version)."""
    target = _INT_BY_WIDTH.get(dtype.itemsize)
    if target is None:
        raise ConfigError(f"no integer view for {dtype} ({dtype.itemsize}-byte elements)")
    return target


def int_view(t: torch.Tensor) -> torch.Tensor:
    """Flat 1-D contiguous view of ``t``'s bytes as the integer dtype of the same element width.

    1 byte -> uint8, 2 -> int16, 4 -> int32, 8 -> int64. Copies only when ``t`` is not
    contiguous; stays on ``t``'s device. A 0-d tensor gives one element.
    """
    if not t.is_contiguous():  # copied as ints: a bool's copy writes 0/1 (see raw_view)
        return raw_view(t).contiguous().reshape(-1)
    flat = t if t.dim() == 1 else t.reshape(-1)  # (reshape costs ~3 us, called per tensor)
    target = int_dtype(t.dtype)
    return flat if flat.dtype == target else flat.view(target)


def raw_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` seen as the integer dtype of its width, same shape and strides (no copy, any
    layout). Copy through it to keep a tensor's bytes: torch copies a bool tensor's elements
    as 0 or 1 (``clone``, ``copy_``, ``contiguous``), and a bool's other bytes (a uint8 mask
    viewed as bool, ``torch.empty``) are what the diff reads and the engines hold."""
    target = int_dtype(t.dtype)
    return t if t.dtype == target else t.view(target)


def raw_clone(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` with its bytes (``clone`` through :func:`raw_view`)."""
    return raw_view(t).clone(memory_format=torch.contiguous_format).view(t.dtype)


def gather(
    flat: torch.Tensor, positions: torch.Tensor, idx: NDArray[np.int64] | None = None
) -> torch.Tensor:
    """``flat[positions]`` as a new tensor; on CPU by :func:`asyncsync.codec.native.take` (the C
    kernel, else NumPy's ``take``, ~2x torch's gather).

    ``idx`` is the same positions as a NumPy array when the caller already has one.
    """
    if flat.device.type != "cpu":
        return flat[positions.to(flat.device)]
    if idx is None:
        idx = positions.numpy()
    src = flat.numpy()
    out = np.empty(idx.shape, dtype=src.dtype)
    native.take(src, idx, out)
    return torch.from_numpy(out)


#: safetensors code -> torch dtype, of every dtype the format carries
BY_CODE: dict[str, torch.dtype] = {SAFETENSORS_CODES[n]: dt for n, dt in DTYPES.items()}
