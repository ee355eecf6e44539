"""Applying a full version: new files written to the staging directory and verified, before
the engine moves them into place (:meth:`LocalCheckpoint.commit`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import safetensors.torch
import torch

from asyncsync import fsio
from asyncsync.errors import ApplyFailed, ChecksumMismatch
from asyncsync.format import TensorEntry
from asyncsync.format.checksum import entry_checksum

__all__ = ["check_staged", "stage_part"]


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
        t = t.detach().cpu().contiguous()
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
