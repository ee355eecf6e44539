"""Who commits a version: the publisher alone, or rank 0 of a group for every rank.

The :class:`~asyncsync.publish.publisher.Publisher` runs one pipeline (diff, encode, write) for
every version. What differs between a single publisher and one rank of a multi-rank trainer is
how a version's round begins (which version, delta or full) and how it ends (commit, or report
a part to rank 0 and learn the outcome). That is a *committer*, given to the publisher:

* :class:`SoloCommitter`: the publisher decides alone and commits its own manifest.
* :class:`RankedCommitter`: the ranks agree on a plan (:mod:`asyncsync.publish.group`), each
  writes its shards and part record, and rank 0 merges the parts into one manifest.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import torch

from asyncsync.codec.shards import PendingUpdate
from asyncsync.errors import ConfigError, PublishError
from asyncsync.format import Manifest, ShardInfo, TensorEntry
from asyncsync.fsio import FileLock
from asyncsync.publish.commit import discard
from asyncsync.publish.distributed import Coordinator
from asyncsync.publish.group import Attempt, Plan, RankGroup
from asyncsync.publish.merge import PartRecord, TensorSlice, check_state_dict, merge, schema_of

__all__ = ["Committer", "RankedCommitter", "Round", "SoloCommitter", "Written"]

logger = logging.getLogger(__name__)

CommitMerged = Callable[
    [tuple[TensorEntry, ...], tuple[ShardInfo, ...], int, dict[str, Any]], Awaitable[Manifest]
]


@dataclass(frozen=True)
class Round:
    """One version's publish as the committer set it up."""

    version: int
    delta: bool
    full: bool
    slices: dict[str, TensorSlice]
    prefix: str = ""  # of this process's shard file names
    shared_dir: bool = False  # other processes write into the version directory too
    refuse: str | None = None  # raised inside the pipeline, so that the group learns it
    plan: Plan | None = None
    schema: dict[str, Any] = field(default_factory=dict)

    @property
    def attempt(self) -> str | None:
        return self.plan.attempt if self.plan is not None else None


@dataclass(frozen=True)
class Written:
    """What the pipeline wrote for one round: the entries, shards and what the snapshot needs,
    or the ``error`` that stopped it (then ``entries`` is empty)."""

    names: list[str]
    entries: tuple[TensorEntry, ...]
    shards: tuple[ShardInfo, ...]
    raw_bytes: int
    pending: list[PendingUpdate]
    sums: dict[str, str]
    producer: dict[str, Any]
    error: BaseException | None = None


class PublisherView(Protocol):
    """What a committer reads of its publisher."""

    stale: list[str]  # tensors whose snapshot is not what was shipped: the next is a keyframe

    @property
    def mode(self) -> str: ...
    @property
    def keyframe_interval(self) -> int: ...
    @property
    def next_version(self) -> int: ...
    @property
    def last_version(self) -> int | None: ...
    @property
    def has_snapshot(self) -> bool: ...
    @property
    def run_id(self) -> str: ...
    def same_schema(
        self, state_dict: Mapping[str, torch.Tensor], slices: Mapping[str, TensorSlice]
    ) -> bool: ...
    def schema_changes(self, state_dict: Mapping[str, torch.Tensor]) -> str: ...
    def set_round(self, run_id: str, next_version: int) -> None: ...
    async def adopt(self, a: Attempt) -> None: ...


class Committer(Protocol):
    """How a publisher's rounds begin and end (see the module docstring)."""

    rank: int
    ranked: bool  # one rank of a group
    is_committer: bool  # commits manifests, appends the log, runs retention

    async def open(self, root: Path, latest: int | None, lock: FileLock | None = None) -> None:
        """Start at ``latest`` in ``root``; ``lock``: the publisher's, held (its file names
        this rank's token)."""

    async def begin(
        self,
        pub: PublisherView,
        state_dict: Mapping[str, torch.Tensor],
        slices: Mapping[str, TensorSlice] | None,
        *,
        keyframe: bool,
        base: bool,
        step: int | None = None,
        abstain: Exception | None = None,
    ) -> Round: ...
    async def finish(
        self,
        rnd: Round,
        vdir: Path,
        written: Written,
        stage: list[str],
        checksum: str,
        commit_merged: CommitMerged,
    ) -> Manifest: ...
    async def end(self) -> None: ...
    def describe(self) -> str: ...


class SoloCommitter:
    """A publisher that is the only writer of its root."""

    rank = 0
    ranked = False
    is_committer = True

    async def open(self, root: Path, latest: int | None, lock: FileLock | None = None) -> None:
        return None

    async def begin(
        self,
        pub: PublisherView,
        state_dict: Mapping[str, torch.Tensor],
        slices: Mapping[str, TensorSlice] | None,
        *,
        keyframe: bool,
        base: bool,
        step: int | None = None,
        abstain: Exception | None = None,
    ) -> Round:
        """Seed (``base=False``) or publish: a full version, or a delta against the snapshot.
        ``abstain``: raised (a publisher alone has nobody to tell)."""
        if abstain is not None:
            raise abstain
        sl = check_state_dict(state_dict, slices)
        if not state_dict:  # (a rank of a group may hold none of the tensors)
            raise ConfigError(
                "the state dict is empty: a version without tensors would leave every engine "
                "with none (a filter that matched nothing?); pass the model's tensors"
            )
        version = pub.next_version
        if not base or pub.mode == "full":  # no snapshot needed: the version is complete
            return Round(version, delta=False, full=True, slices=sl)
        if not pub.has_snapshot:
            raise PublishError(
                "no snapshot of the root's newest version to diff against (nothing published "
                "by this publisher yet, or the root moved on while it was closed): call seed() "
                "first"
            )
        if not pub.same_schema(state_dict, sl):
            logger.warning(
                "v%d: the tensor set changed (%s): publishing a full version; receivers "
                "re-initialise from it", version, pub.schema_changes(state_dict),
            )  # fmt: skip
            return Round(version, delta=False, full=True, slices=sl)
        if pub.stale:  # receivers hold what was shipped, not the snapshot: no delta from it
            return Round(version, delta=False, full=True, slices=sl)
        due = pub.keyframe_interval > 0 and version % pub.keyframe_interval == 0
        return Round(version, delta=True, full=keyframe or due, slices=sl)

    async def finish(
        self,
        rnd: Round,
        vdir: Path,
        written: Written,
        stage: list[str],
        checksum: str,
        commit_merged: CommitMerged,
    ) -> Manifest:
        """Commit the version, or remove its directory and raise PublishError."""
        try:
            if written.error is not None:
                raise written.error
            merged = merge([(written.entries, written.shards)], checksum)  # slices must tile
            return await commit_merged(*merged, written.raw_bytes, {})
        except BaseException as exc:
            await discard(vdir, exc, rnd.version, stage[0])  # the step in flight then

    async def end(self) -> None:
        return None

    def describe(self) -> str:
        return ""


class RankedCommitter:
    """One rank of a group of publishers that commit each version in one manifest."""

    ranked = True

    def __init__(
        self, coordinator: Coordinator, config: dict[str, Any], keyframe_interval: int
    ) -> None:
        self.group = RankGroup(coordinator, config, keyframe_interval)
        self.rank = self.group.rank
        self.is_committer = self.group.is_committer
        self._beating = AsyncExitStack()  # this rank's heartbeat, from the plan to end()
        self._lock: FileLock | None = None  # the publisher's (this rank's file)
        self._held = 0  # tensors of this rank in the last version it knows committed

    async def open(self, root: Path, latest: int | None, lock: FileLock | None = None) -> None:
        self._lock = lock
        await self.group.open(root, latest)

    async def _check_lock(self) -> None:
        """Raise PublishError when this rank's lock file is no longer the one its publisher
        holds (the root wiped under it): another process may be this rank now, and a message
        of ours would stand for its weights (or overwrite its message)."""
        lock = self._lock
        if lock is not None and not await asyncio.to_thread(lock.intact):
            raise PublishError(
                f"rank {self.rank}: {lock.path} is no longer the lock file this publisher holds "
                "(the root was wiped, or the file removed or replaced): another process may be "
                f"rank {self.rank} now; this one takes no part. Close this publisher",
                ranks=(self.rank,),
            )

    async def begin(
        self,
        pub: PublisherView,
        state_dict: Mapping[str, torch.Tensor],
        slices: Mapping[str, TensorSlice] | None,
        *,
        keyframe: bool,
        base: bool,
        step: int | None = None,
        abstain: Exception | None = None,
    ) -> Round:
        """Agree on the attempt's plan. ``base``: diff against the snapshot if every rank can
        (False for seed). A rank without a snapshot (restarted) makes the group publish full.
        ``step``: the caller's, the plan round's key. ``abstain``: this rank's reason not to
        publish: told to rank 0, which fails the round on every rank, then raised here."""
        await self._check_lock()  # before any message: an orphaned rank sends none
        group = self.group
        error: Exception | None = abstain
        try:
            sl = check_state_dict(state_dict, slices)
        except ConfigError as exc:  # told to rank 0 so that the group fails fast, then raised
            sl, error = {}, exc
        if abstain is not None:
            sl, error = {}, abstain
        elif error is None and not state_dict and self._held:  # a filter that matched nothing?
            error = ConfigError(
                f"the state dict is empty, and this rank's last version held {self._held} "
                "tensors: a version without them would leave every engine without them; pass "
                "this rank's tensors"
            )
        elif error is None and pub.has_snapshot and not pub.same_schema(state_dict, sl):
            logger.warning(
                "rank %d: the tensor set changed (%s): the group publishes a full version; "
                "receivers re-initialise from it", self.rank, pub.schema_changes(state_dict),
            )  # fmt: skip
        ok = base and error is None and pub.mode == "delta"
        u = group.unresolved

        async def adopt(a: Attempt) -> None:  # the attempt whose outcome it missed: committed
            self._count(a.names)
            await pub.adopt(a)

        schema = schema_of(state_dict, sl) if error is None else {}
        plan = await group.plan(
            snapshot=pub.last_version if pub.has_snapshot else None,
            # a stale snapshot is not what receivers hold: a delta from it (even a keyframe's)
            # would not apply, and every receiver re-seeds; the group publishes full instead
            can_delta=ok and pub.has_snapshot and not pub.stale and pub.same_schema(state_dict, sl),
            can_delta_after=ok and u is not None and u.schema == schema,
            want_full=keyframe or bool(pub.stale),  # its snapshot is not what it shipped
            error=error,
            next_version=pub.next_version,
            last_version=pub.last_version,
            run_id=pub.run_id,
            adopt=adopt,
            step=step,
        )
        pub.set_round(plan.run_id, plan.version)
        await self._beating.enter_async_context(group.coordinator.heartbeat(plan.attempt))
        refuse = None
        if plan.delta and pub.last_version != plan.version - 1:
            refuse = f"rank {self.rank} holds v{pub.last_version}, not v{plan.version - 1}"
        elif plan.delta and pub.stale:  # the adoption's copy failed (a keyframe's delta too)
            refuse = (
                f"rank {self.rank}: its snapshot could not be brought up to v{pub.last_version}, "
                "whose outcome it had missed (see its log): no delta is diffed against it; "
                "the next version is a keyframe"
            )
        return Round(
            plan.version,
            delta=plan.delta,
            full=plan.full,
            slices=sl,  # checked above: plan() raised if it was not valid
            prefix=plan.shard_prefix(self.rank),
            shared_dir=True,
            refuse=refuse,
            plan=plan,
            schema=schema,
        )

    async def finish(
        self,
        rnd: Round,
        vdir: Path,
        written: Written,
        stage: list[str],
        checksum: str,
        commit_merged: CommitMerged,
    ) -> Manifest:
        """Report this rank's part record (or its failure) and learn the outcome."""
        plan = rnd.plan
        assert plan is not None
        part: PartRecord | BaseException
        if written.error is None:
            try:  # the root may have been wiped since the plan
                await self._check_lock()
            except PublishError as exc:
                written = replace(written, error=exc)
        if written.error is not None:
            part = written.error
        else:
            part = PartRecord(
                rnd.version, plan.attempt, self.rank, plan.run_id, written.shards,
                written.entries, written.raw_bytes, {"rank": self.rank, **written.producer},
            )  # fmt: skip
        attempt = Attempt(
            rnd.version, plan.attempt, written.names, written.pending, written.sums,
            rnd.slices, rnd.schema,
        )  # fmt: skip
        m = await self.group.commit(
            plan, vdir, part, attempt, algorithm=checksum, commit_merged=commit_merged
        )
        self._count(written.names)
        return m

    def _count(self, names: list[str]) -> None:
        """A version holding this rank's ``names`` was committed."""
        self._held = len(names)

    async def end(self) -> None:
        """The round is over (committed or not): stop the heartbeat."""
        await self._beating.aclose()

    def describe(self) -> str:
        return f" rank={self.group.rank}/{self.group.world_size}"
