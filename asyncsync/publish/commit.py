"""Committing one version: make its shards durable, run the hook, rename its manifest into place.

The rename of ``vN/manifest.json`` is the commit (docs/FORMAT.md). Before it, a failed or
cancelled publish removes the version directory (:func:`discard`) and nothing exists for
readers; after it, the version exists whatever happens next, so a cancellation that arrives
once the rename may have happened is deferred until the caller's bookkeeping is done
(:func:`commit_version` returns True).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import shutil
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, NoReturn

from asyncsync.errors import AsyncSyncError, ConfigError, PublishError, first_error
from asyncsync.format import MANIFEST_NAME, Manifest, ShardInfo, TensorEntry, Totals, fingerprint
from asyncsync.fsio import atomic_write, fsync_dir
from asyncsync.pipeline import finish_thread
from asyncsync.publish.retention import RetentionPolicy, collect

__all__ = [
    "PreCommitHook",
    "build_manifest",
    "collect_garbage",
    "commit_version",
    "discard",
    "run_hook",
]

logger = logging.getLogger(__name__)

PreCommitHook = Callable[[Path], Any] | Callable[[Path], Awaitable[Any]]


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


async def commit_version(
    root: Path,
    vdir: Path,
    manifest: Manifest,
    stage: list[str],
    hook: PreCommitHook | None,
) -> bool:
    """Make the shards durable, run the hook, write the manifest: the commit.

    ``stage[0]`` names the step in flight (for the caller's error message). Returns True when
    a cancellation arrived after the rename: the version is committed, and the caller must
    finish its bookkeeping and then raise ``CancelledError``.
    """
    stage[0] = "fsync"
    await asyncio.to_thread(fsync_dir, vdir)
    await asyncio.to_thread(fsync_dir, root)
    if hook is not None:
        stage[0] = "pre-commit hook"
        await run_hook(hook, vdir)
    stage[0] = "manifest"
    path = vdir / MANIFEST_NAME
    write = functools.partial(atomic_write, path, manifest.to_json().encode(), sync_dir=False)
    try:
        await finish_thread(write)
    except asyncio.CancelledError:
        if not await asyncio.to_thread(path.exists):
            raise  # the rename did not happen: nothing is committed
        return True  # committed: finish the bookkeeping, then cancel
    # The rename is done: the version exists for readers, whatever happens next.
    try:
        await finish_thread(fsync_dir, vdir)
    except asyncio.CancelledError:
        return True
    except OSError as exc:
        logger.warning(
            "version %d is committed, but syncing its directory failed (%s); readers see it",
            manifest.version, exc,
        )  # fmt: skip
    return False


async def discard(vdir: Path, exc: BaseException, version: int, stage: str) -> NoReturn:
    """Remove an uncommitted version directory and raise what the caller should see."""
    await asyncio.shield(asyncio.to_thread(shutil.rmtree, vdir, True))
    err = first_error(exc)
    if not isinstance(err, Exception) or isinstance(err, ConfigError):
        raise err
    raise PublishError(
        f"publishing version {version} failed during {stage}: {err!r}; "
        "nothing was committed and the snapshot is unchanged"
    ) from err


async def run_hook(hook: PreCommitHook, vdir: Path) -> None:
    """Run a pre-commit hook, sync (in a thread) or async; await what a sync hook returns."""
    if inspect.iscoroutinefunction(hook):
        await hook(vdir)
        return
    result = await asyncio.to_thread(hook, vdir)
    if inspect.isawaitable(result):
        await result


async def collect_garbage(root: Path, retention: RetentionPolicy) -> None:
    """Apply the retention policy after a commit; never fails the commit."""
    try:
        await asyncio.to_thread(collect, root, retention)
    except (OSError, AsyncSyncError) as exc:
        logger.error("retention on %s failed (retried after the next commit): %s", root, exc)
