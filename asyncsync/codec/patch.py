"""Patches: a decoded delta applied in place to a flat int view (``set`` or ``xor``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from asyncsync.codec import native
from asyncsync.codec.views import gather
from asyncsync.errors import ConfigError

__all__ = ["Patch", "apply_patch"]


@dataclass(frozen=True)
class Patch:
    """A decoded delta. ``set``: ``flat[pos] = values``; ``xor``: ``flat[pos] ^= values``.

    ``positions`` is sorted int64, or ``None`` for every element (dense); ``values`` has the
    target's int-view dtype. ``positions_xef``: the xef positions blob (FORMAT.md 4.2) that
    ``positions`` were decoded from, when they were; an undo journal keeps it as it is instead
    of coding the positions again, and the CPU kernels check only its ends. It is honoured
    only as :meth:`decoded_xef` returns it: for a Patch made by :meth:`of_xef` (the decoder)
    whose positions are still those it was made with.
    """

    op: Literal["set", "xor"]
    positions: torch.Tensor | None
    values: torch.Tensor
    positions_xef: bytes | memoryview | None = field(default=None, compare=False, repr=False)
    # (address, length, version counter, blob) of the decoded positions
    _xef_key: tuple[int, int, int, bytes | memoryview] | None = field(
        default=None, compare=False, repr=False
    )
    # (positions, values, their NumPy arrays, their addresses) as the decoder made them
    _arrays: tuple[torch.Tensor, torch.Tensor, Any, Any, int, int] | None = field(
        default=None, compare=False, repr=False
    )

    @classmethod
    def of_xef(
        cls,
        op: Literal["set", "xor"],
        positions: torch.Tensor,
        values: torch.Tensor,
        blob: bytes | memoryview,
        arrays: tuple[Any, Any] | None = None,
    ) -> Patch:
        """A Patch whose ``positions`` the caller decoded from ``blob`` (and checked: strictly
        increasing within the tensor), so that :meth:`decoded_xef` vouches for the blob.
        ``arrays``: the NumPy arrays that ``positions`` and ``values`` are made from (for
        :meth:`arrays`)."""
        kept = None
        if arrays is not None:
            kept = (positions, values, *arrays, positions.data_ptr(), values.data_ptr())
        return cls(op, positions, values, blob, (*_identity(positions), blob), kept)

    def arrays(self) -> tuple[Any, Any]:
        """NumPy views of ``positions`` (None when dense) and ``values`` (CPU tensors): those
        the decoder made them from while they are still its tensors over the same memory (a
        ``.numpy()`` costs ~3 us, several per tensor at a MoE model's tens of thousands of
        small tensors), else new ones."""
        a, pos, values = self._arrays, self.positions, self.values
        if (
            a is not None
            and a[0] is pos
            and a[1] is values
            and a[4] == a[0].data_ptr()
            and a[5] == values.data_ptr()
            and a[3].size == values.numel()  # not resized in place (a view would overrun)
            and a[2].size == a[0].numel()
        ):
            return a[2], a[3]
        return (None if pos is None else pos.numpy()), values.numpy()

    def decoded_xef(self) -> bytes | memoryview | None:
        """``positions_xef`` if this Patch was made by :meth:`of_xef` and its positions are the
        very ones it was made with (the same memory, not written since, the same blob), else
        None: a Patch made up by hand, or altered with ``dataclasses.replace`` or in place,
        is checked and journaled from its positions, never from a blob that may not be
        theirs."""
        key, pos, blob = self._xef_key, self.positions, self.positions_xef
        if key is None or pos is None or blob is None or key[3] is not blob:
            return None
        return blob if _identity(pos) == key[:3] else None


def _identity(t: torch.Tensor) -> tuple[int, int, int]:
    """Where ``t``'s elements are and how often they were written in place (views share it).
    (``data_ptr`` is the storage's address plus the offset: one call, not three.)"""
    return (t.data_ptr(), t.numel(), t._version)


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
    if flat.device.type != "cpu":
        _device_patch(flat, patch.op, pos.to(flat.device), values, old_out)
        return
    if old_out is not None:
        old_out.copy_(gather(flat, pos))
    # NumPy fancy indexing: no intra-op thread pool to contend on
    arr, idx, vals = flat.numpy(), pos.numpy(), values.numpy()
    if patch.op == "set":
        arr[idx] = vals
    else:
        arr[idx] ^= vals


def _device_patch(
    flat: torch.Tensor, op: str, pos: torch.Tensor, values: torch.Tensor, old: torch.Tensor | None
) -> None:
    """A sparse patch on the device: the positions copied there once, one gather (the old
    values, which an XOR also needs), one scatter."""
    if op == "set":
        if old is not None:
            torch.index_select(flat, 0, pos, out=old)
        flat.index_copy_(0, pos, values)
        return
    before = flat.index_select(0, pos)
    if old is not None:
        old.copy_(before)
    flat.index_copy_(0, pos, before.bitwise_xor_(values))


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
