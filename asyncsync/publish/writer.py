"""The write stage of a publish: shard files for one version, and what they hold.

A :class:`VersionWriter` lives for one publish. An encoded bucket's full tensors (keyframes)
become one full shard; its deltas join those of the buckets before it until they fill a delta
shard of about ``shard_bytes`` (:class:`~asyncsync.codec.shards.DeltaPacker`; with ``taper``,
shard 0 is the first bucket's alone and the last shards halve down to one bucket), and
:meth:`finish` writes the last one. Every shard is written atomically (temp + fsync + rename;
the directory is synced once before the commit), and the writer records each shard's size and
checksum and each tensor's manifest entry, so that when every bucket is written the manifest
can be built from it. It also collects the snapshot updates that the publisher applies after
the commit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from asyncsync.codec.shards import (
    DeltaPacker,
    EncodedBucket,
    ItemResult,
    PendingUpdate,
    delta_keys,
    delta_shard_parts,
)
from asyncsync.codec.stream_shard import StreamEntry, stream_metadata
from asyncsync.format import DeltaRef, FullRef, ShardInfo, TensorEntry
from asyncsync.format.checksum import new_hasher
from asyncsync.fsio import atomic_write
from asyncsync.publish.merge import TensorSlice, as_part

__all__ = ["VersionWriter"]


@dataclass
class VersionWriter:
    """Writes one version's shards into ``vdir`` and accumulates their manifest entries.

    Call :meth:`write` for each encoded bucket in order, then :meth:`finish` once.
    """

    vdir: Path
    algorithm: str
    version: int
    run_id: str
    shard_bytes: int  # a delta shard collects buckets' deltas up to about this many bytes
    meta: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)  # dtype, shape
    slices: Mapping[str, TensorSlice] = field(default_factory=dict)
    prefix: str = ""  # of shard file names: "r0003-<attempt>-" in a multi-rank publish
    # (base version, base fingerprint, attempt, encoding): write self-describing delta shards
    # that a receiver may apply before the manifest (format 3, FORMAT.md 4.3); None: plain ones
    stream: tuple[int, str, str, str] | None = None
    # with ``stream``: shard 0 is the first bucket alone and the last shards halve (about
    # log2(shard_bytes / a bucket's delta) more files: the default, adaptive size's way;
    # DeltaPacker): a receiver applying shards as they land starts early and ends soon after
    taper: bool = False
    sizes: Sequence[int] = ()  # with ``taper``: each tensor's model bytes, by its index
    shards: list[ShardInfo] = field(default_factory=list)
    entries: dict[int, TensorEntry] = field(default_factory=dict)
    pending: list[PendingUpdate] = field(default_factory=list)
    raw_bytes: int = 0
    sums: dict[str, str] = field(default_factory=dict)  # checksum of each local tensor
    seconds: dict[str, float] = field(
        default_factory=lambda: {"diff": 0.0, "encode": 0.0, "write": 0.0}
    )

    def __post_init__(self) -> None:
        self._packer = DeltaPacker(self.shard_bytes)
        self._waiting: list[tuple[ItemResult, int | None]] = []  # (item, its full shard)
        self._tapers = self.taper and self.stream is not None
        self._left = sum(self.sizes) if self._tapers else 0  # model bytes of the buckets to come
        self._count = {"delta": 0, "full": 0}  # the shards written of each role

    def write(self, enc: EncodedBucket) -> None:
        """Take one encoded bucket: write its full shard now and its deltas when a shard fills."""
        full_shard = None
        if enc.full_blob is not None:
            full_shard = self._write_shard("full", enc.full_blob)
        for it in enc.items:
            if it.mode is None:
                self._record(it, None, full_shard)
            else:
                self._waiting.append((it, full_shard))
        model, left = 0, None
        if self._tapers:
            model = sum(self.sizes[it.index] for it in enc.items)
            self._left -= model
            left = self._left
        for group in self._packer.add(enc.delta_blobs, model=model, left=left):
            self._write_deltas(group)
        self.pending.extend(enc.pending)
        self.raw_bytes += enc.raw_bytes

    def finish(self) -> None:
        """Write the last delta shard (the deltas no shard has taken yet)."""
        group = self._packer.take()
        if group:
            self._write_deltas(group)
        if self._waiting:
            raise AssertionError(f"{len(self._waiting)} tensors' deltas were never written")

    def _write_shard(self, role: str, blob: bytes | list[bytes | memoryview]) -> int:
        """Write one shard (its bytes, or the pieces to write one after another)."""
        n = self._count[role]
        fname = f"{self.prefix}{role}-{n:05d}.safetensors"
        parts = [blob] if isinstance(blob, bytes) else blob
        size = atomic_write(self.vdir / fname, parts, root=self.vdir.parent, sync_dir=False)
        h = new_hasher(self.algorithm)
        for part in parts:
            h.update(part)
        self.shards.append(ShardInfo(fname, role, size, h.hexdigest()))  # type: ignore[arg-type]
        self._count[role] = n + 1
        return len(self.shards) - 1

    def _write_deltas(self, group: dict[str, bytes]) -> None:
        """Write one delta shard and record the entries of the tensors whose deltas it holds."""
        meta = None
        if self.stream is not None:
            meta = self._stream_meta(group)
        parts = delta_shard_parts(group, version=self.version, run_id=self.run_id, stream=meta)
        shard = self._write_shard("delta", parts)
        rest = []
        for it, full_shard in self._waiting:
            if delta_keys(it.index)[0] in group:
                self._record(it, shard, full_shard)
            else:
                rest.append((it, full_shard))
        self._waiting = rest

    def _stream_meta(self, group: dict[str, bytes]) -> dict[str, str]:
        """The metadata that makes the delta shard of ``group`` self-describing."""
        assert self.stream is not None
        base_version, base_fingerprint, attempt, encoding = self.stream
        entries = []
        for it, _ in self._waiting:
            pkey, vkey = delta_keys(it.index)
            if pkey in group:
                assert it.mode is not None
                dtype, shape = self.meta[it.name]
                entries.append(
                    StreamEntry(it.name, dtype, shape, it.changed, it.mode, pkey, vkey, it.checksum)
                )
        h = new_hasher(self.algorithm)
        for b in group.values():
            h.update(b)
        return stream_metadata(
            base_version=base_version,
            base_fingerprint=base_fingerprint,
            attempt=attempt,
            shard_index=self._count["delta"],
            encoding=encoding,
            algorithm=self.algorithm,
            entries=entries,
            data_checksum=h.hexdigest(),
        )

    def _record(self, it: ItemResult, delta_shard: int | None, full_shard: int | None) -> None:
        delta_ref = None
        if it.mode is not None:
            assert delta_shard is not None
            pkey, vkey = delta_keys(it.index)
            delta_ref = DeltaRef(delta_shard, it.mode, pkey, vkey)
        full_ref = FullRef(full_shard, it.name) if full_shard is not None else None
        dtype, shape = self.meta[it.name]
        entry = TensorEntry(
            name=it.name,
            dtype=dtype,
            shape=shape,
            checksum=it.checksum,
            changed=it.changed,
            delta=delta_ref,
            full=full_ref,
        )
        sl = self.slices.get(it.name)
        self.entries[it.index] = entry if sl is None else as_part(entry, sl, self.algorithm)
        self.sums[it.name] = it.checksum
