"""What one benchmark child does: the :class:`Job` the parent writes as JSON and the child reads.

Its own module so that the roles (:mod:`asyncsync.ops.bench.worker`, the scale sweep's
:mod:`asyncsync.ops.bench.scale`, the peers' :mod:`asyncsync.ops.bench.peers`) and the parent
(:mod:`asyncsync.ops.bench.measure`) import it without importing each other.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from asyncsync import fsio

__all__ = ["Job", "Role"]

Role = Literal[
    "publish",
    "receive",
    "cost",
    "scale-publish",
    "scale-receive",
    "scale-cost",
    "peer-publish",
    "peer-receive",
]


@dataclass
class Job:
    """What one child does (written as JSON by the parent, read back here)."""

    role: Role
    root: str
    result: str
    states: list[str] = field(default_factory=list)  # safetensors files: version 0, 1, ...
    checkpoint: str = ""
    ready: str = ""  # the receiver creates it once it holds version 0 and is throttled
    engine_id: str = "bench"
    pipelined: bool = True
    prefetch: bool = True
    bandwidth: float | None = None
    latency: float = 0.0
    bucket_bytes: int = 32 << 20
    poll_interval: float = 0.05
    settle: float = 0.1
    repeats: int = 5
    full_repeats: int = 2
    timeout: float = 300.0
    spawned_at: float = 0.0  # time.time() when the parent started this child
    # the scale sweep (asyncsync.ops.bench.scale): states are generated, not read from files
    scale_bytes: int = 0
    versions: int = 3
    density: float = 0.03
    seed: int = 0
    threads: int = 0  # the CPU pool and torch's intra-op threads (0: the machine's default)
    peer: str = ""  # the peer comparison (asyncsync.ops.bench.peers): which system
    redo_log: int = 0  # the scale receiver's LocalCheckpoint(redo_log=...)

    @classmethod
    def read(cls, path: str | Path) -> Job:
        return cls(**json.loads(Path(path).read_text()))

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1))

    @property
    def throttle(self) -> fsio.Throttle:
        # the shared root only: the receiver's local checkpoint is on a local disk
        return fsio.Throttle(self.bandwidth, self.latency, os.path.abspath(self.root))
