"""The receiver's own inotify watch (receiver/inotify.py), read by the event loop: real inotify
on this host's filesystem. It wakes at once for a root entry that can mean a new version, not
for acks, leases or temp files; never for what happens below the root (nor through a symlink
in it); says when the root itself goes; and runs no thread and no timer (an idle receiver does
not wake: watchfiles, the fallback, checks its events 500 times a second)."""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest

from receiver import inotify
from receiver.watch import _version_events, wakeups
from tests.conftest import eventually

pytestmark = pytest.mark.skipif(not inotify.available(), reason="no inotify here")


def _keep(root: Path) -> Callable[[str], bool]:
    keep = _version_events(root)
    return lambda name: keep(None, str(root / name))


async def _reasons_until_an_event(root: Path, writes: Coroutine[Any, Any, None]) -> list[str]:
    """The wake-up reasons of a watch of ``root`` while ``writes`` runs, up to the first event."""
    got: list[str] = []
    task = asyncio.create_task(writes)
    async for reason in wakeups(root, poll_interval=30.0, use_inotify=True):
        got.append(reason)
        if reason == "event":
            break
    await task
    return got


def _drain(w: inotify.DirectoryWatch, root: Path) -> tuple[bool, bool]:
    time.sleep(0.05)  # the kernel queues events synchronously; a margin for slow hosts
    return w.read(_keep(root))


def test_wakes_for_versions_and_the_log_not_for_acks_leases_or_temp_files(tmp_path: Path) -> None:
    w = inotify.DirectoryWatch(tmp_path)
    try:
        assert _drain(w, tmp_path) == (False, False)  # nothing pending
        (tmp_path / "acks").mkdir()
        (tmp_path / "leases").mkdir()
        (tmp_path / ".tmp.manifest.json.abc").write_text("x")
        assert _drain(w, tmp_path) == (False, False)
        (tmp_path / "acks" / "e1.json").write_text("{}")  # below the root: not watched
        (tmp_path / "leases" / "e1.json").write_text("{}")
        assert _drain(w, tmp_path) == (False, False)
        (tmp_path / "v000000000001").mkdir()
        assert _drain(w, tmp_path) == (True, False)
        (tmp_path / "v000000000001" / "manifest.json").write_text("{}")  # below: no event
        assert _drain(w, tmp_path) == (False, False)
        with open(tmp_path / "log.jsonl", "a") as f:
            f.write("{}\n")
        assert _drain(w, tmp_path) == (True, False)
        os.rename(tmp_path / ".tmp.manifest.json.abc", tmp_path / "asyncsync.json")
        assert _drain(w, tmp_path) == (True, False)  # renamed into place
    finally:
        w.close()


def test_a_flood_of_events_is_read_a_buffer_at_a_time(tmp_path: Path) -> None:
    """Found by attack (helper-20): ``read`` drained the descriptor, so a process creating
    files in the root faster than Python parses the events (ignored dot-files, ~90,000 a
    second) held the event loop for as long as the flood lasted (5-15 s: no sync, no lease
    heartbeat). One call now reads at most one buffer; the watch reads again after a pause."""
    w = inotify.DirectoryWatch(tmp_path)
    try:
        for i in range(4000):  # ~40 bytes an event: several buffers' worth
            (tmp_path / f".f{i}").touch()
        for i in range(4000):
            (tmp_path / f".f{i}").unlink()
        pending = 0
        while True:
            before = _queued_bytes(w.fd)
            if before == 0:
                break
            assert w.read(_keep(tmp_path)) == (False, False)  # dot-files: nothing wanted
            read = before - _queued_bytes(w.fd)
            assert 0 < read <= inotify.READ_BYTES
            pending += 1
        assert pending > 2  # the flood took several calls, each bounded
    finally:
        w.close()


def _queued_bytes(fd: int) -> int:
    """Bytes of events waiting on an inotify descriptor (FIONREAD)."""
    import array
    import fcntl
    import termios

    buf = array.array("i", [0])
    fcntl.ioctl(fd, termios.FIONREAD, buf, True)
    return int(buf[0])


async def test_the_watch_pauses_between_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After each read the watch stops reading for INOTIFY_PAUSE: a flood costs a bounded share
    of a core and the loop stays free (the first event still wakes at once)."""
    from receiver import watch as watch_mod

    monkeypatch.setattr(watch_mod, "INOTIFY_PAUSE", 0.3)
    reads: list[float] = []
    real_read = inotify.DirectoryWatch.read

    def counting(self: inotify.DirectoryWatch, keep: Callable[[str], bool]) -> tuple[bool, bool]:
        reads.append(time.monotonic())
        return real_read(self, keep)

    monkeypatch.setattr(inotify.DirectoryWatch, "read", counting)

    async def flood() -> None:
        await asyncio.sleep(0.1)
        for i in range(200):
            (tmp_path / f".f{i}").touch()
            await asyncio.sleep(0.005)  # a second of events, one every 5 ms
        (tmp_path / "v000000000001").mkdir()

    assert await _reasons_until_an_event(tmp_path, flood()) == ["start", "event"]
    gaps = [b - a for a, b in itertools.pairwise(reads)]
    assert gaps and min(gaps) >= 0.29  # never two reads within the pause


def test_a_symlink_in_the_root_is_not_followed(tmp_path: Path) -> None:
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    root.mkdir()
    elsewhere.mkdir()
    (root / "v000000000001").symlink_to(elsewhere, target_is_directory=True)
    w = inotify.DirectoryWatch(root)
    try:
        _drain(w, root)
        (elsewhere / "manifest.json").write_text("{}")
        (elsewhere / "sub").mkdir()
        assert _drain(w, root) == (False, False)
        fdinfo = Path(f"/proc/self/fdinfo/{w.fd}").read_text()
        watches = [line for line in fdinfo.splitlines() if line.startswith("inotify wd:")]
        assert len(watches) == 1  # the root alone
        assert f"ino:{os.stat(root).st_ino:x} " in watches[0]
    finally:
        w.close()


def test_says_when_the_root_goes(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    w = inotify.DirectoryWatch(root)
    try:
        shutil.rmtree(root)
        assert _drain(w, root)[1] is True
    finally:
        w.close()


def test_refuses_what_it_cannot_watch(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        inotify.DirectoryWatch(tmp_path / "missing")
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError):
        inotify.DirectoryWatch(tmp_path / "file")
    fds = len(os.listdir("/proc/self/fd"))
    for _ in range(20):  # a refused watch leaves no descriptor behind
        with pytest.raises(OSError):
            inotify.DirectoryWatch(tmp_path / "missing")
    assert len(os.listdir("/proc/self/fd")) == fds


async def test_wakeups_wake_at_once_and_start_no_thread(tmp_path: Path) -> None:
    before = threading.active_count()
    got: list[tuple[str, float]] = []
    written: list[float] = []

    async def write() -> None:
        await asyncio.sleep(0.2)
        threads.append(threading.active_count())
        for name in ("acks", "v000000000001", "log.jsonl"):
            written.append(time.monotonic())
            if name == "log.jsonl":
                (tmp_path / name).write_text("x")
            else:
                (tmp_path / name).mkdir()
            await asyncio.sleep(0.2)

    threads: list[int] = []
    writer = asyncio.create_task(write())
    async for reason in wakeups(tmp_path, poll_interval=30.0, use_inotify=True):
        got.append((reason, time.monotonic()))
        if sum(r == "event" for r, _ in got) == 2:
            break
    await writer
    assert [r for r, _ in got] == ["start", "event", "event"]  # none for acks, no poll
    assert got[1][1] >= written[1]  # woken by the version directory, not by acks
    assert threads == [before]  # watching needs no thread (watchfiles starts one)


async def _event_after(root: Path, change: Callable[[], None], wake_dir: Path) -> list[str]:
    """Wake-up reasons of a watch of ``root`` (polls every 0.25 s): ``change()`` at 0.2 s, a
    version directory made in ``wake_dir`` after the next polls, until an event or 2 s."""
    made: list[float] = []

    async def scenario() -> None:
        await asyncio.sleep(0.2)
        change()
        await asyncio.sleep(0.6)  # a poll (every 0.25 s) finds the new directory
        made.append(time.monotonic())
        (wake_dir / "v000000000001").mkdir()

    got: list[tuple[str, float]] = []
    task = asyncio.create_task(scenario())
    async with asyncio.timeout(10):
        async for reason in wakeups(root, poll_interval=0.25, use_inotify=True):
            got.append((reason, time.monotonic()))
            if made and (reason == "event" or time.monotonic() - made[0] > 2.0):
                break
    await task
    return [r for r, t in got if made and t >= made[0]]


@pytest.mark.parametrize("watcher", ["inotify", "watchfiles"])
@pytest.mark.parametrize("start", ["root-goes-and-comes-back", "root-missing-at-start"])
async def test_a_root_made_again_is_watched_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, start: str, watcher: str
) -> None:
    """A root removed and made again (or made after the receiver started) wakes the receiver
    at once again after the first poll that finds it: the watch was of the old directory (or
    none), and only the polls found versions until the receiver was restarted. ``watchfiles``:
    the fallback where the receiver's own inotify is not available (not Linux), standing in on
    Linux; its watch went on, on the removed directory, and a new root that reused the inode
    number was taken for the same one."""
    if watcher == "watchfiles":
        monkeypatch.setattr(inotify, "available", lambda: False)
    root = tmp_path / "root"
    if start == "root-goes-and-comes-back":
        root.mkdir()

    def remake() -> None:
        if root.exists():
            shutil.rmtree(root)
        root.mkdir()

    assert "event" in await _event_after(root, remake, root)  # not polls alone


async def test_a_root_reached_through_a_re_pointed_symlink_is_watched_again(
    tmp_path: Path,
) -> None:
    """FORMAT.md lets the root be reached through a symlink; re-pointed to another directory
    (``ln -sfn`` + ``mv -T``), no event reaches the old target's watch: the receiver found
    versions by polls alone, for good. The watch follows the directory the path names."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    root = tmp_path / "root"
    root.symlink_to("a")

    def flip() -> None:
        (tmp_path / "root.new").symlink_to("b")
        os.replace(tmp_path / "root.new", root)

    assert "event" in await _event_after(root, flip, tmp_path / "b")


async def test_a_watch_refused_once_is_tried_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A root made again mode 000 (its chmod a moment later) refused the new watch with EACCES,
    and inotify stayed off until a restart. It is tried again at the next wake-up."""
    root = tmp_path / "root"
    root.mkdir()
    real = inotify.DirectoryWatch
    refusals = [PermissionError(13, "Permission denied")]

    def watch(directory: Path) -> inotify.DirectoryWatch:
        if refusals and directory == root and not root.joinpath("old").exists():
            raise refusals.pop()
        return real(directory)

    def remake() -> None:
        shutil.rmtree(root)
        root.mkdir()

    root.joinpath("old").mkdir()
    monkeypatch.setattr(inotify, "DirectoryWatch", watch)
    assert "event" in await _event_after(root, remake, root)
    assert refusals == []  # it was refused once


async def test_the_watchfiles_fallback_still_wakes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where there is no inotify of our own (another OS), watchfiles watches the root."""
    monkeypatch.setattr(inotify, "available", lambda: False)

    async def write() -> None:
        await asyncio.sleep(0.3)
        (tmp_path / "v000000000001").mkdir()

    assert await _reasons_until_an_event(tmp_path, write()) == ["start", "event"]


async def test_a_nap_stops_reading_a_flood_of_events_it_does_not_want(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by attack (attack-109): a nap read every event of other entries as it came, so a
    process creating files in a stream's version directory in a loop held 26-49% of a core
    (polling: 1%), though none woke the reader. After FUTILE_READS reads that wanted nothing
    the rest of the nap is a poll (the events left queued, or dropped by the kernel): 4%."""
    reads: list[bool] = []
    real_read = inotify.DirectoryWatch.read

    def counting(self: inotify.DirectoryWatch, keep: Callable[[str], bool]) -> tuple[bool, bool]:
        got = real_read(self, keep)
        reads.append(any(got))
        return got

    monkeypatch.setattr(inotify.DirectoryWatch, "read", counting)
    w = inotify.DirectoryWatch(tmp_path, follow=False, arrivals=True)
    try:
        napping = asyncio.create_task(
            inotify.nap(w, 1.0, asyncio.Event(), "shard".__eq__)
        )  # fmt: skip
        budget = getattr(inotify, "FUTILE_READS", 4)
        for i in itertools.count():
            (tmp_path / f"junk{i}").touch()
            await eventually(
                lambda: _queued_bytes(w.fd) == 0 or len(reads) >= budget, "the events read"
            )
            if len(reads) >= budget:
                break
        (tmp_path / "shard").touch()  # wanted, but read no more in this nap: its poll sees it
        await napping  # (its timeout: the shard is the caller's to find)
        assert reads == [False] * budget
        assert _queued_bytes(w.fd) > 0
    finally:
        w.close()


def test_a_watch_closed_without_a_running_loop_is_closed_at_once(tmp_path: Path) -> None:
    """``close`` on an event loop hands the kernel's wait to the loop's executor (it held
    the loop 5-22 ms on a busy host); with no loop running it closes here, and the
    descriptor is gone when it returns."""
    w = inotify.DirectoryWatch(tmp_path)
    fd = w.fd
    assert "inotify" in os.readlink(f"/proc/self/fd/{fd}")
    w.close()
    assert w.fd == -1
    with pytest.raises(OSError):
        os.fstat(fd)
    w.close()  # a second call does nothing


async def test_a_watch_closed_on_the_loop_is_closed_by_its_executor(tmp_path: Path) -> None:
    w = inotify.DirectoryWatch(tmp_path)
    fd = w.fd
    w.close()
    assert w.fd == -1
    await eventually(lambda: _closed(fd), "the watch closed")


def _closed(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return True
    return False
