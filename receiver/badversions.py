"""Bad versions: what a receiver does past a version it cannot take (FORMAT.md section 8).

A version is *bad* for a receiver when, after the bounded re-reads that cover a network
filesystem showing a file before its bytes, it is still damaged (a shard missing, short, of
the wrong size or failing its checksum; a shard header naming another version; a manifest
that does not parse), or when it names other tensors than the engine holds. The receiver then:

1. marks it bad (per run; reported in ``AgentStatus.bad_versions``, the ack's
   ``bad_versions``, ``/metrics`` and the log);
2. goes on from the newest keyframe past it, so one damaged version never stalls it;
3. with no keyframe past it, stays at its version, says why, and on each sync tries the version
   once more (no re-read window: it may have been repaired) and looks for a keyframe again.

:class:`BadVersions` holds the marks and plans a receiver's next step around them. Its
methods block (manifest reads); the agent calls them through ``asyncio.to_thread``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

from asyncsync.errors import ManifestError, ManifestUnreadable
from asyncsync.format import ROOT_INFO_NAME, Manifest, manifest_path
from asyncsync.format.store import ManifestCache, list_versions, read_root_info
from receiver.engines.base import EngineState
from receiver.plan import Mode, keyframe_after, keyframes_in, plan_next

__all__ = ["MAX_BAD_KEPT", "BadVersions"]

logger = logging.getLogger(__name__)

MAX_BAD_KEPT = 16  # bad versions remembered (and reported) per run


class BadVersions:
    """The bad versions of the root's current run, and planning past them."""

    def __init__(self, root: Path, engine_id: str, verify_deadline: float):
        self.root = root
        self.engine_id = engine_id
        self.verify_deadline = verify_deadline
        self.manifests = ManifestCache()
        self.marks: dict[int, str] = {}  # version -> why (the newest MAX_BAD_KEPT: reported)
        # every version found bad during the sync in progress, however many: planning skips
        # them all, so a sync never tries one twice (with more bad versions than marks kept, a
        # mark evicted at once would otherwise be planned, tried and marked again forever)
        self.tried: set[int] = set()
        self.run: str | None = None
        self.root_run: str | None = None  # asyncsync.json's run id, re-read on a mismatch
        self.waiting: str | None = None  # why the last sync stayed where it was
        self.waiting_on: tuple[int, str] | None = None  # (the bad version, what follows it)
        # marked in this sync and not yet logged: each is said once, in one line with what
        # the receiver does about it (goes on from a keyframe, stays), when that is known
        self.unsaid: dict[int, str] = {}

    def __contains__(self, version: object) -> bool:
        return version in self.marks

    def versions(self) -> tuple[int, ...]:
        return tuple(sorted(self.marks))

    def begin_sync(self) -> None:
        """A new sync: versions found bad by the last one are tried again unless still marked."""
        self.tried = set()

    def skip(self) -> set[int]:
        """The versions planning goes past: marked, or found bad during this sync."""
        return set(self.marks) | self.tried

    def for_run(self, run_id: str) -> None:
        """Marks are per run: a new run in the root starts with none."""
        if self.run is not None and self.run != run_id:
            self.marks, self.tried = {}, set()
        self.run = run_id

    def mark(self, version: int, exc: BaseException) -> None:
        if version not in self.marks:
            self.unsaid[version] = f"{type(exc).__name__}: {exc}"
        self.marks[version] = f"{type(exc).__name__}: {exc}"
        self.tried.add(version)
        while len(self.marks) > MAX_BAD_KEPT:
            del self.marks[min(self.marks)]

    def cleared(self, version: int) -> None:
        """``version`` was applied after all (repaired): no longer bad."""
        self.tried.discard(version)
        self.say(version)
        if self.marks.pop(version, None) is not None:
            logger.info("agent %s: v%d was bad and is now applied", self.engine_id, version)

    def patience(self, version: int) -> float:
        """Seconds to re-read a version's files: none for a version already known bad."""
        return 0.0 if version in self.marks or version in self.tried else self.verify_deadline

    def say(self, version: int, then: str = "") -> bool:
        """Log ``version`` as bad, with ``then`` (what the receiver does about it): at ERROR
        with why when it was marked in this sync, else at WARNING. True when why was said."""
        why = self.unsaid.pop(version, None)
        if why is None:
            if then:
                logger.warning("agent %s: v%d is bad%s", self.engine_id, version, then)
            return False
        logger.error("agent %s: v%d is bad (%s)%s", self.engine_id, version, why, then)
        return True

    def say_rest(self) -> None:
        """Log the versions marked in this sync and gone past without a word (at its end)."""
        for version in sorted(self.unsaid):
            self.say(version)

    def wait(self, version: int, then: str) -> None:
        """Record why a receiver stays where it is: ``version`` is bad, and ``then``."""
        self.waiting, self.waiting_on = f"v{version} is bad{then}", (version, then)

    # -- reading and planning (blocking) ----------------------------------------------------
    def read(self, root: Path, version: int) -> Manifest:
        """A manifest (cached); one that does not parse is re-read until ``verify_deadline``,
        then marked bad and its ManifestError raised. One that parses but breaks a rule is
        marked bad at once: a file renamed into place never shows another complete object."""
        deadline, delay = time.monotonic() + self.patience(version), 0.05
        while True:
            try:
                return self._of_the_root(self.manifests.get(root, version))
            except ManifestError as exc:
                if not isinstance(exc, ManifestUnreadable) or time.monotonic() >= deadline:
                    self.mark(version, exc)
                    raise
                time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
                delay = min(delay * 2, 1.0)

    def _of_the_root(self, m: Manifest) -> Manifest:
        """``m``, or ManifestError when its run id is not the root's (``asyncsync.json``): a
        manifest copied in from another root, or a damaged one, is refused by name. Taken for
        the root's chain it made the receiver say what did not happen ("version N is missing",
        "the root is run X: re-seeding"). The root record is re-read on a mismatch: it is
        written before a new run's first manifest (a root wiped and published into again)."""
        if m.run_id == self.root_run:
            return m
        try:
            info = read_root_info(self.root)
        except (OSError, ManifestError):  # no verdict without the record: FORMAT.md 11.4
            return m
        self.root_run = None if info is None else info.run_id
        if self.root_run is None or m.run_id == self.root_run:
            return m
        raise ManifestError(
            f"{manifest_path(self.root, m.version)} names run {m.run_id}, but the root's run "
            f"is {self.root_run} ({ROOT_INFO_NAME}): refused (a manifest copied from another "
            "root, or damaged)"
        )

    def newest_readable(self, found: int) -> tuple[Manifest | None, ManifestError | None]:
        """The newest committed version at or below ``found`` whose manifest reads, and the
        error of the newest one when it does not.

        The versions tried are the ``MAX_BAD_KEPT`` numbers below ``found`` (found by exact
        probes where a listing lags) and the listed ones below those: a damaged version far
        past the others (a directory planted at the last version number) is gone past to the
        newest one that reads, not taken for the end of the chain."""
        first: ManifestError | None = None
        window = range(found, max(found - MAX_BAD_KEPT, 0) - 1, -1)

        def candidates() -> Iterator[int]:
            yield from window
            # the root is listed only when the window holds nothing readable (every sync
            # comes here: the listing latest_version made is not scanned again for nothing)
            yield from (v for v in reversed(list_versions(self.root)) if v < window[-1])

        unreadable = 0
        for v in candidates():
            try:
                return self.read(self.root, v), first
            except FileNotFoundError:
                continue
            except ManifestError as exc:
                first = first or exc
                unreadable += 1
                if unreadable > MAX_BAD_KEPT:
                    break
        return None, first

    def keyframe_after(self, version: int, latest: int) -> Manifest | None:
        return keyframe_after(self.root, version, latest, self.read, self.skip(), self.run)

    def plan(self, state: EngineState, latest: int) -> tuple[Manifest, Mode]:
        """The next step toward ``latest``: the newest keyframe past a bad next version, else
        what :func:`receiver.plan.plan_next` says. Re-raises the ManifestError (and records
        why, :attr:`waiting`) when the next version's manifest is damaged and no keyframe
        follows it."""
        cur = state.version
        if cur is not None and cur + 1 in self.skip():
            kf = self.keyframe_after(cur + 1, latest)
            if kf is not None:
                self.say(cur + 1, f": going on from keyframe v{kf.version}")
                return kf, "full"
        try:
            return plan_next(self.root, state, latest, self.read, self.skip(), self.run)
        except ManifestError:  # the next version's manifest is damaged (now marked)
            if cur is None:
                raise
            kf = self.keyframe_after(cur + 1, latest)
            if kf is None:
                self.stuck(cur + 1, cur)
                raise
            self.say(cur + 1, f": going on from keyframe v{kf.version}")
            return kf, "full"

    def can_go_past(self, version: int, cur: int | None, latest: int) -> bool:
        """Whether a receiver at ``cur`` has a way around the bad ``version``: a keyframe past
        it, or (an empty engine) any keyframe that is not bad. Records why not."""
        if cur is None:
            if keyframes_in(self.root, 0, latest, self.run, self.read, self.skip()) is not None:
                return True
            self.wait(version, " and no other keyframe is readable")
            return False
        if self.keyframe_after(version, latest) is not None:
            return True
        self.stuck(version, cur)
        return False

    def stuck(self, version: int, cur: int) -> None:
        """Record why a receiver stays at ``cur``: ``version`` is bad, nothing follows it."""
        self.wait(
            version,
            f" and no keyframe follows it yet: the engine stays at v{cur} and goes on from "
            "the next keyframe as soon as one is published",
        )
