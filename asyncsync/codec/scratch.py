"""Reuse of the large temporaries of the diff and the decode, whose pages are already faulted in.

Every version allocates the same temporaries again: the diff's positions, new values and XORs
(~0.2 bytes per element of the model at 3 % changed), the byte planes of the values, the
decode's positions and values, the journal's old values. A fresh buffer above malloc's mmap
threshold (:mod:`asyncsync.memory`) comes from the kernel zeroed and is faulted in page by page
as it is first written. Measured at 1 GiB (BENCHMARKS.md, "Issue 26, sixth session"): the pool
takes ~40 % of the minor faults of a version on each side, ~30-60 ms of kernel CPU.

:class:`ScratchPool` hands out views of buffers it keeps, and takes a buffer back by itself
once nothing refers to it any more: CPython counts every reference (a NumPy view, a tensor of
``torch.from_numpy``, a ``memoryview`` all hold one to the buffer), so a buffer whose only
reference is the pool's list can be reused without any caller having to give it back, and a
buffer still in use anywhere is never handed out twice. The pool keeps at most ``limit``
bytes: a quarter of the largest model the process moves, between 16 and 256 MiB (:func:`fit`),
or ``ASYNCSYNC_SCRATCH_MB`` (0 turns it off); beyond it, buffers are plain allocations, freed as
before. What it keeps stays resident while the process lives.
"""

from __future__ import annotations

from typing import Any

from numpy.typing import DTypeLike, NDArray

from asyncsync.errors import ConfigError
from asyncsync.memory import MIN_BYTES, ScratchPool, scratch_env

__all__ = ["MIN_BYTES", "ScratchPool", "empty", "fit", "pool"]

#: bytes the process-wide pool keeps at most, unless ``ASYNCSYNC_SCRATCH_MB`` says
DEFAULT_LIMIT = 256 << 20
#: ... and at most this share of the largest model the process moves (:func:`fit`), but
#: not below FIT_FLOOR
FIT_SHARE, FIT_FLOOR = 4, 16 << 20


def fit(model_bytes: int) -> None:
    """Keep the process-wide pool to a quarter of the largest model this process moves (at
    least 16 MiB, at most :data:`DEFAULT_LIMIT`): the publisher calls it for each version, the
    receiver for each version it applies. ``ASYNCSYNC_SCRATCH_MB``, when set, is kept as is."""
    if not _FIXED:
        pool.limit = max(pool.limit, min(DEFAULT_LIMIT, model_bytes // FIT_SHARE))


try:
    _ENV = scratch_env()
except ConfigError:  # said at start-up (memory.check_env: the Publisher, the receiver's agent),
    _ENV = None  # in context: an import never fails for it
_FIXED = _ENV is not None
#: the process-wide pool of the diff's and the decode's temporaries (FIT_FLOOR until
#: :func:`fit` sizes it by the model)
pool = ScratchPool(FIT_FLOOR if _ENV is None else _ENV)


def empty(n: int, dtype: DTypeLike) -> NDArray[Any]:
    """``np.empty(n, dtype)`` from the process-wide :data:`pool`."""
    return pool.empty(n, dtype)
