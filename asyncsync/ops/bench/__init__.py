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

from asyncsync.ops.bench.measure import BenchConfig, BenchFailed, run_bench
from asyncsync.ops.bench.report import TARGETS, markdown, plot, summarise

__all__ = ["TARGETS", "BenchConfig", "BenchFailed", "markdown", "plot", "run_bench", "summarise"]
