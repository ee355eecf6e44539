"""What a publish reports: :class:`PublishResult` per version, :class:`PublisherStats` overall."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from asyncsync.format import Manifest

__all__ = ["PublishResult", "PublisherStats"]


@dataclass(frozen=True)
class PublishResult:
    """What one publish committed, with its cost per stage (seconds: ``diff``, ``encode``,
    ``write`` summed over buckets; ``commit``; ``total`` wall time)."""

    version: int
    kind: Literal["full", "delta"]
    base_version: int | None
    changed: int
    total: int
    density: float
    wire_bytes: int
    delta_bytes: int
    raw_bytes: int
    shards: int
    seconds: Mapping[str, float]
    path: Path

    @property
    def zero_diff(self) -> bool:
        return self.kind == "delta" and self.changed == 0

    @classmethod
    def of(cls, manifest: Manifest, seconds: Mapping[str, float], path: Path) -> PublishResult:
        t = manifest.totals
        return cls(
            version=manifest.version,
            kind=manifest.kind,
            base_version=manifest.base_version,
            changed=t.changed,
            total=t.elements,
            density=t.density,
            wire_bytes=t.wire_bytes,
            delta_bytes=t.delta_bytes,
            raw_bytes=t.raw_bytes,
            shards=len(manifest.shards),
            seconds=dict(seconds),
            path=path,
        )


@dataclass(frozen=True)
class PublisherStats:
    """Totals of one publisher since it opened, and its recent results."""

    root: Path
    run_id: str
    last_version: int | None
    published: int
    keyframes: int
    zero_diff: int
    wire_bytes: int
    changed: int
    elements: int
    last: PublishResult | None
    recent: tuple[PublishResult, ...] = field(default=())
