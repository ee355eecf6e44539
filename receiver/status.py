"""What a receiver agent reports: :class:`AgentStatus` (``ReceiverAgent.status()``, the status
port's ``/status``, ``asyncsync-receiver`` logs) and the counters it is made of."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["AgentStatus", "Counters"]


@dataclass(frozen=True)
class AgentStatus:
    engine_id: str
    version: int | None
    latest: int | None
    lag: int | None
    applied: int
    failures: int
    last_error: str | None
    last_apply_seconds: float | None
    prefetched_shards: int = 0  # shards read before their manifest existed, then verified
    streamed_shards: int = 0  # shards applied by the stream (receiver.stream), then confirmed
    applying: int | None = None  # the version in flight
    progress: tuple[int, int] | None = None  # its shards applied / to apply
    engine: dict[str, Any] | None = None  # engine-specific facts (Engine.info())
    bad_versions: tuple[int, ...] = ()  # versions found damaged or unusable, and gone past


@dataclass
class Counters:
    """What the agent counts as it runs (AgentStatus is made of it)."""

    prefetched: int = 0
    streamed: int = 0
    applying: int | None = None
    progress: tuple[int, int] | None = None
    progress_logged: float = 0.0
    applied: int = 0
    failures: int = 0
    last_error: str | None = None
    last_apply_seconds: float | None = None
    latest: int | None = None
    history: list[dict[str, Any]] = field(default_factory=list)
