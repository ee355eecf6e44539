"""Streaming receive: read a version's delta shards while the publisher is still writing them.

The publisher writes ``delta-00000.safetensors``, ``delta-00001...`` in order, each under a temp
name renamed into place when complete, and the manifest last. A :class:`Prefetcher` for version
N polls those exact names, reads each shard as soon as it appears and keeps its bytes, until
the manifest appears (then it wakes the agent) or its memory budget is spent. Nothing it reads
is trusted: the agent uses a prefetched shard only if its size and checksum match the
manifest, and reads it again otherwise. So the trainer's writes and the receiver's reads
overlap, and end-to-end time approaches the slower of the two instead of their sum.
"""

from __future__ import annotations

import asyncio
import logging
import stat
from collections.abc import Callable
from functools import partial
from pathlib import Path

from asyncsync import fsio
from asyncsync.format import MANIFEST_NAME, version_dir
from asyncsync.fsio import read_bytes

__all__ = ["Prefetcher", "being_written", "probe"]

logger = logging.getLogger(__name__)


class Prefetcher:
    """Prefetch the delta shards of ``version`` from ``root`` (see the module docstring).

    Args:
        on_manifest: set when the version's manifest appears.
        max_bytes: the most bytes held prefetched at once (a shard that would pass it is
            read after the commit instead).
        interval: seconds between polls of the next expected name.
    """

    def __init__(
        self,
        root: Path,
        version: int,
        *,
        on_manifest: asyncio.Event,
        max_bytes: int = 512 << 20,
        interval: float = 0.005,
    ) -> None:
        self.version = version
        self.root = root
        self.dir = version_dir(root, version)
        self.on_manifest = on_manifest
        self.max_bytes = max_bytes
        self.interval = interval
        self.shards: dict[str, bytes] = {}
        self.bytes = 0

    def take(self, file: str) -> bytes | None:
        """The prefetched bytes of ``file`` (once), or None."""
        data = self.shards.pop(file, None)
        if data is not None:
            self.bytes -= len(data)
        return data

    async def run(self) -> None:
        """Poll and read until the manifest appears; cancel to stop early."""
        k = 0
        manifest = self.dir / MANIFEST_NAME
        delay = self.interval
        while True:
            if await asyncio.to_thread(probe, manifest, self.root) is not None:
                self.on_manifest.set()  # whatever it is: the agent reads (or refuses) it
                return
            name = f"delta-{k:05d}.safetensors"
            path = self.dir / name
            if self.bytes < self.max_bytes and await asyncio.to_thread(probe, path, self.root) == 1:
                # within what is left of the budget (a read to the whole of it went past it by up
                # to one shard: twice the budget held at once)
                left = self.max_bytes - self.bytes
                read = partial(read_bytes, path, limit=left, root=self.root)
                try:
                    data = await asyncio.to_thread(read)
                except (OSError, ValueError) as exc:  # vanished or too large: read after commit
                    logger.debug("prefetch of %s skipped: %s", path, exc)
                else:
                    self.shards[name] = data
                    self.bytes += len(data)
                k += 1
                delay = self.interval
                continue
            await asyncio.sleep(delay)
            delay = min(delay * 1.25, 0.1)  # an abandoned write must not spin the CPU


def being_written(root: Path, version: int) -> bool:
    """Whether ``version``'s directory exists, a real directory (not followed if a symlink)."""
    return probe(version_dir(root, version), root, stat.S_ISDIR) == 1


def probe(path: Path, root: Path, test: Callable[[int], bool] = stat.S_ISREG) -> int | None:
    """What is at ``path`` in ``root``, never followed (fsio): None nothing, 1 what ``test``
    accepts (a regular file), 0 anything else (a symlinked version directory too)."""
    try:
        st = fsio.lstat(path, root=root)
    except OSError:  # a symlinked version directory: let the agent say why
        return 0
    return None if st is None else int(test(st.st_mode))
