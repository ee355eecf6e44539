"""``asyncsync bench``: the benchmark suite (BENCHMARKS.md shows a run and how to read it).

One run measures, side by side and from the realistic workload generator
(:mod:`asyncsync.ops.workload`): wire bytes per changed element for ours and the published
baselines (:mod:`~asyncsync.ops.bench.baselines`); publish cost against one ``torch.ne`` pass;
end-to-end latency over a throttled filesystem against the transfer bound and against a
full-checkpoint sync; pipelined against serialized stages; peak RSS of publisher and receiver
(separate processes, :mod:`~asyncsync.ops.bench.worker`, measuring with
:mod:`~asyncsync.ops.bench.probes`); and the receiver's apply throughput.
:mod:`~asyncsync.ops.bench.measure` runs it, :mod:`~asyncsync.ops.bench.report` turns the numbers
into the JSON summary, markdown tables and PNG plots, :mod:`~asyncsync.ops.bench.cli` is the
subcommand.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncsync.ops.bench.measure import BenchConfig, BenchFailed, run_bench
    from asyncsync.ops.bench.report import TARGETS, markdown, plot, summarise

__all__ = ["TARGETS", "BenchConfig", "BenchFailed", "markdown", "plot", "run_bench", "summarise"]

# imported on first use: `asyncsync --help` and the other subcommands never load the bench
_LAZY = {n: "asyncsync.ops.bench.measure" for n in ("BenchConfig", "BenchFailed", "run_bench")}
_LAZY.update(
    {n: "asyncsync.ops.bench.report" for n in ("TARGETS", "markdown", "plot", "summarise")}
)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
