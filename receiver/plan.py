"""Planning a receiver's way along a root's chain of versions (blocking reads of manifests).

Given what an engine holds (:class:`~receiver.engines.base.EngineState`) and what the root
holds, these functions answer: which version is the newest, whether the engine's state can be
a base for the root's chain at all, and which version to apply next and how (its delta, or full
data from a keyframe). The agent runs them in a worker thread.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Literal

from asyncsync.errors import ChainError, FormatError
from asyncsync.format import Manifest
from asyncsync.format.store import is_committed, list_versions, newest_committed, read_manifest
from receiver.engines.base import EngineState

__all__ = [
    "Mode",
    "diverged",
    "keyframe_after",
    "keyframes_in",
    "latest_version",
    "newest_keyframe",
    "plan_next",
]

logger = logging.getLogger(__name__)

Mode = Literal["delta", "full"]
Reader = Callable[[Path, int], Manifest]  # read_manifest, or a cache's get (store.ManifestCache)


def latest_version(root: Path, held: int | None) -> int | None:
    """Newest committed version: a directory scan, then exact-path probes past it.

    Probing ``v{N+1}/manifest.json`` by name is not served from a stale cached listing the way
    a scan is on NFS, so a fresh commit is found even when the listing lags.
    """
    latest = newest_committed(root)
    known = [v for v in (latest, held) if v is not None]
    probe = max(known) + 1 if known else 0
    while is_committed(root, probe):  # an exact-path lookup; nothing followed
        latest = probe
        probe += 1
    return latest


def keyframes_in(
    root: Path, lo: int, hi: int, run_id: str | None, read: Reader, bad: Collection[int]
) -> Manifest | None:
    """The newest full version in ``lo..hi`` not in ``bad`` (damaged manifests skipped)."""
    for v in reversed(list_versions(root)):
        if v > hi or v < lo or v in bad:
            continue
        with contextlib.suppress(FileNotFoundError, FormatError):  # gone, or damaged
            m = read(root, v)
            if m.kind == "full" and (run_id is None or m.run_id == run_id):
                return m
    return None


def keyframe_after(
    root: Path,
    bad: int,
    target: int,
    read: Reader = read_manifest,
    skip: Collection[int] = (),
    run_id: str | None = None,
) -> Manifest | None:
    """The newest keyframe past the bad version ``bad`` (at most ``target``, not in ``skip``,
    of ``run_id`` when given): where a receiver that cannot take ``bad`` goes instead
    (FORMAT.md section 8)."""
    return keyframes_in(root, bad + 1, target, run_id, read, skip)


def newest_keyframe(
    root: Path,
    target: int,
    run_id: str | None = None,
    read: Reader = read_manifest,
    skip: Collection[int] = (),
) -> Manifest:
    """The newest full version at or below ``target`` (of ``run_id`` when given), not in
    ``skip`` (versions known to be bad)."""
    m = keyframes_in(root, 0, target, run_id, read, skip)
    if m is not None:
        return m
    if newer := [v for v in list_versions(root) if v > target]:
        # (found by attack: `asyncsync gc --keep-versions 1` beside a receiver that had just
        # read the newest version: its advice to publish a keyframe was wrong, one had come)
        raise ChainError(
            f"{root}: no keyframe at or below version {target} any more: removed (retention?)"
            f" while v{newer[-1]} was committed; the next sync looks again from there"
        )
    raise ChainError(
        f"{root}: no keyframe at or below version {target}"
        + (f" of run {run_id}" if run_id else "")
        + " to start from; publish one (publish(..., keyframe=True)) or keep more versions"
    )


def plan_next(
    root: Path,
    state: EngineState,
    latest: int,
    read: Reader = read_manifest,
    skip: Collection[int] = (),
    run_id: str | None = None,
) -> tuple[Manifest, Mode]:
    """The next version to apply from the engine's version toward ``latest`` (of the run
    ``run_id`` when given: the root's), and how.

    A full version of another run is never a step of the chain (a version directory copied
    from another root, FORMAT.md 11.4): taken there, the next version of the root's run would
    re-seed the engine from an older keyframe and walk back to it, for ever (attack-38).
    Raises FormatError when the next version's manifest is damaged (the caller decides).
    """
    cur = state.version
    if cur is not None:
        try:
            m = read(root, cur + 1)
        except FileNotFoundError:
            m = None
        if m is not None and m.run_id == state.run_id and m.has_delta:
            return m, "delta"
        if m is not None and m.kind == "full" and run_id in (None, m.run_id):
            return m, "full"
        if m is None:
            logger.warning("version %d is gone: catching up from a keyframe", cur + 1)
    return newest_keyframe(root, latest, run_id, read=read, skip=skip), "full"


def diverged(
    root: Path, state: EngineState, newest: Manifest, read: Reader = read_manifest
) -> str | None:
    """Why the engine's state cannot be a base for ``newest``'s chain, or None.

    Another run's version, or a version number whose fingerprint differs from the root's
    manifest of that number (removed and republished with other contents).
    """
    if state.version is None:
        return None
    if state.run_id is not None and state.run_id != newest.run_id:
        return (
            f"engine holds v{state.version} of run {state.run_id}; the root is run {newest.run_id}"
        )
    if state.fingerprint is None or state.version > newest.version:
        return None
    try:
        mine = newest if state.version == newest.version else read(root, state.version)
    except (FileNotFoundError, FormatError):
        return None  # pruned or damaged: the planner moves on from the next version anyway
    if mine.fingerprint != state.fingerprint:
        return (
            f"engine's v{state.version} has fingerprint {state.fingerprint}, the root's "
            f"v{state.version} has {mine.fingerprint} (republished with other contents)"
        )
    return None
