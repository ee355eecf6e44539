"""Crash stress harness: kill publishers and receivers with SIGKILL at random points.

``python stress/crash.py publisher --trials 50`` and ``python stress/crash.py receiver --trials
50`` (see :mod:`stress.crash`). The quick versions run in ``tests/test_crash.py``.

Modules:

* :mod:`stress.states`     a state dict that is a pure function of (seed, version)
* :mod:`stress.procs`      child processes (fresh interpreter or forkserver) and SIGKILL
* :mod:`stress.inspect`    what a kill left on disk: leftovers, invariants of a root
* :mod:`stress.children`   the child entry points (the publisher loop)
* :mod:`stress.publisher_stress`, :mod:`stress.receiver_stress`  the two drivers
* :mod:`stress.crash`      the command line
"""
