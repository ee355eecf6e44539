"""The receiver agent: discover -> fetch + verify -> decode -> apply -> ack.

Example::

    engine = LocalCheckpoint("/local/ckpt")
    async with ReceiverAgent("/shared/weights", engine, engine_id="node3-gpu0") as agent:
        await agent.run()               # or: version = await agent.sync_once()

For each committed version after the one the engine holds, in order, the agent reads each shard
the engine needs, checks its size and checksum (retrying with backoff until ``verify_deadline``,
since network filesystems can show a renamed file before its bytes), parses it, and decodes it
in groups of bounded size (``receiver.shard_reader``) that it hands to the engine; decoding
group k+1 (and reading the next shard) overlaps the engine applying group k. The
engine commits only after every tensor it touched matches the manifest's checksum, and only then
is the version acknowledged. When a version in the chain is missing (retention) or the engine
holds nothing, the agent starts from the newest keyframe at or below the target.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from functools import partial
from typing import Any

from asyncsync.codec import scratch
from asyncsync.errors import (
    ApplyFailed,
    AsyncSyncError,
    ChainError,
    ChecksumMismatch,
    ConfigError,
    FormatError,
    IncompatibleVersion,
    IncompleteVersion,
    LockHeld,
    ManifestError,
    OutOfOrder,
)
from asyncsync.format import Manifest, ShardInfo, check_engine_id, version_dir
from asyncsync.format.lease import DEFAULT_LEASE_TTL
from asyncsync.format.names import root_path
from asyncsync.format.store import is_committed
from asyncsync.fsio import check_throttle_env
from asyncsync.memory import check_env as check_memory_env
from asyncsync.memory import gc_paused, keep_freed_memory, release_large_buffers, trim_free_memory
from asyncsync.pipeline import GlueGate, LoopLock, check_threads_env, run_pipeline
from receiver.acking import RootPresence
from receiver.badversions import BadVersions
from receiver.early import EarlyRead
from receiver.engine_watch import watch_engine
from receiver.engines.base import Engine, TensorUpdate
from receiver.options import AGENT_OPTIONS, check_agent_options
from receiver.parts import PartAssembler
from receiver.plan import Mode, diverged, latest_version, newest_keyframe
from receiver.shard_reader import (
    VERIFY_DEADLINE,
    Piece,
    ShardData,
    apply_groups,
    decode_pieces,
    group_bytes_for,
    open_shard,
    pieces_by_shard,
    read_verified,
    shard_source,
    tensor_bytes,
    verified,
)
from receiver.status import AgentStatus, Counters
from receiver.stream import STREAM_TIMEOUT
from receiver.watch import Repeats, first_of, inotify_wanted, wakeups

__all__ = ["VERIFY_DEADLINE", "AgentStatus", "ReceiverAgent"]

logger = logging.getLogger(__name__)

PROGRESS_LOG_SECONDS = 5.0


class ReceiverAgent:
    """Keeps one engine at the newest committed version of ``root``.

    Args:
        root: the shared directory the publisher writes.
        engine: where the weights go (``receiver.engines``).
        engine_id: this engine's name in acks (``[A-Za-z0-9._-]``).
        poll_interval: seconds between polls, at least ``MIN_POLL_SECONDS`` (0.01; inotify
            events wake it sooner where they work).
        verify_deadline: how long a shard that is missing, short or failing its checksum is
            re-read before the version is refused (network filesystems publish lazily).
        use_inotify: force inotify on/off (default: on unless ASYNCSYNC_FORCE_POLLING=1).
        pipelined: read, verify and decode the next group of tensors while the engine applies
            this one (default); False does each step of each group one after another.
        prefetch: in :meth:`run`, start reading the next version's shards as they land,
            before its manifest exists (streaming receive; see receiver.prefetch).
        prefetch_bytes: memory budget of one version's prefetched shards.
        apply_group_bytes: decoded bytes (positions + values) of a delta handed to the engine
            at once; bounds the decoded patches and the engine's undo journal in memory. None
            (default): sized by the model, 1/64 of its bytes within [1 MiB, 16 MiB]
            (``receiver.shard_reader.group_bytes_for``).
        lease_ttl: seconds another receiver must see the engine id's lease unchanged before it
            takes the id (this one renews it every third of that; FORMAT.md section 7.1).
        lease_settle: seconds between writing this receiver's claim on the engine id and
            reading the others' (FORMAT.md section 7.1): above the time the root's filesystem
            takes to show a file written on another host. None: 0 on a local filesystem,
            5 s on NFS, FUSE and the rest.
        stream_timeout: with ``prefetch`` and an engine that ``streams`` (LocalCheckpoint), the
            next version's self-describing delta shards are applied as they land, before its
            manifest (``receiver.stream``); with a shard applied, a version whose manifest nor
            next shard comes for this long is rolled back (the publish was abandoned).

    A version that stays damaged after the re-reads (a shard missing, short, of the wrong size
    or failing its checksum, a manifest that does not parse) or that names other tensors than
    the engine holds is *bad*: the agent goes on from the newest keyframe past it, reports it
    (``status().bad_versions``, the ack, the log) and, while no keyframe follows it, stays at
    its version and tries it once more on each sync (FORMAT.md section 8).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        engine: Engine,
        engine_id: str,
        *,
        poll_interval: float = 1.0,
        verify_deadline: float = VERIFY_DEADLINE,
        use_inotify: bool | None = None,
        pipelined: bool = True,
        prefetch: bool = True,
        prefetch_bytes: int = 512 << 20,
        apply_group_bytes: int | None = None,
        lease_ttl: float = DEFAULT_LEASE_TTL,
        lease_settle: float | None = None,
        stream_timeout: float = STREAM_TIMEOUT,
    ) -> None:
        given = locals()  # the keyword-only options, checked as a Ray ReceiverSpec checks them
        check_agent_options({name: given[name] for name in AGENT_OPTIONS})
        check_memory_env()  # read at the first device copy (an audit): said at start-up
        check_threads_env()  # read at the first parallel map: said at start-up too
        check_throttle_env()  # ASYNCSYNC_THROTTLE, read at import (a bad one: no throttle)
        self.root = root_path(root)
        self.engine = engine
        engine.on_lost = self._reconcile_ack  # a server found serving other weights: no ack
        try:
            self.engine_id = check_engine_id(engine_id)
        except ManifestError as exc:  # an argument, not the root's content
            raise ConfigError(str(exc)) from None
        self.poll_interval = poll_interval
        self.verify_deadline = verify_deadline
        self.use_inotify = use_inotify
        self.pipelined = pipelined
        self.prefetch = prefetch
        self.prefetch_bytes = prefetch_bytes
        self.apply_group_bytes = apply_group_bytes
        self.stream_timeout = stream_timeout
        self._bad = BadVersions(self.root, self.engine_id, verify_deadline)
        self._early = EarlyRead(  # the next version, before its manifest
            self.root, self.engine_id, use_inotify=inotify_wanted(use_inotify),
            manifests=self._bad.manifests,
        )  # fmt: skip
        self._wake: asyncio.Event | None = None
        self._stop: asyncio.Event | None = None  # run()'s: checked between versions
        self._presence = RootPresence(
            self.root, self.engine_id, engine, lease_ttl=lease_ttl, lease_settle=lease_settle
        )
        self._opened = False
        self._sync_lock = LoopLock()  # (not an asyncio.Lock: the agent may outlive a loop)
        self._refused: set[int] = set()  # versions the engine refused (a keyframe follows)
        self._said_waiting: str | None = None
        self._said_failure: BaseException | None = None  # the bad version's line said it
        self._c = Counters()

    # ------------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> ReceiverAgent:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def open(self) -> None:
        if self._opened:
            return
        release_large_buffers()
        await self._presence.hold()  # before the engine or the ack is touched
        try:
            await self.engine.open()
            await self._presence.load()
            await self._reconcile_ack()
        except BaseException:  # the engine closed too: its locks (checkpoint, server) let go
            try:
                await asyncio.shield(self.engine.close())
            except Exception as exc:
                logger.warning("agent %s: closing the engine after a failed open: %s",
                               self.engine_id, exc)  # fmt: skip
            finally:
                with contextlib.suppress(Exception):
                    await asyncio.shield(self._presence.release())
            raise
        self._opened = True
        logger.info("agent %s open: engine at %s", self.engine_id, self.engine.state.version)

    async def close(self) -> None:
        if self._opened:
            self._opened = False
            try:
                await self.engine.close()
            finally:
                await self._presence.release()

    # ------------------------------------------------------------------ public API
    @property
    def version(self) -> int | None:
        return self.engine.state.version

    def status(self) -> AgentStatus:
        v, latest = self.version, self._c.latest
        return AgentStatus(
            engine_id=self.engine_id,
            version=v,
            latest=latest,
            lag=None if latest is None else latest - (v if v is not None else -1),
            applied=self._c.applied,
            failures=self._c.failures,
            last_error=self._c.last_error,
            last_apply_seconds=self._c.last_apply_seconds,
            prefetched_shards=self._c.prefetched,
            streamed_shards=self._c.streamed,
            applying=self._c.applying,
            progress=self._c.progress,
            engine=self.engine.info(),
            bad_versions=self._bad.versions(),
        )

    async def sync_once(self) -> int | None:
        """Apply, in order, every committed version after the engine's; return the version held.

        Returns None only when the root has no committed version yet. Raises (and leaves the
        engine at its last good version) when a version cannot be applied.
        """
        await self.open()
        async with self._sync_lock:
            self._said_failure = None
            try:
                await self._presence.hold()
                version = await self._sync()
            except Exception as exc:
                self._c.failures += 1
                self._c.last_error = f"{type(exc).__name__}: {exc}"
                if self._bad.waiting is not None:
                    self._c.last_error += f" ({self._bad.waiting})"
                raise
            finally:
                self._bad.say_rest()
            self._c.last_error = None
            return version

    async def run(self, *, stop: asyncio.Event | None = None) -> None:
        """Keep the engine current until ``stop`` is set (or the task is cancelled).

        Failures are logged and retried on the next event or poll; the engine keeps serving its
        last good version meanwhile.
        """
        await self.open()
        stop = self._stop = stop or asyncio.Event()
        wake = self._wake = asyncio.Event()

        async def watch() -> None:
            async for _reason in wakeups(
                self.root, poll_interval=self.poll_interval, use_inotify=self.use_inotify
            ):
                wake.set()

        async def heartbeat() -> None:
            while True:
                await asyncio.sleep(self._presence.lease.ttl / 3)
                try:
                    await self._presence.renew()
                except AsyncSyncError:
                    wake.set()  # the next sync reports it (and takes the id again once it can)
                except OSError as exc:  # the root's filesystem hiccuped: try again next beat
                    logger.warning("agent %s: lease heartbeat failed: %s", self.engine_id, exc)

        watcher = asyncio.create_task(watch(), name=f"watch {self.engine_id}")
        beat = asyncio.create_task(heartbeat(), name=f"lease {self.engine_id}")
        check = watch_engine(self.engine, wake, self._sync_lock.locked)  # a restarted server
        checker = asyncio.create_task(check, name=f"engine check {self.engine_id}")
        failing = Repeats()
        try:
            while not stop.is_set():
                await first_of(wake, stop)
                wake.clear()
                if stop.is_set():
                    break
                try:
                    await self.sync_once()
                    failing.clear()
                    await self._early.drop_stale(self._bad)  # a stream no sync took
                except (AsyncSyncError, OSError) as exc:
                    await self._early.drop_stale(self._bad)  # now, not after the backoff below
                    # a lost id is said by renew; a bad version's error by its own line
                    lost = isinstance(exc, LockHeld) and self._presence.lost is not None
                    said = lost or exc is self._said_failure
                    self._said_failure = None  # (its traceback holds the sync's frames)
                    if failing.should_log(str(exc)) and not said:
                        logger.error("agent %s: sync failed%s: %s",
                                     self.engine_id, failing.since(), exc)  # fmt: skip
                    # the same failure again and again (a damaged version, no keyframe after
                    # it): retry less often, up to every REPEAT_LOG_SECONDS / 6; a lost id at
                    # the pace its retake allows (every ttl / 3), which no backoff stretches
                    pause = self._presence.lease.ttl / 3 if lost else None
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(
                            stop.wait(), pause or failing.backoff(self.poll_interval)
                        )
                except Exception:  # an engine's own bug must not stop the agent for good
                    logger.exception("agent %s: sync failed unexpectedly", self.engine_id)
                if self.prefetch:
                    await self._early.start(
                        self.engine, self.version, wake, prefetch_bytes=self.prefetch_bytes,
                        group_bytes=self.apply_group_bytes, idle_timeout=self.stream_timeout,
                        verify_deadline=self.verify_deadline,
                    )  # fmt: skip
        finally:
            for task in (watcher, beat, checker):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await self._early.stop()
            self._wake = self._stop = None

    def exclusive(self) -> LoopLock:
        """``async with agent.exclusive():`` no version is applied meanwhile (the sync lock;
        the served-bytes audit holds it, ``receiver.audit``)."""
        return self._sync_lock

    def request_sync(self) -> bool:
        """Ask a running :meth:`run` loop to sync now (e.g. from a control endpoint).

        Returns False when the agent is not running.
        """
        if self._wake is None:
            return False
        self._wake.set()
        return True

    def __repr__(self) -> str:
        return (
            f"<ReceiverAgent engine_id={self.engine_id} version={self.version} "
            f"latest={self._c.latest} root={str(self.root)!r}>"
        )

    # ------------------------------------------------------------------ sync
    async def _sync(self) -> int | None:
        self._bad.begin_sync()
        await self._reconcile_ack()  # a server found serving other weights since: no ack
        found = await asyncio.to_thread(latest_version, self.root, self.version)
        self._c.latest = found
        if found is None:
            return self.version
        bad = self._bad
        newest, damaged = await asyncio.to_thread(bad.newest_readable, found)
        if newest is None:
            if damaged is not None:
                raise damaged
            raise ChainError(f"{self.root}: no readable manifest near v{found}")
        latest = newest.version
        bad.for_run(newest.run_id)
        if self.version is not None and self.version >= latest:
            try:  # nothing newer: a restarted server gets what we hold (and an engine may
                await self.engine.reconcile()  # find it lost what it held: the ack says so)
            finally:
                await asyncio.shield(self._reconcile_ack())
        why = await asyncio.to_thread(diverged, self.root, self.engine.state, newest, bad.read)
        if why is not None:
            # another run (a wiped root, another trainer) or contents: start from a keyframe
            logger.warning("agent %s: %s: re-seeding from a keyframe", self.engine_id, why)
            await self._reseed(latest, newest.run_id)
        bad.waiting = None
        try:
            await self._walk(latest, newest.run_id)
            if damaged is not None and self.version == latest:  # the newest does not read
                bad.stuck(found, latest)
                raise damaged
        except AsyncSyncError as exc:
            if bad.waiting is not None and bad.waiting != self._said_waiting:
                assert bad.waiting_on is not None
                if bad.say(*bad.waiting_on):  # with why: run() need not say the error again
                    self._said_failure = exc
                self._said_waiting = bad.waiting  # said once: the sync error repeats it
                with contextlib.suppress(OSError, AsyncSyncError):  # say which versions are bad
                    await self._presence.ensure(bad.versions())
            raise
        await self._presence.ensure(bad.versions())  # also rewrites an ack removed from outside
        return self.version

    async def _walk(self, latest: int, run_id: str) -> None:
        """Apply versions until the engine holds ``latest``, going past bad ones."""
        fell_back = False
        while (cur := self.version) is None or cur < latest:
            m, mode = await asyncio.to_thread(self._bad.plan, self.engine.state, latest)
            if m.version in self._refused:
                kf = await asyncio.to_thread(self._bad.keyframe_after, m.version, latest)
                if kf is not None:
                    logger.info("agent %s: v%d was refused by the engine: going on from "
                                "keyframe v%d", self.engine_id, m.version, kf.version)  # fmt: skip
                    m, mode = kf, "full"
            if cur is not None and m.version <= cur:
                raise ChainError(
                    f"newest keyframe {m.version} is not past the engine's version {cur} and "
                    f"version {cur + 1} is missing: cannot reach {latest}"
                )
            try:
                await self._apply_version(m, mode)
            except OutOfOrder:
                if cur is None or self.version is not None:
                    raise
                continue  # the engine lost its version (a wipe): on from a keyframe now
            except (FormatError, IncompatibleVersion) as exc:
                if mode == "delta" and getattr(exc, "tensor", None) is not None and not fell_back:
                    # A tensor that does not match after a delta was applied (the engine rolled
                    # it back): the engine's bytes are not the delta's base. Once per sync, start
                    # over from the newest keyframe instead of retrying the same delta forever.
                    fell_back = True
                    logger.warning(
                        "agent %s: v%d does not apply to the engine's bytes (%s): re-seeding",
                        self.engine_id, m.version, exc,
                    )  # fmt: skip
                    await self._reseed(latest, run_id)
                    continue
                if isinstance(exc, IncompleteVersion) and not await asyncio.to_thread(
                    is_committed, self.root, m.version
                ):  # retention removed it while it was read (the manifest goes first): not bad
                    logger.warning(
                        "agent %s: v%d was removed while it was read (retention): going on "
                        "from a keyframe", self.engine_id, m.version,
                    )  # fmt: skip
                    continue  # the plan finds it gone
                self._bad.mark(m.version, exc)
                if not await asyncio.to_thread(self._bad.can_go_past, m.version, cur, latest):
                    raise
                continue  # the plan goes past it
            except ApplyFailed:
                # The engine refused it (a server that cannot load it, or down). Not bad for
                # good: it may be the server's fault. But when a keyframe follows it, the next
                # attempt goes on from that keyframe instead of retrying this version until
                # the server takes it (the keyframe alone makes the engine whole).
                kf = await asyncio.to_thread(self._bad.keyframe_after, m.version, latest)
                if kf is not None and m.version not in self._refused:
                    self._refused.add(m.version)
                    logger.warning(
                        "agent %s: the engine refused v%d: the next attempt goes on from the "
                        "keyframe after it", self.engine_id, m.version,
                    )  # fmt: skip
                raise
            await self._ack(m)
            if self._stop is not None and self._stop.is_set():
                return  # stopping: after the version in flight, not the whole catch-up
        if cur > latest:
            raise ChainError(
                f"engine holds version {cur} but the root's newest is {latest}: was the root "
                "reset? Point the engine at an empty checkpoint to start over."
            )

    async def _reseed(self, latest: int, run_id: str) -> None:
        while True:
            kf = await asyncio.to_thread(
                newest_keyframe, self.root, latest, run_id, self._bad.read, self._bad.skip()
            )
            try:
                await self._apply_version(kf, "full")
            except (FormatError, IncompatibleVersion) as exc:
                self._bad.mark(kf.version, exc)  # then the keyframe before it, if any
                if not await asyncio.to_thread(self._bad.can_go_past, kf.version, None, latest):
                    raise
                continue
            await self._ack(kf)
            return

    async def _reconcile_ack(self) -> None:
        await self._presence.reconcile(self._bad.versions())

    async def _ack(self, m: Manifest) -> None:
        try:
            await self._presence.ack(m.version, m.fingerprint, m.run_id, self._bad.versions())
        finally:  # also when the id was lost meanwhile: the engine's deferred work goes on
            await self.engine.acknowledged()

    async def _apply_version(self, m: Manifest, mode: Mode) -> None:
        t0 = time.perf_counter()
        scratch.fit(m.totals.model_bytes)  # the decode's temporaries: by the model's size
        keep_freed_memory(m.totals.model_bytes)  # ... and what malloc's arenas keep of the rest
        shards = [(i, s) for i, s in enumerate(m.shards) if s.role == mode]
        early = await self._early.take_stream(m, mode)
        self._c.streamed += len(early or ())
        try:  # (a bump or a begin may lose what the engine held: the ack says so at once)
            if mode == "delta" and not shards and early is None:
                await self.engine.bump(m)
            else:
                with gc_paused():  # the version's records, patches and views: see gc_paused
                    if early is None:
                        await self.engine.begin(m, mode)
                    rest = [(i, s) for i, s in shards if early is None or s.file not in early]
                    await self._stream(m, mode, rest)
                    await self.engine.commit()
        except BaseException:
            with contextlib.suppress(Exception):
                await asyncio.shield(self.engine.abort())
            with contextlib.suppress(Exception):  # a failed full apply can leave nothing
                await asyncio.shield(self._reconcile_ack())
            raise
        dt = time.perf_counter() - t0
        self._bad.cleared(m.version)
        self._c.applied += 1
        self._c.last_apply_seconds = dt
        self._c.last_error = None
        logger.info("agent %s applied version %d (%s, %d shards) in %.3fs",
                    self.engine_id, m.version, mode, len(shards), dt)  # fmt: skip
        if mode == "full":  # its whole-tensor temporaries: freed, not yet given back (after
            await asyncio.to_thread(trim_free_memory)  # the try: a cancel here aborts nothing)

    async def _stream(self, m: Manifest, mode: Mode, shards: list[tuple[int, ShardInfo]]) -> None:
        """Read+verify each shard once; decode group k+1 while the engine applies group k."""
        parts = PartAssembler(m, mode)  # joins the parts of tensors in parts across shards
        group_bytes = self.apply_group_bytes or group_bytes_for(m.totals.model_bytes)
        by_shard = pieces_by_shard(m, mode)  # (one pass over the entries, not one per shard)
        work = [
            (idx, shard, group, g == 0, g == len(groups) - 1)
            for idx, shard in shards
            for groups in [apply_groups(m, mode, idx, group_bytes, by_shard=by_shard)]
            for g, group in enumerate(groups)
        ]
        opened: dict[int, ShardData] = {}  # the parsed shard, until its last group
        gate = GlueGate()  # a group of small tensors decoded and applied one at a time

        async def fetch(item: tuple[int, ShardInfo, list[Piece], bool, bool]) -> Any:
            idx, shard, group, first, last = item
            where = str(m.shard_path(version_dir(self.root, m.version), shard))
            if first:
                opened[idx] = await self._open_shard(m, idx, shard)
            tensors = opened.pop(idx) if last else opened[idx]
            decode = partial(decode_pieces, m, mode, tensors, group, where)
            async with gate.hold(sizes := [tensor_bytes(piece) for piece in group]):
                updates = await asyncio.to_thread(lambda: parts.add(decode()))
            return updates, last, sizes

        c = self._c
        c.applying, c.progress, c.progress_logged = m.version, (0, len(shards)), time.monotonic()

        async def apply(item: tuple[list[TensorUpdate], bool, list[int]]) -> None:
            updates, last, sizes = item
            async with gate.hold(sizes):
                await self.engine.apply(updates)
            if not last:
                return
            done = (c.progress[0] + 1) if c.progress else 1
            c.progress = (done, len(shards))
            if time.monotonic() - c.progress_logged > PROGRESS_LOG_SECONDS:
                c.progress_logged = time.monotonic()
                logger.info("agent %s: applying v%d (%s): %d/%d shards",
                            self.engine_id, m.version, mode, done, len(shards))  # fmt: skip

        try:
            stages: list[tuple[str, Any]] = [("fetch", fetch), ("apply", apply)]
            await run_pipeline(work, stages, maxsize=1, pipelined=self.pipelined)
            parts.check_done()
        finally:
            c.applying = c.progress = None

    async def _open_shard(self, m: Manifest, idx: int, shard: ShardInfo) -> ShardData:
        """Read (or take prefetched), verify and parse one shard, re-reading until the deadline
        while it is missing, short or fails its checksum (not yet visible on this host)."""
        path, root = shard_source(self.root, m, shard)  # never follows a symlink in the root
        deadline = time.monotonic() + self._bad.patience(m.version)  # known bad: read once
        delay = 0.05
        early: bytes | bytearray | memoryview | None = self._early.prefetched(m, shard)
        while True:
            try:
                if early is not None:
                    data, early = early, None
                    await asyncio.to_thread(verified, data, path, shard, m.checksum_algorithm)
                    self._c.prefetched += 1
                else:
                    read = partial(read_verified, path, shard, m.checksum_algorithm, root=root)
                    data = await asyncio.to_thread(read)
                break
            except (ChecksumMismatch, IncompleteVersion) as exc:
                if time.monotonic() >= deadline:
                    raise
                logger.info("%s; re-reading in %.2fs", exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
        return await asyncio.to_thread(open_shard, m, shard, data, str(path))
