"""Joining the parts of a tensor published in parts (format 2) into one whole-tensor update.

A tensor sliced across the ranks of a multi-rank publisher has one part per rank, each in that
rank's shards: its delta (positions relative to the part) or its full data (the part's
elements). Engines take each tensor once, whole (``receiver.engines.base``), so the agent
collects a tensor's parts as their shards are decoded and hands the engine one
:class:`~receiver.engines.base.TensorUpdate` when the last part arrives:

* delta, every part sparse: one sparse patch, each part's positions moved by its offset;
* delta, some part dense (xef only, op xor): one dense xor patch of the whole tensor, zero
  where no part changed it;
* full: the whole tensor, each part's elements copied to its offset.

Memory: a delta holds only the parts' patches; a full apply holds each parted tensor until
its last part arrives (with one slice per rank, up to the sliced tensors' size).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncsync.codec import Patch
from asyncsync.errors import FormatError
from asyncsync.format import Manifest, TensorEntry, TensorPart
from receiver.engines.base import TensorUpdate

__all__ = ["PartAssembler", "PartUpdate"]


@dataclass(frozen=True)
class PartUpdate:
    """One part's decoded data: a patch relative to the part, or its elements (1-D)."""

    entry: TensorEntry
    part: TensorPart
    patch: Patch | None = None
    full: torch.Tensor | None = None


class PartAssembler:
    """Collects the parts of each parted tensor of ``manifest`` applied in ``mode``."""

    def __init__(self, manifest: Manifest, mode: str) -> None:
        self.mode = mode
        self._want: dict[str, set[int]] = {}
        for e in manifest.tensors:
            if e.parts is not None:
                offs = {p.offset for p in e.parts if (p.delta if mode == "delta" else p.full)}
                if offs:
                    self._want[e.name] = offs
        self._got: dict[str, list[PartUpdate]] = {}

    def add(self, updates: list[TensorUpdate | PartUpdate]) -> list[TensorUpdate]:
        """The updates ready for the engine: whole tensors as they are, parted tensors whose
        last expected part is among ``updates``."""
        out: list[TensorUpdate] = []
        for u in updates:
            if isinstance(u, TensorUpdate):
                out.append(u)
                continue
            name = u.entry.name
            want = self._want.get(name)
            got = self._got.setdefault(name, [])
            if (
                want is None
                or u.part.offset not in want
                or any(g.part.offset == u.part.offset for g in got)
            ):
                raise FormatError(f"tensor {name!r}: unexpected part at {u.part.offset}")
            got.append(u)
            if len(got) == len(want):
                del self._got[name], self._want[name]
                got.sort(key=lambda g: g.part.offset)
                out.append(_join(u.entry, got))
        return out

    def check_done(self) -> None:
        """Raise FormatError if a parted tensor is still missing parts (after the last shard)."""
        if self._want:
            name = next(iter(self._want))
            have = {g.part.offset for g in self._got.get(name, [])}
            raise FormatError(
                f"tensor {name!r}: parts at {sorted(self._want[name] - have)} never arrived "
                f"(the manifest names them in its shards)"
            )


def _join(entry: TensorEntry, parts: list[PartUpdate]) -> TensorUpdate:
    if parts[0].full is not None:
        flat = torch.empty(entry.numel, dtype=entry.torch_dtype)
        for g in parts:
            assert g.full is not None
            flat[g.part.offset : g.part.offset + g.part.numel] = g.full.reshape(-1)
        return TensorUpdate(entry, full=flat.reshape(entry.shape))
    patches = [g.patch for g in parts if g.patch is not None]
    ops = {p.op for p in patches}
    if len(ops) != 1 or len(patches) != len(parts):
        raise FormatError(f"tensor {entry.name!r}: its parts' patches do not match")
    op = ops.pop()
    if all(p.positions is not None for p in patches):
        moved = [
            p.positions + g.part.offset
            for g, p in zip(parts, patches, strict=True)
            if p.positions is not None
        ]
        values = torch.cat([p.values for p in patches])
        return TensorUpdate(entry, patch=Patch(op, torch.cat(moved), values))
    if op != "xor":
        raise FormatError(f"tensor {entry.name!r}: a dense part needs the xor encoding")
    xor = torch.zeros(entry.numel, dtype=patches[0].values.dtype)
    for g, p in zip(parts, patches, strict=True):
        if p.positions is None:
            xor[g.part.offset : g.part.offset + g.part.numel] = p.values
        else:
            xor[p.positions + g.part.offset] = p.values
    return TensorUpdate(entry, patch=Patch("xor", None, xor))
