"""Applying a delta in place, undoably: the undo journal written before every patch, undo, and
the check of the patched bytes against the manifest.

Before an apply group writes, an undo record with the OLD values of every position it will
write is durable in the journal directory (:mod:`receiver.engines.checkpoint.journal`). Undo
writes the old values back, newest record first, so it is idempotent: a failed checksum, an
abort and a restart after a crash all run it, as often as needed.
"""

from __future__ import annotations

import mmap
from collections.abc import Mapping
from pathlib import Path

import torch

from asyncsync import fsio
from asyncsync.codec import Patch, apply_patch
from asyncsync.errors import EngineStateError
from asyncsync.format import TensorEntry
from receiver.engines.checkpoint import journal
from receiver.engines.st_layout import FileMaps, TensorLocation

__all__ = ["first_mismatch", "journal_and_patch", "undo"]

#: (name, location, flat int view of the mapped bytes, checked patch) of one tensor
Work = tuple[str, TensorLocation, torch.Tensor, Patch]


def journal_and_patch(
    maps: FileMaps, journal_dir: Path, seq: int, version: int, work: list[Work]
) -> None:
    """Write the undo record ``undo-{seq}`` of ``work`` durably, then patch the mapped bytes."""
    for _name, loc, _flat, patch in work:
        if _touches_most_pages(patch, loc):
            maps.prefault(loc)
    write_record(journal_dir / f"undo-{seq:06d}.safetensors", journal.encode(work, version))
    for _name, _loc, flat, patch in work:
        apply_patch(flat, patch)


def write_record(path: Path, record: bytes) -> None:
    """Make one undo record durable (temp file, fsync, rename, fsync of the directory)."""
    fsio.atomic_write(path, record)


def undo(journal_dir: Path, layout: Mapping[str, TensorLocation], maps: FileMaps) -> None:
    """Write back the old values of every undo record (newest first), then sync the maps."""
    for path in sorted(journal_dir.glob("undo-*.safetensors"), reverse=True):
        try:
            records = journal.read(path)
        except Exception as exc:
            raise EngineStateError(f"undo journal {path} is unreadable: {exc}") from exc
        for name, pos, old in records:
            loc = layout.get(name)
            if loc is None:
                raise EngineStateError(f"undo journal {path} names unknown tensor {name!r}")
            flat = maps.flat(loc)
            old = old.view(flat.dtype)
            if pos is None:
                flat.copy_(old)
            elif pos.numel():
                flat.index_copy_(0, pos, old)
            del flat
    maps.sync()


def first_mismatch(
    maps: FileMaps,
    layout: Mapping[str, TensorLocation],
    entries: Mapping[str, TensorEntry],
    touched: set[str],
    algorithm: str,
    held: Mapping[str, str] | None,
) -> tuple[str, str] | None:
    """(name, checksum) of the first tensor whose new bytes differ from its manifest entry.

    Touched tensors and those the manifest says changed are hashed from the files; the others
    are compared by the checksum recorded for the version held (``held``: None when it was
    recorded with another algorithm, then they are not compared).
    """
    for name, e in entries.items():
        if name in touched or e.changed > 0:
            got = maps.checksum(layout[name], algorithm, e.layout)
        elif held is not None:
            got = held.get(name, e.checksum)
        else:
            continue
        if got != e.checksum:
            return name, got
    return None


def _touches_most_pages(patch: Patch, loc: TensorLocation) -> bool:
    """At least one changed element per page on average (then ~2/3 of the pages or more are
    written): prefaulting the whole range is cheaper than faulting page by page."""
    if patch.positions is None:
        return True
    return patch.positions.numel() * mmap.PAGESIZE >= loc.nbytes
