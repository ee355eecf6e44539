"""Parts of one version: what each rank of a multi-rank publisher wrote, and merging them.

Each rank of a multi-rank publisher writes its shards into the version directory under
rank-qualified names (:func:`shard_prefix`) and then a *part record*
(``part-r0003-<attempt>.json``, :class:`PartRecord`): its shards and tensor entries, shard
indices counted from 0 within the rank. The committer merges the records of all ranks into the
content of one manifest (:func:`merge`): shard lists concatenated in rank order with every
index re-based, tensor names unique across ranks except tensors the ranks declared as slices
(:class:`TensorSlice`), whose parts are joined into one entry that must be tiled exactly.

Pure functions and records; no file I/O (the publisher and :mod:`asyncsync.publish.group` do that).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from asyncsync.errors import ConfigError, ManifestError
from asyncsync.format import (
    FORMAT_VERSION,
    MAX_NAME_CHARS,
    MAX_VERSION,
    SAFETENSORS_METADATA,
    DeltaRef,
    FullRef,
    ShardInfo,
    TensorEntry,
    TensorPart,
)
from asyncsync.format.checksum import parts_checksum
from asyncsync.format.fields import load_json
from asyncsync.format.names import MAX_INT, MAX_RANK, carried_dtypes, not_carried

__all__ = [
    "PART_RECORD",
    "PartRecord",
    "TensorSlice",
    "as_part",
    "check_state_dict",
    "merge",
    "part_file_name",
    "schema_of",
    "shard_prefix",
]

PART_RECORD = "asyncsync-part"
_ATTEMPT_RE = re.compile(r"^[0-9a-f]{8,64}\Z")  # (\Z: $ also matches before a final "\n")
NOT_A_MAPPING = (
    "the state dict must be a mapping of names to tensors (model.state_dict(), a dict), got {}"
)


@dataclass(frozen=True)
class TensorSlice:
    """This rank holds the flat elements ``[offset, offset + numel)`` of a tensor of
    ``full_shape`` (row-major), ``numel`` being its local tensor's. Example, a dim-0 shard of a
    row-parallel weight of 4096 x 1024 on rank r of 4::

        TensorSlice(offset=r * 1024 * 1024, full_shape=(4096, 1024))
    """

    offset: int
    full_shape: tuple[int, ...]

    def __post_init__(self) -> None:
        shape = tuple(self.full_shape)
        if (
            isinstance(self.offset, bool)
            or not isinstance(self.offset, int)
            or self.offset < 0
            or len(shape) > MAX_RANK
            or not all(
                isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= MAX_INT for s in shape
            )
        ):
            raise ConfigError(
                f"TensorSlice(offset={self.offset!r}, full_shape={self.full_shape!r}): offset "
                f"and dims must be non-negative ints, dims at most 2^53 - 1 and {MAX_RANK} "
                "of them at most (what a manifest holds)"
            )
        object.__setattr__(self, "full_shape", shape)

    @property
    def full_numel(self) -> int:
        return math.prod(self.full_shape)


def _subclass(t: torch.Tensor) -> str | None:
    """What ``t`` is when it is a tensor subclass whose data is not its own memory (its
    operations dispatch in Python): a DTensor (FSDP2, tensor parallel), a FakeTensor."""
    if not torch._C._dispatch_keys(t).has(torch._C.DispatchKey.Python):
        return None
    hint = (
        "pass t.full_tensor(), or each rank's t.to_local() with slices"
        if type(t).__name__ == "DTensor"
        else "pass the plain tensor it wraps"
    )
    return f"a {type(t).__name__} (a tensor subclass without memory of its own to read: {hint})"


def check_state_dict(
    state_dict: Mapping[str, torch.Tensor], slices: Mapping[str, TensorSlice] | None
) -> dict[str, TensorSlice]:
    """Raise ConfigError for a state dict or slices the format cannot carry; return the slices."""
    if not isinstance(state_dict, Mapping):  # the module itself, None, pairs, a tensor
        raise ConfigError(NOT_A_MAPPING.format(type(state_dict).__name__))
    for name in state_dict:
        if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS:
            raise ConfigError(
                f"state dict keys must be strings of 1 to {MAX_NAME_CHARS} characters, "
                f"got {name!r:.80}"
            )
        try:  # a lone surrogate: no JSON header nor manifest can hold the name
            name.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ConfigError(
                f"state dict key {name!r:.80} is not valid UTF-8 ({exc.reason}): rename it"
            ) from None
        if name == SAFETENSORS_METADATA:  # safetensors' header key: no shard can hold it
            raise ConfigError(
                f"a tensor may not be named {name!r} (the key safetensors reserves for its "
                "header metadata): rename it in the state dict"
            )
        if not isinstance(state_dict[name], torch.Tensor):
            raise ConfigError(f"state_dict[{name!r}] is not a tensor")
        t = state_dict[name]
        if t.dtype not in carried_dtypes():
            raise ConfigError(
                f"state_dict[{name!r}] has dtype {t.dtype}, which the format does not carry: "
                f"{not_carried(t.dtype)}"
            )
        odd = (
            f"of layout {t.layout}" if t.layout != torch.strided
            else "a nested tensor" if t.is_nested
            else "a meta tensor (no data)" if t.is_meta
            else "a lazily negated view" if t.is_neg()
            else "a lazily conjugated view (t.conj(): resolve_conj() it)" if t.is_conj()
            else _subclass(t)
        )  # fmt: skip
        if odd:
            raise ConfigError(
                f"state_dict[{name!r}] is {odd}: only dense tensors with data are carried "
                "(densify or materialize it first)"
            )
        if t.dim() > MAX_RANK or any(n > MAX_INT for n in t.shape):
            raise ConfigError(
                f"state_dict[{name!r}] has shape {list(t.shape)} ({t.dim()} dimensions): a "
                f"manifest holds at most {MAX_RANK} dimensions of at most 2^53 - 1 each "
                "(reshape it)"
            )
    for name, sl in (slices or {}).items():
        if name not in state_dict or not isinstance(sl, TensorSlice):
            raise ConfigError(f"slices[{name!r}] must be a TensorSlice of a state-dict tensor")
        n = state_dict[name].numel()
        if n == 0 or sl.offset + n > sl.full_numel:
            raise ConfigError(
                f"slices[{name!r}]: {n} elements at offset {sl.offset} do not fit in "
                f"full_shape {list(sl.full_shape)}; a slice is non-empty and inside the tensor"
            )
    return dict(slices or {})


def schema_of(
    state_dict: Mapping[str, torch.Tensor], slices: Mapping[str, TensorSlice]
) -> dict[str, Any]:
    """What a snapshot of ``state_dict`` holds: a delta needs the same names, dtypes, shapes
    and slices."""
    return {n: (t.dtype, tuple(t.shape), slices.get(n)) for n, t in state_dict.items()}


def shard_prefix(rank: int, attempt: str) -> str:
    """File-name prefix of rank ``rank``'s shards in attempt ``attempt``: ``r0003-<attempt>-``."""
    return f"r{rank:04d}-{attempt}-"


def part_file_name(rank: int, attempt: str) -> str:
    return f"part-r{rank:04d}-{attempt}.json"


def as_part(entry: TensorEntry, sl: TensorSlice, algorithm: str) -> TensorEntry:
    """A rank's entry of its local tensor, made the one-part entry of the full tensor."""
    if entry.numel == 0 or sl.offset + entry.numel > sl.full_numel:
        raise ConfigError(
            f"slice of {entry.name!r}: {entry.numel} elements at offset {sl.offset} do not fit "
            f"in full_shape {list(sl.full_shape)} ({sl.full_numel} elements); a slice is "
            "non-empty and inside the tensor"
        )
    part = TensorPart(
        sl.offset, entry.numel, entry.checksum, entry.changed, entry.delta, entry.full
    )
    return TensorEntry(
        name=entry.name,
        dtype=entry.dtype,
        shape=sl.full_shape,
        checksum=parts_checksum([(part.offset, part.numel, part.checksum)], algorithm),
        changed=entry.changed,
        parts=(part,),
    )


def _rebase(entry: TensorEntry, base: int) -> TensorEntry:
    """``entry`` with every shard index (its own and its parts') moved up by ``base``."""
    if base == 0:
        return entry

    def up(d: DeltaRef | None, f: FullRef | None) -> dict[str, Any]:
        return {
            "delta": None if d is None else replace(d, shard=d.shard + base),
            "full": None if f is None else replace(f, shard=f.shard + base),
        }

    parts = entry.parts
    if parts is not None:
        parts = tuple(replace(p, **up(p.delta, p.full)) for p in parts)
    return replace(entry, parts=parts, **up(entry.delta, entry.full))


def merge(
    pieces: Sequence[tuple[Sequence[TensorEntry], Sequence[ShardInfo]]], algorithm: str
) -> tuple[tuple[TensorEntry, ...], tuple[ShardInfo, ...]]:
    """Merge each rank's (entries, shards), in rank order, into one manifest's tensors and shards.

    Raises ConfigError naming the tensor when two ranks publish one name without both declaring
    it a slice, when slices disagree on dtype or shape, or when they do not tile the tensor;
    and when no rank published a tensor.
    """
    shards: list[ShardInfo] = []
    entries: dict[str, TensorEntry] = {}
    owner: dict[str, int] = {}
    parts: dict[str, list[TensorPart]] = {}
    for rank, (tensors, rank_shards) in enumerate(pieces):
        base = len(shards)
        shards.extend(rank_shards)
        for e in tensors:
            e = _rebase(e, base)
            prev = entries.get(e.name)
            if prev is None:
                entries[e.name], owner[e.name] = e, rank
                if e.parts is not None:
                    parts[e.name] = list(e.parts)
                continue
            if prev.parts is None or e.parts is None:
                raise ConfigError(
                    f"tensor {e.name!r} is published by ranks {owner[e.name]} and {rank}: give "
                    "each rank its own names, or have every rank declare its share in slices="
                )
            if (prev.dtype, prev.shape) != (e.dtype, e.shape):
                raise ConfigError(
                    f"slices of {e.name!r} disagree: rank {owner[e.name]} has "
                    f"{prev.dtype}{list(prev.shape)}, rank {rank} {e.dtype}{list(e.shape)}"
                )
            parts[e.name].extend(e.parts)
    for name, ps in parts.items():
        ps.sort(key=lambda p: p.offset)
        e = entries[name]
        end = 0
        for p in ps:
            if p.offset != end:
                what = "overlap" if p.offset < end else "leave a gap"
                raise ConfigError(
                    f"the slices of {name!r} {what} at element {min(end, p.offset)} of "
                    f"{e.numel}: the ranks' slices must tile the tensor exactly"
                )
            end += p.numel
        if end != e.numel:
            raise ConfigError(
                f"the slices of {name!r} cover {end} of its {e.numel} elements: the ranks' "
                "slices must tile the tensor exactly"
            )
        entries[name] = replace(
            e,
            parts=tuple(ps),
            changed=sum(p.changed for p in ps),
            checksum=parts_checksum(((p.offset, p.numel, p.checksum) for p in ps), algorithm),
        )
    if not entries:  # a version without tensors would leave every engine with none
        raise ConfigError(f"no rank of {len(pieces)} published a tensor: pass the model's tensors")
    return tuple(entries.values()), tuple(shards)


@dataclass(frozen=True)
class PartRecord:
    """What one rank wrote for one attempt at a version (``part-r0003-<attempt>.json``)."""

    version: int
    attempt: str
    rank: int
    run_id: str
    shards: tuple[ShardInfo, ...]
    tensors: tuple[TensorEntry, ...]
    raw_bytes: int
    producer: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        d = {
            "format": PART_RECORD,
            "format_version": FORMAT_VERSION,
            "version": self.version,
            "attempt": self.attempt,
            "rank": self.rank,
            "run_id": self.run_id,
            "shards": [asdict(s) for s in self.shards],
            "tensors": [t.to_dict() for t in self.tensors],
            "raw_bytes": self.raw_bytes,
            "producer": self.producer,
        }
        return json.dumps(d, allow_nan=False) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, *, where: str = "part record") -> PartRecord:
        """Parse and check a part record (its entries are checked as a manifest's would be)."""
        d = load_json(text, where)  # the strict reader of every JSON file of a root
        if d.get("format") != PART_RECORD:
            raise ManifestError(f"{where}: not an asyncsync part record")
        if d.get("format_version") != FORMAT_VERSION:
            raise ManifestError(f"{where}: format_version {d.get('format_version')!r} unknown")
        version, rank, raw = d.get("version"), d.get("rank"), d.get("raw_bytes")
        attempt, run_id = d.get("attempt"), d.get("run_id")
        shards, tensors, producer = d.get("shards"), d.get("tensors"), d.get("producer", {})
        if not (
            _nat(version, MAX_VERSION)
            and _nat(rank, 1 << 20)
            and _nat(raw, 2**53)
            and isinstance(attempt, str)
            and _ATTEMPT_RE.match(attempt)
            and isinstance(run_id, str)
            and isinstance(shards, list)
            and isinstance(tensors, list)
            and isinstance(producer, dict)
        ):
            raise ManifestError(f"{where}: malformed part record")
        return cls(
            version=int(version),  # type: ignore[arg-type]
            attempt=attempt,
            rank=int(rank),  # type: ignore[arg-type]
            run_id=run_id,
            shards=tuple(
                ShardInfo.from_dict(s, f"{where} shards[{i}]") for i, s in enumerate(shards)
            ),
            tensors=tuple(
                TensorEntry.from_dict(t, f"{where} tensors[{i}]") for i, t in enumerate(tensors)
            ),
            raw_bytes=int(raw),  # type: ignore[arg-type]
            producer=producer,
        )


def _nat(v: object, hi: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= hi
