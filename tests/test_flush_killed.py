"""A real receiver (``python -m receiver.cli``) whose checkpoint disk fails under its flush,
killed with SIGKILL right after the failed flush and right after the wipe that follows, and
started again: it never acknowledges a version whose bytes its checkpoint does not hold.

The disk is an ext4 on a loop device whose backing file lies on a small tmpfs
(:func:`tests.mounts.ext4_on_tmpfs`): the blocks of the data files are punched out of it and
the tmpfs filled, so the writeback of the pages a delta changed fails (EIO/ENOSPC), as on a
failing disk, while small writes (state, journal) still find room. The kernel then marks those
pages clean: once it drops them (``POSIX_FADV_DONTNEED`` here, memory pressure in life) the
files read back what the disk holds, which is not the acknowledged version.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch

from asyncsync import Publisher
from asyncsync.format.acks import read_acks
from asyncsync.format.store import read_manifest
from receiver.engines.checkpoint import verify_checkpoint
from tests.mounts import ext4_on_tmpfs, fill, punch_pages

REPO = Path(__file__).resolve().parent.parent


def _model(seed: int = 0) -> dict[str, torch.Tensor]:
    """2 MiB of bf16: more pages than the room left below the disk."""
    g = torch.Generator().manual_seed(seed)
    return {f"l.{i}.w": torch.randn(128 << 10, generator=g).to(torch.bfloat16) for i in range(8)}


def _step(sd: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, t in sd.items():
        t = t.clone()
        m = torch.rand(t.numel(), generator=g) < 0.01  # every page; an undo journal of ~60 KB
        t[m] = (t[m].float() + 0.5).to(torch.bfloat16)
        out[k] = t
    return out


class _Receivers:
    """Real receiver processes, one at a time, their output in one log."""

    def __init__(self, root: Path, ck: Path, log: Path) -> None:
        self.root, self.ck, self.log = root, ck, log
        self.proc: subprocess.Popen[bytes] | None = None
        self.mark = 0  # where the running one's output begins in the log

    def start(self) -> None:
        self.mark = self.log.stat().st_size if self.log.exists() else 0
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "receiver.cli", "--root", str(self.root), "--engine-id",
                 "e", "--checkpoint", str(self.ck), "--force-polling", "--poll-interval", "0.2"],
                stdout=out, stderr=out, cwd=REPO,
                env={**os.environ, "PYTHONPATH": str(REPO)},
            )  # fmt: skip

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def said(self, text: str) -> bool:
        with open(self.log, "rb") as f:
            f.seek(self.mark)
            return text.encode() in f.read()


@contextmanager
def _receivers(root: Path, ck: Path, log: Path) -> Iterator[_Receivers]:
    r = _Receivers(root, ck, log)
    try:
        yield r
    finally:
        r.kill()


def _wait(cond: Callable[[], Any], what: str, r: _Receivers, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"no {what}; receiver log:\n{r.log.read_text()[-3000:]}"
        time.sleep(0.02)


def _state(ck: Path) -> dict[str, Any] | None:
    try:
        st: dict[str, Any] = json.loads((ck / ".asyncsync" / "state.json").read_text())
    except (OSError, ValueError):
        return None
    return st


def _acked(root: Path) -> int | None:
    a = read_acks(root).get("e")
    return None if a is None else a.version


def _wiped(ck: Path, root: Path) -> bool:
    st = _state(ck)
    return st is not None and st["version"] is None and _acked(root) is None


@contextmanager
def _pinned(files: list[Path]) -> Iterator[Callable[[], None]]:
    """Keep the files' pages in memory (mlock of a shared mapping) until the call it yields
    lets them go and drops them. The blocks punched below them read back zeros, so a page the
    kernel dropped early would lose bytes the disk had written (a failing disk cannot write,
    but it still reads); only the pages a failed flush left clean are meant to go."""
    libc = ctypes.CDLL(None, use_errno=True)
    maps: list[mmap.mmap] = []
    for f in files:
        fd = os.open(f, os.O_RDWR)
        try:
            maps.append(mmap.mmap(fd, f.stat().st_size))
        finally:
            os.close(fd)
    views = [ctypes.c_char.from_buffer(m) for m in maps]  # (their addresses)
    spans = [(ctypes.addressof(v), len(m)) for v, m in zip(views, maps, strict=True)]
    for addr, n in spans:
        assert libc.mlock(ctypes.c_void_p(addr), n) == 0, os.strerror(ctypes.get_errno())

    def release() -> None:
        for addr, n in spans:
            libc.munlock(ctypes.c_void_p(addr), n)
        spans.clear()
        views.clear()
        for m in maps:
            m.close()
        maps.clear()
        for f in files:
            _drop_pages(f)

    try:
        yield release
    finally:
        if maps:
            release()


def _drop_pages(p: Path) -> None:
    """What memory pressure does to the pages a failed writeback left clean: dropped."""
    fd = os.open(p, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _lost(root: Path, ck: Path) -> list[str]:
    """What the checkpoint lacks of the version acknowledged (nothing: no ack, or it holds
    that version bit for bit)."""
    v = _acked(root)
    if v is None:
        return []
    try:
        return [f"v{v}: {name}" for name in verify_checkpoint(ck, read_manifest(root, v))]
    except Exception as exc:  # a header that no longer reads
        return [f"v{v}: {exc}"]


async def test_a_receiver_killed_after_a_failed_flush_never_acks_bytes_it_lost(
    tmp_path: Path,
) -> None:
    """Killed right after v1's flush failed, v1's pages then dropped: started again, the
    receiver wipes the checkpoint and removes its ack (killed right after that wipe and started
    again, it holds nothing and acks nothing), or, where the failing disk refuses even the
    wipe's state, it stops with v1 still not known durable; once the disk has room it holds v1
    again, bit for bit, and durable. Attacked this way, it failed to open for good when the
    dropped pages held a file's header, and could not open or wipe on its full disk (the
    tests of those, which do not depend on which pages the kernel drops:
    test_flush.py::test_an_unsynced_version_whose_header_was_lost_is_wiped and
    test_full_disk.py::test_a_checkpoint_opens_on_its_full_disk)."""
    root = tmp_path / "root"
    with ext4_on_tmpfs(tmp_path / "disk") as (disk, image):
        ck = disk / "ck"
        sd0 = _model()
        with _receivers(root, ck, tmp_path / "receiver.log") as r, ExitStack() as stack:
            async with Publisher(root, keyframe_interval=0) as pub:
                await pub.seed(sd0)
                r.start()
                _wait(lambda: _acked(root) == 0, "ack of v0", r)
                os.sync()
                files = sorted(ck.glob("model*.safetensors"))
                pinned = stack.enter_context(_pinned(files))
                for f in files:  # the disk fails from now on
                    punch_pages(f, image, set(range((f.stat().st_size + 4095) // 4096)))
                # room for v1's undo journal, its state and ext4's own journal, not for its
                # 2 MiB of pages: with 300 KB left (and 5 % of elements changed, a ~300 KB
                # journal) the journal's fsync itself failed now and then (CI, 2026-12-04)
                fill(image.parent, 700_000)
                await pub.publish(_step(sd0, 1))
                _wait(lambda: r.said("making v1 durable failed"), "failed flush of v1", r)
                r.kill()
                assert _acked(root) == 1 and _lost(root, ck) == []  # (in the page cache)
                pinned()  # the pages the failed flush could not write are dropped
                r.start()
                _wait(lambda: _wiped(ck, root) or not r.alive(), "wipe (or exit)", r)
                if r.alive():  # wiped, ack removed
                    r.kill()  # right after the wipe
                    assert _acked(root) is None
                    r.start()
                    _wait(lambda: r.said("sync failed") or not r.alive(), "a sync", r)
                # the disk refused even the wipe's state (the loop device refuses the blocks
                # of the files it removed; a plain full disk does not): the receiver is down,
                # v1 still not known durable, and an open wipes it once it can
                st = _state(ck)
                assert st is not None
                assert (st["version"], st.get("synced")) in ((None, None), (1, False))
                if r.alive():
                    assert _acked(root) is None and _lost(root, ck) == []
                (image.parent / "ballast").unlink()  # the disk has room again
                if not r.alive():
                    r.start()  # as its supervisor would
                _wait(lambda: r.said("applied version 1") and _acked(root) == 1, "v1 again", r)
                assert _lost(root, ck) == []
                assert r.proc is not None
                r.proc.send_signal(signal.SIGTERM)
                assert r.proc.wait(60) == 0
                st = _state(ck)
                assert st is not None and (st["version"], st.get("synced", True)) == (1, True)
                assert _lost(root, ck) == []
