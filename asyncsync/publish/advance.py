"""After a commit: the publisher's snapshot brought to the committed version, off the loop.

Once a version's manifest is in place the publisher's snapshot must become that version before
the next delta is diffed against it: the updates the version did not already make in its diff's
pass are applied (:func:`asyncsync.publish.snapshot.advance`: sparse scatters, or whole
tensors copied, every tensor of a full version), and the tensors copied whole are hashed
against the checksums shipped (:func:`~asyncsync.publish.snapshot.unshipped`). A full
version's copy and hash take ~0.4 s per GiB: minutes for a large model, which must not stop
the trainer's event loop (acks, heartbeats, its other tasks), so :func:`after_commit` runs
them in a worker thread.

The version is committed when this runs, so the snapshot is never left between two versions:
a cancellation that arrives meanwhile waits for the thread and is reported to the caller
(which raises it once its bookkeeping is done, as :func:`asyncsync.publish.commit.complete`
does), and a copy that fails (out of memory) leaves every tensor marked stale, so that the
next version is a keyframe and no delta is diffed against a snapshot nobody verified.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence

import torch

from asyncsync.codec.shards import PendingUpdate
from asyncsync.publish import snapshot

__all__ = ["after_commit", "bring_up"]

logger = logging.getLogger(__name__)

Snapshot = dict[str, torch.Tensor]


def bring_up(
    snap: Snapshot | None,
    names: Sequence[str],
    pending: Sequence[PendingUpdate],
    algorithm: str,
    sums: Mapping[str, str] | None = None,
) -> tuple[Snapshot, list[str]]:
    """The snapshot of the committed version (``snap``'s tensors updated in place, ``pending``
    applied) and the names of the tensors in it whose bytes are not those shipped (``sums``:
    the checksums of a full version's tensors; None: nothing to check)."""
    new = snapshot.advance(snap, names, pending)
    return new, snapshot.unshipped(new, pending, sums or {}, algorithm)


async def after_commit(
    snap: Snapshot | None,
    names: Sequence[str],
    pending: Sequence[PendingUpdate],
    algorithm: str,
    sums: Mapping[str, str] | None = None,
) -> tuple[Snapshot | None, list[str], bool]:
    """:func:`bring_up` in a worker thread: ``(snapshot, stale names, cancelled)``.

    Runs to its end even if cancelled meanwhile (``cancelled`` says so: the caller raises
    ``CancelledError`` once its bookkeeping is done). A failure is logged, not raised (the
    version is committed): the snapshot is then ``snap`` as the failed copy left it, every one
    of ``names`` stale.
    """
    fut = asyncio.ensure_future(asyncio.to_thread(bring_up, snap, names, pending, algorithm, sums))
    cancelled = False
    while not fut.done():
        try:
            await asyncio.shield(fut)
        except asyncio.CancelledError:
            if fut.cancelled():
                raise
            cancelled = True  # (even if the thread has just finished: the caller's cancel)
        except Exception:
            pass  # the thread's: read below
    try:
        new, stale = fut.result()
    except Exception as exc:
        logger.error(
            "the version is committed, but its snapshot could not be brought up to it (%r): "
            "the next version is a keyframe",
            exc,
        )
        return snap, list(names), cancelled
    return new, stale, cancelled
