"""Applying a full version: new files written to the staging directory and verified, before
the engine moves them into place (:meth:`LocalCheckpoint.commit`).

A staged file is written as ``safetensors.torch.save_file`` writes it (the same bytes), but in
writes of :data:`WRITE_SPAN` bytes at offsets that are multiples of it, where ``save_file``
writes each tensor on its own at whatever offset it starts. The page cache keeps the folios
those writes made for as long as the file stays cached, and every later delta patches the file
in place through a mapping of them: on Linux (ext4 with large folios) a 2 MiB folio is mapped
writable by one fault and written back whole, but a smaller one (a tensor's end inside a 2 MiB
range, the header) is faulted page by page, each fault walking all of the folio's buffers
(``block_page_mkwrite``), and so again at the unmap and the writeback. Measured at 1 GiB
(BENCHMARKS.md, twenty-seventh session): ~50 ms less kernel CPU per delta.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import cast

import numpy as np
import safetensors.torch
import torch

from asyncsync import fsio
from asyncsync.codec import raw_clone, raw_view
from asyncsync.codec.shards import safetensors_parts
from asyncsync.errors import ApplyFailed, ChecksumMismatch, EngineStateError, IncompatibleVersion
from asyncsync.format import TensorEntry
from asyncsync.format.checksum import entry_checksum
from asyncsync.format.names import DTYPES, SAFETENSORS_CODES
from asyncsync.memory import gc_paused
from receiver.engines.st_layout import TensorLocation, read_layout

__all__ = ["check_staged", "stage_part", "staged_layout"]


def stage_part(
    staging: Path, part: str, items: list[tuple[TensorEntry, torch.Tensor]], algorithm: str
) -> dict[str, str]:
    """Write ``items`` durably as the staged file ``part``; the checksum of each tensor."""
    tensors: dict[str, torch.Tensor] = {}
    sums: dict[str, str] = {}
    for entry, t in items:
        if t.dtype != entry.torch_dtype or tuple(t.shape) != entry.shape:
            raise ApplyFailed(
                f"tensor {entry.name!r}: got {t.dtype}{list(t.shape)}, manifest says "
                f"{entry.dtype}{list(entry.shape)}"
            )
        # copied as ints: a non-contiguous bool's own copy writes 0/1, not its bytes
        t = raw_view(t.detach()).cpu().contiguous().view(t.dtype)
        tensors[entry.name] = t
        sums[entry.name] = entry_checksum(entry, t, algorithm)
    path = staging / part
    if not write_safetensors(path, tensors, {"format": "pt"}):
        safetensors.torch.save_file(_unshared(tensors), path, metadata={"format": "pt"})
    # readable by an inference server running as another user (0644 like the index),
    # whatever this receiver's umask (0777 made it 0000: not even its own open could read it)
    os.chmod(path, fsio.FILE_MODE)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return sums


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with each one whose storage another already has copied (its bytes: a bool's
    own copy writes 0/1): ``save_file`` refuses shared storage, and a full shard's tensors are
    views of one buffer, tied names one tensor (:func:`write_safetensors` writes them as they
    are)."""
    out, ptrs = {}, set()
    for name, t in tensors.items():
        ptr = t.untyped_storage().data_ptr()
        out[name] = raw_clone(t) if t.numel() and ptr in ptrs else t
        ptrs.add(ptr)
    return out


#: a staged file is written in writes of this many bytes, at offsets that are multiples of it
#: (a multiple of the largest folio, 2 MiB on x86-64)
WRITE_SPAN = 16 << 20
#: the safetensors dtype codes in the order ``save_file`` lays tensors out (widest first; its
#: ``Dtype``'s order, reversed): each tensor starts at a multiple of its element size
_ST_ORDER = [
    "U64", "I64", "F64", "C64", "F32", "U32", "I32", "BF16", "F16", "U16", "I16",
    "F8_E5M2FNUZ", "F8_E4M3FNUZ", "F8_E8M0", "F8_E4M3", "F8_E5M2", "I8", "U8", "BOOL",
]  # fmt: skip
_RANK = {code: i for i, code in enumerate(_ST_ORDER)}
#: each torch dtype's place in that order (a lookup per tensor: its name is slower to get)
_RANK_OF = {
    dt: _RANK[SAFETENSORS_CODES[n]] for n, dt in DTYPES.items() if SAFETENSORS_CODES[n] in _RANK
}
_IOV_MAX = 512  # buffers one writev takes at most (Linux: 1024); more are joined first


def write_safetensors(
    path: Path, tensors: Mapping[str, torch.Tensor], metadata: dict[str, str]
) -> bool:
    """Write ``tensors`` (contiguous CPU tensors) as the safetensors file ``path``, the bytes
    ``safetensors.torch.save_file`` writes (:func:`~asyncsync.codec.shards.safetensors_parts`,
    in its order, names not escaped), in :data:`WRITE_SPAN`-aligned writes (see the module
    docstring). False, nothing written, where it leaves the file to ``save_file`` (a dtype not
    ranked above, a tensor named like the header's metadata key). The header's dicts and lists
    (a few per tensor, alive together) are made with the cyclic collector paused."""
    ranks = {n: _RANK_OF.get(t.dtype) for n, t in tensors.items()}
    if "__metadata__" in tensors or None in ranks.values():
        return False
    with gc_paused():
        entries = [
            (n, tensors[n], raw_view(tensors[n]).reshape(-1).numpy().view(np.uint8).data)
            for n in sorted(tensors, key=lambda n: (ranks[n], n))
        ]
        header, *data = safetensors_parts(metadata, entries, ensure_ascii=False)
        del entries
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, fsio.FILE_MODE)
    try:
        # the tensors' bytes as the views made above: only the header wrapped
        _write_spans(fd, cast("list[memoryview]", [memoryview(header), *data]), WRITE_SPAN)
    finally:
        os.close(fd)
    return True


def _write_spans(fd: int, pieces: list[memoryview], span: int) -> None:
    """Write ``pieces`` one after another from offset 0, one ``writev`` per ``span`` bytes of
    the file (the last one shorter)."""
    batch: list[memoryview | bytes] = []
    size = 0
    for piece in pieces:
        while piece.nbytes:
            take = min(piece.nbytes, span - size)
            batch.append(piece[:take])
            piece, size = piece[take:], size + take
            if len(batch) >= _IOV_MAX:  # a span of many small tensors: one copy of them
                batch = [b"".join(batch)]
            if size == span:
                _writev_all(fd, batch)
                batch, size = [], 0
    if batch:
        _writev_all(fd, batch)


def _writev_all(fd: int, batch: list[memoryview | bytes]) -> None:
    views = [memoryview(b) for b in batch]
    while views:
        n = os.writev(fd, views)
        if n <= 0:  # a regular file takes some bytes or raises (ENOSPC, EFBIG)
            raise OSError(f"writev wrote {n} bytes")
        while views and n >= views[0].nbytes:
            n -= views.pop(0).nbytes
        if n:
            views[0] = views[0][n:]


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
