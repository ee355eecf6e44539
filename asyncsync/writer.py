"""The write stage of a publish: shard files for one version, and what they hold.

A :class:`VersionWriter` lives for one publish. Each encoded bucket becomes one delta shard
(and one full shard on keyframes), written atomically (temp + fsync + rename; the directory is
synced once before the commit), and the writer records each shard's size and checksum and each
tensor's manifest entry, so that when every bucket is written the manifest can be built from
it. It also collects the snapshot updates that the publisher applies after the commit.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from asyncsync.checksum import checksum_bytes
from asyncsync.format import DeltaRef, FullRef, ShardInfo, TensorEntry
from asyncsync.fsio import atomic_write
from asyncsync.merge import TensorSlice, as_part
from asyncsync.shards import EncodedBucket, PendingUpdate, delta_keys

__all__ = ["VersionWriter"]


@dataclass
class VersionWriter:
    """Writes one version's shards into ``vdir`` and accumulates their manifest entries."""

    vdir: Path
    algorithm: str
    meta: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)  # dtype, shape
    slices: Mapping[str, TensorSlice] = field(default_factory=dict)
    prefix: str = ""  # of shard file names: "r0003-<attempt>-" in a multi-rank publish
    shards: list[ShardInfo] = field(default_factory=list)
    entries: dict[int, TensorEntry] = field(default_factory=dict)
    pending: list[PendingUpdate] = field(default_factory=list)
    raw_bytes: int = 0
    sums: dict[str, str] = field(default_factory=dict)  # checksum of each local tensor
    seconds: dict[str, float] = field(
        default_factory=lambda: {"diff": 0.0, "encode": 0.0, "write": 0.0}
    )

    def write(self, enc: EncodedBucket) -> None:
        """Write one bucket's shards (tmp + fsync + rename) and record their entries."""
        shard_of: dict[str, int] = {}
        for role, blob in (("delta", enc.delta_blob), ("full", enc.full_blob)):
            if blob is None:
                continue
            n = sum(1 for s in self.shards if s.role == role)
            fname = f"{self.prefix}{role}-{n:05d}.safetensors"
            atomic_write(self.vdir / fname, blob, sync_dir=False)
            shard_of[role] = len(self.shards)
            checksum = checksum_bytes(blob, self.algorithm)
            self.shards.append(ShardInfo(fname, role, len(blob), checksum))  # type: ignore[arg-type]
        for it in enc.items:
            delta_ref = None
            if it.mode is not None:
                pkey, vkey = delta_keys(it.index)
                delta_ref = DeltaRef(shard_of["delta"], it.mode, pkey, vkey)
            full_ref = FullRef(shard_of["full"], it.name) if it.has_full else None
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
        self.pending.extend(enc.pending)
        self.raw_bytes += enc.raw_bytes
