"""Wake-ups for the receiver: inotify events where they work, polling always.

Inotify only sees writes made through this host's mount: NFS and FUSE clients never get events
for other hosts' writes. So events only make the receiver react sooner; a poll every
``poll_interval`` seconds is what guarantees discovery, and the agent looks up the exact path of
the next version's manifest, which a stale directory listing cannot hide.

On Linux the events are read by the event loop itself (:mod:`receiver.inotify`: no thread and
no timer, so an idle receiver never wakes); elsewhere through watchfiles, whose thread checks
for events every 2 ms. The watch is on the root alone, not recursive: a recursive watch follows
symlinks (watchfiles walks them and watches their targets, so a symlink to ``/`` planted in the
root would make it walk the whole filesystem). Every commit ends with an event in the root
itself (the log line appended after the manifest rename; a new version directory before it),
and the prefetcher polls the next version's directory for its manifest (``receiver.prefetch``).
A root that is missing at the start, goes away (removed and made again) or whose path names
another directory (a symlink on the way re-pointed, a filesystem mounted on it or unmounted) is
watched again at the first wake-up that finds the new directory: until then the polls alone
find new versions.

Resolution order for inotify: argument ``use_inotify`` > environment ``ASYNCSYNC_FORCE_POLLING``
(``1`` disables inotify) > on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import stat
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from asyncsync.format import ACKS_DIR
from asyncsync.format.names import LEASES_DIR
from receiver import inotify

__all__ = ["REPEAT_LOG_SECONDS", "Repeats", "first_of", "inotify_wanted", "wakeups"]

REPEAT_LOG_SECONDS = 60.0  # a failure that recurs is logged again after this long
INOTIFY_PAUSE = 0.005  # s between two reads of the root's events (the first wakes at once)

logger = logging.getLogger(__name__)


def inotify_wanted(use_inotify: bool | None) -> bool:
    """Whether to use inotify: ``use_inotify`` if given, else unless ASYNCSYNC_FORCE_POLLING."""
    if use_inotify is not None:
        return use_inotify
    return os.environ.get("ASYNCSYNC_FORCE_POLLING", "").lower() not in ("1", "true", "yes")


def _version_events(root: Path) -> Callable[[object, str], bool]:
    """A watchfiles filter keeping events that can mean a new version: not acks or leases
    (receivers' own writes and heartbeats), not temp files."""
    own = tuple(str(root / d) + os.sep for d in (ACKS_DIR, LEASES_DIR))
    own_dirs = tuple(str(root / d) for d in (ACKS_DIR, LEASES_DIR))

    def keep(_change: object, path: str) -> bool:
        if path.startswith(own) or path in own_dirs:
            return False
        return not os.path.basename(path).startswith(".")

    return keep


async def _watch(root: Path, wake: asyncio.Event, stop: asyncio.Event) -> bool:
    """Watch until ``stop``, the root goes or the watch fails; True when a watch of the root
    may be made again once it is a directory again (it went away, or was not there)."""
    if inotify.available():
        return await _watch_inotify(root, wake, stop)
    return await _watch_watchfiles(root, wake, stop)


async def _watch_inotify(root: Path, wake: asyncio.Event, stop: asyncio.Event) -> bool:
    """Wake on each batch of wanted events, read by the loop, until ``stop`` or the root goes
    (then True: a new root may be watched again)."""
    try:
        watch = inotify.DirectoryWatch(root)
    except (FileNotFoundError, NotADirectoryError, PermissionError) as exc:
        # gone since it was looked at, or not readable for now (a root made again mode 000
        # before its chmod): tried again at the next wake-up (the sync says what is wrong)
        logger.debug("inotify watch on %s not made (%s); polling until it can be", root, exc)
        return True
    except OSError as exc:  # e.g. the inotify instance or watch limit reached
        logger.warning("inotify watch on %s failed (%s); polling only", root, exc)
        return False
    keep = _version_events(root)
    gone = asyncio.Event()

    loop = asyncio.get_running_loop()
    rearm: list[asyncio.TimerHandle] = []

    def ready() -> None:
        # one read, then none for INOTIFY_PAUSE: a flood of events in the root (even of names
        # the filter drops) costs a bounded share of a core and never holds the loop
        loop.remove_reader(watch.fd)
        try:
            wanted, lost = watch.read(lambda name: keep(None, str(root / name)))
        except OSError as exc:
            logger.warning("inotify watch on %s stopped (%s); polling only", root, exc)
            wanted, lost = True, True
        if wanted:
            wake.set()
        if lost:
            gone.set()
        else:
            rearm[:] = [loop.call_later(INOTIFY_PAUSE, loop.add_reader, watch.fd, ready)]

    loop.add_reader(watch.fd, ready)
    try:
        await first_of(stop, gone)
        if gone.is_set() and not stop.is_set():
            logger.warning(
                "inotify watch on %s stopped (the root went away); polling until it is back",
                root,
            )
    finally:
        for handle in rearm:
            handle.cancel()
        loop.remove_reader(watch.fd)
        watch.close()
    return gone.is_set()


async def _watch_watchfiles(root: Path, wake: asyncio.Event, stop: asyncio.Event) -> bool:
    """Wake on each batch of wanted events, through watchfiles' thread, until ``stop`` or the
    watch ends; True when it ended because the root went away or names another directory now
    (a new root may be watched again), False for a watch that failed on a root still there
    (e.g. a watch limit: polling only, not a new failed watch at every wake-up)."""
    try:
        import watchfiles
    except ImportError:  # pragma: no cover - a declared dependency
        logger.warning("watchfiles is not installed; polling only")
        return False
    watched = _directory_ident(root)
    try:
        async for changes in watchfiles.awatch(
            root,
            stop_event=stop,
            debounce=5,  # ms: a commit is seen at most this late (a version is a few events)
            step=2,
            recursive=False,  # never follows a symlink in the root (module docstring)
            ignore_permission_denied=True,
            watch_filter=_version_events(root),
        ):
            wake.set()
            if any(path == str(root) for _, path in changes):
                # the root itself removed or moved: the watch goes on, on a directory nobody
                # can reach, and the new root may reuse its inode number (not seen as another)
                logger.warning(
                    "inotify watch on %s stopped (the root went away); polling until it is back",
                    root,
                )
                return True
    except Exception as exc:  # e.g. inotify watch limit reached, root removed
        if stop.is_set() or _directory_ident(root) == watched:
            logger.warning("inotify watch on %s stopped (%s); polling only", root, exc)
            return False
        logger.warning(
            "inotify watch on %s stopped (%s: the root went away); polling until it is back",
            root,
            exc,
        )
        return True
    return not stop.is_set() and _directory_ident(root) != watched


async def wakeups(
    root: Path, *, poll_interval: float, use_inotify: bool | None = None
) -> AsyncIterator[str]:
    """Yield ``"start"``, then ``"event"`` or ``"poll"`` each time the root may have changed."""
    wake = asyncio.Event()
    stop = asyncio.Event()
    task: asyncio.Task[bool] | None = None
    watched: tuple[int, int] | None = None  # (st_dev, st_ino) of the directory watched
    wanted = inotify_wanted(use_inotify)

    def arm() -> None:
        """Watch the directory the root's path names now, where no watch of it runs and one
        may: at the start, and at each wake-up after the root was missing, went away (removed
        and made again) or is another directory (a symlink on the way re-pointed, a mount on
        it made or gone: no event reaches the old watch then)."""
        nonlocal task, watched
        if not wanted:
            return
        ident = _directory_ident(root)
        if task is not None and not task.done():
            if ident is None or ident == watched:
                return  # the same directory (or none: the watch says so itself)
            task.cancel()  # it watches a directory the root's path no longer names
            logger.info("inotify watch on %s: the path names another directory now", root)
        elif task is not None:
            if ident is None or not _may_watch_again(task):
                return
            logger.info("inotify watch on %s again (the root is back)", root)
        if ident is not None:
            task = asyncio.create_task(_watch(root, wake, stop), name=f"watch {root}")
            watched = ident

    arm()
    try:
        yield "start"
        while True:
            try:
                async with asyncio.timeout(poll_interval):
                    await wake.wait()
                reason = "event"
            except TimeoutError:
                reason = "poll"
            wake.clear()
            arm()
            yield reason
    finally:
        stop.set()
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _directory_ident(path: Path) -> tuple[int, int] | None:
    """(st_dev, st_ino) of the directory ``path`` names now (through symlinks), else None."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISDIR(st.st_mode) else None


def _may_watch_again(task: asyncio.Task[bool]) -> bool:
    """The watch task ended, and because the root went away (not a failure, not stopped)."""
    return task.done() and not task.cancelled() and task.exception() is None and task.result()


class Repeats:
    """One failure said once per REPEAT_LOG_SECONDS, however often it recurs."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.message: str | None = None
        self.logged = 0.0
        self.count = 0  # failures since it was last logged
        self.repeated = 0  # failures that were not logged before the last line
        self.streak = 0  # failures in a row

    def should_log(self, message: str) -> bool:
        now = time.monotonic()
        self.streak += 1
        if message != self.message or now - self.logged >= REPEAT_LOG_SECONDS:
            self.repeated, self.count = (self.count if message == self.message else 0), 0
            self.message, self.logged = message, now
            return True
        self.count += 1
        return False

    def since(self) -> str:
        return f" ({self.repeated + 1} times in {REPEAT_LOG_SECONDS:g}s)" if self.repeated else ""

    def backoff(self, poll: float) -> float:
        return min(poll * 2 ** min(self.streak - 1, 10), REPEAT_LOG_SECONDS / 6)


async def first_of(*events: asyncio.Event) -> None:
    """Wait until any of ``events`` is set."""
    waiters = [asyncio.create_task(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
