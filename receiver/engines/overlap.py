"""Memory that several names of a module share: tied weights, views of one flat buffer.

A ``torch.nn.Module`` may register one buffer together with views of it (FSDP-1's flat
parameters, a fused QKV weight with its q/k/v blocks): the state dict then names some bytes
more than once, and a version's delta patches those bytes once per name. XOR patches applied
twice cancel, so an engine patches each byte of such memory once per version: :class:`Covered`
keeps the bytes a version's patches already wrote (a contiguous tensor's whole span: its patch
made every byte of it what the version says) and drops the elements of a later patch that fall
there. What the names share is then what each carries (a trainer whose views are views of its
buffer sends consistent ones); a version whose names disagree on shared bytes is caught by the
commit's checksums of every such name.

An element only partly inside what was written (views of one buffer with different element
widths, split mid-element) is patched in full: such a version is then refused by the checksum,
as before, never held wrong.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from typing import Any

import torch

from asyncsync.codec import Patch

__all__ = ["Covered", "apart", "span", "touched"]

Span = tuple[Any, int, int]


def span(t: torch.Tensor) -> Span:
    """(device, first byte, end) of the memory ``t``'s elements occupy."""
    if t.numel() == 0:
        return (t.device, 0, 0)
    extent = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
    return (t.device, t.data_ptr(), t.data_ptr() + extent * t.element_size())


def apart(spans: dict[str, Span]) -> set[str]:
    """The names whose span shares no byte with another name's."""
    out: set[str] = set()
    by_device: dict[str, list[tuple[int, int, str]]] = {}
    for name, (device, lo, hi) in spans.items():
        if lo == hi:
            out.add(name)  # no bytes
        else:
            by_device.setdefault(str(device), []).append((lo, hi, name))
    for items in by_device.values():
        items.sort()
        reach = -1  # the furthest end of the spans that start before this one
        for i, (lo, hi, name) in enumerate(items):
            after = items[i + 1][0] if i + 1 < len(items) else hi  # later ones start later
            if reach <= lo and after >= hi:
                out.add(name)
            reach = max(reach, hi)
    return out


def touched(written: Iterable[Span], spans: dict[str, Span]) -> set[str]:
    """The names of ``spans`` that share a byte with one of the ``written`` spans."""
    merged: dict[str, tuple[list[int], list[int]]] = {}  # device -> disjoint (starts, ends)
    for device, lo, hi in sorted(written, key=lambda s: (str(s[0]), s[1])):
        starts, ends = merged.setdefault(str(device), ([], []))
        if lo == hi:
            continue
        if ends and lo <= ends[-1]:
            ends[-1] = max(ends[-1], hi)
        else:
            starts.append(lo)
            ends.append(hi)
    out: set[str] = set()
    for name, (device, lo, hi) in spans.items():
        starts, ends = merged.get(str(device), ([], []))
        i = bisect.bisect_left(starts, hi)  # the written spans that start before this one ends
        if lo < hi and i and ends[i - 1] > lo:
            out.add(name)
    return out


def _addresses(t: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The first byte of each of ``t``'s elements at ``positions`` (row-major flat indices)."""
    if t.is_contiguous():
        offsets = positions
    else:
        offsets, rest = torch.zeros_like(positions), positions
        for n, st in zip(reversed(t.shape), reversed(t.stride()), strict=True):
            offsets += (rest % n) * st
            rest = rest // n
    return t.data_ptr() + offsets * t.element_size()


class Covered:
    """The bytes of one device a version's patches have written so far, as disjoint sorted
    ``[start, end)`` intervals (see the module docstring). Not thread-safe: an engine patches
    all the names of shared memory of one device on one thread, one after another."""

    def __init__(self) -> None:
        self.starts = torch.empty(0, dtype=torch.int64)
        self.ends = torch.empty(0, dtype=torch.int64)

    def _inside(self, lo: torch.Tensor, size: int) -> torch.Tensor:
        """Whether each ``[lo, lo + size)`` lies wholly inside one written interval."""
        starts, ends = self.starts.to(lo.device), self.ends.to(lo.device)
        i = torch.searchsorted(starts, lo, right=True) - 1
        return (i >= 0) & (ends[i.clamp(min=0)] >= lo + size)

    def drop_written(self, t: torch.Tensor, patch: Patch) -> Patch:
        """``patch`` (for ``t``, values as its int view) less its elements whose bytes a patch
        of this version already wrote; ``patch`` itself where there are none."""
        if not self.starts.numel() or t.numel() == 0:
            return patch
        size = t.element_size()
        if patch.positions is None and t.is_contiguous():
            if patch.op == "set":  # writes what is there already
                return patch
            base, values = t.data_ptr(), patch.values
            first = int(torch.searchsorted(self.ends, base, right=True))
            last = int(torch.searchsorted(self.starts, base + t.numel() * size))
            ranges = zip(
                self.starts[first:last].tolist(), self.ends[first:last].tolist(), strict=True
            )
            for lo, hi in ranges:
                a, b = -(-max(lo - base, 0) // size), (hi - base) // size  # whole elements
                if a < b:
                    if values is patch.values:
                        values = values.clone()
                    values[a:b] = 0  # ^0 leaves the bytes as they are
            return patch if values is patch.values else Patch("xor", None, values)
        pos = patch.positions
        if pos is None:  # dense over a tensor that is not contiguous: as positions
            pos = torch.arange(t.numel(), dtype=torch.int64, device=patch.values.device)
        written = self._inside(_addresses(t, pos), size)
        if patch.positions is not None and not bool(written.any()):
            return patch
        keep = ~written
        return Patch(patch.op, pos[keep], patch.values[keep.to(patch.values.device)])

    def add(self, t: torch.Tensor, patch: Patch) -> None:
        """Record the bytes ``patch``, just applied to ``t``, made what the version says."""
        if t.numel() == 0:
            return
        size = t.element_size()
        if t.is_contiguous():
            lo = torch.tensor([t.data_ptr()], dtype=torch.int64)
            hi = lo + t.numel() * size
        else:
            pos = patch.positions
            if pos is None:
                pos = torch.arange(t.numel(), dtype=torch.int64)
            lo = _addresses(t, pos.to("cpu"))
            hi = lo + size
        starts, order = torch.sort(torch.cat([self.starts, lo]))
        ends = torch.cat([self.ends, hi])[order]
        reach = torch.cummax(ends, 0).values
        head = torch.ones_like(starts, dtype=torch.bool)
        head[1:] = starts[1:] > reach[:-1]  # a new interval: starts after all before it end
        last = torch.cat([torch.nonzero(head).reshape(-1)[1:] - 1, torch.tensor([len(starts) - 1])])
        self.starts, self.ends = starts[head], reach[last]
