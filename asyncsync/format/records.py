"""The records of the protocol: manifests (shards, tensors, parts, totals) and acks."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from asyncsync.checksum import ALGORITHMS, parts_checksum
from asyncsync.codec import ENCODINGS
from asyncsync.errors import ConfigError, ManifestError
from asyncsync.format.fields import (
    _dict,
    _float,
    _get,
    _hex,
    _int,
    _known,
    _load_json,
    _opt_int,
    _str,
)
from asyncsync.format.names import (
    _HEX_RE,
    _MAX_INT,
    _MAX_RANK,
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_NAME,
    MAX_VERSION,
    READ_FORMAT_VERSIONS,
    check_engine_id,
    check_file_name,
    dtype_from_name,
)


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
            bytes=_int(d, "bytes", where),
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
        return self.numel * self.torch_dtype.itemsize

    def to_dict(self) -> dict[str, Any]:
        d = _plain(self)
        d["shape"] = list(self.shape)
        if self.parts is None:
            del d["parts"]  # format-1 shape for tensors that are not in parts
        else:
            d["parts"] = [_plain(p) for p in self.parts]
        return d

    @classmethod
    def from_dict(cls, d: object, where: str) -> TensorEntry:
        d = _dict(d, where)
        name = _str(d, "name", where, 4096)
        if not name:
            raise ManifestError(f"{where}: empty tensor name")
        where = f"{where} ({name!r})"
        dtype = _get(d, "dtype", str, where)
        dtype_from_name(dtype)
        shape_raw = _get(d, "shape", list, where)
        if len(shape_raw) > _MAX_RANK or not all(
            isinstance(s, int) and not isinstance(s, bool) and 0 <= s < _MAX_INT for s in shape_raw
        ):
            raise ManifestError(
                f"{where}: shape must be a list of non-negative ints, got {shape_raw!r}"
            )
        shape = tuple(int(s) for s in shape_raw)
        if math.prod(shape) >= _MAX_INT:
            raise ManifestError(f"{where}: shape {shape} is too large")
        entry = cls(
            name=name,
            dtype=dtype,
            shape=shape,
            checksum=_hex(d, "checksum", where),
            changed=_int(d, "changed", where),
            delta=None if d.get("delta") is None else DeltaRef.from_dict(d["delta"], where),
            full=None if d.get("full") is None else FullRef.from_dict(d["full"], where),
            parts=None if d.get("parts") is None else _parts(d["parts"], where),
        )
        if entry.changed > entry.numel:
            raise ManifestError(f"{where}: changed={entry.changed} exceeds numel={entry.numel}")
        if entry.parts is not None and (entry.delta is not None or entry.full is not None):
            raise ManifestError(f"{where}: a tensor in parts has its delta/full in its parts")
        for p in entry.parts or ():
            if p.offset + p.numel > entry.numel:
                raise ManifestError(f"{where}: part at {p.offset} runs past numel={entry.numel}")
        return entry


def _parts(v: object, where: str) -> tuple[TensorPart, ...]:
    if not isinstance(v, list) or not v or len(v) > 1 << 16:
        raise ManifestError(f"{where}: parts must be a non-empty list")
    return tuple(TensorPart.from_dict(p, f"{where} parts[{i}]") for i, p in enumerate(v))


@dataclass(frozen=True)
class Totals:
    tensors: int
    elements: int
    changed: int
    density: float
    model_bytes: int
    wire_bytes: int  # bytes of all shards of this version
    delta_bytes: int  # bytes of the delta shards only
    raw_bytes: int  # delta payload bytes before compression

    @classmethod
    def of(
        cls,
        tensors: Sequence[TensorEntry],
        shards: Sequence[ShardInfo],
        raw_bytes: int,
        *,
        external_full: bool = False,
    ) -> Totals:
        """The totals of a version with these tensors and shards (``external_full``: its full
        shards belong to a registered checkpoint and are not wire bytes of this version)."""
        elements = sum(e.numel for e in tensors)
        changed = sum(e.changed for e in tensors)
        return cls(
            tensors=len(tensors),
            elements=elements,
            changed=changed,
            density=changed / elements if elements else 0.0,
            model_bytes=sum(e.nbytes for e in tensors),
            wire_bytes=sum(s.bytes for s in shards if not external_full or s.role == "delta"),
            delta_bytes=sum(s.bytes for s in shards if s.role == "delta"),
            raw_bytes=raw_bytes,
        )

    @classmethod
    def from_dict(cls, d: object, where: str) -> Totals:
        d = _dict(d, where)
        return cls(
            tensors=_int(d, "tensors", where),
            elements=_int(d, "elements", where),
            changed=_int(d, "changed", where),
            density=_float(d, "density", where),
            model_bytes=_int(d, "model_bytes", where),
            wire_bytes=_int(d, "wire_bytes", where),
            delta_bytes=_int(d, "delta_bytes", where),
            raw_bytes=_int(d, "raw_bytes", where),
        )


@dataclass(frozen=True)
class Manifest:
    """A committed version. See docs/FORMAT.md for the meaning and invariants of each field."""

    version: int
    base_version: int | None
    kind: Literal["full", "delta"]
    encoding: str
    checksum_algorithm: str
    run_id: str
    shards: tuple[ShardInfo, ...]
    tensors: tuple[TensorEntry, ...]
    totals: Totals
    fingerprint: str
    created_at: float
    committed_at: float
    producer: dict[str, Any] = field(default_factory=dict)
    shard_dir: str | None = None  # full shards live outside the version dir (registered checkpoint)
    format_version: int = FORMAT_VERSION
    attempt: str | None = None  # multi-rank publish: the attempt this manifest commits

    # -- derived views ------------------------------------------------------------------
    @property
    def is_keyframe(self) -> bool:
        return self.kind == "full"

    @property
    def has_delta(self) -> bool:
        """True when an engine at ``base_version`` can reach this version from the delta alone."""
        return self.base_version is not None

    def tensor_map(self) -> dict[str, TensorEntry]:
        return {t.name: t for t in self.tensors}

    def shard_path(self, version_path: Path, shard: ShardInfo) -> Path:
        base = Path(self.shard_dir) if (self.shard_dir and shard.role == "full") else version_path
        return base / shard.file

    # -- JSON ---------------------------------------------------------------------------
    def to_json(self) -> str:
        d: dict[str, Any] = {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "run_id": self.run_id,
            "version": self.version,
            "base_version": self.base_version,
            "kind": self.kind,
            "encoding": self.encoding,
            "checksum_algorithm": self.checksum_algorithm,
            "shard_dir": self.shard_dir,
            "shards": [_plain(s) for s in self.shards],
            "tensors": [t.to_dict() for t in self.tensors],
            "totals": _plain(self.totals),
            "fingerprint": self.fingerprint,
            "producer": self.producer,
            "created_at": self.created_at,
            "committed_at": self.committed_at,
        }
        if self.attempt is not None:
            d["attempt"] = self.attempt
        # compact: json's C encoder (indented output takes its pure-Python path, ~10x slower
        # for a manifest of a few hundred tensors); `asyncsync inspect` pretty-prints
        return json.dumps(d, separators=(",", ":"), allow_nan=False) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, *, where: str = "manifest") -> Manifest:
        d = _load_json(text, where)
        if d.get("format") != FORMAT_NAME:
            raise ManifestError(f"{where}: not an asyncsync manifest (format={d.get('format')!r})")
        fv = _int(d, "format_version", where)
        if fv not in READ_FORMAT_VERSIONS:
            raise ManifestError(
                f"{where}: format_version {fv} is not supported by this reader "
                f"(it reads {', '.join(map(str, READ_FORMAT_VERSIONS))}); "
                "upgrade asyncsync on this host"
            )
        attempt = d.get("attempt")
        if attempt is not None and (not isinstance(attempt, str) or not _HEX_RE.match(attempt)):
            raise ManifestError(f"{where}: attempt must be a lowercase hex string or null")
        kind = _get(d, "kind", str, where)
        if kind not in ("full", "delta"):
            raise ManifestError(f"{where}: kind must be 'full' or 'delta', got {kind!r}")
        version = _int(d, "version", where, hi=MAX_VERSION)
        shard_dir = d.get("shard_dir")
        if shard_dir is not None and (not isinstance(shard_dir, str) or not shard_dir):
            raise ManifestError(f"{where}: shard_dir must be a non-empty string or null")
        producer = d.get("producer", {})
        m = cls(
            version=version,
            base_version=_opt_int(d, "base_version", where, hi=MAX_VERSION),
            kind=kind,
            encoding=_known(d, "encoding", ENCODINGS, where),
            checksum_algorithm=_known(d, "checksum_algorithm", ALGORITHMS, where),
            run_id=_str(d, "run_id", where, 128),
            shards=tuple(
                ShardInfo.from_dict(s, f"{where} shards[{i}]")
                for i, s in enumerate(_get(d, "shards", list, where))
            ),
            tensors=tuple(
                TensorEntry.from_dict(t, f"{where} tensors[{i}]")
                for i, t in enumerate(_get(d, "tensors", list, where))
            ),
            totals=Totals.from_dict(_get(d, "totals", dict, where), f"{where} totals"),
            fingerprint=_hex(d, "fingerprint", where),
            created_at=_float(d, "created_at", where),
            committed_at=_float(d, "committed_at", where),
            producer=_dict(producer, f"{where} producer"),
            shard_dir=shard_dir,
            format_version=fv,
            attempt=attempt,
        )
        m.validate(where)
        return m

    def validate(self, where: str = "manifest") -> None:
        """Cross-field invariants (FORMAT.md, "Invariants"). Raises ManifestError."""
        if self.kind == "delta" and self.base_version is None:
            raise ManifestError(f"{where}: a delta version needs a base_version")
        if self.base_version is not None and self.base_version != self.version - 1:
            raise ManifestError(
                f"{where}: base_version {self.base_version} must be version-1 ({self.version - 1})"
            )
        if self.shard_dir is not None and self.kind != "full":
            raise ManifestError(f"{where}: shard_dir is only allowed on full versions")
        files = [s.file for s in self.shards]
        if len(set(files)) != len(files):
            raise ManifestError(f"{where}: duplicate shard file names")
        if MANIFEST_NAME in files:
            raise ManifestError(f"{where}: a shard may not be named {MANIFEST_NAME}")
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise ManifestError(f"{where}: duplicate tensor names")
        keys: set[tuple[int, str]] = set()
        for t in self.tensors:
            w = f"{where} tensor {t.name!r}"
            if t.parts is not None:
                self._check_parts(t, w)
            for p in t.spans:
                if t.parts is not None:
                    w = f"{where} tensor {t.name!r} part at {p.offset}"
                if self.kind == "full" and p.full is None:
                    raise ManifestError(f"{w}: a full version must give every tensor's full data")
                if self.kind == "delta" and p.full is not None:
                    raise ManifestError(f"{w}: a delta version carries no full data")
                if p.delta is not None:
                    if self.base_version is None:
                        raise ManifestError(f"{w}: delta data without a base_version")
                    if p.changed == 0:
                        raise ManifestError(f"{w}: delta data for an unchanged tensor")
                    self._check_ref(p.delta.shard, "delta", w)
                    for k in (p.delta.positions, p.delta.values):
                        if (p.delta.shard, k) in keys:
                            raise ManifestError(f"{w}: shard key {k!r} used twice")
                        keys.add((p.delta.shard, k))
                elif self.base_version is not None and p.changed > 0:
                    raise ManifestError(f"{w}: changed={p.changed} but no delta data")
                if p.full is not None:
                    self._check_ref(p.full.shard, "full", w)
        tot = self.totals
        if tot.tensors != len(self.tensors):
            raise ManifestError(f"{where}: totals.tensors does not match the tensor list")
        if tot.changed != sum(t.changed for t in self.tensors):
            raise ManifestError(f"{where}: totals.changed does not match the tensors")
        if tot.elements != sum(t.numel for t in self.tensors):
            raise ManifestError(f"{where}: totals.elements does not match the tensors")
        if tot.wire_bytes != sum(
            s.bytes for s in self.shards if not self.shard_dir or s.role == "delta"
        ):
            raise ManifestError(f"{where}: totals.wire_bytes does not match the shards")

    def _check_parts(self, t: TensorEntry, where: str) -> None:
        """A tensor in parts: format 2, parts tile it in offset order, sums and checksum agree."""
        parts = t.parts or ()
        if self.format_version < 2:
            raise ManifestError(f"{where}: tensors in parts need format_version 2")
        end = 0
        for p in parts:
            if p.offset != end:
                raise ManifestError(
                    f"{where}: parts must tile the tensor in offset order; expected a part at "
                    f"{end}, found one at {p.offset}"
                )
            end += p.numel
        if end != t.numel:
            raise ManifestError(f"{where}: parts cover {end} of {t.numel} elements")
        if t.changed != sum(p.changed for p in parts):
            raise ManifestError(f"{where}: changed is not the sum of its parts' changed")
        try:
            want = parts_checksum(
                ((p.offset, p.numel, p.checksum) for p in parts), self.checksum_algorithm
            )
        except ConfigError as exc:
            raise ManifestError(f"{where}: {exc}") from exc
        if t.checksum != want:
            raise ManifestError(f"{where}: checksum is not the composite of its parts' checksums")

    def _check_ref(self, shard: int, role: str, where: str) -> None:
        if not 0 <= shard < len(self.shards):
            raise ManifestError(f"{where}: shard index {shard} out of range")
        if self.shards[shard].role != role:
            raise ManifestError(f"{where}: shard {shard} is not a {role} shard")

    def log_record(self) -> dict[str, Any]:
        """The one-line summary appended to ``log.jsonl``."""
        return {
            "version": self.version,
            "base_version": self.base_version,
            "kind": self.kind,
            "run_id": self.run_id,
            "changed": self.totals.changed,
            "elements": self.totals.elements,
            "density": self.totals.density,
            "wire_bytes": self.totals.wire_bytes,
            "delta_bytes": self.totals.delta_bytes,
            "shards": len(self.shards),
            "fingerprint": self.fingerprint,
            "committed_at": self.committed_at,
        }


def fingerprint(tensors: list[TensorEntry] | tuple[TensorEntry, ...], algorithm: str) -> str:
    """The checksum of a whole model state: over each tensor's name, dtype, shape and checksum."""
    from asyncsync.checksum import checksum_bytes

    canon = "\n".join(
        f"{t.name}\t{t.dtype}\t{','.join(map(str, t.shape))}\t{t.checksum}"
        for t in sorted(tensors, key=lambda e: e.name)
    )
    return checksum_bytes(canon.encode(), algorithm)


@dataclass(frozen=True)
class AckRecord:
    """What an engine holds: written by its receiver only after the engine holds ``version``."""

    engine_id: str
    version: int
    fingerprint: str
    run_id: str
    applied_at: float
    host: str = ""
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        d = {"format": FORMAT_NAME, **asdict(self)}
        return json.dumps(d, allow_nan=False) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, *, where: str = "ack") -> AckRecord:
        d = _load_json(text, where)
        if d.get("format") != FORMAT_NAME:
            raise ManifestError(f"{where}: not an asyncsync ack record")
        fv = _int(d, "format_version", where)
        if fv not in READ_FORMAT_VERSIONS:
            raise ManifestError(f"{where}: unsupported format_version {fv}")
        return cls(
            engine_id=check_engine_id(d.get("engine_id")),
            version=_int(d, "version", where, hi=MAX_VERSION),
            fingerprint=_hex(d, "fingerprint", where),
            run_id=_str(d, "run_id", where, 128),
            applied_at=_float(d, "applied_at", where),
            host=_str(d, "host", where, 256) if "host" in d else "",
            format_version=fv,
        )
