"""The undo journal of a LocalCheckpoint delta, one record per apply group (pure but `read`).

Before an apply group writes into the checkpoint in place, the old bytes of every position it
will write are made durable in ``.asyncsync/journal/undo-NNNNNN.safetensors``; undoing writes
them back, which is idempotent (:mod:`receiver.engines.checkpoint.inplace`). A record is a
safetensors file of two uint8 tensors, however many tensors the group patched (serialising one
tensor per patched tensor cost more than the patching):

* ``positions``: each sparse patch's positions: the xef positions blob the patch was decoded from
  (``xef``: kept as it came, nothing coded again), else Elias-Fano coded (``ef``:
  ``asyncsync.codec.ef``, ~0.3x the bytes of int64), or raw little-endian int64 when they are
  not strictly increasing (``raw``);
* ``values``: the old bytes at those positions (a dense patch: the whole tensor's);

each piece 8-aligned (zero bytes between pieces), with per-tensor name, count, width, numel,
positions coding and positions bytes in the metadata. :func:`read` also accepts the
one-tensor-pair-per-patch layout (``p{i}``/``v{i}``) that earlier versions wrote.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import safetensors
import safetensors.torch
import torch

from asyncsync import fsio
from asyncsync.codec import Patch, decode_xef_positions, ef, native, scratch
from asyncsync.errors import ConfigError
from asyncsync.pipeline import parallel_map
from receiver.engines.st_layout import TensorLocation

__all__ = ["JOURNAL_FORMAT", "Work", "encode", "encode_parts", "read"]

JOURNAL_FORMAT = "asyncsync-journal"

Work = list[tuple[str, TensorLocation, torch.Tensor, Patch]]  # name, location, flat view, patch


def encode(work: Work, version: int) -> bytes:
    """One undo record (a safetensors file) for a batch of patches: :func:`encode_parts` joined."""
    return b"".join(encode_parts(work, version))


def encode_parts(work: Work, version: int) -> list[bytes | memoryview]:
    """One undo record for a batch of patches, as the buffers to write one after another (the
    old values are not copied again into one blob). A safetensors file of two uint8 tensors
    however many tensors were patched (one tensor per patch cost more than the patching):

    * ``positions``: each sparse patch's positions (the xef blob it was decoded from, else
      Elias-Fano coded, else raw int64 if they are not strictly increasing), one after another;
    * ``values``: the old bytes at those positions (or a dense patch's whole tensor).

    Each piece starts 8-aligned; the metadata gives each tensor's name, count, width, numel,
    positions coding and positions bytes.
    """
    pos_blobs: list[bytes] = []
    encs: list[str] = []
    counts = [
        flat.numel() if p.positions is None else p.positions.numel() for _, _, flat, p in work
    ]
    widths = [flat.element_size() for _, _, flat, _ in work]
    for *_, flat, patch in work:
        if patch.positions is None:
            pos_blobs.append(b"")
            encs.append("dense")
            continue
        idx = patch.positions.numpy()
        if patch.positions_xef is not None and idx.size:
            pos_blobs.append(patch.positions_xef)
            encs.append("xef")
            continue
        try:
            pos_blobs.append(ef.encode(idx, flat.numel())[0] if idx.size else b"")
            encs.append("ef")
        except ConfigError:  # not strictly increasing: keep them as they are
            pos_blobs.append(idx.astype("<i8").tobytes())
            encs.append("raw")
    packed = b"".join(b + bytes(align8(len(b)) - len(b)) for b in pos_blobs)
    values = torch.from_numpy(
        scratch.empty(sum(align8(c * w) for c, w in zip(counts, widths, strict=True)), np.uint8)
    )
    jobs = []
    vi = 0
    for (_name, _loc, flat, patch), n, w in zip(work, counts, widths, strict=True):
        jobs.append((values[vi : vi + n * w].view(flat.dtype), flat, patch))
        values[vi + n * w : vi + align8(n * w)] = 0  # the padding: no stale bytes of the pool
        vi += align8(n * w)

    def gather_old(job: tuple[torch.Tensor, torch.Tensor, Patch]) -> None:  # on the pool
        out, flat, patch = job
        if patch.positions is None:
            out.copy_(flat)
        else:
            native.take(flat.numpy(), patch.positions.numpy(), out.numpy())

    parallel_map(gather_old, jobs)
    meta = {
        "format": JOURNAL_FORMAT,
        "layout": "packed",
        "target_version": str(version),
        "names": json.dumps([name for name, *_ in work]),
        "counts": json.dumps(counts),
        "widths": json.dumps(widths),
        "numels": json.dumps([flat.numel() for *_, flat, _ in work]),
        "positions": json.dumps(encs),
        "position_bytes": json.dumps([len(b) for b in pos_blobs]),
    }
    header = {
        "__metadata__": meta,
        "positions": {"dtype": "U8", "shape": [len(packed)], "data_offsets": [0, len(packed)]},
        "values": {
            "dtype": "U8",
            "shape": [values.numel()],
            "data_offsets": [len(packed), len(packed) + values.numel()],
        },
    }
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)  # as safetensors pads it
    return [struct.pack("<Q", len(text)) + text, packed, memoryview(values.numpy())]  # type: ignore[arg-type]


def align8(nbytes: int) -> int:
    """Each tensor's old bytes start 8-aligned in ``values``, so they view as their dtype."""
    return -(-nbytes // 8) * 8


def read(path: Path) -> list[tuple[str, torch.Tensor | None, torch.Tensor]]:
    """(name, positions or None for a whole tensor, old bytes as uint8) of each journaled patch.

    Also reads the one-tensor-per-patch layout earlier versions wrote (``p{i}``/``v{i}``).
    """
    os.close(fsio.open_file(path))  # a FIFO or a device: refused here, safe_open would block
    with safetensors.safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        names = json.loads(meta["names"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    if meta.get("layout") != "packed":
        return [
            (name, tensors.get(f"p{i}"), tensors[f"v{i}"].view(torch.uint8).view(-1))
            for i, name in enumerate(names)
        ]
    keys = ("counts", "widths", "numels", "positions", "position_bytes")
    counts, widths, numels, encs, pos_bytes = (json.loads(meta[k]) for k in keys)
    positions, values = tensors["positions"], tensors["values"]
    out: list[tuple[str, torch.Tensor | None, torch.Tensor]] = []
    pi = vi = 0
    for name, n, w, numel, enc, nb in zip(
        names, counts, widths, numels, encs, pos_bytes, strict=True
    ):
        blob = positions[pi : pi + nb].numpy()
        pos = None
        if enc == "xef":
            pos = torch.from_numpy(decode_xef_positions(blob.tobytes(), n, numel))
        elif enc == "ef":
            pos = torch.from_numpy(ef.decode(blob.tobytes(), n, numel)) if n else None
            pos = pos if pos is not None else torch.empty(0, dtype=torch.int64)
        elif enc == "raw":
            pos = torch.from_numpy(blob.view("<i8").astype(np.int64))
        elif enc != "dense":
            raise ValueError(f"unknown positions coding {enc!r}")
        out.append((name, pos, values[vi : vi + n * w]))
        pi += align8(nb)
        vi += align8(n * w)
    if pi != positions.numel() or vi != values.numel():
        raise ValueError("positions/values do not match the recorded counts")
    return out
