"""FailureBackoff: how long an HTTP engine waits after failed server updates before the next.

A server that keeps refusing is not paused (and its requests aborted) once per poll: after a
failed update the engine refuses to try again for ``first`` seconds, doubling per consecutive
failure up to ``most`` (docs/ENGINES.md, "Backoff between failed updates").
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from asyncsync.errors import ApplyFailed, ConfigError, check_seconds

__all__ = ["FailureBackoff"]


class FailureBackoff:
    """``(first, max)`` seconds after a failed update, doubling per consecutive failure."""

    def __init__(self, first_max: Sequence[float], kind: str):
        if not isinstance(first_max, tuple | list) or len(first_max) != 2:
            raise ConfigError(f"failure_backoff must be (first, max) seconds, got {first_max!r}")
        for x in first_max:
            check_seconds("failure_backoff", x)
        if first_max[0] < 0 or first_max[1] < first_max[0]:
            raise ConfigError(
                f"failure_backoff must be (first >= 0, max >= first), got {first_max}"
            )
        self.first, self.most = float(first_max[0]), float(first_max[1])
        self.kind = kind
        self.failures = 0
        self.retry_at = 0.0
        self.last: str | None = None

    def failed(self) -> None:
        self.failures += 1
        delay = min(self.first * 2 ** (self.failures - 1), self.most)
        self.retry_at = time.monotonic() + delay
        self.last = f"{self.failures} consecutive failure(s), next attempt in {delay:g}s"

    def reset(self) -> None:
        self.failures, self.retry_at, self.last = 0, 0.0, None

    def check(self, version: int) -> None:
        """Raise ApplyFailed while the backoff after the last failure runs."""
        left = self.retry_at - time.monotonic()
        if left > 0:
            raise ApplyFailed(
                f"{self.kind}: not trying v{version} yet ({self.last}; {left:.1f}s left)"
            )
