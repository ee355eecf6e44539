"""The records a manifest is made of: shards, tensor entries, their delta and full refs, parts."""

from __future__ import annotations

import math
from dataclasses import dataclass, is_dataclass
from typing import TYPE_CHECKING, Any, Literal

from asyncsync.errors import ManifestError
from asyncsync.format.fields import _dict, _get, _hex, _int, _str
from asyncsync.format.names import (
    DTYPE_SIZES,
    MAX_INT,
    MAX_NAME_CHARS,
    MAX_RANK,
    MAX_SHARD_BYTES,
    SAFETENSORS_METADATA,
    check_dtype_name,
    check_file_name,
    dtype_from_name,
)

if TYPE_CHECKING:
    import torch

__all__ = ["DeltaRef", "FullRef", "ShardInfo", "TensorEntry", "TensorPart"]


def _plain(record: Any) -> dict[str, Any]:
    """A record's fields as a dict, nested records as dicts (what ``asdict`` returns, without
    its deep copies: a manifest of a few hundred tensors serialises several times faster)."""
    return {k: _plain(v) if is_dataclass(v) else v for k, v in record.__dict__.items()}


@dataclass(frozen=True)
class ShardInfo:
    """One shard file of a version: its name inside the version dir, role, size and checksum."""

    file: str
    role: Literal["delta", "full"]
    bytes: int
    checksum: str

    @classmethod
    def from_dict(cls, d: object, where: str) -> ShardInfo:
        d = _dict(d, where)
        role = _get(d, "role", str, where)
        if role not in ("delta", "full"):
            raise ManifestError(f"{where}: role must be 'delta' or 'full', got {role!r}")
        return cls(
            file=check_file_name(d.get("file"), f"{where} file"),
            role=role,
            bytes=_int(d, "bytes", where, hi=MAX_SHARD_BYTES),
            checksum=_hex(d, "checksum", where),
        )


@dataclass(frozen=True)
class DeltaRef:
    """Where a tensor's delta lives: two uint8 tensors (positions, values) in a delta shard."""

    shard: int
    mode: Literal["sparse", "dense"]
    positions: str
    values: str

    @classmethod
    def from_dict(cls, d: object, where: str) -> DeltaRef:
        d = _dict(d, where)
        mode = _get(d, "mode", str, where)
        if mode not in ("sparse", "dense"):
            raise ManifestError(f"{where}: mode must be 'sparse' or 'dense', got {mode!r}")
        return cls(
            shard=_int(d, "shard", where, hi=1 << 20),
            mode=mode,
            positions=_str(d, "positions", where, 1024),
            values=_str(d, "values", where, 1024),
        )


@dataclass(frozen=True)
class FullRef:
    """Where a tensor's complete bytes live: a key (the tensor's name) in a full shard."""

    shard: int
    key: str

    @classmethod
    def from_dict(cls, d: object, where: str) -> FullRef:
        d = _dict(d, where)
        return cls(shard=_int(d, "shard", where, hi=1 << 20), key=_str(d, "key", where, 4096))


@dataclass(frozen=True)
class TensorPart:
    """The elements ``[offset, offset + numel)`` (flat, row-major) of a tensor in parts: its own
    checksum, changed count and data, as a whole tensor's would be (format version 2)."""

    offset: int
    numel: int
    checksum: str  # of the part's new bytes
    changed: int
    delta: DeltaRef | None = None  # positions relative to the part
    full: FullRef | None = None  # the part's ``numel`` elements

    @classmethod
    def from_dict(cls, d: object, where: str) -> TensorPart:
        d = _dict(d, where)
        part = cls(
            offset=_int(d, "offset", where),
            numel=_int(d, "numel", where, lo=1),
            checksum=_hex(d, "checksum", where),
            changed=_int(d, "changed", where),
            delta=None if d.get("delta") is None else DeltaRef.from_dict(d["delta"], where),
            full=None if d.get("full") is None else FullRef.from_dict(d["full"], where),
        )
        if part.changed > part.numel:
            raise ManifestError(f"{where}: changed={part.changed} exceeds numel={part.numel}")
        return part


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    checksum: str  # of the tensor's complete new bytes (the parts' composite when in parts)
    changed: int
    delta: DeltaRef | None = None
    full: FullRef | None = None
    parts: tuple[TensorPart, ...] | None = None  # format 2: the tensor in parts, by offset

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def spans(self) -> tuple[TensorPart, ...]:
        """The entry's parts; a tensor that is not in parts is one part covering it all."""
        if self.parts is not None:
            return self.parts
        return (TensorPart(0, self.numel, self.checksum, self.changed, self.delta, self.full),)

    @property
    def layout(self) -> tuple[tuple[int, int], ...] | None:
        """``(offset, numel)`` of each part, or None for a tensor that is not in parts."""
        return None if self.parts is None else tuple((p.offset, p.numel) for p in self.parts)

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_SIZES[self.dtype]

    def to_dict(self) -> dict[str, Any]:
        # the fields in their order, written out: a manifest holds one entry per tensor (tens
        # of thousands for a MoE model) and _plain's generic walk was ~2x this
        delta, full = self.delta, self.full
        d: dict[str, Any] = {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "checksum": self.checksum,
            "changed": self.changed,
            "delta": None if delta is None else dict(delta.__dict__),
            "full": None if full is None else dict(full.__dict__),
        }
        if self.parts is not None:  # (none: format-1 shape for tensors that are not in parts)
            d["parts"] = [_plain(p) for p in self.parts]
        return d

    @classmethod
    def from_dict(cls, d: object, where: str) -> TensorEntry:
        d = _dict(d, where)
        name = _str(d, "name", where, MAX_NAME_CHARS)
        if not name or name == SAFETENSORS_METADATA:
            raise ManifestError(f"{where}: tensor name {name!r} is empty or reserved")
        where = f"{where} ({name!r})"
        dtype = _get(d, "dtype", str, where)
        check_dtype_name(dtype)
        shape = _shape(_get(d, "shape", list, where), where)
        numel = math.prod(shape)
        if numel > MAX_INT:
            raise ManifestError(f"{where}: shape {shape} is too large")
        delta, full, parts = d.get("delta"), d.get("full"), d.get("parts")
        entry = cls(
            name=name,
            dtype=dtype,
            shape=shape,
            checksum=_hex(d, "checksum", where),
            changed=_int(d, "changed", where),
            delta=None if delta is None else DeltaRef.from_dict(delta, where),
            full=None if full is None else FullRef.from_dict(full, where),
            parts=None if parts is None else _parts(parts, where),
        )
        if entry.changed > numel:
            raise ManifestError(f"{where}: changed={entry.changed} exceeds numel={numel}")
        if entry.parts is not None and (entry.delta is not None or entry.full is not None):
            raise ManifestError(f"{where}: a tensor in parts has its delta/full in its parts")
        for p in entry.parts or ():
            if p.offset + p.numel > numel:
                raise ManifestError(f"{where}: part at {p.offset} runs past numel={numel}")
        return entry


def _shape(raw: list[Any], where: str) -> tuple[int, ...]:
    """A shape: at most MAX_RANK ints in 0..MAX_INT, never a bool (a loop, not a generator:
    a manifest holds one per tensor and most have one or two dimensions)."""
    ok = len(raw) <= MAX_RANK
    exact = True
    for s in raw:
        if type(s) is not int:
            exact = False
            if not isinstance(s, int) or isinstance(s, bool):
                ok = False
                break
        if not 0 <= s <= MAX_INT:
            ok = False
            break
    if not ok:
        raise ManifestError(f"{where}: shape must be a list of non-negative ints, got {raw!r}")
    return tuple(raw) if exact else tuple(int(s) for s in raw)


def _parts(v: object, where: str) -> tuple[TensorPart, ...]:
    if not isinstance(v, list) or not v or len(v) > 1 << 16:
        raise ManifestError(f"{where}: parts must be a non-empty list")
    return tuple(TensorPart.from_dict(p, f"{where} parts[{i}]") for i, p in enumerate(v))
