"""Self-describing delta shards (format 3, FORMAT.md section 4.3): the metadata that lets a
receiver verify, decode and apply a delta shard before the version's manifest exists. No file
I/O: the writer (:mod:`asyncsync.publish.writer`) puts :func:`stream_metadata` in a delta
shard's header; the receiver (:mod:`receiver.stream`) reads it back with :func:`stream_header`.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from asyncsync.codec.shards import read_header
from asyncsync.errors import FormatError

__all__ = ["STREAM_FORMAT", "StreamEntry", "StreamHeader", "stream_header", "stream_metadata"]

STREAM_FORMAT = "3"


@dataclass(frozen=True)
class StreamEntry:
    """What a self-describing delta shard says of one tensor whose delta it holds (FORMAT.md
    4.3): enough to decode and apply it before the manifest exists, and to compare with the
    manifest's entry once it does."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    changed: int
    mode: str
    positions: str
    values: str
    checksum: str

    def to_json(self) -> list[object]:
        return [self.name, self.dtype, list(self.shape), self.changed, self.mode,
                self.positions, self.values, self.checksum]  # fmt: skip


@dataclass(frozen=True)
class StreamHeader:
    """The streaming metadata of a delta shard (format 3), parsed and checked for shape."""

    version: int
    run_id: str
    base_version: int
    base_fingerprint: str
    attempt: str
    shard_index: int
    encoding: str
    algorithm: str
    data_checksum: str
    data_offset: int  # where the blobs start (after the header)
    entries: tuple[StreamEntry, ...]


def stream_metadata(
    *,
    base_version: int,
    base_fingerprint: str,
    attempt: str,
    shard_index: int,
    encoding: str,
    algorithm: str,
    entries: Sequence[StreamEntry],
    data_checksum: str,
) -> dict[str, str]:
    """The ``__metadata__`` keys that make a delta shard self-describing (FORMAT.md 4.3)."""
    return {
        "asyncsync.format_version": STREAM_FORMAT,
        "asyncsync.base_version": str(base_version),
        "asyncsync.base_fingerprint": base_fingerprint,
        "asyncsync.attempt": attempt,
        "asyncsync.shard_index": str(shard_index),
        "asyncsync.encoding": encoding,
        "asyncsync.checksum_algorithm": algorithm,
        "asyncsync.entries": json.dumps([e.to_json() for e in entries], separators=(",", ":")),
        "asyncsync.data_checksum": data_checksum,
    }


def stream_header(data: bytes | memoryview, *, where: str) -> StreamHeader | None:
    """The streaming metadata of delta shard bytes, or None when the shard has none (written by
    format 2, or by a rank of a multi-rank publisher). FormatError if it is malformed."""
    header = read_header(data, where=where)
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict) or meta.get("asyncsync.format_version") != STREAM_FORMAT:
        return None
    if meta.get("asyncsync.role") != "delta":
        raise FormatError(f"{where}: a streaming shard must have the delta role")
    (n,) = struct.unpack("<Q", bytes(data[:8]))
    try:
        raw = json.loads(meta["asyncsync.entries"])
        entries = tuple(_stream_entry(e) for e in raw)
        out = StreamHeader(
            version=_nat(meta["asyncsync.version"]),
            run_id=str(meta["asyncsync.run_id"]),
            base_version=_nat(meta["asyncsync.base_version"]),
            base_fingerprint=str(meta["asyncsync.base_fingerprint"]),
            attempt=str(meta["asyncsync.attempt"]),
            shard_index=_nat(meta["asyncsync.shard_index"]),
            encoding=str(meta["asyncsync.encoding"]),
            algorithm=str(meta["asyncsync.checksum_algorithm"]),
            data_checksum=str(meta["asyncsync.data_checksum"]),
            data_offset=8 + n,
            entries=entries,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise FormatError(f"{where}: malformed streaming metadata ({exc!r})") from exc
    if out.base_version + 1 != out.version:
        raise FormatError(f"{where}: base_version {out.base_version} is not version - 1")
    keys = set()
    for e in entries:
        for k in (e.positions, e.values):
            info = header.get(k)
            if k in keys or not isinstance(info, dict) or info.get("dtype") != "U8":
                raise FormatError(f"{where}: entry {e.name!r} names blob {k!r} badly")
            keys.add(k)
    return out


def _nat(text: object) -> int:
    if not isinstance(text, str) or not text.isdigit() or len(text) > 15:
        raise ValueError(f"not a small natural number: {text!r}")
    return int(text)


def _stream_entry(e: object) -> StreamEntry:
    if not isinstance(e, list) or len(e) != 8:
        raise ValueError(f"entry {e!r} is not a list of 8")
    name, dtype, shape, changed, mode, pos, val, checksum = e
    if not all(isinstance(x, str) for x in (name, dtype, mode, pos, val, checksum)):
        raise ValueError(f"entry {e!r}: name, dtype, mode, keys and checksum are strings")
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**53 for d in shape
    ):
        raise ValueError(f"entry {name!r}: bad shape {shape!r}")
    if not isinstance(changed, int) or isinstance(changed, bool) or not 0 < changed < 2**53:
        raise ValueError(f"entry {name!r}: bad changed {changed!r}")
    if mode not in ("sparse", "dense"):
        raise ValueError(f"entry {name!r}: bad mode {mode!r}")
    return StreamEntry(name, dtype, tuple(shape), changed, mode, pos, val, checksum)
