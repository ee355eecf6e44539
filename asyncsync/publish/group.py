"""The multi-rank publish protocol: plan, commit, and resolving an attempt a rank missed.

One publish of a group of ranks is one *attempt* at a version, with a fresh id (``attempt``):

1. **plan** (exchange "plan"): each rank says what it holds (the version of its snapshot, the
   attempt whose outcome it missed, whether it can diff its state dict against its snapshot,
   whether it wants a keyframe). Rank 0, the committer, answers with the plan: version
   (``latest + 1``), attempt id, delta or not (only if every rank holds the latest version),
   full or not; and with the id of the attempt it committed last, from which every rank
   resolves an attempt it missed the outcome of (:class:`Attempt`).
2. every rank writes its shards under ``r{rank:04d}-{attempt}-...`` names, fsyncs the version
   directory and writes its part record (:mod:`asyncsync.publish.merge`).
3. **commit** (exchange "commit", keyed by the attempt): each rank reports its part record or its
   error. Rank 0 commits only when every rank's part is there: it merges them, runs the
   pre-commit hook and writes the manifest, which records the attempt id. Otherwise it removes
   the version directory and every rank raises PublishError naming the failed ranks.

A rank that cannot learn the outcome (rank 0 died, a timeout) raises OutcomeUnknown and keeps
the changes of its attempt: its snapshot is unchanged, and the next plan tells whether that
attempt was committed (then the rank advances its snapshot with the kept changes) or not
(then they are dropped). So no rank ever diffs against a snapshot other ranks do not share.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

from asyncsync import codec, fsio
from asyncsync.codec.shards import PendingUpdate
from asyncsync.errors import (
    AsyncSyncError,
    ConfigError,
    CoordinationError,
    OutcomeUnknown,
    PublishError,
    first_error,
)
from asyncsync.format import MANIFEST_NAME, Manifest, ShardInfo, TensorEntry
from asyncsync.format.store import read_manifest
from asyncsync.fsio import atomic_write, fsync_dir, read_bytes
from asyncsync.pipeline import finish_thread
from asyncsync.publish.distributed import Coordinator, Message, step_key
from asyncsync.publish.merge import PartRecord, TensorSlice, merge, part_file_name, shard_prefix

__all__ = ["Attempt", "Plan", "RankGroup"]

logger = logging.getLogger(__name__)

CommitMerged = Callable[
    [tuple[TensorEntry, ...], tuple[ShardInfo, ...], int, dict[str, Any]], Awaitable[Manifest]
]


@dataclass(frozen=True)
class Plan:
    """What rank 0 decided for one attempt; the same on every rank."""

    version: int
    attempt: str
    delta: bool
    full: bool
    run_id: str

    def shard_prefix(self, rank: int) -> str:
        return shard_prefix(rank, self.attempt)


@dataclass
class Attempt:
    """A rank's attempt whose outcome it missed: enough to advance its snapshot if it was
    committed. ``schema`` is what the snapshot's tensors would then be (name, dtype, shape,
    slice), to tell whether the next state dict can be diffed against it."""

    version: int
    attempt: str
    names: list[str]
    updates: list[PendingUpdate]
    checksums: dict[str, str]
    slices: dict[str, TensorSlice]
    schema: dict[str, Any] = field(default_factory=dict)


class RankGroup:
    """The protocol state of one rank (see the module docstring); the Publisher drives it."""

    def __init__(
        self, coordinator: Coordinator, config: dict[str, Any], keyframe_interval: int
    ) -> None:
        self.coordinator = coordinator
        self.config = {**config, "world_size": coordinator.world_size}  # the same on every rank
        self.keyframe_interval = keyframe_interval  # rank 0's decides
        self.rank = coordinator.rank
        self.world_size = coordinator.world_size
        self.last_attempt: str | None = None  # the attempt of the newest committed version
        self.unresolved: Attempt | None = None

    @property
    def is_committer(self) -> bool:
        return self.rank == 0

    def __repr__(self) -> str:
        return f"<RankGroup rank={self.rank}/{self.world_size} last_attempt={self.last_attempt}>"

    async def open(self, root: Path, latest: int | None) -> None:
        """Start the coordinator's run of the group; rank 0 learns the attempt of the newest
        committed version (None if not multi-rank)."""
        await self.coordinator.open()
        if self.is_committer and latest is not None:
            with contextlib.suppress(FileNotFoundError, AsyncSyncError):
                m = await asyncio.to_thread(read_manifest, root, latest)
                self.last_attempt = m.attempt

    # ------------------------------------------------------------------ plan
    async def plan(
        self,
        *,
        snapshot: int | None,
        can_delta: bool,
        can_delta_after: bool,
        want_full: bool,
        error: Exception | None,
        next_version: int,
        last_version: int | None,
        run_id: str,
        adopt: Callable[[Attempt], Awaitable[None]],
        step: int | None = None,
    ) -> Plan:
        """Agree on the next attempt; raise PublishError if the group cannot (``error``, this
        rank's own reason not to publish, is raised after telling rank 0).

        ``can_delta_after``: whether this rank could diff if its unresolved attempt turns out
        committed. ``next_version``, ``last_version``, ``run_id`` count on rank 0 only. ``adopt``
        is awaited with the unresolved attempt when the plan says that it was committed. ``step``:
        the caller's step, the round's key (None: rounds are paired by count)."""
        u = self.unresolved
        hello: Message = {
            "snapshot": snapshot,
            "can_delta": can_delta,
            "pending": None
            if u is None
            else {"version": u.version, "attempt": u.attempt, "can_delta": can_delta_after},
            "want_full": want_full,
            "config": self.config,
            "error": None if error is None else str(error),
            "producer": f"{socket.gethostname()}:{os.getpid()}",
        }

        async def decide(hellos: list[Message | None]) -> Message:
            return self._decide_plan(hellos, next_version, last_version, run_id)

        try:
            key = None if step is None else step_key(step)
            res = await self.coordinator.exchange("plan", key, hello, decide)
        except CoordinationError as exc:  # its own words: a transport's failure, an odd round
            if error is not None:
                raise error from exc
            raise PublishError(
                f"{exc}; nothing was published by this attempt", ranks=(0,) if self.rank else ()
            ) from exc
        attempt = res.get("attempt")
        beat: contextlib.AbstractAsyncContextManager[None] = contextlib.nullcontext()
        if isinstance(attempt, str) and not res.get("error"):  # rank 0 now waits for our part
            beat = self.coordinator.heartbeat(attempt)
        try:
            async with beat:  # an adoption's copy may take long: this rank is alive meanwhile
                await self._resolve(res.get("last_attempt"), adopt)
        except asyncio.CancelledError:  # the others go on to the commit: tell them
            if isinstance(attempt, str) and not res.get("error") and error is None:
                await self._abandon(res.get("version"), attempt)
            raise
        if error is not None:
            raise error
        if res.get("error"):
            raise PublishError(str(res["error"]), ranks=tuple(res.get("ranks") or ()))
        try:
            return Plan(
                version=int(res["version"]),
                attempt=str(res["attempt"]),
                delta=bool(res["delta"]),
                full=bool(res["full"]),
                run_id=str(res["run_id"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise PublishError(f"rank {self.rank}: malformed plan from rank 0: {res!r}") from exc

    def _decide_plan(
        self,
        hellos: list[Message | None],
        next_version: int,
        last_version: int | None,
        run_id: str,
    ) -> Message:
        last = {"last_attempt": self.last_attempt}  # every answer resolves missed outcomes

        def refuse(ranks: list[int], why: str) -> Message:
            return {**last, "ranks": ranks, "error": f"{why}; nothing was published"}

        silent = [r for r, h in enumerate(hellos) if h is None]
        if silent:
            return refuse(silent, f"ranks {silent} did not join the publish of v{next_version} "
                          "in time (slow to call publish, or not running)")  # fmt: skip
        ready = [h for h in hellos if h is not None]
        failed = [(r, h["error"]) for r, h in enumerate(ready) if h.get("error")]
        if failed:
            return refuse([r for r, _ in failed], "; ".join(f"rank {r}: {e}" for r, e in failed))
        odd = [r for r, h in enumerate(ready) if h.get("config") != self.config]
        if odd:
            return refuse(odd, f"ranks {odd} are configured differently from rank 0 "
                          f"({self.config}): give every rank the same options")  # fmt: skip

        def holds(h: Message) -> tuple[int | None, bool]:
            """(version of the rank's snapshot, can it diff against it) once resolved."""
            p = h.get("pending")
            if p and self.last_attempt is not None and p.get("attempt") == self.last_attempt:
                return p.get("version"), bool(p.get("can_delta"))
            return h.get("snapshot"), bool(h.get("can_delta"))

        delta = last_version is not None and next_version == last_version + 1
        delta = delta and all(holds(h) == (last_version, True) for h in ready)
        due = self.keyframe_interval > 0 and next_version % self.keyframe_interval == 0
        full = not delta or due or any(h.get("want_full") for h in ready)
        attempt = secrets.token_hex(6)
        plan = {"version": next_version, "attempt": attempt, "delta": delta, "full": full}
        return {**last, **plan, "run_id": run_id}

    async def _resolve(
        self, last_attempt: object, adopt: Callable[[Attempt], Awaitable[None]]
    ) -> None:
        u, self.unresolved = self.unresolved, None
        if isinstance(last_attempt, str):
            self.last_attempt = last_attempt
        if u is None:
            return
        if u.attempt == last_attempt:
            logger.warning(
                "rank %d: version %d (attempt %s), whose outcome this rank missed, was "
                "committed: advancing the snapshot to it", self.rank, u.version, u.attempt,
            )  # fmt: skip
            await adopt(u)
        else:
            logger.warning(
                "rank %d: version %d (attempt %s), whose outcome this rank missed, was not "
                "committed: dropping its changes", self.rank, u.version, u.attempt,
            )  # fmt: skip

    # ------------------------------------------------------------------ commit
    async def commit(
        self,
        plan: Plan,
        vdir: Path,
        part: PartRecord | BaseException,
        pending: Attempt | None,
        *,
        algorithm: str,
        commit_merged: CommitMerged,
    ) -> Manifest:
        """Report this rank's part (or its failure) and learn the outcome.

        Returns the committed manifest, or raises: PublishError when the attempt failed (rank 0
        has removed the version directory), OutcomeUnknown when this rank could not learn the
        outcome (``pending`` is kept for the next plan to resolve). On rank 0, once the manifest
        is renamed into place nothing removes the version: a failure to tell the others is
        logged (they resolve it at the next plan) and the manifest returned. (The publisher
        defers a cancellation that arrives after the rename until this returns.)
        """
        if isinstance(part, BaseException) and not isinstance(part, Exception):
            try:
                if isinstance(part, asyncio.CancelledError):  # the others would wait: tell them
                    await self._abandon(plan.version, plan.attempt)
            finally:  # (cancelled again meanwhile too)
                if self.is_committer:  # leave nothing behind
                    await _remove_uncommitted(vdir)
            raise part
        message: Message = {"version": plan.version, "attempt": plan.attempt}  # the round
        if isinstance(part, BaseException):
            message["error"] = f"{type(part).__name__}: {first_error(part)}"
        else:
            try:
                # this rank's shard renames are durable
                await asyncio.to_thread(partial(fsync_dir, vdir, root=vdir.parent))
                data = part.to_json().encode()
                path = vdir / part_file_name(self.rank, plan.attempt)
                await asyncio.to_thread(partial(atomic_write, path, data, root=vdir.parent))
                message["part"] = part_file_name(self.rank, plan.attempt)
            except OSError as exc:
                message["error"] = f"writing its part record failed: {exc!r}"
        committed: list[Manifest] = []

        async def decide(msgs: list[Message | None]) -> Message:
            assert isinstance(part, PartRecord)  # rank 0 with an error decides "failed" first
            # a message of another round is no message (one without a round is the transport's)
            msgs = [None if m is not None and _round(m) not in (_round(message), (None, None))
                    else m for m in msgs]  # fmt: skip
            try:
                m = await self._merge_and_commit(plan, vdir, part, msgs, algorithm, commit_merged)
            except Exception as exc:
                err = first_error(exc)
                logger.error("rank 0: committing version %d failed: %r", plan.version, err)
                why = f"committing version {plan.version} failed: {err}"
                # a ConfigError is the ranks' parts not fitting together: no one rank to blame
                blame = [] if isinstance(err, ConfigError) else [0]
                return {"committed": False, "ranks": blame, "error": why}
            if m is None:
                return await self._failure(plan, vdir, msgs)
            committed.append(m)
            self.last_attempt = plan.attempt  # before any other await: the version exists
            return {"committed": True, "manifest": m.to_json()}

        async def decide_failed(msgs: list[Message | None]) -> Message:
            return await self._failure(plan, vdir, msgs)

        def own_failure() -> PublishError:
            return PublishError(
                f"rank {self.rank}: publishing version {plan.version} failed: "
                f"{message['error']}; nothing was committed and the snapshot is unchanged",
                ranks=(self.rank,),
            )

        try:
            res = await self.coordinator.exchange(
                "commit", plan.attempt, message, decide_failed if "error" in message else decide
            )
        except Exception as exc:  # CoordinationError, or any failure of the transport
            if committed:  # rank 0, after the rename: the version stands
                logger.error(
                    "rank 0: version %d is committed, but telling the other ranks failed "
                    "(%r); they resolve it at the next plan", plan.version, exc,
                )  # fmt: skip
                res = {"committed": True}
            elif self.is_committer:  # nothing was renamed: undo
                await _remove_uncommitted(vdir)
                raise PublishError(
                    f"rank 0: the commit exchange of version {plan.version} failed ({exc!r}); "
                    "the version was removed and every rank keeps its snapshot"
                ) from exc
            elif "error" in message:  # rank 0 cannot commit without this rank's part
                raise own_failure() from exc
            else:
                if pending is not None:
                    self.unresolved = _kept(pending)
                raise OutcomeUnknown(
                    f"rank {self.rank}: could not learn whether version {plan.version} "
                    f"(attempt {plan.attempt}) was committed ({exc}); the snapshot is unchanged "
                    "and the next publish resolves it",
                    ranks=(0,),
                ) from exc
        except BaseException:  # cancelled before the rename (the publisher defers later ones)
            if self.is_committer and not committed:
                await _remove_uncommitted(vdir)
            elif not self.is_committer and pending is not None and "error" not in message:
                self.unresolved = _kept(pending)  # rank 0 may commit it: the next plan tells
            raise
        if self.is_committer:
            if committed:
                await finish_thread(_remove_unnamed, vdir, committed[0])
                return committed[0]
            await _remove_uncommitted(vdir)
        elif res.get("committed"):
            self.last_attempt = plan.attempt
            try:
                return Manifest.from_json(
                    str(res["manifest"]), where=f"v{plan.version} from rank 0"
                )
            except (KeyError, AsyncSyncError) as exc:
                if pending is not None:
                    self.unresolved = _kept(pending)
                raise OutcomeUnknown(f"rank {self.rank}: unreadable commit result: {exc}") from exc
        blamed = tuple(res.get("ranks") or ())
        if isinstance(part, BaseException) and (not blamed or self.rank in blamed):
            raise own_failure() from part
        if isinstance(part, BaseException):  # rank 0 gave up first (cancelled): both reasons
            raise PublishError(
                f"{res.get('error')}; rank {self.rank}'s own part failed too: {message['error']}",
                ranks=tuple(sorted({*blamed, self.rank})),
            ) from part
        raise PublishError(str(res.get("error")), ranks=blamed)

    async def _abandon(self, version: object, attempt: str) -> None:
        """This rank's call was cancelled before the commit exchange of ``attempt``: tell the
        others (:meth:`Coordinator.abandon`), so that they fail it at once naming this rank
        instead of waiting for it until the timeout."""
        why = f"its publish call was cancelled before it reported its part of v{version}"
        message: Message = {"version": version, "attempt": attempt, "error": why}
        try:
            await self.coordinator.abandon("commit", attempt, message)
        except Exception as exc:  # the others find this rank silent after the timeout
            logger.warning("rank %d: telling the others of the cancel failed: %r", self.rank, exc)

    async def _failure(self, plan: Plan, vdir: Path, msgs: Sequence[Message | None]) -> Message:
        """The failure result naming the ranks that failed or sent nothing."""
        silent = [r for r, m in enumerate(msgs) if m is None]
        # a broken transport hears from nobody: blame the ranks whose part record is missing,
        # once those still writing theirs had the coordinator's grace to finish
        deadline = time.monotonic() + self.coordinator.broken_grace
        while True:
            absent = [r for r in silent if not _exists(vdir / part_file_name(r, plan.attempt))]
            if not absent or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.05)
        silent = absent or silent
        failed = [(r, m["error"]) for r, m in enumerate(msgs) if m is not None and "error" in m]
        why = [f"rank {r} failed: {e}" for r, e in failed]
        if silent:
            why.insert(0, f"ranks {silent} went silent: {self.coordinator.silence}")
        return {
            "committed": False,
            "ranks": sorted({*silent, *(r for r, _ in failed)}),
            "error": f"version {plan.version} (attempt {plan.attempt}) was not committed: "
            + "; ".join(why)
            + "; every rank keeps its snapshot, the next publish retries",
        }

    async def _merge_and_commit(
        self,
        plan: Plan,
        vdir: Path,
        own: PartRecord,
        msgs: Sequence[Message | None],
        algorithm: str,
        commit_merged: CommitMerged,
    ) -> Manifest | None:
        """Rank 0: read every part record, merge them, commit. None: a rank failed."""
        if any(m is None or "error" in m for m in msgs):
            return None
        records = [own]
        for r in range(1, self.world_size):
            path = vdir / part_file_name(r, plan.attempt)
            data = await asyncio.to_thread(
                partial(read_bytes, path, limit=256 << 20, root=vdir.parent)
            )
            rec = PartRecord.from_json(data, where=str(path))
            if (rec.version, rec.attempt, rec.rank, rec.run_id) != (
                plan.version, plan.attempt, r, plan.run_id
            ):  # fmt: skip
                raise PublishError(f"{path} belongs to another attempt, rank or run")
            records.append(rec)
        entries, shards = merge([(r.tensors, r.shards) for r in records], algorithm)
        producer = {"world_size": self.world_size, "ranks": [r.producer for r in records]}
        return await commit_merged(entries, shards, sum(r.raw_bytes for r in records), producer)


def _kept(a: Attempt) -> Attempt:
    """``a`` made independent of the caller's tensors (whole-tensor updates reference them)."""
    ups = [
        u if u.positions is not None else replace(u, values=codec.raw_clone(u.values))
        for u in a.updates
    ]
    return replace(a, updates=ups)


def _round(m: Message) -> tuple[object, object]:
    return m.get("version"), m.get("attempt")


async def _remove_uncommitted(vdir: Path) -> None:
    """Remove the directory of a version that was not committed; never one with a manifest."""

    def remove() -> None:
        if _exists(vdir / MANIFEST_NAME):
            logger.error("%s holds a manifest: it is committed and stays", vdir)
            return
        with contextlib.suppress(OSError):  # never through a symlink (fsio)
            fsio.remove_tree(vdir, root=vdir.parent)

    await finish_thread(remove)  # to its end, however often cancelled: a retry claims vdir


def _remove_unnamed(vdir: Path, m: Manifest) -> None:
    """After a commit: remove part records and files of failed attempts (best effort)."""
    keep = {MANIFEST_NAME, *(s.file for s in m.shards)}
    try:
        names = [name for name, _ in fsio.scan(vdir, root=vdir.parent)]
    except OSError:
        return
    for name in names:
        if name not in keep:
            with contextlib.suppress(OSError):
                fsio.remove(vdir / name, root=vdir.parent)


def _exists(path: Path) -> bool:
    """Whether an entry is at ``path`` (in a version directory; nothing is followed)."""
    try:
        return fsio.lstat(path, root=path.parent.parent) is not None
    except OSError:
        return True
