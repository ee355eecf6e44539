"""The operator's tools: the ``asyncsync`` command (:mod:`~asyncsync.ops.cli`), the benchmark
suite (:mod:`~asyncsync.ops.bench`), ``make demo`` (:mod:`~asyncsync.ops.demo`) and the
realistic training-step generator used by the demo, the bench and the tests
(:mod:`~asyncsync.ops.workload`). Progress bars, log set-up and argument types live one floor
down, in :mod:`asyncsync.console`, because the receiver's CLI and the training session use them
too."""
