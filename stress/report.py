"""The outcome of a crash-stress run: counts, where the kills landed, failures."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

__all__ = ["Ema", "StressReport"]


@dataclass
class StressReport:
    """What one ``stress/crash.py`` run did and found.

    ``mid`` counts kills whose traces on disk show they interrupted the work in progress (a
    publish: a version directory without manifest, temp files, a log line not yet appended;
    an apply: the engine's state ``applying``, journal or staging files). ``phases`` says where
    the kills landed by the child's own clock (e.g. ``delta 25-50%``: in the second quarter of
    a delta publish, scaled by the measured mean duration), ``categories`` what the disk showed.
    """

    side: Literal["publisher", "receiver"]
    trials: int = 0
    kills: int = 0
    mid: int = 0
    categories: Counter[str] = field(default_factory=Counter)
    phases: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0
    versions: int = 0
    params: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.failures

    def line(self) -> str:
        what = "publish" if self.side == "publisher" else "apply"
        return (
            f"{self.side} crash stress: {self.trials} trials, {self.mid} kills mid-{what}, "
            f"{len(self.failures)} failures ({self.seconds:.1f}s)"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "side": self.side,
            "trials": self.trials,
            "kills": self.kills,
            "kills_mid": self.mid,
            "categories": dict(sorted(self.categories.items())),
            "phases": dict(sorted(self.phases.items())),
            "failures": self.failures,
            "seconds": round(self.seconds, 3),
            "versions": self.versions,
            "params": self.params,
            **self.extra,
        }

    def write_json(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=1, default=str) + "\n")


@dataclass
class Ema:
    """An exponential moving average with a starting guess (durations, to aim the kills)."""

    value: float
    alpha: float = 0.3
    samples: int = 0

    def add(self, x: float) -> None:
        self.value = x if self.samples == 0 else (1 - self.alpha) * self.value + self.alpha * x
        self.samples += 1
