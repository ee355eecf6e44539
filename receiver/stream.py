"""Streaming apply: version N's delta shards applied while the trainer still writes N (format 3).

A single publisher writes version N's delta shards ``delta-00000.safetensors``, ``delta-00001...``
in order, each renamed into place when complete, and the manifest last. From format 3 each
delta shard is *self-describing* (FORMAT.md section 4.3): its header names the version, run,
base version and base fingerprint it applies to, the publish attempt, its index, the encoding
and checksum algorithm, the checksum of its data, and an entry per tensor (name, dtype, shape,
changed, mode, blob keys, the tensor's new checksum). A :class:`StreamApplier` for an engine
that holds N-1 polls those exact names and, for each complete shard (its data checksum matches:
a network filesystem may show a renamed file before its bytes), checks it against the engine
and against N-1's manifest, opens the engine's transaction for N on the first one (the engine
journals as usual, so a crash undoes it), and decodes and applies it in apply groups.

Nothing is served or acknowledged then: the engine's version changes only in ``commit``, which
the agent calls once N's manifest exists and validates and the shards applied early match it
(:meth:`StreamApplier.mismatch`: same files, sizes, checksums, tensors, entries), through the
engine's ``confirm`` (the manifest replaces the provisional one the transaction began with).
The shards left when it appears are applied by the stream while the agent reads it (``take``
waits for them), any not (yet) visible here the ordinary way. A shard of another attempt, of
another base, damaged, the version directory removed, or no progress for ``idle_timeout``: the
applier aborts the transaction (the engine rolls back) and the version is applied the ordinary
way once its manifest exists, or streamed again if it is written anew before that (the
directory shows again, or another shard 0 is there), or the publisher goes on after its stall
(the shard waited for lands): :meth:`StreamApplier.shows_again`.
Only engines that say ``streams`` (``LocalCheckpoint``) are fed early; for the others the
agent only prefetches the bytes (:mod:`receiver.prefetch`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from asyncsync import fsio
from asyncsync.codec.shards import ShardData, parse_delta_shard
from asyncsync.codec.stream_shard import StreamHeader, stream_header
from asyncsync.errors import AsyncSyncError, FormatError
from asyncsync.format import MANIFEST_NAME, DeltaRef, Manifest, TensorEntry, version_dir
from asyncsync.format.checksum import checksum_bytes, new_hasher
from asyncsync.format.names import MAX_SHARD_BYTES
from asyncsync.format.store import list_versions
from asyncsync.pipeline import threads
from receiver import inotify
from receiver.engines.base import Engine
from receiver.prefetch import being_written, probe
from receiver.shard_reader import (
    VERIFY_DEADLINE,
    Piece,
    decode_pieces,
    group_pieces,
    read_pooled,
)
from receiver.watch import inotify_wanted

__all__ = ["STREAM_TIMEOUT", "AppliedShard", "StreamApplier"]

logger = logging.getLogger(__name__)
_Shard = tuple[Path, memoryview, StreamHeader]  # a shard read: its path, bytes, header

#: seconds a streamed version may go without a new shard or its manifest before it is rolled back
STREAM_TIMEOUT = 120.0


class StreamAbandoned(FormatError):
    """The version being streamed will not be committed as it was read (see the module doc)."""


@dataclass(frozen=True)
class AppliedShard:
    """A delta shard applied before the manifest: what the manifest must say of it."""

    file: str
    bytes: int
    checksum: str  # of the whole file, with the streamed header's algorithm
    header: StreamHeader


class StreamApplier:
    """Apply the delta shards of ``base.version + 1`` into ``engine`` as they land.

    Args:
        base: the manifest of the version the engine holds (N-1); its fingerprint must be the
            engine's.
        on_manifest: set when N's manifest appears (the agent then syncs and takes over).
        group_bytes: decoded bytes handed to the engine at once.
        idle_timeout: give up (abort) after this long with an open transaction and neither a
            new shard nor the manifest.
        verify_deadline: how long a shard whose data does not match its data checksum yet is
            re-read before the stream gives up.
        use_inotify: also wake as a shard is renamed into the version's directory (where
            inotify sees it: this host's writes), not only at the next poll (default: unless
            ASYNCSYNC_FORCE_POLLING=1, as the agent's).
    """

    def __init__(
        self,
        root: Path,
        engine: Engine,
        base: Manifest,
        *,
        on_manifest: asyncio.Event,
        group_bytes: int,
        idle_timeout: float = STREAM_TIMEOUT,
        verify_deadline: float = VERIFY_DEADLINE,
        interval: float = 0.005,
        use_inotify: bool | None = None,
    ) -> None:
        self.root = root
        self.engine = engine
        self.base = base
        self.version = base.version + 1
        self.dir = version_dir(root, self.version)
        self.on_manifest = on_manifest
        self.group_bytes = group_bytes
        self.idle_timeout = idle_timeout
        self.verify_deadline = verify_deadline
        self.interval = interval
        self.use_inotify = inotify_wanted(use_inotify)
        self.applied: list[AppliedShard] = []
        self.txn_open = False  # the engine holds a transaction for self.version
        self.failed: str | None = None
        self.gone = False  # it failed because the version directory was gone
        self.stalled: int | None = None  # it timed out waiting for this shard (a stall)
        self.first: tuple[int, int] | None = None  # (inode, mtime) of the shard 0 it read
        self._provisional: Manifest | None = None
        self._shard0: StreamHeader | None = None  # the header of the first shard taken
        self._names: set[str] = set()
        self._stop = asyncio.Event()
        self._drain = False  # finish() lets the reader go on to the last shard (manifest seen)
        self._applying = False  # a shard is being checked and decoded (progress: no idle timeout)
        self._pending: asyncio.Future[None] | None = None  # the engine's apply in flight
        self._progressed = 0.0  # when the last shard's apply ended (monotonic)
        self._base_entries = base.tensor_map()
        self._limit = shard_limit(base)

    # ------------------------------------------------------------------ the agent's side
    async def finish(self, task: asyncio.Task[None] | None, *, drain: bool = False) -> None:
        """Read no further shard (with ``drain``: none after those in place when the manifest
        is), apply those read, and wait for the task (the transaction stays open)."""
        self._drain = drain
        self._stop.set()
        if task is not None:
            try:
                await task
            except asyncio.CancelledError:
                me = asyncio.current_task()
                if me is not None and me.cancelling():  # our caller is being cancelled (the
                    raise  # stream task with it, which rolled back): never swallow that

    async def take(
        self, task: asyncio.Task[None] | None, m: Manifest, mode: str
    ) -> set[str] | None:
        """Before the agent applies ``m``: apply the shards left, stop, and return the shard
        files applied into the engine's open transaction for ``m``, now confirmed by it
        (``engine.confirm``); None when no transaction is open. A transaction for another
        version, or one ``m`` does not confirm, is aborted (the engine rolls back) and None
        returned: ``m`` is then applied the ordinary way."""
        same = (self.version, mode) == (m.version, "delta")
        await self.finish(task, drain=same and self.txn_open)
        if not self.txn_open:
            return None
        why = self.mismatch(m) if same else "another version"
        if why is None:
            try:
                await self.engine.confirm(m)
            except AsyncSyncError as exc:
                why = str(exc)
        if why is not None:
            logger.warning(
                "the shards of v%d applied early are not what v%d commits (%s); rolling back "
                "and applying it from its manifest", self.version, m.version, why,
            )  # fmt: skip
            await self._abort(why)
            return None
        self.txn_open = False  # the agent's now
        return {a.file for a in self.applied}

    def mismatch(self, m: Manifest) -> str | None:
        """Why the shards applied early are not what manifest ``m`` commits (None: they are)."""
        if m.version != self.version or m.base_version != self.base.version:
            return f"the manifest is v{m.version} on base {m.base_version}"
        if m.run_id != self.base.run_id or m.shard_dir is not None:  # a keyframe may confirm
            return "the manifest is of another run or registers a checkpoint"
        if m.encoding != self._header(0).encoding or m.checksum_algorithm != self.base_algo():
            return "the manifest names another encoding or checksum algorithm"
        by_file = {s.file: (i, s) for i, s in enumerate(m.shards)}
        entries = m.tensor_map()
        for a in self.applied:
            if a.file not in by_file:
                return f"{a.file} was applied but the manifest does not name it"
            idx, s = by_file[a.file]
            if (s.role, s.bytes, s.checksum) != ("delta", a.bytes, a.checksum):
                return f"{a.file}: the manifest's size or checksum differs from what was applied"
            for e in a.header.entries:
                me = entries.get(e.name)
                if me is None or me.parts is not None or me.delta is None:
                    return f"tensor {e.name!r} was applied but has no such delta in the manifest"
                want = (idx, e.mode, e.positions, e.values, e.changed, e.checksum)
                got = (me.delta.shard, me.delta.mode, me.delta.positions, me.delta.values,
                       me.changed, me.checksum)  # fmt: skip
                if want != got or (me.dtype, me.shape) != (e.dtype, e.shape):
                    return f"tensor {e.name!r}: the manifest's entry differs from its shard's"
        applied = {a.file for a in self.applied}
        for t in m.tensors:  # every tensor whose delta is in an applied shard was applied
            in_applied = t.delta is not None and m.shards[t.delta.shard].file in applied
            if in_applied and t.name not in self._names:
                return f"tensor {t.name!r} is in an applied shard but was not applied"
        return None

    def base_algo(self) -> str:
        return self._header(0).algorithm

    def _header(self, k: int) -> StreamHeader:
        return self.applied[k].header

    # ------------------------------------------------------------------ the task
    async def run(self) -> None:
        """Apply shards as they land until the manifest appears or :meth:`finish`: the next
        shard is read (and its data checked) while this one is decoded, and checked and decoded
        while the engine applies this one's last group, so neither a slow filesystem's transfer
        nor the decode adds to the apply."""
        ready: asyncio.Queue[_Shard] = asyncio.Queue(maxsize=1)
        reader = asyncio.create_task(self._read_ahead(ready), name=f"read v{self.version}")
        try:
            while (shard := await self._next(ready, reader)) is not None:
                self._applying = True
                try:  # also after finish(): read and checked, so the agent need not read it again
                    await self._apply(*shard)
                finally:
                    self._applying, self._progressed = False, time.monotonic()
            await self._settle()  # the manifest, finish(), or a publisher of format 2
        except asyncio.CancelledError:
            await asyncio.shield(self._abort("cancelled"))
            raise
        except Exception as exc:
            logger.warning("streaming apply of v%d stopped: %s", self.version, exc)
            if isinstance(exc, OSError) and not self.gone:  # the directory went mid-read (a
                self.gone = not await asyncio.to_thread(  # mount going stale): as if seen gone
                    being_written, self.root, self.version
                )
            await asyncio.shield(self._abort(f"{type(exc).__name__}: {exc}"))
        finally:
            if not reader.done():
                reader.cancel()
                with contextlib.suppress(BaseException):
                    await reader

    async def _next(
        self, ready: asyncio.Queue[_Shard], reader: asyncio.Task[None]
    ) -> _Shard | None:
        """The next shard read, or None once the reader has ended (its error raised); the
        error of the apply in flight is raised as soon as it ends."""
        took = asyncio.ensure_future(ready.get())
        try:
            while not (took.done() or reader.done()):
                waits: set[asyncio.Future[Any]] = {took, reader}
                if self._pending is not None:
                    waits.add(self._pending)
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                if self._pending is not None and self._pending.done():
                    await self._settle()
        finally:
            if not took.done():
                took.cancel()
        if took.done() and not took.cancelled():
            shard = took.result()
        elif not ready.empty():  # read just before the reader ended
            shard = ready.get_nowait()
        else:
            reader.result()  # the reader's error, if any
            return None
        ready.task_done()  # the reader may read the next one now
        return shard

    async def _read_ahead(self, ready: asyncio.Queue[_Shard]) -> None:
        """Poll for the shards in order and queue each complete one (one ahead of the shard
        being checked and decoded); once the manifest is there, return at the first shard
        missing (or not the next, or not verified at once); return at :meth:`finish`, or at a
        first shard of format 2."""
        watch = inotify.watch_or_none(self.dir, self.use_inotify)  # else polling only
        try:
            await self._read_each(ready, watch)
        finally:
            if watch is not None:
                watch.close()  # (the kernel's wait for it off the loop)

    async def _read_each(
        self,
        ready: asyncio.Queue[_Shard],
        watch: inotify.DirectoryWatch | None,
    ) -> None:
        k = 0
        attempt: str | None = None
        last = time.monotonic()
        delay = self.interval
        manifest = self.dir / MANIFEST_NAME
        committed = False  # the manifest is there: every shard is, read those not read yet
        while True:
            path = self.dir / f"delta-{k:05d}.safetensors"
            seen, there = await asyncio.to_thread(_look, manifest, path, self.root, committed)
            if seen and not committed:
                self.on_manifest.set()  # the agent reads it meanwhile, then takes this stream
                committed = True
            if self._stop.is_set() and not (committed and self._drain):
                return
            if there != 1:
                if committed:  # the last delta shard was read
                    return
                if self.txn_open and not await asyncio.to_thread(
                    being_written, self.root, self.version
                ):
                    self.gone = True
                    raise StreamAbandoned(await asyncio.to_thread(self._gone_why))
                idle = time.monotonic() - max(last, self._progressed)
                if self.txn_open and not self._busy() and idle > self.idle_timeout:
                    self.stalled = k
                    raise StreamAbandoned(
                        f"no shard nor manifest of v{self.version} for "
                        f"{self.idle_timeout:g}s: the publish was abandoned"
                    )
                wanted = (path.name, MANIFEST_NAME)  # not other files (a flood of them)
                await inotify.nap(watch, delay, self._stop, wanted.__contains__)
                delay = min(delay * 1.25, 0.1)  # an abandoned write must not spin the CPU
                continue
            if k == 0:  # before the read: a file replaced meanwhile only restarts a failed one
                self.first = await asyncio.to_thread(_identity, path, self.root)
            try:  # (after the manifest: read once, no re-read until the verify deadline)
                got = await self._read(path, first=k == 0, manifest=None if committed else manifest)
                if got is None:  # shard 0 not self-describing, or the manifest came: the agent
                    return  # applies the version (the rest of it) after its commit
                data, hdr = got
                if attempt is None:
                    attempt = hdr.attempt
                if hdr.attempt != attempt:
                    raise StreamAbandoned(f"{path.name} belongs to another publish attempt")
                if hdr.shard_index != k:
                    raise StreamAbandoned(f"{path.name} says it is shard {hdr.shard_index}")
            except (StreamAbandoned, OSError, ValueError):  # (ValueError: larger than any shard)
                if committed:  # a file after the last shard (a leftover, damaged, a FIFO): the
                    return  # agent applies what the manifest names, nothing is rolled back
                raise
            await ready.put((path, data, hdr))
            await ready.join()  # taken: read the next while this one is applied, not further
            k += 1
            last = time.monotonic()
            delay = self.interval

    def _gone_why(self) -> str:
        """Why the version directory went before its manifest was seen: a later version is
        committed (then this one was too, and retention removed it: the receiver is behind),
        or none is (the publisher abandoned it: a failed or killed publish removes it)."""
        try:
            later = [v for v in list_versions(self.root) if v > self.version]
        except OSError:
            later = []
        if later:
            return (
                f"v{self.version} was committed and retention removed it before this receiver "
                f"saw its manifest (v{later[-1]} is committed: the receiver is behind)"
            )
        return f"{self.dir} is gone and no manifest of it was seen: the publish was abandoned"

    def shows_again(self) -> bool:
        """After this stream failed: whether its version is being written anew, so a new stream
        of it may start: the directory shows again after it was seen gone, or holds another
        shard 0 than the one read (another attempt), or the shard it timed out waiting for is
        there (the publisher went on after a stall longer than ``idle_timeout``: a slow mount;
        streamed again on the same files, it was applied only after its manifest). Never on
        the same files otherwise: a stream that failed on them would fail again, rolling the
        engine back each time."""
        if not being_written(self.root, self.version):
            return False
        if self.gone:
            return True
        if self.stalled is not None:
            return probe(self.dir / f"delta-{self.stalled:05d}.safetensors", self.root) == 1
        now = _identity(self.dir / "delta-00000.safetensors", self.root)
        return self.first is not None and now is not None and now != self.first

    async def abandon(self, task: asyncio.Task[None] | None, why: str) -> None:
        """Stop, and roll back the transaction if one is open (its manifest came but did not
        commit the version: unreadable, or refused)."""
        await self.finish(task)
        if self.txn_open:
            logger.warning("streaming apply of v%d rolled back: %s", self.version, why)
        await self._abort(why)

    async def _abort(self, why: str) -> None:
        self.failed = why
        await self._quiesce()  # never under an apply still running
        if self.txn_open:
            try:
                with contextlib.suppress(Exception):
                    await self.engine.abort()
            finally:
                self.txn_open = False  # once the engine is back at the base

    async def _read(
        self, path: Path, *, first: bool, manifest: Path | None
    ) -> tuple[memoryview, StreamHeader] | None:
        """The shard's bytes and streaming header once its data checksum matches (re-read for
        ``verify_deadline`` s: it may show before its bytes; read once when ``manifest`` is
        None: seen); None for a ``first`` one not self-describing (a format 2 publisher), and
        as the manifest shows or at :meth:`finish` (a damaged file after the last shard held
        the commit for the deadline, then rolled every shard streamed back)."""
        deadline = time.monotonic() + (0.0 if manifest is None else self.verify_deadline)
        delay = 0.02
        while True:  # nothing below the root is followed
            data, hdr, ok = await asyncio.to_thread(_read_checked, path, self._limit, self.root)
            if hdr is not None and ok:
                return data, hdr
            if hdr is None and first:  # an older publisher: applied after commit
                return None
            # A shard after self-describing ones that is not (yet) one, or whose data does not
            # match: its bytes may not be visible yet (NFS shows a renamed file first)
            if time.monotonic() >= deadline:
                raise StreamAbandoned(f"{path}: not a complete self-describing shard in time")
            if self._stop.is_set() or (
                manifest is not None and await asyncio.to_thread(_seen, manifest, self.root)
            ):
                self.on_manifest.set()  # (the agent applies the rest from the manifest)
                return None
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)

    async def _apply(self, path: Path, data: memoryview, hdr: StreamHeader) -> None:
        """Check one shard against the base and the engine, then decode and apply it."""
        base, where = self.base, str(path)
        state = self.engine.state
        if (hdr.version, hdr.run_id) != (self.version, base.run_id):
            raise StreamAbandoned(f"{where}: names v{hdr.version} of run {hdr.run_id}")
        if hdr.base_version != base.version or hdr.base_fingerprint != base.fingerprint:
            raise StreamAbandoned(f"{where}: applies to another base than v{base.version}")
        if (state.version, state.fingerprint) != (base.version, base.fingerprint):
            raise StreamAbandoned(f"{where}: the engine no longer holds v{base.version}")
        first = self._shard0  # (self.applied may not hold it yet: its apply may be in flight)
        if first is not None and (hdr.encoding, hdr.algorithm) != (first.encoding, first.algorithm):
            raise StreamAbandoned(f"{where}: another encoding or algorithm than shard 0")
        new_hasher(hdr.algorithm)  # ConfigError (an AsyncSyncError) for an unknown one
        pieces: list[Piece] = []
        for e in hdr.entries:
            b = self._base_entries.get(e.name)
            if b is None or b.parts is not None or (b.dtype, b.shape) != (e.dtype, e.shape):
                raise StreamAbandoned(f"{where}: tensor {e.name!r} is not one of v{base.version}")
            if e.name in self._names:
                raise StreamAbandoned(f"{where}: tensor {e.name!r} comes twice")
            ref = DeltaRef(hdr.shard_index, e.mode, e.positions, e.values)  # type: ignore[arg-type]
            entry = TensorEntry(e.name, e.dtype, e.shape, e.checksum, e.changed, delta=ref)
            pieces.append((entry, None, ref))
        parse = partial(
            parse_delta_shard, data, where=where, version=self.version, run_id=base.run_id
        )
        tensors, checksum = await asyncio.to_thread(  # (one thread hop: a few ms each under load)
            lambda: (parse(), checksum_bytes(data, hdr.algorithm))
        )
        if not self.txn_open:
            self._shard0 = hdr
            self._provisional = replace(
                base,
                version=self.version,
                base_version=base.version,
                kind="delta",
                encoding=hdr.encoding,
                checksum_algorithm=hdr.algorithm,
                shards=(),
                shard_dir=None,
                attempt=None,
            )
            try:
                await self.engine.begin(self._provisional, "delta")
            except asyncio.CancelledError:  # the begin may still complete in its thread: the
                with contextlib.suppress(Exception):  # engine runs one call at a time, so
                    await asyncio.shield(self.engine.abort())  # this abort comes after it
                raise
            self.txn_open = True
        self._names.update(e.name for e in hdr.entries)
        assert self._provisional is not None
        done = AppliedShard(path.name, len(data), checksum, hdr)
        await self._apply_groups(self._provisional, tensors, pieces, where, done)

    async def _apply_groups(
        self, m: Manifest, tensors: ShardData, pieces: list[Piece], where: str, done: AppliedShard
    ) -> None:
        """Decode group g+1 while the engine applies group g, across shards: the last group's
        apply is left in flight (:attr:`_pending`) while the next shard is checked and decoded,
        so at most one decoded group waits for the engine. ``done`` is recorded once the last
        group's apply has returned."""
        groups = group_pieces(pieces, self.group_bytes, threads())
        if not groups:  # (no tensor: nothing to apply)
            await self._settle()
            self._applied(done)
        for g, group in enumerate(groups):
            updates = await asyncio.to_thread(decode_pieces, m, "delta", tensors, group, where)
            await self._settle()  # the previous group's apply, perhaps of the previous shard
            applying = self.engine.apply(updates)  # type: ignore[arg-type]
            last = done if g == len(groups) - 1 else None
            self._pending = asyncio.ensure_future(self._apply_group(applying, last))

    async def _apply_group(self, applying: Awaitable[None], last: AppliedShard | None) -> None:
        await applying
        if last is not None:
            self._applied(last)

    def _applied(self, shard: AppliedShard) -> None:
        self.applied.append(shard)
        self._progressed = time.monotonic()
        logger.debug("streamed %s of v%d (%d tensors)", shard.file, self.version,
                     len(shard.header.entries))  # fmt: skip

    def _busy(self) -> bool:
        """A shard is being checked or decoded, or an apply is in flight: progress."""
        return self._applying or (self._pending is not None and not self._pending.done())

    async def _settle(self) -> None:
        """Wait for the apply in flight (its error raised). Shielded: a cancelled caller leaves
        it running, and :meth:`_abort` waits for it (:meth:`_quiesce`) before rolling back."""
        if (pending := self._pending) is not None:
            await asyncio.shield(pending)
            self._pending = None

    async def _quiesce(self) -> None:
        """Wait for the apply in flight to end, whatever it raises and however often the caller
        is cancelled meanwhile (the engine's thread cannot be stopped)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        while not pending.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(pending)
        if not pending.cancelled():
            pending.exception()  # retrieved: the failure that stopped the stream is what counts


def shard_limit(base: Manifest) -> int:
    """The most bytes a delta shard of the version after ``base`` can hold: every tensor of
    ``base`` in it, each with its widest positions (8 bytes an element) and values (a zstd
    frame of every element, with its overhead), and their header entries. No manifest names
    the shard's size yet: without this a file put there (a sparse 1 TiB one) was read whole
    into memory, checked from ``fstat`` against 1 TiB only."""
    tensors = sum(8 * e.numel + 2 * e.nbytes + 4096 for e in base.tensors)
    return min(MAX_SHARD_BYTES, tensors + 8192 * len(base.tensors) + (1 << 20))


def _seen(path: Path, root: Path) -> bool:
    """Whether an entry is at ``path`` in ``root`` (whatever it is: the agent reads or refuses
    it). StreamAbandoned when it cannot be looked at (a dead FUSE mount: ENOTCONN; EIO; a
    version directory replaced by a symlink): a stream that took that for its manifest ended
    with its transaction open and no sync to take it over, the engine half patched for good."""
    try:
        return fsio.lstat(path, root=root) is not None
    except OSError as exc:
        raise StreamAbandoned(f"{path} cannot be looked at: {exc}") from exc


def _look(manifest: Path, path: Path, root: Path, committed: bool) -> tuple[bool, int | None]:
    """(whether the manifest is there, unless ``committed``: seen already; :func:`probe` of the
    next shard) in one thread hop."""
    return (not committed and _seen(manifest, root)), probe(path, root)


def _read_checked(
    path: Path, limit: int, root: Path
) -> tuple[memoryview, StreamHeader | None, bool]:
    """The file's bytes (at most ``limit``; a read-only view of a scratch pool's buffer, reused
    once nothing refers to it: a version's shards into fresh buffers were ~5,000 page faults at
    1 GiB, ~10 ms of CPU) and :func:`_check_data` of them."""
    data = read_pooled(path, limit=limit, root=root)
    return (data, *_check_data(data, str(path)))


def _identity(path: Path, root: Path) -> tuple[int, int] | None:
    """(inode, mtime in ns) of the file at ``path`` (never followed), None when none is."""
    try:
        st = fsio.lstat(path, root=root)
    except OSError:
        return None
    return None if st is None else (st.st_ino, st.st_mtime_ns)


def _check_data(data: bytes | memoryview, where: str) -> tuple[StreamHeader | None, bool]:
    """(the streaming header or None, whether the data matches its data checksum)."""
    try:
        hdr = stream_header(data, where=where)
    except FormatError:
        return None, False  # maybe a torn read; the agent reads it after commit
    if hdr is None:
        return None, False
    h = new_hasher(hdr.algorithm)
    h.update(memoryview(data)[hdr.data_offset :])
    return hdr, h.hexdigest() == hdr.data_checksum
