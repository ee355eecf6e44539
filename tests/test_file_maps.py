"""FileMaps' kernel calls over the checkpoint's mapped files: the prefault and the flush fault in
and write back every page, and neither holds the GIL while the kernel works (Python's own
``mmap.madvise`` and ``mmap.flush`` do, tens to hundreds of ms per GiB during which every other
thread of the receiver stalls: the next version's apply, its acks, the status server).

"Holds the GIL" is told without timing: with no forced switches (a huge switch interval), a
thread spinning on a counter (and yielding the GIL after each step) can run during a C call
only if that call released the GIL, so the counter read before and after the call is unchanged
exactly when it held it.
"""

from __future__ import annotations

import errno
import itertools
import json
import mmap
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from asyncsync.codec import native
from asyncsync.errors import EngineStateError
from receiver.engines.st_layout import FileMaps, TensorLocation, _page_runs, read_layout

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux mm calls")

_BIG = 256 << 20  # long enough (tens of ms) for a waiting thread to be scheduled inside it
RanDuring = Callable[..., bool]


@pytest.fixture
def spinner() -> Iterator[RanDuring]:
    """``ran_during(call)``: whether another Python thread ran while ``call`` was in C."""
    count = [0]
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            count[0] += 1
            time.sleep(0)  # hands the GIL back (the main thread needs no forced switch)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)  # no forced switch: the spinner runs only when it is free
    thread = threading.Thread(target=spin, daemon=True)
    thread.start()

    def ran_during(call: Callable[[], object], prepare: Callable[[], object] = int) -> bool:
        for _ in range(5):  # a loaded machine may not schedule the spinner in time: retry
            prepare()  # (torch ops release the GIL: not inside the count)
            before = count[0]
            call()
            if count[0] != before:
                return True
        return False

    try:
        yield ran_during
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(old)


def _file(tmp_path: Path, size: int) -> TensorLocation:
    path = tmp_path / "model.bin"
    with open(path, "wb") as f:
        f.truncate(size)
    return TensorLocation("t", path.name, torch.uint8, (size,), 0, size)


def _fs_type(path: Path) -> str:
    """The filesystem type of the mount holding ``path`` (/proc/self/mounts)."""
    best, kind = "", ""
    real = os.path.realpath(path)
    with open("/proc/self/mounts") as f:
        for line in f:
            fields = line.split()
            mnt = fields[1].replace("\\040", " ")
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, kind = mnt, fields[2]
    return kind


def _needs_writeback(path: Path) -> None:
    if _fs_type(path) in ("tmpfs", "ramfs"):  # pages stay dirty: there is nothing to write to
        pytest.skip(f"{path} is on a filesystem without writeback")


def _dirty_kb(path: Path) -> int:
    """Dirty kB of this process's mappings of ``path`` (/proc/self/smaps: PTE or page dirty)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
                inside = line.rstrip("\n").endswith(str(path))
            elif inside and head[0] in ("Shared_Dirty:", "Private_Dirty:"):
                total += int(head[1])
    return total


needs_kernel = pytest.mark.skipif(
    native.kernels is None or not hasattr(native.kernels, "populate_write"),
    reason="the C kernels are not built",
)


@needs_kernel
def test_populate_write_faults_every_page_in_writable(tmp_path: Path) -> None:
    loc = _file(tmp_path, 64 << 20)
    fd = os.open(tmp_path / loc.file, os.O_RDWR)
    mm = mmap.mmap(fd, 0)
    try:
        assert _dirty_kb(tmp_path / loc.file) == 0
        try:
            native.kernels.populate_write(mm, 0, len(mm))
        except OSError as exc:  # a kernel before 5.14
            pytest.skip(f"MADV_POPULATE_WRITE: {exc}")
        assert _dirty_kb(tmp_path / loc.file) == 64 << 10  # mapped writable, marked dirty
    finally:
        mm.close()
        os.close(fd)


@needs_kernel
@pytest.mark.parametrize(
    ("start", "length", "error"),
    [
        (-4096, 4096, "outside"),
        (0, -1, "outside"),
        (0, (8 << 20) + 1, "outside"),
        (8 << 20, 1, "outside"),
        (100, 4096, "page boundary"),
    ],
)
def test_populate_write_refuses_a_bad_range(start: int, length: int, error: str) -> None:
    mm = mmap.mmap(-1, 8 << 20)
    with pytest.raises(ValueError, match=error):
        native.kernels.populate_write(mm, start, length)
    mm.close()  # no buffer export left behind by the refusal


@needs_kernel
def test_populate_write_refuses_read_only_and_non_buffers() -> None:
    with pytest.raises(TypeError, match="writable"):
        native.kernels.populate_write(b"x" * 8192, 0, 4096)
    with pytest.raises(TypeError, match="buffer protocol"):
        native.kernels.populate_write(object(), 0, 0)


@pytest.fixture
def anon() -> Iterator[mmap.mmap]:
    """A private anonymous map of _BIG bytes (MADV_DONTNEED frees its pages again)."""
    mm = mmap.mmap(-1, _BIG, flags=mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20))
    yield mm
    mm.close()


def _drop(mm: mmap.mmap) -> None:
    mm.madvise(mmap.MADV_DONTNEED)  # the next populate faults every page in again


@needs_kernel
def test_populate_write_releases_the_gil(spinner: RanDuring, anon: mmap.mmap) -> None:
    try:
        native.kernels.populate_write(anon, 0, _BIG)
    except OSError as exc:
        pytest.skip(f"MADV_POPULATE_WRITE: {exc}")
    assert spinner(lambda: native.kernels.populate_write(anon, 0, _BIG), lambda: _drop(anon))


def test_a_spinner_cannot_run_inside_a_call_that_holds_the_gil(
    spinner: RanDuring, anon: mmap.mmap
) -> None:
    """The check above can fail: ``mmap.madvise`` holds the GIL (CPython 3.11-3.13)."""
    if sys.version_info >= (3, 14):
        pytest.skip("a later CPython may release the GIL in mmap.madvise")
    advice = getattr(mmap, "MADV_POPULATE_WRITE", 23)
    try:
        anon.madvise(advice, 0, _BIG)
    except OSError as exc:
        pytest.skip(f"MADV_POPULATE_WRITE: {exc}")
    assert not spinner(lambda: anon.madvise(advice, 0, _BIG), lambda: _drop(anon))


def _dirtying(call: Callable[[], bool]) -> tuple[bool, int]:
    """``call()``'s result and the page-cache bytes this process dirtied during it:
    ``write_bytes`` of /proc/self/io, which the kernel adds to as each clean page becomes dirty,
    and which a writeback starting meanwhile (memory pressure, another process's dirty data) does
    not take back, as it does the dirty count of /proc/self/smaps."""

    def written() -> int:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("write_bytes:"):
                return int(line.split()[1])
        raise AssertionError("no write_bytes in /proc/self/io")

    before = written()
    result = call()
    return result, written() - before


def test_prefault_maps_the_range_and_releases_the_gil(tmp_path: Path, spinner: RanDuring) -> None:
    _needs_writeback(tmp_path)  # each try below starts from pages the writeback cleaned
    loc = _file(tmp_path, _BIG)
    maps = FileMaps(tmp_path)
    try:
        done, dirtied = _dirtying(lambda: maps.prefault(loc))
        assert done or pytest.skip("no MADV_POPULATE_WRITE here")
        # writable and dirty now: every page, without one fault each as a patch writes (the
        # call's write faults dirtied them: nothing else writes to the new file)
        assert dirtied >= _BIG
        if native.kernels is not None and hasattr(native.kernels, "populate_write"):
            # each try after a writeback, which write-protects the pages again
            assert spinner(lambda: maps.prefault(loc), maps.sync)
    finally:
        maps.close()


def test_sync_writes_back_the_pages_written_through_the_map(tmp_path: Path) -> None:
    """On Linux the flush is fsync alone (no msync): it must still write back (and clean)
    every page dirtied through the shared mapping, and the bytes must be in the file."""
    _needs_writeback(tmp_path)
    loc = _file(tmp_path, 16 << 20)
    maps = FileMaps(tmp_path)
    try:
        flat = maps.flat(loc)
        flat[:: mmap.PAGESIZE] = 7  # one byte in every page
        assert _dirty_kb(tmp_path / loc.file) >= (16 << 10) * 9 // 10
        maps.sync()
        assert _dirty_kb(tmp_path / loc.file) == 0
    finally:
        maps.close()
    fd = os.open(tmp_path / loc.file, os.O_RDONLY)
    try:
        data = os.pread(fd, 16 << 20, 0)
    finally:
        os.close(fd)
    assert data[:: mmap.PAGESIZE] == bytes([7]) * ((16 << 20) // mmap.PAGESIZE)


def test_sync_after_unmap_writes_back_the_pages_written_through_the_dropped_map(
    tmp_path: Path,
) -> None:
    """The flush drops its maps' mappings when it is submitted (``unmap``: held through it,
    they counted every page the next version mapped again twice in the receiver's RSS) and
    keeps the descriptors. The pages dirtied through the dropped mapping stay dirty in the
    page cache, and ``sync`` (fsync of the descriptors) writes them back and cleans them."""
    _needs_writeback(tmp_path)
    loc = _file(tmp_path, 16 << 20)
    path = tmp_path / loc.file
    maps = FileMaps(tmp_path)
    try:
        maps.flat(loc)[:: mmap.PAGESIZE] = 7  # one byte in every page
        maps.unmap()
        assert str(path) not in Path("/proc/self/maps").read_text()
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as probe:
            assert sum(probe[:: mmap.PAGESIZE]) == 7 * ((16 << 20) // mmap.PAGESIZE)  # mapped
            assert _dirty_kb(path) >= (16 << 10) // 2  # the pages' own dirty flags
            maps.sync()
            assert _dirty_kb(path) == 0
    finally:
        maps.close()
    assert str(path) not in Path("/proc/self/maps").read_text()


def test_sync_writes_back_with_the_gil_released(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writeback itself runs without the GIL: a thread armed just before ``sync`` first runs
    inside it and still finds most pages dirty. (``mmap.flush`` writes them back holding the
    GIL: the ``fsync`` after it, where another thread first runs, finds them clean.) The file is
    mapped without MADV_HUGEPAGE here: in 2 MiB folios the writeback cleans the dirty bits a
    folio at a time, fast enough that the watcher found none left in 1 try of 5 (the I/O waits
    after, on pages no longer dirty): this test counts dirty pages, not huge folios."""
    import receiver.engines.st_layout as st_layout

    monkeypatch.setattr(st_layout, "_MADV_HUGEPAGE", None)
    _needs_writeback(tmp_path)
    loc = _file(tmp_path, _BIG)
    path = tmp_path / loc.file
    maps = FileMaps(tmp_path)
    half = (_BIG >> 10) // 2  # kB: most pages still dirty when the watcher first looks
    seen: list[int] = []
    armed = [False]  # a plain store: setting it never lets go of the GIL (Event.set may)
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            if armed[0]:
                armed[0] = False
                seen.append(_dirty_kb(path))
            time.sleep(0)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        flat = maps.flat(loc)
        for _ in range(5):
            flat[:: mmap.PAGESIZE] += 1  # every page dirty (torch releases the GIL here)
            armed[0] = True  # the watcher can look only once the main thread lets go of the GIL
            maps.sync()
            armed[0] = False
            if max(seen, default=0) > half:
                break
        assert max(seen, default=0) > half, seen
        assert _dirty_kb(path) == 0
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(old)
        maps.close()


@pytest.mark.parametrize("begin", [0, 100, mmap.PAGESIZE - 2])
def test_page_runs_are_the_pages_holding_the_positions(begin: int) -> None:
    """The prefault of a sparse patch on a copy-on-write filesystem faults in exactly the pages
    its elements lie on (an element may straddle two), in runs, within the file."""
    n = 10 * mmap.PAGESIZE // 4
    loc = TensorLocation("t", "f", torch.float32, (n,), begin, begin + 4 * n)
    pos = torch.tensor([0, 1, 1000, 1001, 1024, 5000, n - 1])
    runs = _page_runs(loc, pos, loc.end)
    got: set[int] = set()
    for start, end in runs:
        assert start % mmap.PAGESIZE == 0 and start < end <= loc.end
        got |= set(range(start // mmap.PAGESIZE, -(-end // mmap.PAGESIZE)))
    at = [begin + 4 * int(p) for p in pos]
    assert got == {a // mmap.PAGESIZE for a in at} | {(a + 3) // mmap.PAGESIZE for a in at}
    assert all(a[1] < b[0] for a, b in itertools.pairwise(runs))  # apart: true runs
    assert _page_runs(loc, torch.empty(0, dtype=torch.int64), loc.end) == []


@pytest.mark.parametrize(("code", "raised"), [(errno.EFAULT, errno.ENOSPC), (errno.EINVAL, None),
                                              (errno.ENOMEM, None)])  # fmt: skip
def test_a_prefault_the_kernel_cannot_do_is_an_error_only_for_efault(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, raised: int | None
) -> None:
    """EFAULT from ``MADV_POPULATE_WRITE``: a page the kernel cannot make writable (a full
    copy-on-write filesystem; a write there would be SIGBUS) is an ENOSPC naming the tensor and
    its file. Any other error (an older kernel, memory pressure) leaves the patch to fault its
    pages in as before. A fake kernel: a real full btrfs gives EFAULT only by chance now that
    the checkpoint's files are no-copy-on-write (tests/test_full_disk.py)."""
    loc = _file(tmp_path, 1 << 16)

    class Kernels:
        def populate_write(self, *_: object) -> None:
            raise OSError(code, os.strerror(code))

    monkeypatch.setattr(native, "kernels", Kernels())
    maps = FileMaps(tmp_path)
    try:
        if raised is None:
            assert maps.prefault(loc) is False
            return
        with pytest.raises(OSError, match=f"{loc.name!r} writable") as info:
            maps.prefault(loc)
        assert info.value.errno == raised and info.value.filename == str(tmp_path / loc.file)
    finally:
        maps.close()


def test_a_prefault_past_a_file_cut_behind_its_back_says_so(tmp_path: Path) -> None:
    """A data file truncated while the receiver has it mapped (found by attack: ``truncate``
    on a running receiver's checkpoint): the kernel's EFAULT was said as "no space to overwrite
    them (a full copy-on-write filesystem?)", blaming a full disk. The real kernel call here."""
    loc = _file(tmp_path, 1 << 20)
    maps = FileMaps(tmp_path)
    try:
        maps.flat(loc)  # mapped at its full size
        os.truncate(tmp_path / loc.file, 1 << 16)
        try:
            done = maps.prefault(loc)
        except OSError as exc:
            assert exc.errno == errno.EIO, exc
            assert "is 65536 bytes now" in str(exc) and "cut behind" in str(exc), exc
            assert exc.filename == str(tmp_path / loc.file)
        else:
            if not done:  # no MADV_POPULATE_WRITE here, or an error other than EFAULT
                pytest.skip("the kernel did not say EFAULT past the end of the file")
            pytest.fail("a prefault past the end of the file succeeded")
    finally:
        maps.close()


def _vm_flags(path: Path) -> list[str]:
    """The VmFlags of this process's mappings of ``path`` (/proc/self/smaps)."""
    out: list[list[str]] = []
    name = os.path.realpath(path)
    with open("/proc/self/smaps") as f:
        mine = False
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
                mine = head[-1] == name
            elif mine and line.startswith("VmFlags:"):
                out.append(head[1:])
    return [flag for flags in out for flag in flags] if out else []


_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@pytest.mark.skipif(
    not _THP.exists() or "[never]" in _THP.read_text(), reason="no transparent huge pages here"
)
def test_the_mappings_ask_for_huge_folios(tmp_path: Path) -> None:
    """A data file is mapped with MADV_HUGEPAGE: its pages faulted in through the map come as
    PMD-sized folios whatever the device's read-ahead (at 128 KiB a cold 256 MiB file's
    populate cost 49 ms of CPU against 15.5 with it, and every version after ~15 % more)."""
    loc = _file(tmp_path, 4 << 20)
    maps = FileMaps(tmp_path)
    try:
        maps.flat(loc)[:1] = 1  # mapped (the first touch maps the file)
        flags = _vm_flags(tmp_path / loc.file)
        assert flags, "the file is not mapped"
        assert "hg" in flags, flags
    finally:
        maps.close()


@pytest.mark.parametrize(
    ("entry", "words"),
    [
        ({"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8]}, "no supported dtype"),
        ({"dtype": {"F32": 1}, "shape": [2], "data_offsets": [0, 8]}, "no supported dtype"),
        ({"dtype": "F4", "shape": [2], "data_offsets": [0, 8]}, "no supported dtype"),
        ({"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}, "invalid shape"),
        ({"dtype": "F32", "shape": [2], "data_offsets": [0, True]}, "invalid data_offsets"),
        ({"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}, "does not fit"),
        ([0, 8], "no supported dtype"),
    ],
)
def test_a_damaged_local_header_is_an_engine_state_error(
    tmp_path: Path, entry: object, words: str
) -> None:
    """The local checkpoint's own files (``st_layout.read_layout``): any damaged entry is one
    EngineStateError naming the file (a list or dict as the dtype raised TypeError)."""
    text = json.dumps({"w": entry}).encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(len(text).to_bytes(8, "little") + text + bytes(8))
    with pytest.raises(EngineStateError, match=words) as info:
        read_layout(path)
    assert str(path) in str(info.value)
