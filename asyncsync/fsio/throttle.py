"""The simulated slow filesystem: a :class:`Throttle` (``ASYNCSYNC_THROTTLE=200MB/s,5ms``) set
for this process makes each read and write of :mod:`asyncsync.fsio` take as long as it would on
a slow shared filesystem (bench, tests)."""

from __future__ import annotations

import contextlib
import os
import re
import time
from dataclasses import dataclass

from asyncsync.errors import ConfigError

_Path = str | os.PathLike[str]

_UNITS = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "KI": 1024, "MI": 1 << 20, "GI": 1 << 30}


@dataclass(frozen=True)
class Throttle:
    """A simulated slow filesystem: ``bandwidth`` bytes/s (None: unlimited) and ``latency``
    seconds per file operation, for files under ``root`` (None: every file)."""

    bandwidth: float | None = None
    latency: float = 0.0
    root: str | None = None

    def __post_init__(self) -> None:
        if self.bandwidth is not None and self.bandwidth <= 0:
            raise ValueError(f"throttle bandwidth must be > 0, got {self.bandwidth}")
        if self.latency < 0:
            raise ValueError(f"throttle latency must be >= 0, got {self.latency}")

    @classmethod
    def parse(cls, text: str) -> Throttle:
        """``"200MB/s,5ms"``, ``"1GiB/s"``, ``"10ms@/shared/root"`` -> Throttle."""
        bw: float | None = None
        lat = 0.0
        text, _, root = text.partition("@")
        for part in filter(None, (p.strip() for p in text.split(","))):
            m = re.fullmatch(r"([\d.]+)\s*([KMG]I?)?B/S", part.upper())
            if m:
                bw = float(m.group(1)) * _UNITS[m.group(2) or ""]
                continue
            m = re.fullmatch(r"([\d.]+)\s*(MS|S|US)", part.upper())
            if m:
                lat = float(m.group(1)) * {"S": 1.0, "MS": 1e-3, "US": 1e-6}[m.group(2)]
                continue
            raise ValueError(f"cannot parse throttle {text!r}: use e.g. '200MB/s,5ms@/root'")
        return cls(bw, lat, os.path.abspath(root) if root else None)

    def applies_to(self, path: _Path) -> bool:
        if self.root is None:
            return True
        p = os.path.abspath(path)
        return p == self.root or p.startswith(self.root.rstrip(os.sep) + os.sep)

    def cost(self, nbytes: int) -> float:
        """Seconds one file operation of ``nbytes`` takes on this filesystem."""
        return self.latency + (nbytes / self.bandwidth if self.bandwidth else 0.0)


def check_throttle_env() -> Throttle | None:
    """``ASYNCSYNC_THROTTLE`` (None: unset); a ConfigError for one that does not parse, said
    where a Publisher, a receiver's agent or bench starts (at import: no throttle, no error)."""
    try:
        return Throttle.parse(env) if (env := os.environ.get("ASYNCSYNC_THROTTLE")) else None
    except ValueError as exc:
        raise ConfigError(f"ASYNCSYNC_THROTTLE={env!r}: {exc}") from None


_throttle: Throttle | None = None
with contextlib.suppress(ConfigError):
    _throttle = check_throttle_env()


def set_throttle(throttle: Throttle | None) -> None:
    """Simulate a slow filesystem in this process (None: off)."""
    global _throttle
    _throttle = throttle


def get_throttle() -> Throttle | None:
    return _throttle


def _throttled(path: _Path, nbytes: int, started: float) -> None:
    t = _throttle
    if t is not None and t.applies_to(path):
        remaining = t.cost(nbytes) - (time.perf_counter() - started)
        if remaining > 0:
            time.sleep(remaining)
