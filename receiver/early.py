"""A receiver agent's early read of the next version: started while that version's directory
is being written (no manifest yet), taken by the sync that applies it.

It is a :class:`~receiver.stream.StreamApplier` (shards applied into an engine transaction
before the manifest, for an engine that ``streams``) or a :class:`~receiver.prefetch.Prefetcher`
(shard bytes read ahead); :func:`early_reader` chooses.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Container
from pathlib import Path

from asyncsync.errors import AsyncSyncError
from asyncsync.format import Manifest, ShardInfo
from asyncsync.format.store import ManifestCache, is_committed, read_manifest
from receiver.engines.base import Engine
from receiver.plan import Mode
from receiver.prefetch import Prefetcher, being_written
from receiver.shard_reader import group_bytes_for
from receiver.stream import StreamApplier

__all__ = ["MAX_RESTREAMS", "RESTREAM_DELAY", "EarlyRead", "early_reader"]

logger = logging.getLogger(__name__)

#: how often the stream of one version is started again after it failed (the version written
#: anew, its directory back after it was gone, the publisher going on after a stall) before
#: the version waits for its manifest: each start after a failure may cost one more rollback
#: (a flapping mount: one per flap). The first at once, the n-th RESTREAM_DELAY * 2**(n-2) s
#: after the one before.
MAX_RESTREAMS = 3
RESTREAM_DELAY = 1.0


class EarlyRead:
    """At most one early read at a time, and its task."""

    def __init__(
        self,
        root: Path,
        engine_id: str,
        *,
        use_inotify: bool | None = None,
        manifests: ManifestCache | None = None,
    ) -> None:
        self.root = root
        self.engine_id = engine_id
        self.use_inotify = use_inotify  # a stream wakes as its shards land (this host's writes)
        # the agent's: the base a stream checks against is the version just applied (parsed)
        self.manifests = manifests or ManifestCache()
        self.reader: Prefetcher | StreamApplier | None = None
        self.task: asyncio.Task[None] | None = None
        self._restreams = (-1, 0, 0.0)  # (version, streams started again, when the last)

    async def start(
        self,
        engine: Engine,
        cur: int | None,
        wake: asyncio.Event,
        *,
        prefetch_bytes: int,
        group_bytes: int | None,
        idle_timeout: float,
        verify_deadline: float,
    ) -> None:
        """Read version ``cur + 1`` early if it is being written now (a directory without a
        manifest); a read of another version is cancelled."""
        if cur is None:
            return
        nxt = cur + 1
        if self.reader is not None:
            if self.reader.version == nxt and not await self._again():
                return
            if self.task is not None:
                self.task.cancel()
            self.reader = self.task = None
        if not await asyncio.to_thread(being_written, self.root, nxt):
            return
        self.reader = await early_reader(
            self.root, engine, cur, wake, prefetch_bytes=prefetch_bytes,
            group_bytes=group_bytes, idle_timeout=idle_timeout, verify_deadline=verify_deadline,
            use_inotify=self.use_inotify, read=self.manifests.get,
        )  # fmt: skip
        self.task = asyncio.create_task(self.reader.run(), name=f"prefetch v{nxt} {self.engine_id}")

    async def _again(self) -> bool:
        """Whether the stream of the next version failed (rolled back) and that version is
        being written anew: stream it again (:meth:`StreamApplier.shows_again`), at most
        :data:`MAX_RESTREAMS` times, backed off. Before, it was applied only after its
        manifest once a stream of it had failed."""
        s, task = self.reader, self.task
        if not (isinstance(s, StreamApplier) and s.failed and task and task.done()):
            return False
        if s.txn_open or not await asyncio.to_thread(s.shows_again):
            return False
        version, n, last = self._restreams if self._restreams[0] == s.version else (s.version, 0, 0)
        if n >= MAX_RESTREAMS:
            if n == MAX_RESTREAMS:  # said once
                logger.warning("v%d: its stream failed %d times (the last: %s); it is applied "
                               "after its manifest", version, n + 1, s.failed)  # fmt: skip
                self._restreams = (version, n + 1, last)
            return False
        now = time.monotonic()
        if n and now < last + RESTREAM_DELAY * 2 ** (n - 1):
            return False  # a flapping directory: one rollback per flap, backed off
        self._restreams = (version, n + 1, now)
        return True

    async def drop_stale(self, bad: Container[int]) -> None:
        """After a sync: roll back a streamed transaction whose stream ended (its manifest
        came, or seemed to) but that no later sync will take: the manifest is bad (unreadable,
        refused) or gone (shown, then removed: a hostile or buggy writer, a mount's stale
        cache). Left open, the engine stayed half patched with no deadline left to undo it."""
        s, task = self.reader, self.task
        if not (isinstance(s, StreamApplier) and s.txn_open and task and task.done()):
            return
        if s.version in bad:
            why = "its manifest came but does not read or was refused"
        elif not await asyncio.to_thread(is_committed, self.root, s.version):
            why = "its manifest was seen but is gone"
        else:
            return  # committed: the next sync takes it
        await s.abandon(task, why)
        self.reader = self.task = None

    async def take_stream(self, m: Manifest, mode: Mode) -> set[str] | None:
        """The shard files a streaming apply applied into the engine's transaction for ``m``,
        confirmed by ``m`` (None: no transaction open; see :meth:`StreamApplier.take`)."""
        s, task = self.reader, self.task
        if not isinstance(s, StreamApplier):
            return None
        self.reader = self.task = None
        return await s.take(task, m, mode)

    def prefetched(self, m: Manifest, shard: ShardInfo) -> bytes | None:
        """The bytes of ``shard`` of ``m`` read ahead, if they were (taken: given once)."""
        p = self.reader
        if not isinstance(p, Prefetcher) or p.version != m.version or shard.role != "delta":
            return None
        return p.take(shard.file)

    async def stop(self) -> None:
        """Cancel the read (a stream's open transaction is the engine's to abort)."""
        task, self.reader, self.task = self.task, None, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def early_reader(
    root: Path,
    engine: Engine,
    held: int,
    wake: asyncio.Event,
    *,
    prefetch_bytes: int,
    group_bytes: int | None,
    idle_timeout: float,
    verify_deadline: float,
    use_inotify: bool | None = None,
    read: Callable[[Path, int], Manifest] = read_manifest,
) -> StreamApplier | Prefetcher:
    """What reads version ``held + 1`` before its manifest: a :class:`StreamApplier` when the
    engine ``streams`` and holds ``held`` as the root's manifest says (fingerprint), else a
    :class:`~receiver.prefetch.Prefetcher` of its bytes."""
    base = None
    if engine.streams:
        with contextlib.suppress(AsyncSyncError, OSError):
            base = await asyncio.to_thread(read, root, held)  # (the agent's cache: parsed)
    if base is None or base.fingerprint != engine.state.fingerprint:
        return Prefetcher(root, held + 1, on_manifest=wake, max_bytes=prefetch_bytes)
    return StreamApplier(
        root,
        engine,
        base,
        on_manifest=wake,
        group_bytes=group_bytes or group_bytes_for(base.totals.model_bytes),
        idle_timeout=idle_timeout,
        verify_deadline=verify_deadline,
        use_inotify=use_inotify,
    )
