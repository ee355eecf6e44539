"""The bytewise diff of tensor pairs: where each changed, the new values and ``old ^ new``.

On CPU with the native kernel (:mod:`asyncsync.codec.native`) one fused pass per tensor over
its 8-byte words writes each differing element's position, new value and XOR (about one
``torch.ne``); without it NumPy's ``!=``, ``flatnonzero`` and two gathers give the same result
about 3x slower. Accelerator tensors take the torch path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray

from asyncsync.codec import native
from asyncsync.codec.views import gather, int_view
from asyncsync.errors import ConfigError

__all__ = ["Change", "changed_positions", "diff_tensors"]


@dataclass(frozen=True)
class Change:
    """Where and how one tensor changed: sorted int64 ``positions``, the new elements there
    (``values``) and ``old ^ new`` there (``xor``), both of the tensor's int-view dtype."""

    positions: torch.Tensor
    values: torch.Tensor
    xor: torch.Tensor


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
    """One CPU pair through the C diff kernel (:func:`asyncsync.codec.native.diff`)."""
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
