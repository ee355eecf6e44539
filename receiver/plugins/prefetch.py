"""The stage read and verified while the engine still serves: the pause holds only the apply.

The receiver commits a version's stage (``stage.json`` written last, atomically) before it
commits its own checkpoint and pauses the server. :class:`StagePrefetch`, one thread beside
each :class:`~receiver.plugins.inplace.InEngineLoader`, watches the stage directory of the
checkpoint the model holds (``<checkpoint>/.asyncsync/engine-stage/``), and reads and verifies
the newest stage as soon as it exists (:func:`~receiver.plugins.stage.read_stage`: its data's
checksum, bounds, sorted positions), then offers it to the loader
(:meth:`~receiver.plugins.inplace.InEngineLoader.offer`). When the receiver then asks for that
stage, the loader takes the verified copy instead of reading the stage inside the pause.

What makes this safe: the copy is used only when ``stage.json`` on disk is, byte for byte, the
record it was read from; that record names the checksum of the data file, which the copy was
verified against. Anything else (no copy, another record, a record that cannot be read) is the
ordinary path: the stage is read and verified in the call. The copy holds memory until the
apply takes it or a newer stage replaces it (one at a time). Engine-agnostic.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from asyncsync.errors import FormatError, check_seconds
from receiver.plugins.stage import STAGE_DIR, STAGE_NAME, read_stage

if TYPE_CHECKING:
    from receiver.plugins.inplace import InEngineLoader

__all__ = ["ENV_PREFETCH", "StagePrefetch", "start_prefetch"]

logger = logging.getLogger(__name__)

#: ``0`` turns the prefetch off (every stage is then read inside the apply call)
ENV_PREFETCH = "ASYNCSYNC_STAGE_PREFETCH"


_running: list[StagePrefetch] = []


def start_prefetch(loader: InEngineLoader) -> StagePrefetch | None:
    """Start the prefetch thread of ``loader`` (an engine plugin calls it once per model);
    None when ``$ASYNCSYNC_STAGE_PREFETCH`` is ``0``."""
    if os.environ.get(ENV_PREFETCH, "1").strip() == "0":
        return None
    p = StagePrefetch(loader)
    p.start()
    _running.append(p)
    return p


class StagePrefetch:
    """Reads each new stage of ``loader``'s checkpoint ahead of its apply (see the module).

    Args:
        loader: the model's loader; stages are looked for under the checkpoint it holds.
        interval: seconds between looks at the stage directory.
    """

    def __init__(self, loader: InEngineLoader, *, interval: float = 0.01):
        check_seconds("StagePrefetch: interval", interval, above=True)
        self.loader = loader
        self.interval = interval
        self.prefetched = 0  # stages read and verified ahead
        self.failed = 0  # stages that did not verify when read ahead (the apply reads again)
        self._tried: tuple[str, int, int] | None = None  # (path, inode, mtime) last read
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __repr__(self) -> str:
        return f"<StagePrefetch prefetched={self.prefetched} failed={self.failed}>"

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="asyncsync-stage-prefetch", daemon=True
            )
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread; wait at most ``timeout`` seconds for it (inf: without a limit)."""
        check_seconds("StagePrefetch.stop: timeout", timeout, forever=True)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(None if timeout == float("inf") else timeout)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.poll()
            except Exception:  # never let a bug here stop the engine's thread pool or serving
                logger.exception("asyncsync: stage prefetch failed")
                self._stop.wait(1.0)

    def poll(self) -> bool:
        """Look once; True when a new stage was read and verified."""
        held = self.loader.held
        if held is None:
            return False
        newest = _newest_stage(held.directory / ".asyncsync" / STAGE_DIR)
        if newest is None:
            return False
        path, st = newest
        key = (str(path), st.st_ino, st.st_mtime_ns)
        if key == self._tried:
            return False
        self._tried = key
        t0 = time.perf_counter()
        with self.loader.reading:  # an apply reading it meanwhile: it is not read twice
            if self.loader.last_stage == path.resolve():
                return False  # already read by its apply
            try:
                stage = read_stage(path)
            except FormatError as exc:  # the apply reads it again and says why
                self.failed += 1
                logger.info("asyncsync: stage %s not read ahead: %s", path.name, exc)
                return False
            self.loader.offer(stage)
        self.prefetched += 1
        logger.debug("asyncsync: stage %s read and verified ahead in %.1f ms", path.name,
                     (time.perf_counter() - t0) * 1000)  # fmt: skip
        return True


def _newest_stage(directory: Path) -> tuple[Path, os.stat_result] | None:
    """The committed stage of the highest version under ``directory`` and its record's stat."""
    try:
        names = sorted((e.name for e in os.scandir(directory) if e.name.startswith("v")),
                       reverse=True)  # fmt: skip
    except OSError:
        return None
    for name in names:
        try:
            st = os.stat(directory / name / STAGE_NAME, follow_symlinks=False)
        except OSError:
            continue  # not committed yet (or removed meanwhile)
        return directory / name, st
    return None
