"""The operator's tools: the ``asyncsync`` command (:mod:`~asyncsync.ops.cli`), the benchmark
suite (:mod:`~asyncsync.ops.bench`), ``make demo`` (:mod:`~asyncsync.ops.demo`), progress bars
(:mod:`~asyncsync.ops.progress`), log set-up for the CLIs (:mod:`~asyncsync.ops.logsetup`) and
the realistic training-step generator used by the demo, the bench and the tests
(:mod:`~asyncsync.ops.workload`)."""
