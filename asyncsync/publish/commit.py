"""Committing one version: make its shards durable, run the hook, rename its manifest into place.

The rename of ``vN/manifest.json`` is the commit (docs/FORMAT.md). Before it, a failed or
cancelled publish removes the version directory (:func:`discard`) and nothing exists for
readers; after it, the version exists whatever happens next: a manifest once renamed into place
is never rewritten nor removed by a publish, and every step after the rename (telling the other
ranks, removing unnamed files, the log line) either completes or is completed later. So a
cancellation that arrives once the rename may have happened is deferred until the caller's
bookkeeping is done (:func:`commit_version` returns True, :func:`through_commit`,
:func:`complete`), and a publisher that opens a root finishes a commit a kill interrupted
(:func:`finish_interrupted`).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import inspect
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, NoReturn, Protocol, TypeVar

from asyncsync import fsio
from asyncsync.errors import (
    AsyncSyncError,
    ConfigError,
    LockHeld,
    ManifestError,
    PublishError,
    first_error,
)
from asyncsync.format import (
    LOG_NAME,
    MANIFEST_NAME,
    Manifest,
    ShardInfo,
    TensorEntry,
    Totals,
    fingerprint,
    store,
    version_dir,
)
from asyncsync.format.fields import check_density
from asyncsync.format.log import append_manifest, parse_record
from asyncsync.format.store import (
    ensure_root_info,
    list_versions,
    next_version_after,
    read_manifest,
    read_root_info,
    uncommitted_dirs,
)
from asyncsync.fsio import FileLock, atomic_write, fsync_dir, make_dir
from asyncsync.pipeline import finish_thread
from asyncsync.publish.retention import ManifestKinds, RetentionPolicy, collect

__all__ = [
    "PreCommitHook",
    "build_manifest",
    "claim_version_dir",
    "collect_garbage",
    "commit_version",
    "complete",
    "discard",
    "clean_leftovers",
    "finish_interrupted",
    "log_and_collect",
    "open_root",
    "run_hook",
    "through_commit",
]

T = TypeVar("T")

logger = logging.getLogger(__name__)

PreCommitHook = Callable[[Path], Any] | Callable[[Path], Awaitable[Any]]
# what to do when the root cannot be made or locked, by errno (otherwise: another directory)
_ROOT_FIXES = {errno.ENOSPC: "free space on its filesystem", errno.EDQUOT: "raise the quota",
               errno.EROFS: "mount its filesystem writable"}  # fmt: skip


class Opener(Protocol):
    """What :func:`open_root` reads of a publisher's committer."""

    is_committer: bool

    async def open(self, root: Path, latest: int | None, lock: FileLock | None = None) -> None: ...


async def open_root(root: Path, lock: FileLock, committer: Opener) -> tuple[str, list[int], int]:
    """Make ``root``, take ``lock``, and (the committer) create the root's record, remove what
    interrupted publishes left and finish the commits a kill interrupted; open ``committer``.
    Returns ``(run_id, committed versions, next version)``, the lock held; on an error the
    lock is released (ConfigError for an OSError, LockHeld when another publisher holds it).
    Each step's thread is waited for when cancelled (a lock taken by a thread the caller no
    longer awaited stayed held: other publishers refused, this one opened at version 0)."""
    try:
        await finish_thread(functools.partial(make_dir, root, parents=True, exist_ok=True))
        acquired = await finish_thread(lock.acquire)
    except OSError as exc:
        fix = _ROOT_FIXES.get(exc.errno or 0, "pass a directory this process can write")
        raise ConfigError(f"cannot open the root {root}: {exc}; {fix}") from exc
    except BaseException:  # cancelled: the thread has ended, and may have taken the lock
        lock.release()
        raise
    if not acquired:
        raise LockHeld(
            f"another publisher holds {lock.path} ({lock.holder()}); one publisher per root"
        )
    is_committer = committer.is_committer
    try:
        # only the committer creates the root or removes leftovers: other ranks may be
        # writing into an uncommitted version directory right now
        info = await finish_thread(ensure_root_info if is_committer else read_root_info, root)
        run_id = info.run_id if info is not None else ""
        if is_committer:  # (its lock released only once these threads are done)
            await finish_thread(clean_leftovers, root)
            await finish_thread(finish_interrupted, root)
        versions = await finish_thread(list_versions, root)
        nxt = next_version_after(root, versions)  # (the lock is released below)
        await committer.open(root, versions[-1] if versions else None, lock)
    except OSError as exc:  # e.g. fsio.UnsafePath: a symlink where .rendezvous/ should be
        lock.release()
        raise ConfigError(f"cannot open the root {root}: {exc}") from exc
    except BaseException:
        lock.release()
        raise
    return run_id, versions, nxt


def build_manifest(
    *,
    version: int,
    entries: tuple[TensorEntry, ...],
    shards: tuple[ShardInfo, ...],
    raw_bytes: int,
    created: float,
    delta: bool,
    full: bool,
    encoding: str,
    checksum: str,
    run_id: str,
    producer: Mapping[str, Any],
    shard_dir: str | None = None,
    attempt: str | None = None,
) -> Manifest:
    """The manifest of one version, its totals and fingerprint computed from its records."""
    totals = Totals.of(entries, shards, raw_bytes, external_full=shard_dir is not None)
    return Manifest(
        version=version,
        base_version=version - 1 if delta else None,
        kind="full" if full else "delta",
        encoding=encoding,
        checksum_algorithm=checksum,
        run_id=run_id,
        shards=shards,
        tensors=entries,
        totals=totals,
        fingerprint=fingerprint(entries, checksum),
        created_at=created,
        committed_at=time.time(),
        producer=dict(producer),
        shard_dir=shard_dir,
        attempt=attempt,
    )


def check_readable(data: bytes, version: int) -> None:
    """ConfigError for a manifest every reader would refuse unparsed: over 256 MiB (FORMAT.md
    3), or denser than any valid record (11.3: a producer holding a long list of small
    numbers, thousands of tensors of many dimensions)."""
    fix = (
        "publish fewer tensors or give them shorter names (a non-ASCII character takes 6-12 "
        "bytes of its JSON) or fewer dimensions, or a smaller producer"
    )
    if len(data) > store.MAX_MANIFEST_BYTES:
        raise ConfigError(
            f"the manifest of version {version} would be {len(data)} bytes, more than the "
            f"{store.MAX_MANIFEST_BYTES} bytes readers take: {fix}"
        )
    try:
        check_density(data, f"the manifest of version {version}")
    except ManifestError as exc:
        raise ConfigError(f"{exc}; every reader would refuse it: {fix}") from None


def lock_name(rank: int) -> str:
    """The lock file of a publisher (rank 0 of a group, or alone) or of rank ``rank``."""
    return f".publisher.r{rank:04d}.lock" if rank else ".publisher.lock"


async def commit_version(
    root: Path,
    vdir: Path,
    manifest: Manifest,
    stage: list[str],
    hook: PreCommitHook | None,
    lock: FileLock | None = None,
) -> bool:
    """Make the shards durable, run the hook, write the manifest: the commit.

    ``stage[0]`` names the step in flight (for the caller's error message). Returns True when
    a cancellation arrived after the rename: the version is committed, and the caller must
    finish its bookkeeping and then raise ``CancelledError``. ``lock``: the publisher's, checked
    to be still the root's (:meth:`~asyncsync.fsio.FileLock.intact`) right before the manifest
    is written.
    """
    stage[0] = "manifest"
    data = manifest.to_json().encode()
    check_readable(data, manifest.version)
    stage[0] = "fsync"
    await asyncio.to_thread(functools.partial(fsync_dir, vdir, root=root))
    await asyncio.to_thread(fsync_dir, root)
    path = vdir / MANIFEST_NAME

    def exists() -> bool:  # any entry there, never followed: a manifest is never rewritten
        return fsio.lstat(path, root=root) is not None

    if await asyncio.to_thread(exists):  # never rewrite a committed version
        raise PublishError(
            f"version {manifest.version} is already committed ({path}); refusing to rewrite it"
        )
    if hook is not None:
        stage[0] = "pre-commit hook"
        await run_hook(hook, vdir)
    stage[0] = "manifest"
    if lock is not None and not await asyncio.to_thread(lock.intact):
        raise PublishError(
            f"{lock.path} is no longer the lock file this publisher holds (the root was "
            "wiped, or the file removed or replaced): another publisher may be writing this "
            "root; nothing was committed. Close this publisher and open it again"
        )
    write = functools.partial(atomic_write, path, data, root=root, sync_dir=False)
    try:
        await finish_thread(write)
    except asyncio.CancelledError:
        # to its end, however often cancelled: a second cancel here left a committed version
        # the publisher took for undone (every later publish: "already committed")
        renamed, _ = await complete(asyncio.to_thread(exists))
        if not renamed:
            raise  # the rename did not happen: nothing is committed
        return True  # committed: finish the bookkeeping, then cancel
    # The rename is done: the version exists for readers, whatever happens next.
    try:
        await finish_thread(functools.partial(fsync_dir, vdir, root=root))
    except asyncio.CancelledError:
        return True
    except OSError as exc:
        logger.warning(
            "version %d is committed, but syncing its directory failed (%s); readers see it",
            manifest.version, exc,
        )  # fmt: skip
    return False


def claim_version_dir(root: Path, vdir: Path, shared: bool = False) -> None:
    """Create the directory of the version about to be written (``shared``: other ranks may
    have created it). The committer owns that name: anything else found there, a symlink, a
    FIFO, a file or an uncommitted directory (put there by hand or by a crash), is removed
    first, never followed; a directory holding a manifest is committed and never rewritten.
    Run it by ``finish_thread``: a cancelled caller that went on would remove the directory
    before this thread made it."""
    try:
        fsio.make_dir(vdir, root=root, exist_ok=shared)
        return
    except (FileExistsError, fsio.UnsafePath):
        if shared:
            raise
    with contextlib.suppress(fsio.UnsafePath):  # a symlink or a file: no manifest in it
        if fsio.lstat(vdir / MANIFEST_NAME, root=root) is not None:
            raise PublishError(f"version {vdir.name} is already committed ({vdir}): not rewritten")
    logger.warning("removing %s: it holds no manifest and is in the way of this version", vdir)
    fsio.remove_tree(vdir, root=root)
    fsio.make_dir(vdir, root=root)


async def discard(vdir: Path, exc: BaseException, version: int, stage: str) -> NoReturn:
    """Remove an uncommitted version directory and raise what the caller should see (a
    directory that holds a manifest is committed: it stays)."""

    def remove() -> None:
        with contextlib.suppress(OSError):  # never through a symlink (fsio), best effort
            if fsio.lstat(vdir / MANIFEST_NAME, root=vdir.parent) is None:
                fsio.remove_tree(vdir, root=vdir.parent)

    await finish_thread(remove)  # to its end, however often cancelled: a retry claims vdir
    err = first_error(exc)
    if not isinstance(err, Exception) or isinstance(err, ConfigError):
        raise err
    raise PublishError(
        f"publishing version {version} failed during {stage}: {err!r}; "
        "nothing was committed and the snapshot is unchanged"
    ) from err


async def run_hook(hook: PreCommitHook, vdir: Path) -> None:
    """Run a pre-commit hook, sync (in a thread) or async; await what a sync hook returns.

    A cancelled publish waits for a sync hook's thread (:func:`finish_thread`): it cannot be
    stopped, and the version directory it may be reading is removed once the publish unwinds."""
    if inspect.iscoroutinefunction(hook):
        await hook(vdir)
        return
    result = await finish_thread(hook, vdir)
    if inspect.isawaitable(result):
        await result


async def log_and_collect(
    root: Path,
    manifest: Manifest,
    retention: RetentionPolicy | None,
    kinds: ManifestKinds | None = None,
) -> None:
    """After a commit: append its log line, then apply the retention policy; never fails."""
    try:
        await asyncio.to_thread(append_manifest, root, manifest)
    except OSError as exc:  # the log is for operators; the version is committed regardless
        logger.error("version %d committed but the log append failed: %s", manifest.version, exc)
    if retention is not None:
        await collect_garbage(root, retention, kinds)


async def collect_garbage(
    root: Path, retention: RetentionPolicy, kinds: ManifestKinds | None = None
) -> None:
    """Apply the retention policy after a commit; never fails the commit."""
    try:
        await asyncio.to_thread(collect, root, retention, kinds=kinds)
    except (OSError, AsyncSyncError) as exc:
        logger.error("retention on %s failed (retried after the next commit): %s", root, exc)


async def through_commit(aw: Awaitable[T], renamed: Callable[[], bool]) -> tuple[T, bool]:
    """Await ``aw`` (the end of a round: commit, tell the others, clean up); return its result
    and whether a cancellation arrived meanwhile.

    A cancellation before the manifest rename (``renamed()`` False) is passed on to ``aw``,
    whose handlers undo the version; one after it is held back: ``aw`` runs to its end, and
    the caller finishes its bookkeeping and then raises ``CancelledError``.
    """
    fut = asyncio.ensure_future(aw)
    cancelled = False
    while True:
        try:
            return await asyncio.shield(fut), cancelled
        except asyncio.CancelledError:
            if fut.done():  # ended, and the cancel came before this took its result
                if fut.cancelled() or fut.exception() is not None:
                    raise
                return fut.result(), True  # (the caller's bookkeeping must not be skipped)
            cancelled = True
            if not renamed():
                fut.cancel()


async def complete(aw: Awaitable[T]) -> tuple[T, bool]:
    """Await ``aw`` to its end even if cancelled meanwhile; return (result, cancelled)."""
    return await through_commit(aw, lambda: True)


def clean_leftovers(root: Path) -> None:
    """Remove what interrupted publishes left: version directories without a manifest, temp
    files. Run by the committer when it opens the root (no other publisher writes there)."""
    for d in uncommitted_dirs(root):
        logger.warning("removing uncommitted version directory %s", d)
        with contextlib.suppress(OSError):
            fsio.remove_tree(d, root=root)
    for p in fsio.remove_temp_files(root):
        logger.warning("removed leftover temp file %s", p)


def finish_interrupted(root: Path) -> list[int]:
    """Finish the commits a kill interrupted after the manifest rename; return their versions.

    A version not yet in ``log.jsonl`` (or the newest one) may still hold files its manifest
    does not name (part records, files of failed attempts): they are removed, then its log
    line appended. Run by the committer when it opens the root, before it publishes.
    """
    versions = list_versions(root)
    if not versions:
        return []
    try:
        logged = _last_logged(root)
    except OSError as exc:  # a log that is a symlink, a FIFO: never followed, not appended to
        logger.error("cannot read %s (%s): no log line is added", root / LOG_NAME, exc)
        logged = versions[-1]
    todo = [v for v in versions if logged is None or v > logged] or versions[-1:]
    done = []
    for v in todo:
        try:
            m = read_manifest(root, v)
        except (OSError, AsyncSyncError) as exc:
            logger.warning("cannot finish version %d: %s", v, exc)
            continue
        vdir = version_dir(root, v)
        keep = (
            {MANIFEST_NAME, *(s.file for s in m.shards)} if m.shard_dir is None else {MANIFEST_NAME}
        )
        with contextlib.suppress(OSError):
            for name, _ in fsio.scan(vdir, root=root):
                if name not in keep:
                    logger.warning("removing %s/%s, which its manifest does not name", vdir, name)
                    with contextlib.suppress(OSError):
                        fsio.remove_tree(vdir / name, root=root)
        if logged is None or v > logged:
            try:
                append_manifest(root, m)
            except OSError as exc:  # the log is for operators: the versions stand regardless
                logger.error("cannot append to %s: %s", root / LOG_NAME, exc)
                break
            done.append(v)
    if done:
        logger.warning("finished the interrupted commit of versions %s (log lines added)", done)
    return done


def _last_logged(root: Path) -> int | None:
    """The newest version ``log.jsonl`` lists (its last 1 MiB is read), or None when there is
    no log; OSError when it cannot be read (fsio.UnsafePath: a symlink, a FIFO)."""
    try:
        with os.fdopen(fsio.open_file(root / LOG_NAME, root=root), "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - (1 << 20)))
            lines = f.read(1 << 20).decode("utf-8", errors="replace").splitlines()
    except FileNotFoundError:
        return None
    versions = [int(rec["version"]) for rec in map(parse_record, lines) if rec is not None]
    return max(versions, default=None)
