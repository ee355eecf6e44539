"""The redo records of a LocalCheckpoint run with a redo log: a committed delta kept beside the
data files instead of patched into them.

A record ``.asyncsync/redo/redo-VVVVVVVVVVVV.rec`` holds one version's decoded patches (per
tensor: the positions it sets or XORs and their new values) and what the version says of the
tensors (the manifest's checksums, its algorithm and the parts of tensors published in parts),
so that the files, once every record held is patched into them in turn, can be checked
against the newest one's checksums (:mod:`~receiver.engines.checkpoint.redolog`).

The file, written as the apply groups come (:class:`RecordWriter`: a temp file ``.redo-*.part``,
fsynced, renamed, the directory fsynced: it exists whole or not at all)::

    chunk*   one per apply group: u64 header length, a JSON header (names, ops, counts, widths,
             numels, positions codings and bytes), padded to 8; the positions blobs, then the
             values (each 8-aligned)
    trailer  JSON {format, format_version, version, base_version, run_id, fingerprint,
             checksum_algorithm, checksums, parts, chunks: [offsets]}, u64 its length, MAGIC

Positions are kept as they came (the xef blob a patch was decoded from: nothing coded again),
else Elias-Fano coded, else raw int64 (:func:`~receiver.engines.checkpoint.journal.code_positions`);
values raw in the tensor's int view. Nothing in a record is hashed again: its values were checked
in transit (the shard checksums) and the bytes it composes are checked at compaction.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from numpy.typing import NDArray

from asyncsync import fsio
from asyncsync.codec import Patch
from receiver.engines.checkpoint.journal import align8, code_positions, decode_positions

__all__ = ["MAGIC", "REDO_FORMAT", "Record", "RecordWriter", "record_name"]

REDO_FORMAT = "asyncsync-redo"
REDO_FORMAT_VERSION = 1
MAGIC = b"ASREDO01"
_TAIL = struct.Struct("<Q8s")


def record_name(version: int) -> str:
    """The file name of version ``version``'s record (names sort as the versions do)."""
    return f"redo-{version:012d}.rec"


# --------------------------------------------------------------------------- writing


class RecordWriter:
    """One version's record, written apply group by apply group, then made durable whole.

    Example::

        w = RecordWriter(redo_dir, 12)
        w.add([("w", numel, patch)])        # each apply group
        path = w.finish({"version": 12, ...})  # fsynced, renamed, the directory fsynced
    """

    def __init__(self, directory: Path, version: int) -> None:
        self.directory = directory
        self.version = version
        self.path = directory / record_name(version)
        self.part = directory / f".{record_name(version)}.part"
        self._fd: int | None = os.open(
            self.part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644
        )
        # 0644 whatever the umask: 0777 made it 0000, a record its own reader could not open
        # (the files wiped as unreadable, re-seeded, and so at every version, for ever)
        os.fchmod(self._fd, 0o644)
        self._at = 0
        self._chunks: list[int] = []
        self.nbytes = 0  # values and positions written (the record's payload)

    def add(self, items: Sequence[tuple[str, int, Patch]]) -> None:
        """Append one chunk: each (name, numel, patch) of an apply group."""
        if not items:
            return
        encs, blobs = code_positions([(numel, p) for _, numel, p in items])
        arrays = [p.values.contiguous().numpy() for *_, p in items]
        values = [memoryview(a).cast("B") for a in arrays]  # type: ignore[arg-type]
        meta = {
            "names": [name for name, *_ in items],
            "ops": [p.op for *_, p in items],
            "counts": [a.size for a in arrays],
            "widths": [p.values.element_size() for *_, p in items],
            "numels": [numel for _, numel, _ in items],
            "positions": encs,
            "position_bytes": [len(b) for b in blobs],
        }
        text = json.dumps(meta, separators=(",", ":")).encode()
        text += b" " * (-(8 + len(text)) % 8)
        bufs: list[bytes | memoryview] = [struct.pack("<Q", len(text)) + text]
        for b in (*blobs, *values):
            bufs += [b, bytes(align8(len(b)) - len(b))]
        self._chunks.append(self._at)
        self._write(bufs)
        self.nbytes += sum(len(b) for b in blobs) + sum(v.nbytes for v in values)

    def finish(self, meta: Mapping[str, Any]) -> Path:
        """Write the trailer (``meta``: the version's identity and checksums), fsync, rename
        into place and fsync the directory: the record is durable before the state names it."""
        trailer = {"format": REDO_FORMAT, "format_version": REDO_FORMAT_VERSION, **meta}
        trailer["chunks"] = self._chunks
        text = json.dumps(trailer, separators=(",", ":")).encode()
        self._write([text, _TAIL.pack(len(text), MAGIC)])
        assert self._fd is not None
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = None
        os.replace(self.part, self.path)
        fsio.fsync_dir(self.directory)
        return self.path

    def discard(self) -> None:
        """Drop the record being written (an aborted or refused version)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self.part.unlink(missing_ok=True)

    def _write(self, bufs: list[bytes | memoryview]) -> None:
        assert self._fd is not None
        views = [memoryview(b).cast("B") for b in bufs if len(b)]
        while views:
            n = os.writev(self._fd, views[:512])
            self._at += n
            while views and n >= views[0].nbytes:
                n -= views[0].nbytes
                views.pop(0)
            if views and n:
                views[0] = views[0][n:]


# --------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class _Entry:
    op: Literal["set", "xor"]
    count: int
    width: int
    numel: int
    enc: str
    pos_at: int
    pos_bytes: int
    val_at: int


@dataclass
class Record:
    """A record read back (mapped): its trailer's fields and where each tensor's patch lies.

    Raises ValueError for a file that is not a whole record."""

    path: Path
    meta: dict[str, Any]
    entries: dict[str, _Entry] = field(default_factory=dict)
    _map: mmap.mmap | None = None

    @classmethod
    def open(cls, path: Path) -> Record:
        fd = fsio.open_file(path)
        try:
            size = os.fstat(fd).st_size
            if size < _TAIL.size:
                raise ValueError(f"{path}: {size} bytes, shorter than a record's tail")
            mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        try:
            return cls._parse(path, mm)
        except RecursionError:  # JSON nested too deeply: a record that cannot be read
            mm.close()
            raise ValueError(f"{path}: its JSON is nested too deeply") from None
        except BaseException:
            mm.close()
            raise

    @classmethod
    def _parse(cls, path: Path, mm: mmap.mmap) -> Record:
        size = len(mm)
        tlen, magic = _TAIL.unpack_from(mm, size - _TAIL.size)
        if magic != MAGIC or tlen > size - _TAIL.size:
            raise ValueError(f"{path}: not a whole redo record (no trailer)")
        tstart = size - _TAIL.size - tlen
        meta = json.loads(mm[tstart : size - _TAIL.size])
        if not isinstance(meta, dict) or meta.get("format") != REDO_FORMAT:
            raise ValueError(f"{path}: not an asyncsync redo record")
        if meta.get("format_version") != REDO_FORMAT_VERSION:
            raise ValueError(f"{path}: redo format_version {meta.get('format_version')!r}")
        rec = cls(path, meta, _map=mm)
        for at in meta["chunks"]:
            if not 0 <= at <= tstart - 8:
                raise ValueError(f"{path}: chunk at {at} outside the record")
            (hlen,) = struct.unpack_from("<Q", mm, at)
            head = json.loads(mm[at + 8 : at + 8 + hlen])
            pos_at = at + 8 + hlen
            keys = ("names", "ops", "counts", "widths", "numels", "positions", "position_bytes")
            cols = [head[k] for k in keys]
            val_at = pos_at + sum(align8(int(b)) for b in head["position_bytes"])
            for name, op, n, w, numel, enc, pb in zip(*cols, strict=True):
                if op not in ("set", "xor") or name in rec.entries:
                    raise ValueError(f"{path}: tensor {name!r}: op {op!r} or a repeat")
                rec.entries[name] = _Entry(op, n, w, numel, enc, pos_at, pb, val_at)
                pos_at += align8(pb)
                val_at += align8(n * w)
            if val_at > tstart:
                raise ValueError(f"{path}: chunk at {at} runs past the trailer")
        return rec

    @property
    def version(self) -> int:
        return int(self.meta["version"])

    def patch(self, name: str, dtype: torch.dtype) -> tuple[str, NDArray[Any] | None, NDArray[Any]]:
        """(op, positions or None for every element, values in ``dtype``) of ``name`` (copies:
        the record may be closed and removed afterwards)."""
        e = self.entries[name]
        assert self._map is not None
        if torch.empty(0, dtype=dtype).element_size() != e.width:
            raise ValueError(f"{self.path}: tensor {name!r} has {e.width}-byte values")
        raw = np.frombuffer(self._map, np.uint8, e.count * e.width, e.val_at).copy()
        # (an empty patch's bytes have stride 0, which torch will not view as wider elements)
        values = (
            (torch.from_numpy(raw) if e.count else torch.empty(0, dtype=torch.uint8))
            .view(dtype)
            .numpy()
        )
        if e.enc == "dense":
            return e.op, None, values
        blob = self._map[e.pos_at : e.pos_at + e.pos_bytes]
        return e.op, decode_positions(e.enc, blob, e.count, e.numel), values

    def as_patch(self, name: str, dtype: torch.dtype) -> Patch:
        """``name``'s patch as the decoder made it (positions from an xef blob keep it: the
        kernels check their ends only, the journal keeps the blob as it is)."""
        op, pos, values = self.patch(name, dtype)
        t = torch.from_numpy(values)
        if pos is None:
            return Patch(op, None, t)  # type: ignore[arg-type]
        e = self.entries[name]
        if e.enc == "xef":
            assert self._map is not None
            blob = self._map[e.pos_at : e.pos_at + e.pos_bytes]
            return Patch.of_xef(op, torch.from_numpy(pos), t, blob)  # type: ignore[arg-type]
        return Patch(op, torch.from_numpy(pos), t)  # type: ignore[arg-type]

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
