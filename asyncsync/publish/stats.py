"""What a publish reports: :class:`PublishResult` per version, :class:`PublisherStats` overall."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from asyncsync.format import Manifest

__all__ = ["PublishResult", "PublisherStats", "Tally"]

logger = logging.getLogger("asyncsync.publish.publisher")  # the publisher's log line


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


class Tally:
    """A publisher's running totals and its last 1000 results."""

    def __init__(self) -> None:
        self.history: list[PublishResult] = []
        self.counts = {"published": 0, "keyframes": 0, "zero_diff": 0, "wire": 0, "changed": 0}
        self.elements = 0

    def record(self, res: PublishResult) -> None:
        self.history.append(res)
        del self.history[:-1000]
        self.counts["published"] += 1
        self.counts["keyframes"] += res.kind == "full"
        self.counts["zero_diff"] += res.zero_diff
        self.counts["wire"] += res.wire_bytes
        self.counts["changed"] += res.changed
        logger.info(
            "committed version %d kind=%s changed=%d/%d (%.3f%%) wire=%d B in %.3fs",
            res.version,
            res.kind,
            res.changed,
            res.total,
            100 * res.density,
            res.wire_bytes,
            res.seconds["total"],
        )

    def stats(self, root: Path, run_id: str, last_version: int | None) -> PublisherStats:
        c = self.counts
        return PublisherStats(
            root=root,
            run_id=run_id,
            last_version=last_version,
            published=c["published"],
            keyframes=c["keyframes"],
            zero_diff=c["zero_diff"],
            wire_bytes=c["wire"],
            changed=c["changed"],
            elements=self.elements,
            last=self.history[-1] if self.history else None,
            recent=tuple(self.history[-100:]),
        )
