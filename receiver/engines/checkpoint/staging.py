"""Applying a full version: new files written to the staging directory and verified, before
the engine moves them into place (:meth:`LocalCheckpoint.commit`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import safetensors.torch
import torch

from asyncsync import fsio
from asyncsync.codec import raw_view
from asyncsync.errors import ApplyFailed, ChecksumMismatch, EngineStateError, IncompatibleVersion
from asyncsync.format import TensorEntry
from asyncsync.format.checksum import entry_checksum
from receiver.engines.st_layout import TensorLocation, read_layout

__all__ = ["check_staged", "stage_part", "staged_layout"]


def stage_part(
    staging: Path, part: str, items: list[tuple[TensorEntry, torch.Tensor]], algorithm: str
) -> dict[str, str]:
    """Write ``items`` durably as the staged file ``part``; the checksum of each tensor."""
    tensors: dict[str, torch.Tensor] = {}
    sums: dict[str, str] = {}
    ptrs: set[int] = set()
    for entry, t in items:
        if t.dtype != entry.torch_dtype or tuple(t.shape) != entry.shape:
            raise ApplyFailed(
                f"tensor {entry.name!r}: got {t.dtype}{list(t.shape)}, manifest says "
                f"{entry.dtype}{list(entry.shape)}"
            )
        # copied as ints: a non-contiguous bool's own copy writes 0/1, not its bytes
        t = raw_view(t.detach()).cpu().contiguous().view(t.dtype)
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and ptr in ptrs:  # safetensors refuses shared storage
            t = t.clone()
        ptrs.add(ptr)
        tensors[entry.name] = t
        sums[entry.name] = entry_checksum(entry, t, algorithm)
    path = staging / part
    safetensors.torch.save_file(tensors, path, metadata={"format": "pt"})
    fd = os.open(path, os.O_RDONLY)
    try:
        # readable by an inference server running as another user (0644 like the index),
        # whatever this receiver's umask
        os.fchmod(fd, fsio.FILE_MODE)
        os.fsync(fd)
    finally:
        os.close(fd)
    return sums


def check_staged(
    entries: Mapping[str, TensorEntry],
    staged: Mapping[str, tuple[str, str]],
    version: int,
    held: int | None,
    staging: Path,
) -> None:
    """Every tensor of the version arrived, with the checksum its entry records."""
    for name, e in entries.items():
        if name not in staged:
            raise ApplyFailed(f"v{version}: tensor {name!r} never arrived")
        part, got = staged[name]
        if got != e.checksum:
            raise ChecksumMismatch(
                f"tensor {name!r} of v{version}: checksum {got} != {e.checksum}; "
                f"v{version} discarded, still at v{held}",
                path=str(staging / part),
                tensor=name,
            )


def staged_layout(
    entries: Mapping[str, TensorEntry],
    staged: Mapping[str, tuple[str, str]],
    version: int,
    staging: Path,
) -> dict[str, TensorLocation]:
    """Where each tensor lies in the staged files, read back from their headers as the engine
    will read them after the swap: checked before any file of the checkpoint is replaced.

    A tensor the read-back layout lacks or holds with another dtype or shape (a name the
    safetensors format cannot store, such as its header key ``__metadata__``) is the version's
    content: IncompatibleVersion, so the agent marks the version bad and the checkpoint keeps
    the version it holds.
    """
    out: dict[str, TensorLocation] = {}
    layouts: dict[str, dict[str, TensorLocation]] = {}
    for name, (part, _) in staged.items():
        if part not in layouts:
            try:
                layouts[part] = read_layout(staging / part)
            except EngineStateError as exc:
                raise IncompatibleVersion(
                    f"v{version}: the staged file of its tensors does not read back ({exc})"
                ) from exc
        loc, e = layouts[part].get(name), entries[name]
        if loc is None or loc.dtype != e.torch_dtype or loc.shape != e.shape:
            raise IncompatibleVersion(
                f"v{version}: tensor {name!r} does not read back from a safetensors file as "
                f"{e.dtype}{list(e.shape)} (a name or shape the file format cannot hold); "
                "the checkpoint keeps the version it holds"
            )
        out[name] = loc
    return out
