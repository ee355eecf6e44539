"""The trainer side: publish versions of a state dict into a root as sparse deltas.

Example::

    async with Publisher("/shared/weights") as pub:
        await pub.seed(model.state_dict())            # version 0, a full keyframe
        for step in range(steps):
            train_step()
            res = await pub.publish(model.state_dict())
            await pub.wait_acked(res.version, quorum=1, timeout=60)

A publish runs as a pipeline of three stages over buckets of tensors, joined by bounded queues so at
most ``max_in_flight`` buckets wait between two stages: **diff** (copy to CPU, bytewise diff against
the snapshot of the last published version), **encode** (encode each changed tensor, checksum it,
serialise a full shard on keyframes) and **write** (temp file, fsync, rename; consecutive buckets'
deltas share a delta shard). When every shard is durable the pre-commit hook runs, then the manifest
is written atomically: that rename is the commit. Only then is the snapshot advanced, so a publish
that fails anywhere leaves no manifest, no files and an unchanged snapshot.
Each tensor is read once: a version holds each tensor's bytes as read, in every part (a
keyframe's delta and full data, a full version's shards and the snapshot kept after), even if
the trainer changes them meanwhile, but a tensor written *while* it is read is published with
some elements old and some new: do not modify the tensors until ``publish`` returns.

How a round begins and ends is the publisher's *committer* (:mod:`asyncsync.publish.ranked`):
alone, or, with a ``coordinator`` (:mod:`asyncsync.publish.distributed`), as one rank of a
trainer whose ranks each publish their own part of the weights (distinct names, or
:class:`~asyncsync.publish.merge.TensorSlice` slices of one tensor) while rank 0 commits the
version once, in one manifest, when every rank's shards are durable
(:mod:`asyncsync.publish.group`). The pipeline above is the same on every rank.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, NoReturn

import torch

from asyncsync import codec
from asyncsync.codec.shards import (
    DiffedBucket,
    EncodedBucket,
    diff_bucket,
    encode_bucket,
)
from asyncsync.errors import ConfigError, PublishError
from asyncsync.format import (
    AckRecord,
    Manifest,
    ShardInfo,
    TensorEntry,
    acks,
    dtype_name,
    version_dir,
)
from asyncsync.format.checksum import DEFAULT_ALGORITHM
from asyncsync.fsio import FileLock
from asyncsync.memory import keep_freed_memory, release_large_buffers
from asyncsync.pipeline import GlueGate, LoopLock, finish_thread, run_pipeline
from asyncsync.publish import snapshot
from asyncsync.publish.advance import Base
from asyncsync.publish.commit import (
    PreCommitHook,
    build_manifest,
    claim_version_dir,
    commit_version,
    complete,
    discard,
    lock_name,
    log_and_collect,
    open_root,
    through_commit,
)
from asyncsync.publish.distributed import Coordinator
from asyncsync.publish.group import Attempt
from asyncsync.publish.hf import checkpoint_path, register_scan
from asyncsync.publish.merge import TensorSlice
from asyncsync.publish.options import ShardSizer, check_options, check_round
from asyncsync.publish.ranked import Committer, RankedCommitter, Round, SoloCommitter, Written
from asyncsync.publish.retention import ManifestKinds, RetentionPolicy
from asyncsync.publish.stats import PublisherStats, PublishResult, Tally
from asyncsync.publish.writer import VersionWriter

__all__ = ["PreCommitHook", "PublishResult", "Publisher", "PublisherStats"]

logger = logging.getLogger(__name__)

LOCK_NAME = lock_name(0)
REENTERED = "a publisher called from inside its own call (its pre-commit hook?) waits for itself"
#: (label, done, total) of the publish in flight, or None (asyncsync.console.progress draws it)
Progress = tuple[str, int, int] | None


class Publisher:
    """Publishes versions of a state dict into ``root`` (see the module docstring).

    Args:
        root: the shared directory: new, empty or a root (FORMAT.md 2). One publisher per root.
        encoding: delta encoding, one of ``codec.ENCODINGS`` (default: ours, ``xef``).
        checksum: checksum algorithm for shards and tensors.
        bucket_bytes: tensors are diffed and encoded in buckets of about this many bytes; a
            keyframe's full shard holds one bucket, and a delta shard collects consecutive
            buckets' encoded deltas up to about this many bytes (so a sparse version is a few
            files, not one per bucket).
        max_in_flight: buckets allowed to wait between two stages (bounds memory).
        pipelined: run the diff, encode and write stages concurrently over buckets (default);
            False runs them one after another (for measuring what the overlap buys).
        mode: ``"delta"`` (default) publishes sparse deltas; ``"full"`` publishes every version as
            a complete safetensors checkpoint (kind ``full``, no delta), like slime's disk mode.
        keyframe_interval: every version divisible by this also carries full data (0: never).
        zstd_level: compression level of the delta payload.
        pre_commit_hook: ``hook(version_dir)`` (sync or async), run after the shards are durable
            and before the manifest, e.g. to flush a filesystem that needs it.
        producer: extra JSON-able fields recorded in each manifest's ``producer``.
        retention: a :class:`~asyncsync.publish.retention.RetentionPolicy` applied after each commit
            (None: keep everything; ``asyncsync gc ROOT`` can prune later).
        coordinator: publish as one rank of a group (:mod:`asyncsync.publish.distributed`); every
            rank calls seed/publish with its own tensors and the same options. Rank 0 commits, runs
            the hook, the log and retention; the others hold their own lock and snapshot.
        delta_shard_bytes: delta shard size (default: ~1/8 of the last delta, 1 MiB to
            ``min(bucket_bytes, 4 MiB)``: :class:`~asyncsync.publish.options.ShardSizer`); a single
            publisher's are self-describing (FORMAT.md 4.3): receivers apply each as it lands.
            At the default size, a delta of two shards or more leads with a small bucket whose
            shard comes first, and its last shards halve down to one bucket's.

    Attributes:
        stale: the tensors whose snapshot is not what was shipped (its copy after the commit
            failed; a warning says so), making the next version full, with no delta (one
            diffed against that snapshot would not apply on any receiver). A full version's
            tensors are read once, into a copy its shards and its snapshot come from.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        encoding: str = codec.DEFAULT_ENCODING,
        checksum: str = DEFAULT_ALGORITHM,
        bucket_bytes: int = 32 << 20,
        max_in_flight: int = 2,
        pipelined: bool = True,
        mode: Literal["delta", "full"] = "delta",
        keyframe_interval: int = 20,
        zstd_level: int = 1,
        pre_commit_hook: PreCommitHook | None = None,
        producer: Mapping[str, Any] | None = None,
        retention: RetentionPolicy | None = None,
        coordinator: Coordinator | None = None,
        delta_shard_bytes: int | None = None,
    ) -> None:
        check_options(
            encoding=encoding, checksum=checksum, bucket_bytes=bucket_bytes, root=root,
            delta_shard_bytes=delta_shard_bytes, max_in_flight=max_in_flight, mode=mode,
            keyframe_interval=keyframe_interval, zstd_level=zstd_level, producer=producer,
            pre_commit_hook=pre_commit_hook, retention=retention, coordinator=coordinator,
            pipelined=pipelined,
        )  # fmt: skip
        self.root = Path(root)
        self.encoding = encoding
        self.checksum = checksum
        self.bucket_bytes = bucket_bytes
        self._shards = ShardSizer(delta_shard_bytes, bucket_bytes)
        self.delta_shard_bytes = self._shards.ceiling
        self.max_in_flight = max_in_flight
        self.pipelined = pipelined
        self.mode = mode
        self.keyframe_interval = keyframe_interval
        self.zstd_level = zstd_level
        self.pre_commit_hook = pre_commit_hook
        self.retention = retention
        self._kinds = ManifestKinds()  # (retention's: each manifest parsed once, not per commit)
        self._producer = {"host": socket.gethostname(), "pid": os.getpid(), **(producer or {})}
        self._committer: Committer = SoloCommitter()
        if coordinator is not None:
            config = {"encoding": encoding, "checksum": checksum, "mode": mode}
            self._committer = RankedCommitter(coordinator, config, keyframe_interval)
        rank = self._committer.rank
        lock = self.root / lock_name(rank)
        self._lock = FileLock(lock, root=self.root)
        self._busy = LoopLock(REENTERED)  # not asyncio.Lock: reusable across asyncio.run calls
        self._run_id = ""
        self._next_version = 0
        self._last_version: int | None = None
        self._base = Base()  # the last committed version's snapshot and records
        self.stale: list[str] = []  # tensors whose snapshot is not what was shipped: keyframe
        self._tally = Tally()
        self._in_flight = 0
        self._progress: Progress = None
        self._cancel_after_commit = False
        self._renamed = False  # the manifest of the round in flight is in place

    # ------------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> Publisher:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def open(self) -> None:
        """Take the root's lock, clean leftovers of interrupted publishes, find the next version."""
        if self._lock.held:
            return
        release_large_buffers()
        run_id, versions, nxt = await open_root(self.root, self._lock, self._committer)
        latest = versions[-1] if versions else None
        if (latest, run_id) != (self._last_version, self._run_id):  # the root moved on since
            self._base = Base()
        self._run_id, self._last_version, self._next_version = run_id, latest, nxt
        logger.info(
            "publisher open root=%s run=%s next_version=%d",
            self.root,
            self._run_id,
            self._next_version,
        )

    async def close(self) -> None:
        async with self._busy:
            self._lock.release()

    def _require_open(self) -> None:
        if not self._lock.held:
            raise PublishError("the publisher is not open: use `async with Publisher(...)`")

    # ------------------------------------------------------------------ public API
    @property
    def version(self) -> int | None:
        """The last committed version in the root (None before the first)."""
        return self._last_version

    @property
    def progress(self) -> Progress:
        """``(label, buckets written, buckets)`` of the publish in flight, or None.

        For progress displays (``asyncsync.console.ProgressWatcher``) of long publishes: seeds and
        keyframes of large models."""
        return self._progress

    @property
    def run_id(self) -> str:
        return self._run_id

    async def seed(
        self,
        source: Mapping[str, torch.Tensor] | str | os.PathLike[str],
        *,
        slices: Mapping[str, TensorSlice] | None = None,
        step: int | None = None,
    ) -> PublishResult:
        """Publish the base version: a full keyframe of ``source``.

        ``source`` is a state dict, or the path of an existing Hugging Face safetensors checkpoint
        directory, which is registered as the base without being rewritten (its files are
        checksummed and referenced by the manifest). On a new root this is version 0; on a root
        that already has versions (a restarted trainer) it is the next version. ``slices``,
        ``step``: see :meth:`publish`.
        """
        self._require_open()
        async with self._busy:
            if not isinstance(source, Mapping):
                if self._committer.ranked:
                    raise ConfigError("a multi-rank publisher seeds from each rank's state dict")
                return await self._register_checkpoint(checkpoint_path(source))
            return await self._round(source, slices, keyframe=True, base=False, step=step)

    async def publish(
        self,
        state_dict: Mapping[str, torch.Tensor],
        *,
        keyframe: bool = False,
        slices: Mapping[str, TensorSlice] | None = None,
        step: int | None = None,
    ) -> PublishResult:
        """Commit the next version: the delta of ``state_dict`` against the last published one.

        A state dict identical to the last one still commits a version (zero diff, no shards).
        Every ``keyframe_interval``-th version, or with ``keyframe=True``, the version also
        carries full data. A changed set of names, dtypes or shapes publishes a full version.
        ``slices`` declares tensors of which ``state_dict`` holds only a flat element range
        (:class:`~asyncsync.publish.merge.TensorSlice`); the ranks' slices of a name must tile it.
        A rank of a group without a snapshot yet (restarted) may publish: the group then
        publishes a full version. ``step`` (a group's ranks): the caller's training step, the
        same on every rank for one version; the ranks' calls meet by it (a rank whose step is
        behind fails, never joining another step's version). None: calls meet in order.
        """
        self._require_open()
        async with self._busy:
            return await self._round(state_dict, slices, keyframe=keyframe, base=True, step=step)

    async def abstain(self, reason: Exception, *, step: int | None = None) -> NoReturn:
        """Take part in this round without publishing, and raise ``reason``: every other rank
        of the group fails the round (PublishError naming this rank and ``reason``), so that
        no version is made without this rank's step and the ranks stay in step. Call it when
        this rank cannot publish (its weights could not be gathered, a check failed)."""
        self._require_open()
        async with self._busy:
            await self._round({}, None, keyframe=False, base=True, step=step, abstain=reason)
        raise reason  # a round with ``abstain`` always raises it

    async def wait_acked(
        self,
        version: int,
        *,
        engines: Sequence[str] | None = None,
        quorum: int | None = None,
        timeout: float | None = None,
    ) -> dict[str, AckRecord]:
        """Wait until ``engines`` (all) or a ``quorum`` of engines hold ``version`` or later.

        Raises :class:`~asyncsync.errors.AckTimeout` naming the engines that are behind.
        """
        return await acks.wait_acked(self.root, version, engines=engines, quorum=quorum,
                                     timeout=timeout, run_id=self._run_id or None)  # fmt: skip

    def statistics(self) -> PublisherStats:
        return self._tally.stats(self.root, self._run_id, self._last_version)

    def __repr__(self) -> str:
        return (
            f"<Publisher root={str(self.root)!r}{self._committer.describe()} "
            f"version={self._last_version} in_flight={self._in_flight} encoding={self.encoding}>"
        )

    # ------------------------------------------------------------------ for the committer
    @property
    def next_version(self) -> int:
        return self._next_version

    @property
    def last_version(self) -> int | None:
        return self._last_version

    @property
    def has_snapshot(self) -> bool:
        return self._base.tensors is not None

    def same_schema(
        self, state_dict: Mapping[str, torch.Tensor], slices: Mapping[str, TensorSlice]
    ) -> bool:
        return self._base.same_schema(state_dict, slices)

    def schema_changes(self, state_dict: Mapping[str, torch.Tensor]) -> str:
        return self._base.schema_changes(state_dict)

    def set_round(self, run_id: str, next_version: int) -> None:
        self._run_id, self._next_version = run_id, next_version

    async def adopt(self, a: Attempt) -> None:
        """The group committed an attempt whose outcome this rank missed: advance to it (the
        snapshot in a thread, finished even if cancelled meanwhile; the cancel raised after)."""
        b, cancelled = self._base, False
        if self.mode == "delta":
            self.stale, cancelled = await b.advance(a.names, a.updates, self.checksum, None)
        b.checksums, b.slices = a.checksums, a.slices
        self._last_version, self._next_version = a.version, a.version + 1
        if cancelled:
            raise asyncio.CancelledError

    # ------------------------------------------------------------------ internals
    async def _round(
        self, sd: Mapping[str, torch.Tensor], slices: Any, *, keyframe: bool, base: bool,
        step: int | None, abstain: Exception | None = None,
    ) -> PublishResult:  # fmt: skip
        check_round(keyframe=keyframe, step=step)
        # read once, as it is now: the trainer's loop may rebind or drop entries meanwhile
        sd = dict(sd) if isinstance(sd, Mapping) else sd
        try:  # the committer sets the round up (a plan), the pipeline runs, the committer ends it
            rnd = await self._committer.begin(
                self, sd, slices, keyframe=keyframe, base=base, step=step, abstain=abstain
            )
            return await self._publish(sd, rnd)
        finally:
            await self._committer.end()

    async def _publish(self, state_dict: Mapping[str, torch.Tensor], rnd: Round) -> PublishResult:
        """The one pipeline (diff, encode, write) of a round, then the committer's end of it."""
        sl, version, delta, full = rnd.slices, rnd.version, rnd.delta, rnd.full
        names = list(state_dict)
        vdir = version_dir(self.root, version)
        t_start = time.perf_counter()
        created = time.time()
        streams = delta and not self._committer.ranked and bool(self._base.fingerprint)  # 4.3
        stream = (version - 1, self._base.fingerprint, secrets.token_hex(6), self.encoding)
        sizes = [state_dict[n].numel() * state_dict[n].element_size() for n in names]
        model = sum(sizes)  # the model's bytes: the shard size, the taper, the diff's scratch
        taper = streams and self._shards.tapers(model)  # receivers apply as shards land
        acc = VersionWriter(
            vdir=vdir, algorithm=self.checksum, version=version, run_id=self._run_id,
            shard_bytes=self._shards.next(model),
            meta={n: (dtype_name(t.dtype), tuple(t.shape)) for n, t in state_dict.items()},
            slices=sl, prefix=rnd.prefix, stream=stream if streams else None,
            taper=taper, sizes=sizes,
        )  # fmt: skip
        stage_ref = ["prepare"]
        self._in_flight = 0
        self._progress = None

        async def commit_merged(
            entries: tuple[TensorEntry, ...],
            shards: tuple[ShardInfo, ...],
            raw_bytes: int,
            producer: dict[str, Any],
        ) -> Manifest:
            m = self._manifest(
                version, entries, shards, raw_bytes, created, delta, full,
                attempt=rnd.attempt, producer=producer,
            )  # fmt: skip
            await self._commit(vdir, m, stage_ref)
            return m

        error: BaseException | None = None
        entries: tuple[TensorEntry, ...] = ()
        # A single publisher's snapshot advances in the diff's own pass (reverted if the version
        # is not committed); a rank of a group keeps its changes apart (it may miss the outcome)
        advance = delta and not self._committer.ranked
        own = full and not advance and self.mode == "delta"  # a full shard and a snapshot: one read
        advanced = snapshot.UndoLog(self.encoding)
        try:
            if rnd.refuse is not None:
                raise PublishError(rnd.refuse)
            await finish_thread(claim_version_dir, self.root, vdir, rnd.shared_dir)
            snap = self._base.tensors if delta else None
            buckets = snapshot.plan_for(
                state_dict, sizes, self.bucket_bytes, advance and not full, lead=taper
            )
            codec.scratch.fit(model)  # the diff's temporaries: by the model's size
            keep_freed_memory(model)  # ... and what malloc's arenas keep of the smaller ones

            def diff(bucket: list[int]) -> DiffedBucket:
                items = snapshot.bucket_items(
                    bucket, names, state_dict, snap, self._base.checksums, own
                )
                snapshot.check_unchanged(items, acc.meta)
                d = diff_bucket(items, delta=delta, algorithm=self.checksum, advance=advance)
                advanced.diffed(d)  # reverted if the version is not committed
                return d

            def encode(d: DiffedBucket) -> EncodedBucket:
                e = encode_bucket(
                    d, version=version, run_id=self._run_id, delta=delta, full=full,
                    encoding=self.encoding, level=self.zstd_level, algorithm=self.checksum,
                )  # fmt: skip
                advanced.encoded(d, e)  # from here on its shard's bytes undo it
                return e

            def write(e: EncodedBucket) -> None:
                acc.write(e)
                label, done, total = self._progress or ("", 0, 0)
                self._progress = (label, done + 1, total)

            # A tapered delta's lead bucket is encoded before the next bucket's diff takes the
            # pool (the large tensors, spread over every worker): its shard lands first
            lead, gate = asyncio.Event(), GlueGate()  # (small tensors: one stage at a time)

            async def diff_after_lead(bucket: list[int]) -> DiffedBucket:
                if taper and len(buckets) > 1 and bucket is buckets[1]:
                    t_wait = time.perf_counter()
                    await lead.wait()  # (not the diff's time: the stage's timer counts it)
                    waited = time.perf_counter() - t_wait
                    acc.seconds["diff"] = acc.seconds.get("diff", 0.0) - waited
                return await gate.run(diff, bucket, [sizes[i] for i in bucket])

            async def encode_lead_first(d: DiffedBucket) -> EncodedBucket:
                try:
                    return await gate.run(encode, d, [sizes[it.index] for it in d.items])
                finally:
                    lead.set()

            kind = "full" if full and not delta else "keyframe" if full else "delta"
            self._progress = (f"publish v{version} ({kind})", 0, len(buckets))
            stage_ref[0] = "diff/encode/write"
            await run_pipeline(
                buckets,
                [("diff", diff_after_lead), ("encode", encode_lead_first), ("write", write)],
                maxsize=self.max_in_flight,
                pipelined=self.pipelined,
                seconds=acc.seconds,
            )
            t_finish = time.perf_counter()
            await finish_thread(acc.finish)  # the last delta shard
            acc.seconds["write"] += time.perf_counter() - t_finish
            entries = tuple(acc.entries[i] for i in range(len(names)))
        except BaseException as exc:
            error = exc
        t_commit = time.perf_counter()
        written = Written(
            names, entries, tuple(acc.shards), acc.raw_bytes, acc.pending, acc.sums,
            dict(self._producer), error,
        )  # fmt: skip
        self._renamed = False
        try:
            finish = self._committer.finish(
                rnd, vdir, written, stage_ref, self.checksum, commit_merged
            )
            manifest, cancelled = await through_commit(finish, lambda: self._renamed)
        except BaseException:
            self._progress = None
            if advanced and not self._renamed:  # unless committed after all: then it is right
                await finish_thread(advanced.revert, vdir)  # (to its end, however cancelled)
            raise
        self._cancel_after_commit |= cancelled
        # Committed: from here on the version exists for readers.
        self._in_flight = 0
        if self.mode == "delta":  # in a thread: a full version's copy takes ~0.4 s per GiB
            sums = acc.sums if full else None
            self.stale, cancelled = await self._base.advance(
                names, acc.pending, self.checksum, sums
            )
            self._cancel_after_commit |= cancelled
        self._base.slices = sl
        seconds = dict(acc.seconds)
        seconds["commit"] = time.perf_counter() - t_commit
        seconds["total"] = time.perf_counter() - t_start
        return await self._committed(manifest, seconds, vdir, acc.sums)

    async def _commit(self, vdir: Path, manifest: Manifest, stage: list[str]) -> None:
        if await commit_version(self.root, vdir, manifest, stage, self.pre_commit_hook, self._lock):
            self._cancel_after_commit = True  # committed: finish the bookkeeping, then cancel
        self._renamed = True

    async def _committed(
        self,
        manifest: Manifest,
        seconds: dict[str, float],
        vdir: Path,
        checksums: dict[str, str] | None = None,
    ) -> PublishResult:
        """Bookkeeping after the manifest rename: counters, log line, retention, result.
        ``checksums``: of this rank's own tensors (the manifest's, by default)."""
        self._progress = None
        self._next_version = manifest.version + 1
        self._last_version = manifest.version
        self._base.committed(manifest, checksums)
        self._tally.elements = manifest.totals.elements
        self._shards.committed(manifest)
        if not self._committer.is_committer:
            res = PublishResult.of(manifest, seconds, vdir)  # the log and retention are rank 0's
            self._tally.record(res)
            return self._result(res)
        done = log_and_collect(self.root, manifest, self.retention, self._kinds)
        _, cancelled = await complete(done)
        self._cancel_after_commit |= cancelled
        res = PublishResult.of(manifest, seconds, vdir)
        self._tally.record(res)
        return self._result(res)

    def _result(self, res: PublishResult) -> PublishResult:
        """``res``, or the cancel that arrived once the version could no longer be undone (on
        every rank: the bookkeeping is done)."""
        if self._cancel_after_commit:
            self._cancel_after_commit = False
            raise asyncio.CancelledError
        return res

    def _manifest(
        self, version: int, entries: tuple[TensorEntry, ...], shards: tuple[ShardInfo, ...],
        raw_bytes: int, created: float, delta: bool, full: bool, shard_dir: str | None = None,
        *, attempt: str | None = None, producer: Mapping[str, Any] | None = None,
    ) -> Manifest:  # fmt: skip
        return build_manifest(
            version=version, entries=entries, shards=shards, raw_bytes=raw_bytes,
            created=created, delta=delta, full=full, encoding=self.encoding,
            checksum=self.checksum, run_id=self._run_id,
            producer={**self._producer, **(producer or {})}, shard_dir=shard_dir, attempt=attempt,
        )  # fmt: skip

    async def _register_checkpoint(self, path: Path) -> PublishResult:
        """Seed from an existing HF safetensors checkpoint without rewriting it."""
        version = self._next_version
        vdir = version_dir(self.root, version)
        t0 = time.perf_counter()
        created = time.time()
        shards, entries, tensors, shard_dir = await asyncio.to_thread(
            register_scan, path, self.root, self.checksum
        )
        manifest = self._manifest(
            version, tuple(entries), tuple(shards), 0, created, False, True, str(shard_dir)
        )
        stage = ["mkdir"]
        try:
            await finish_thread(claim_version_dir, self.root, vdir)
            await self._commit(vdir, manifest, stage)
        except BaseException as exc:
            self._progress = None
            await discard(vdir, exc, version, stage[0])
        self._base.tensors = tensors
        t1 = time.perf_counter()
        return await self._committed(manifest, {"total": t1 - t0, "commit": t1 - t0}, vdir)
