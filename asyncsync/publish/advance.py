"""After a commit: the publisher's base (:class:`Base`: the snapshot and records of the last
committed version, which the next delta is built on) brought to the committed version, the
snapshot off the loop.

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
does), and a copy that fails (out of memory) leaves every tensor marked stale
(``Publisher.stale``), so that the next version is full with no delta (a group's, when one
rank's is stale: no rank's delta is diffed against a snapshot nobody verified, a keyframe's
included).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from asyncsync.codec.shards import PendingUpdate
from asyncsync.format import Manifest
from asyncsync.publish import snapshot
from asyncsync.publish.merge import TensorSlice

__all__ = ["Base", "after_commit", "bring_up"]

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
            "%s", exc, "the next version is a keyframe" if snap is not None else
            "there is no snapshot to diff against (seed again)",
        )  # fmt: skip
        return snap, list(names), cancelled
    return new, stale, cancelled


@dataclass
class Base:
    """What a publisher's next delta is built on: the last committed version's snapshot
    (``tensors``: this rank's, on the host; None before the first version), their checksums
    (reused for the tensors that did not change), the version's fingerprint (a streaming
    shard's base, FORMAT.md 4.3) and this rank's slices. Brought to each committed version by
    :meth:`advance` (the snapshot) and :meth:`committed` (the records)."""

    tensors: Snapshot | None = None
    checksums: dict[str, str] = field(default_factory=dict)
    fingerprint: str = ""
    slices: dict[str, TensorSlice] = field(default_factory=dict)

    def same_schema(
        self, state_dict: Mapping[str, torch.Tensor], slices: Mapping[str, TensorSlice]
    ) -> bool:
        """Whether ``state_dict`` can be diffed against the snapshot (names, dtypes, shapes,
        slices)."""
        assert self.tensors is not None
        return dict(slices) == self.slices and snapshot.same_schema(self.tensors, state_dict)

    def schema_changes(self, state_dict: Mapping[str, torch.Tensor]) -> str:
        assert self.tensors is not None
        return snapshot.schema_changes(self.tensors, state_dict)

    async def advance(
        self,
        names: Sequence[str],
        pending: Sequence[PendingUpdate],
        algorithm: str,
        sums: Mapping[str, str] | None,
    ) -> tuple[list[str], bool]:
        """After the commit: the snapshot brought to the version (:func:`after_commit`);
        returns ``(stale names, cancelled meanwhile)``."""
        self.tensors, stale, cancelled = await after_commit(
            self.tensors, names, pending, algorithm, sums
        )
        return stale, cancelled

    def committed(self, manifest: Manifest, checksums: dict[str, str] | None = None) -> None:
        """The records of the committed ``manifest`` (``checksums``: of this rank's own
        tensors; the manifest's, by default)."""
        self.fingerprint = manifest.fingerprint
        if checksums is None:
            checksums = {e.name: e.checksum for e in manifest.tensors}
        self.checksums = checksums
