"""Retention: delete old versions without ever taking one a live engine still needs.

What is always kept:

* the newest keyframe and every version after it (the chain any engine can start from);
* every version after the one a *live* engine acknowledged (it will replay them), where live
  means its ack was written, or its lease renewed, less than ``ack_ttl`` seconds ago, and not
  dated more than ``ack_ttl`` ahead (file
  mtimes against a freshly created file's; a receiver host's clock, in ``applied_at``, is
  never compared with ours), **or** its lease is seen renewed, or not yet seen unchanged for
  its ttl (FORMAT.md 7). On an object-store mount (rclone, s3fs, gcsfuse) the mtimes are the
  writers' clocks: a live engine whose clock runs more than ``ack_ttl`` behind looks silent by
  them, and only its lease's heartbeat, seen by this process on its own clock, tells. A
  one-shot ``collect`` (``asyncsync gc``) watches such leases until it knows (up to their ttl);
  the publisher's, after each commit, looks once per commit and keeps what it has not decided;
* every version while an ack that cannot be read may be live (whose version it holds is
  unknown): dated within ``ack_ttl`` of now by its mtime, or, when further either way, while
  its engine's lease is seen renewed or not yet seen unchanged for its ttl (as above);
* the newest ``keep_versions`` versions and, counting from the newest, as many versions as fit
  in ``keep_bytes`` (when set).

Everything older is deleted, oldest first. A version is deleted by removing its manifest first
(so readers stop seeing it at once), then its files and directory; a reader that was in the
middle of it gets a missing shard, refuses the version, and catches up from the keyframe.
Files of a registered external checkpoint (``shard_dir``) are never touched.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from dataclasses import dataclass, field
from operator import attrgetter
from pathlib import Path

from asyncsync import fsio
from asyncsync.errors import ManifestError, check_bytes, check_number, check_seconds
from asyncsync.format import ACKS_DIR, MANIFEST_NAME, check_engine_id, version_dir
from asyncsync.format.acks import ack_ages, read_acks, root_clock
from asyncsync.format.liveness import ChangeWatch, watch_leases
from asyncsync.format.log import trim_log
from asyncsync.format.store import ManifestFiles, list_versions
from asyncsync.fsio import fsync_dir

__all__ = ["GcReport", "ManifestKinds", "RetentionPolicy", "collect"]

logger = logging.getLogger(__name__)

#: what this process saw of the leases of engines whose acks look old, from one ``collect`` to
#: the next (the publisher's, after each commit, looks once each time)
_LEASES = ChangeWatch()


@dataclass(frozen=True)
class RetentionPolicy:
    """How much history a root keeps (see the module docstring for what is always kept).

    Args:
        keep_versions: keep at least the newest N versions (None: no count-based floor).
        keep_bytes: keep, from the newest, the versions whose cumulative size fits (None: no
            size-based floor). With both None only the protected versions survive.
        ack_ttl: seconds after which an engine's ack no longer pins versions (a dead engine
            must not keep the whole history); None: acks pin forever.
    """

    keep_versions: int | None = 10
    keep_bytes: int | None = None
    ack_ttl: float | None = 3600.0

    def __post_init__(self) -> None:
        check_number("keep_versions", self.keep_versions, integer=True, minimum=1, optional=True)
        check_bytes("keep_bytes", self.keep_bytes, optional=True)
        check_seconds("ack_ttl", self.ack_ttl, above=True, optional=True)


@dataclass(frozen=True)
class GcReport:
    deleted: tuple[int, ...]
    kept: tuple[int, ...]
    freed_bytes: int
    reasons: dict[int, str] = field(default_factory=dict)  # why each kept version is kept
    #: set when ack ages were measured on this host's clock (the root could not be written
    #: here for the clock probe): the sentence saying so
    clock: str | None = None


def _dir_bytes(root: Path, path: Path) -> int:
    """Bytes of the regular files in a version directory (0 for a symlink: never followed)."""
    try:
        entries = fsio.scan(path, root=root)
    except OSError:
        return 0
    return sum(st.st_size for _, st in entries if stat.S_ISREG(st.st_mode))


class ManifestKinds(ManifestFiles[str]):
    """Each version's kind (``full`` or ``delta``) as its manifest says, the manifest read and
    validated once per file (:class:`~asyncsync.format.store.ManifestFiles`): a publisher's
    :func:`collect` after each commit looks back to the newest keyframe, and parsing those
    manifests again at every commit was most of its cost (~100 ms a commit at 183 tensors and a
    keyframe every 20 versions, at 20,000 tensors seconds). Only the kinds are kept (a parsed
    manifest of many tensors is megabytes), and only of the versions the last :func:`collect`
    listed."""

    def __init__(self) -> None:
        super().__init__(attrgetter("kind"), None)


def collect(
    root: Path,
    policy: RetentionPolicy,
    *,
    dry_run: bool = False,
    watch: float = 0.0,
    kinds: ManifestKinds | None = None,
) -> GcReport:
    """Apply ``policy`` to ``root`` once. Blocking; safe to run beside a live publisher.

    ``watch``: seconds it may spend watching the leases of engines whose acks look older than
    ``ack_ttl`` for a heartbeat (``asyncsync gc``: :data:`WATCH_LIMIT`); 0 looks once, and an
    engine whose lease is not yet decided keeps its versions until a later ``collect`` knows.
    ``kinds``: the versions' kinds known from earlier calls (a publisher's, one per root)."""
    versions = list_versions(root)
    if kinds is None:
        kinds = ManifestKinds()
    kinds.keep_only(versions)
    if not versions:
        return GcReport((), (), 0)
    reasons: dict[int, str] = {}

    def keep(v: int, why: str) -> None:
        reasons.setdefault(v, why)

    newest_keyframe = None
    for v in reversed(versions):
        try:
            if kinds.get(root, v) == "full":
                newest_keyframe = v
                break
        except (FileNotFoundError, ManifestError) as exc:
            logger.warning("gc: cannot read version %d (%s); keeping it", v, exc)
            keep(v, "unreadable manifest")
    if newest_keyframe is None:
        for v in versions:
            keep(v, "no keyframe: the whole chain is needed")
    else:
        for v in versions:
            if v >= newest_keyframe:
                keep(v, "newest keyframe and its chain")
    unreadable: dict[Path, str] = {}
    acks = read_acks(root, unreadable)
    now, clock = root_clock(root)  # once (a probe file): the one write of a dry run
    if clock is not None:
        logger.info("gc %s: %s", root, clock)
    ages = ack_ages(root, acks, now)  # on the filesystem's clock: receivers' clocks may be wrong
    ttl = policy.ack_ttl
    # by the mtimes: more than ack_ttl old, or dated more than ack_ttl ahead (a dead engine
    # whose clock ran ahead pinned its versions until the file server's clock caught up)
    quiet = [e for e in acks if ttl is not None and max(ages[e].age, ages[e].ahead) > ttl]
    maybe = {path: _may_be_live(root, path, ttl, now) for path in unreadable}
    asked = {*quiet, *(e for e in maybe.values() if isinstance(e, str))}  # their leases tell
    heard = watch_leases(root, asked, wait=watch, watch=_LEASES) if asked else {}
    for path, live in maybe.items():  # whose version it pins is unknown: keep them all
        if live is True or (isinstance(live, str) and heard[live] is not False):
            why = unreadable[path]
            logger.warning("gc: %s cannot be read (%s); deleting nothing", path, why)
            for v in versions:
                keep(v, f"{path} cannot be read ({why}): the versions it pins are unknown")
            break
    for ack in acks.values():
        e = ack.engine_id
        if heard.get(e, True) is False:  # no lease, or seen unchanged for its ttl: not live
            continue
        looks = f"{ages[e].age:.0f}s old" if ages[e].age else f"dated {ages[e].ahead:.0f}s ahead"
        why = "" if e not in heard else (
            f" (its ack looks {looks}, but its lease "
            + ("renews: its clock is off)" if heard[e] else "is watched for a heartbeat)")
        )  # fmt: skip
        for v in versions:
            if v > ack.version:
                keep(v, f"engine {e} at {ack.version} needs it{why}")
    newest_first = list(reversed(versions))
    if policy.keep_versions is not None:
        for v in newest_first[: policy.keep_versions]:
            keep(v, f"within the newest {policy.keep_versions}")
    sizes = {v: _dir_bytes(root, version_dir(root, v)) for v in versions}
    if policy.keep_bytes is not None:
        used = 0
        for v in newest_first:
            used += sizes[v]
            if used > policy.keep_bytes:
                break
            keep(v, f"within {policy.keep_bytes} bytes")
    doomed = [v for v in versions if v not in reasons]
    freed = 0
    for v in doomed:
        freed += sizes[v]
        if not dry_run:
            _delete_version(root, v)
    if doomed and not dry_run:
        try:
            trim_log(root, min(reasons))  # the log lists the versions kept, not all ever made
        except OSError as exc:
            logger.warning("gc %s: could not trim the log: %s", root, exc)
    if doomed:
        logger.info(
            "gc %s: deleted %d versions (%d bytes)%s",
            root,
            len(doomed),
            freed,
            " [dry run]" if dry_run else "",
        )
    return GcReport(tuple(doomed), tuple(sorted(reasons)), freed, reasons, clock)


def _may_be_live(root: Path, path: Path, ack_ttl: float | None, now: float) -> bool | str:
    """Whether an ack file that cannot be read may be a live engine's: True when its mtime is
    within ``ack_ttl`` of ``now`` (``acks/`` always may); when further either way, the engine
    id its name gives, whose lease decides (its mtime is its writer's clock on object-store
    mounts: a live receiver whose clock runs behind dates it in the past, a dead one whose
    clock ran ahead in the future); False when it is gone, or further and its name is no
    engine id."""
    if path == root / ACKS_DIR or ack_ttl is None:
        return True
    try:
        mtime = os.lstat(path).st_mtime
    except FileNotFoundError:
        return False
    except OSError:
        return True
    if abs(now - mtime) <= ack_ttl:
        return True
    try:
        return check_engine_id(path.name.removesuffix(".json"))
    except ManifestError:
        return False


def _delete_version(root: Path, version: int) -> None:
    """Uncommit (the manifest first), then remove the directory. Through :mod:`asyncsync.fsio`:
    a version directory that is a symlink is unlinked, its target never touched."""
    vdir = version_dir(root, version)
    with contextlib.suppress(FileNotFoundError, fsio.UnsafePath):
        fsio.remove_tree(vdir / MANIFEST_NAME, root=root)  # readers stop seeing it
        fsync_dir(vdir, root=root)
    with contextlib.suppress(OSError):  # what is left is uncommitted: the publisher removes it
        fsio.remove_tree(vdir, root=root)
    fsync_dir(root)
