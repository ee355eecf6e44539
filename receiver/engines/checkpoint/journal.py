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

A **progressive** record (``undo-NNNNNN.progressive``, :func:`create_progressive`) is what a
receiver that acks before its data is durable writes instead: the old values are not gathered
in a pass of their own and made durable before the patch, but saved by the patch kernel itself
(``journal_patch_hash``), chunk by chunk, into the record's file (the page cache) just before
the chunk is patched, with each tensor's count of saved values after them. The file: an 8-byte
little-endian header length, a JSON header (the packed layout's metadata plus the absolute
offsets ``positions_at``, ``progress_at`` and ``values_at`` of each tensor), the positions blobs
as above, one int64 count per tensor (0 at creation), then each tensor's old values, 8-aligned.
Undo writes back the first ``count`` values of each tensor: exact after a crash of the process
(the page cache keeps every write made before it); after a crash of the machine the record may
be incomplete, so the engine checks every tensor after undoing one at open and re-initialises
from a keyframe if any differs.

Once its version is committed, a progressive record is kept as a **spare**
(``spare-NNNNNN``, :func:`recycled_name`) instead of removed, and the same apply group of the
next version writes its record over it (:func:`create_progressive`, ``fsio.rewrite_as``):
header, positions and zero counts over the old bytes, the size set, then the rename to
``undo-NNNNNN.progressive``; the old values past each count are stale, never read. A new file
cost its pages' allocation, zeroing and freeing every version (the kernel's small writes of old
values, ~40 ms of CPU a version at 1 GiB on this VM). Spares are never read; a rollback, an
interrupted apply's recovery and a full version remove them (their room back).
"""

from __future__ import annotations

import json
import os
import stat
import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import safetensors
import safetensors.torch
import torch
from numpy.typing import NDArray

from asyncsync import fsio
from asyncsync.codec import Patch, decode_xef_positions, ef, native, scratch
from asyncsync.errors import ConfigError
from asyncsync.pipeline import parallel_map
from receiver.engines.st_layout import TensorLocation

__all__ = [
    "JOURNAL_FORMAT",
    "PROGRESSIVE_SUFFIX",
    "SPARE_BYTES",
    "SPARE_PREFIX",
    "Progressive",
    "Work",
    "create_progressive",
    "drop_spares",
    "encode",
    "encode_parts",
    "read",
    "recycled_name",
    "spare_path",
    "target_version",
]

JOURNAL_FORMAT = "asyncsync-journal"
#: file name suffix of a progressive record (``undo-NNNNNN.progressive``)
PROGRESSIVE_SUFFIX = ".progressive"
#: file name prefix of a recycled progressive record (:func:`recycled_name`): never read
SPARE_PREFIX = "spare-"
#: a record larger than this is removed, not kept as a spare
SPARE_BYTES = 64 << 20
_RECORD_LIMIT = 1 << 46  # a record holds at most one apply group's old values
_HEADER_LIMIT = 100 << 20  # as safetensors' own (a header names each tensor of a group)

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
    counts, widths, encs, pos_blobs = _positions(work)
    packed = b"".join(x for b in pos_blobs for x in (b, bytes(align8(len(b)) - len(b))))
    values = torch.from_numpy(
        scratch.empty(sum(align8(c * w) for c, w in zip(counts, widths, strict=True)), np.uint8)
    )
    jobs = []
    vi = 0
    for (_name, _loc, flat, patch), n, w in zip(work, counts, widths, strict=True):
        # (an empty slice of the pool may carry a stride torch cannot view: none needed)
        out = values[vi : vi + n * w].view(flat.dtype) if n else flat[:0].clone()
        jobs.append((out, flat, patch))
        values[vi + n * w : vi + align8(n * w)] = 0  # the padding: no stale bytes of the pool
        vi += align8(n * w)

    def gather_old(job: tuple[torch.Tensor, torch.Tensor, Patch]) -> None:  # on the pool
        out, flat, patch = job
        if patch.positions is None:
            out.copy_(flat)
        else:
            native.take(flat.numpy(), patch.positions.numpy(), out.numpy())

    parallel_map(gather_old, jobs, cost=lambda job: 5 * job[0].nbytes)  # + the int64 positions
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


class Progressive(NamedTuple):
    """A progressive record just created: its open file (``fd``, for the patch kernel's
    writes) and, per tensor of the work, where its old values and its count go."""

    fd: int
    values_at: list[int]
    progress_at: list[int]


def create_progressive(
    path: Path, work: Work, version: int, *, spare: Path | None = None
) -> Progressive:
    """Create the progressive undo record ``path`` of ``work`` (header, positions and zero
    counts, renamed into place: it exists whole or not at all) and open it for the patch
    kernel, which saves each tensor's old values and count in it as it patches. Not fsynced:
    see the module docstring. The caller closes ``fd``.

    ``spare``: a record of an earlier version recycled (:func:`recycled_name`), written over
    and renamed to ``path`` instead of a new file, where it exists: its size set to the whole
    record's (values past a tensor's count are the spare's stale bytes, never read)."""
    counts, widths, encs, pos_blobs = _positions(work)
    meta: dict[str, Any] = {
        "format": JOURNAL_FORMAT,
        "layout": "progressive",
        "target_version": str(version),
        "names": [name for name, *_ in work],
        "counts": counts,
        "widths": widths,
        "numels": [flat.numel() for *_, flat, _ in work],
        "positions": encs,
        "position_bytes": [len(b) for b in pos_blobs],
    }
    # ``json.dumps({**meta, **offsets})``, the meta (the names: most of it) encoded once
    named = json.dumps(meta)[:-1].encode() + b", "
    head = 8
    while True:  # the offsets depend on the header's size, which depends on their digits
        offsets = _offsets(head, pos_blobs, counts, widths)
        text = named + json.dumps(offsets)[1:].encode()
        if align8(8 + len(text)) <= head:
            break
        head = align8(8 + len(text))
    text += b" " * (head - 8 - len(text))
    body: list[bytes | memoryview] = [struct.pack("<Q", len(text)) + text]
    for b in pos_blobs:  # not copied into one blob: written one after another
        body += [b, bytes(align8(len(b)) - len(b))]
    body.append(bytes(8 * len(work)))
    end = offsets["values_at"][-1] + align8(counts[-1] * widths[-1]) if work else head
    if spare is None or not fsio.rewrite_as(spare, path, body, size=end):
        fsio.atomic_write(path, body, fsync=False, sync_dir=False)
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    return Progressive(fd, offsets["values_at"], offsets["progress_at"])


def recycled_name(path: Path) -> str | None:
    """The name an entry of the journal directory keeps when the records of a committed
    version are cleared (:meth:`receiver.state.StateStore.clear_dir`, after the ack, at the
    next begin, at an open): a progressive record ``undo-NNNNNN.progressive`` becomes the spare
    ``spare-NNNNNN``, which the same apply group of the next version rewrites
    (:func:`create_progressive`) instead of making a new file and freeing this one
    (BENCHMARKS.md, thirty-second session); a spare stays (one per apply group of a version).
    None (removed): anything else, and a file over :data:`SPARE_BYTES` (a dense delta's record
    of a whole group is not kept for the sparse ones after it)."""
    name = path.name
    if name.startswith(SPARE_PREFIX):
        seq = name.removeprefix(SPARE_PREFIX)
    elif name.startswith("undo-") and name.endswith(PROGRESSIVE_SUFFIX):
        seq = name.removeprefix("undo-").removesuffix(PROGRESSIVE_SUFFIX)
    else:
        return None
    if not (len(seq) == 6 and seq.isascii() and seq.isdigit()):
        return None
    try:
        st = path.lstat()
    except FileNotFoundError:
        return None
    kept = stat.S_ISREG(st.st_mode) and st.st_size <= SPARE_BYTES
    return f"{SPARE_PREFIX}{seq}" if kept else None


def drop_spares(journal_dir: Path) -> None:
    """Remove the spare records (a full version's staged files may need their room)."""
    if journal_dir.is_symlink() or not journal_dir.is_dir():
        return
    for p in journal_dir.iterdir():
        if p.name.startswith(SPARE_PREFIX) and not p.is_dir():
            p.unlink(missing_ok=True)


def spare_path(journal_dir: Path, seq: int) -> Path:
    """Where :func:`recycled_name` keeps the spare of the record ``undo-{seq}``."""
    return journal_dir / f"{SPARE_PREFIX}{seq:06d}"


def _positions(work: Work) -> tuple[list[int], list[int], list[str], list[bytes | memoryview]]:
    """Per patch of ``work``: its count, width, positions coding and positions blob."""
    counts = [
        flat.numel() if p.positions is None else p.positions.numel() for _, _, flat, p in work
    ]
    widths = [flat.element_size() for _, _, flat, _ in work]
    encs, pos_blobs = code_positions([(flat.numel(), patch) for *_, flat, patch in work])
    return counts, widths, encs, pos_blobs


def code_positions(
    patches: list[tuple[int, Patch]],
) -> tuple[list[str], list[bytes | memoryview]]:
    """The coding and blob of each (numel, patch)'s positions: the xef blob the patch was
    decoded from, else Elias-Fano, else raw int64 (not strictly increasing); ``dense`` for a
    patch of every element (no blob)."""
    pos_blobs: list[bytes | memoryview] = []
    encs: list[str] = []
    for numel, patch in patches:
        if patch.positions is None:
            pos_blobs.append(b"")
            encs.append("dense")
            continue
        idx = patch.positions.numpy()
        if (blob := patch.decoded_xef()) is not None and idx.size:
            pos_blobs.append(blob)
            encs.append("xef")
            continue
        try:
            pos_blobs.append(ef.encode(idx, numel)[0] if idx.size else b"")
            encs.append("ef")
        except ConfigError:  # not strictly increasing: keep them as they are
            pos_blobs.append(idx.astype("<i8").tobytes())
            encs.append("raw")
    return encs, pos_blobs


def _offsets(
    head: int, pos_blobs: list[bytes | memoryview], counts: list[int], widths: list[int]
) -> dict[str, list[int]]:
    """Absolute file offsets of a progressive record whose data starts at ``head``."""
    at = head
    positions_at = []
    for b in pos_blobs:
        positions_at.append(at)
        at += align8(len(b))
    progress_at = [at + 8 * i for i in range(len(counts))]
    at += 8 * len(counts)
    values_at = []
    for n, w in zip(counts, widths, strict=True):
        values_at.append(at)
        at += align8(n * w)
    return {"positions_at": positions_at, "progress_at": progress_at, "values_at": values_at}


def _read_progressive(path: Path) -> list[tuple[str, torch.Tensor | None, torch.Tensor]]:
    """(name, positions or None, old bytes) of the values a progressive record holds: the
    first ``count`` of each tensor (ValueError if the record is not whole up to them)."""
    data = fsio.read_bytes(path, limit=_RECORD_LIMIT)
    if len(data) < 8:
        raise ValueError("shorter than its header length")
    (hlen,) = struct.unpack_from("<Q", data)
    if hlen > len(data) - 8:
        raise ValueError(f"header of {hlen} bytes in a file of {len(data)}")
    meta = json.loads(data[8 : 8 + hlen])
    if meta.get("format") != JOURNAL_FORMAT or meta.get("layout") != "progressive":
        raise ValueError("not a progressive asyncsync journal record")
    keys = ("names", "counts", "widths", "numels", "positions", "position_bytes")
    names, counts, widths, numels, encs, pos_bytes = (meta[k] for k in keys)
    at_keys = ("positions_at", "progress_at", "values_at")
    pos_at, prog_at, val_at = (meta[k] for k in at_keys)
    out: list[tuple[str, torch.Tensor | None, torch.Tensor]] = []
    for i, name in enumerate(names):
        n, w, numel, enc = int(counts[i]), int(widths[i]), int(numels[i]), encs[i]
        (done,) = struct.unpack_from("<q", _span(data, prog_at[i], 8))
        if not 0 <= done <= n:
            raise ValueError(f"tensor {name!r}: {done} values saved of {n}")
        raw = _span(data, val_at[i], done * w)
        old = (
            torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            if raw
            else torch.empty(0, dtype=torch.uint8)
        )
        if enc == "dense":
            pos = None if done == numel else torch.arange(done, dtype=torch.int64)
        else:
            blob = _span(data, pos_at[i], int(pos_bytes[i]))
            pos = torch.from_numpy(decode_positions(enc, blob, n, numel)[:done].copy())
        out.append((str(name), pos, old))
    return out


def _span(data: bytes, at: int, size: int) -> bytes:
    """``size`` bytes of the record from ``at`` (none: whatever ``at``, values not yet saved
    lie past the end of the file)."""
    if size == 0 and at >= 0:
        return b""
    if at < 0 or size < 0 or at + size > len(data):
        raise ValueError(f"bytes [{at}, {at + size}) past the end ({len(data)})")
    return data[at : at + size]


def decode_positions(enc: str, blob: bytes, n: int, numel: int) -> NDArray[np.int64]:
    if enc == "xef":
        return decode_xef_positions(blob, n, numel)
    if enc == "ef":
        return ef.decode(blob, n, numel) if n else np.empty(0, np.int64)
    if enc == "raw":
        return np.frombuffer(blob, "<i8").astype(np.int64)
    raise ValueError(f"unknown positions coding {enc!r}")


def align8(nbytes: int) -> int:
    """Each tensor's old bytes start 8-aligned in ``values``, so they view as their dtype."""
    return -(-nbytes // 8) * 8


def target_version(path: Path) -> int | None:
    """The version the apply that wrote the record ``path`` moved to: its header's
    ``target_version`` (every record has named it, both layouts). None where the header does
    not read or say it (a header nested past the parser's depth, a version no int holds
    included): such a record is left to :func:`read`, which refuses it as before."""
    try:
        fd = fsio.open_file(path)  # a FIFO or a device: refused, never read
        try:
            (hlen,) = struct.unpack("<Q", os.pread(fd, 8, 0))
            if hlen > _HEADER_LIMIT:
                return None
            header = json.loads(os.pread(fd, hlen, 8))
        finally:
            os.close(fd)
        meta = header if path.name.endswith(PROGRESSIVE_SUFFIX) else header["__metadata__"]
        if meta.get("format") != JOURNAL_FORMAT:
            return None
        return int(meta["target_version"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError, struct.error,
            RecursionError, OverflowError):  # fmt: skip
        return None


def read(path: Path) -> list[tuple[str, torch.Tensor | None, torch.Tensor]]:
    """(name, positions or None for a whole tensor, old bytes as uint8) of each journaled patch.

    Also reads the one-tensor-per-patch layout earlier versions wrote (``p{i}``/``v{i}``).
    """
    if path.name.endswith(PROGRESSIVE_SUFFIX):
        return _read_progressive(path)
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
