"""The manifest: one committed version (its shards, tensors, totals), and the model fingerprint.

Everything read from the shared directory goes through :meth:`Manifest.from_json`, which rejects
anything malformed, unsafe (path escapes) or of an unknown format version with a
:class:`~asyncsync.errors.ManifestError`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from asyncsync.errors import ConfigError, ManifestError
from asyncsync.format.checksum import ALGORITHMS, checksum_bytes, parts_checksum
from asyncsync.format.entries import (
    ShardInfo,
    TensorEntry,
    TensorPart,
    _plain,
)
from asyncsync.format.fields import (
    _dict,
    _float,
    _get,
    _hex,
    _int,
    _known,
    _opt_int,
    _str,
    load_json,
)
from asyncsync.format.names import (
    _HEX_RE,
    ENCODINGS,
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_NAME,
    MAX_VERSION,
    READ_FORMAT_VERSIONS,
)
from asyncsync.memory import gc_paused

__all__ = ["Manifest", "Totals", "fingerprint"]


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
        """The manifest ``text`` holds, checked (ManifestError). Parsed with the cyclic garbage
        collector paused (:func:`asyncsync.memory.gc_paused`): a MoE model's manifest is tens of
        thousands of JSON dicts and lists, freed as soon as its records are made."""
        with gc_paused():
            return cls._from_json(text, where)

    @classmethod
    def _from_json(cls, text: str | bytes, where: str) -> Manifest:
        d = load_json(text, where)
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
            if t.parts is not None:
                self._check_parts(t, f"{where} tensor {t.name!r}")
            # a tensor not in parts is its own one span (``t.spans`` would make a TensorPart
            # of each); the place an error names is formatted only when there is one
            for p in t.parts if t.parts is not None else (t,):
                if self.kind == "full" and p.full is None:
                    raise ManifestError(
                        f"{_at(where, t, p)}: a full version must give every tensor's full data"
                    )
                if self.kind == "delta" and p.full is not None:
                    raise ManifestError(f"{_at(where, t, p)}: a delta version carries no full data")
                if p.delta is not None:
                    if self.base_version is None:
                        raise ManifestError(
                            f"{_at(where, t, p)}: delta data without a base_version"
                        )
                    if p.changed == 0:
                        raise ManifestError(
                            f"{_at(where, t, p)}: delta data for an unchanged tensor"
                        )
                    self._check_ref(p.delta.shard, "delta", where, t, p)
                    for k in (p.delta.positions, p.delta.values):
                        if (p.delta.shard, k) in keys:
                            raise ManifestError(f"{_at(where, t, p)}: shard key {k!r} used twice")
                        keys.add((p.delta.shard, k))
                elif self.base_version is not None and p.changed > 0:
                    raise ManifestError(
                        f"{_at(where, t, p)}: changed={p.changed} but no delta data"
                    )
                if self.base_version is None and p.changed != p.numel:
                    raise ManifestError(
                        f"{_at(where, t, p)}: changed={p.changed}, but with no base every element "
                        f"is new (changed must be numel={p.numel})"
                    )
                if p.full is not None:
                    self._check_ref(p.full.shard, "full", where, t, p)
                    if (p.full.shard, p.full.key) in keys:
                        raise ManifestError(
                            f"{_at(where, t, p)}: shard key {p.full.key!r} used twice"
                        )
                    keys.add((p.full.shard, p.full.key))
        self._check_digests(where)
        if self.fingerprint != fingerprint(self.tensors, self.checksum_algorithm):
            raise ManifestError(
                f"{where}: fingerprint {self.fingerprint} is not the one its tensor entries "
                "give (FORMAT.md section 3): the manifest was edited"
            )
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
        if tot.delta_bytes != sum(s.bytes for s in self.shards if s.role == "delta"):
            raise ManifestError(f"{where}: totals.delta_bytes does not match the delta shards")
        density = tot.changed / tot.elements if tot.elements else 0.0
        if not math.isclose(tot.density, density, rel_tol=1e-9, abs_tol=0.0):
            raise ManifestError(
                f"{where}: totals.density {tot.density} is not changed/elements ({density})"
            )

    def _check_digests(self, where: str) -> None:
        """Every checksum has the length of a digest of the manifest's algorithm."""
        n = len(checksum_bytes(b"", self.checksum_algorithm))
        bad = self._bad_digest(n)
        if bad is not None:
            what, digest = bad
            raise ManifestError(
                f"{where}: {what}: checksum {digest!r} is not a {self.checksum_algorithm} "
                f"digest ({n} hex digits)"
            )

    def _bad_digest(self, n: int) -> tuple[str, str] | None:
        """The first checksum (what names it, the digest) that is not ``n`` hex digits long."""
        if len(self.fingerprint) != n:
            return "fingerprint", self.fingerprint
        for s in self.shards:
            if len(s.checksum) != n:
                return f"shard {s.file!r}", s.checksum
        for t in self.tensors:
            if len(t.checksum) != n:
                return f"tensor {t.name!r}", t.checksum
            for p in t.parts or ():
                if len(p.checksum) != n:
                    return f"tensor {t.name!r} part at {p.offset}", p.checksum
        return None

    def _check_parts(self, t: TensorEntry, where: str) -> None:
        """A tensor in parts: format 2, parts tile it in offset order, sums and checksum agree."""
        parts = t.parts or ()
        if self.format_version < 2:
            raise ManifestError(f"{where}: tensors in parts need format_version 2 or later")
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

    def _check_ref(
        self, shard: int, role: str, where: str, t: TensorEntry, p: TensorEntry | TensorPart
    ) -> None:
        if not 0 <= shard < len(self.shards):
            raise ManifestError(f"{_at(where, t, p)}: shard index {shard} out of range")
        if self.shards[shard].role != role:
            raise ManifestError(f"{_at(where, t, p)}: shard {shard} is not a {role} shard")

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


def _at(where: str, t: TensorEntry, p: TensorEntry | TensorPart) -> str:
    """Where in a manifest an error of tensor ``t``'s span ``p`` lies (formatted on raising)."""
    if p is t:
        return f"{where} tensor {t.name!r}"
    return f"{where} tensor {t.name!r} part at {p.offset}"  # type: ignore[union-attr]


def fingerprint(tensors: list[TensorEntry] | tuple[TensorEntry, ...], algorithm: str) -> str:
    """The checksum of a whole model state: over each tensor's name, dtype, shape and checksum."""
    canon = "\n".join(
        f"{t.name}\t{t.dtype}\t{','.join(map(str, t.shape))}\t{t.checksum}"
        for t in sorted(tensors, key=lambda e: e.name)
    )
    return checksum_bytes(canon.encode(), algorithm)
