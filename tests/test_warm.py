"""A delta's begin warms the checkpoint's pages (``FileMaps.warm``): the tensors its patch will
most likely prefault whole are faulted in writable on a thread of their own from the begin on,
while the trainer still writes the shards the patch waits for, so that page-cache work is not
inside the apply. Best effort and bounded: the sparse tensors are left to the patch, a failure
of the kernel call ends the warm-up quietly, and every way out of the version (commit, abort,
the flush's sync, the unmap after the ack) stops it before the mappings go."""

from __future__ import annotations

import contextlib
import errno
import os
import pickle
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

from asyncsync.codec import native
from receiver.engines.checkpoint import inplace
from receiver.engines.st_layout import FileMaps, TensorLocation
from tests import test_engines as te
from tests.conftest import mutate
from tests.mounts import btrfs, fill
from tests.test_file_maps import _dirty_kb, needs_kernel

_MIB = 1 << 20
REPO = Path(__file__).resolve().parent.parent


def _files(tmp_path: Path, *sizes: int) -> list[TensorLocation]:
    """One file per tensor, each ``size`` bytes (a hole: no page in the cache yet)."""
    locs = []
    for i, size in enumerate(sizes):
        path = tmp_path / f"f{i}.bin"
        with open(path, "wb") as f:
            f.truncate(size)
        locs.append(TensorLocation(f"t{i}", path.name, torch.uint8, (size,), 0, size))
    return locs


def _warmer(maps: FileMaps) -> threading.Thread:
    assert maps._warming is not None
    return maps._warming[0]


@needs_kernel
def test_a_warm_up_faults_the_tensors_it_is_given_in_writable(tmp_path: Path) -> None:
    warm, cold = _files(tmp_path, 8 * _MIB, 8 * _MIB)
    maps = FileMaps(tmp_path)
    try:
        maps.warm([warm])
        _warmer(maps).join(60)
        assert not _warmer(maps).is_alive()
        assert _dirty_kb(tmp_path / warm.file) == 8 * _MIB >> 10  # every page, marked dirty
        assert _dirty_kb(tmp_path / cold.file) == 0  # not mapped at all
        maps.warm([cold])  # one warm-up per version: the second call is a no-op
        assert _dirty_kb(tmp_path / cold.file) == 0
    finally:
        maps.close()


Populate = Callable[[Callable[[object, int, int], None], object, int, int], None]


def _fake_populate(monkeypatch: pytest.MonkeyPatch, populate: Populate) -> None:
    """The C kernels as they are, but ``populate_write(mm, start, length)`` calls
    ``populate(real_populate_write, mm, start, length)``."""
    real = native.kernels.populate_write

    class Kernels:
        def __getattr__(self, name: str) -> object:
            return getattr(real.__self__, name)  # type: ignore[attr-defined]

        @staticmethod
        def populate_write(mm: object, start: int, length: int) -> None:
            populate(real, mm, start, length)

    monkeypatch.setattr(native, "kernels", Kernels())


@needs_kernel
@pytest.mark.parametrize("way_out", ["close", "unmap", "sync"])
def test_every_way_out_of_a_version_stops_the_warm_up_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, way_out: str
) -> None:
    """The warm-up is held inside its first populate until ``way_out`` has been called: that
    call returns only after the thread has ended (it never populates a mapping being closed),
    and the thread stops at the next span instead of going on through the rest."""
    (loc,) = _files(tmp_path, 4 * _MIB)
    entered, release, calls = threading.Event(), threading.Event(), []

    def held(real: Callable[..., None], mm: object, start: int, length: int) -> None:
        calls.append(start)  # held at its first call
        entered.set()
        assert release.wait(60)
        real(mm, start, length)

    _fake_populate(monkeypatch, held)
    monkeypatch.setattr("receiver.engines.st_layout._WARM_SPAN", _MIB)
    maps = FileMaps(tmp_path)
    maps.warm([loc])
    assert entered.wait(60)
    done = threading.Event()

    def leave() -> None:
        getattr(maps, way_out)()
        done.set()

    leaving = threading.Thread(target=leave)
    leaving.start()
    assert not done.wait(0.2)  # waits for the populate in flight
    release.set()
    leaving.join(60)
    assert done.is_set() and not _warmer(maps).is_alive()
    assert calls == [0]  # stopped after its first span of four
    maps.close()


@needs_kernel
def test_a_warm_up_starts_once_the_flush_before_it_is_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The previous version's flush writes back every dirty page of the files: a page warmed
    meanwhile would be written twice (by that flush, and after the patch dirtied it again).
    Until that flush is done the warm-up faults nothing in; stopped meanwhile, it never does."""
    first, second = _files(tmp_path, 2 * _MIB, 2 * _MIB)
    populated = threading.Event()

    def seen(real: Callable[..., None], mm: object, start: int, length: int) -> None:
        populated.set()
        real(mm, start, length)

    _fake_populate(monkeypatch, seen)
    flush: Future[None] = Future()
    maps = FileMaps(tmp_path)
    maps.warm([first], after=flush)
    assert not populated.wait(0.5)  # (without the wait it populates as its thread starts)
    flush.set_result(None)
    assert populated.wait(60)
    _warmer(maps).join(60)
    assert _dirty_kb(tmp_path / first.file) == 2 * _MIB >> 10
    maps.close()
    populated.clear()
    never = FileMaps(tmp_path)
    never.warm([second], after=Future())  # a flush that does not end before the version does
    never.close()
    assert not _warmer(never).is_alive() and not populated.is_set()


@needs_kernel
def test_a_warm_up_faults_in_no_more_than_its_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pages warmed long before the patch reaches them would meet the kernel's dirty-page
    limits first and be written back twice: the warm-up takes the tensors in order while they
    fit its budget (a tensor larger than what is left is the patch's, as before)."""
    monkeypatch.setattr("receiver.engines.st_layout._WARM_BYTES", 5 * _MIB)
    a, big, b, c = _files(tmp_path, 2 * _MIB, 8 * _MIB, 2 * _MIB, 2 * _MIB)
    maps = FileMaps(tmp_path)
    maps.warm([a, big, b, c])
    _warmer(maps).join(60)
    assert [_dirty_kb(tmp_path / loc.file) >> 10 for loc in (a, big, b, c)] == [2, 0, 2, 0]
    maps.close()


@needs_kernel
def test_a_warm_up_the_kernel_refuses_ends_quietly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EFAULT (no space to overwrite: a full copy-on-write disk) ends the warm-up without an
    error of its own: the patch's prefault of that tensor is what raises it, naming the file."""
    (loc,) = _files(tmp_path, 2 * _MIB)
    failed: list[BaseException] = []

    def refused(_real: Callable[..., None], _mm: object, _start: int, _length: int) -> None:
        raise OSError(errno.EFAULT, "Bad address")

    _fake_populate(monkeypatch, refused)
    monkeypatch.setattr(threading, "excepthook", lambda args: failed.append(args.exc_value))
    maps = FileMaps(tmp_path)
    maps.warm([loc])
    _warmer(maps).join(60)
    assert failed == [] and _dirty_kb(tmp_path / loc.file) == 0
    with pytest.raises(OSError) as info:
        maps.prefault(loc)
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(tmp_path / loc.file)
    maps.close()


@needs_kernel
@pytest.mark.parametrize("allocating", [False, True], ids=["overwrite-in-place", "copy-on-write"])
def test_a_warmed_tensor_is_not_prefaulted_again_and_none_where_overwrites_allocate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, allocating: bool
) -> None:
    """Once warmed, a tensor's own prefault is skipped where a write fault cannot fail (a
    flush in between may make its pages read-only again: they fault back, nothing more). On a
    copy-on-write filesystem nothing is warmed (each dirty page would hold new space from the
    begin on) and the patch prefaults it, so that no page the patch writes can SIGBUS."""
    (loc,) = _files(tmp_path, 4 * _MIB)
    monkeypatch.setattr("receiver.engines.st_layout.overwrites_allocate", lambda _d: allocating)
    maps = FileMaps(tmp_path)
    maps.warm([loc])
    if allocating:
        assert maps._warming is None and _dirty_kb(tmp_path / loc.file) == 0
    else:
        _warmer(maps).join(60)
    calls = []

    def counted(real: Callable[..., None], mm: object, start: int, length: int) -> None:
        calls.append((start, length))
        real(mm, start, length)

    _fake_populate(monkeypatch, counted)
    assert maps.prefault(loc) is True
    assert calls == ([(0, 4 * _MIB)] if allocating else [])
    maps.close()


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "dense.weight": torch.randn(1 << 20, generator=g).to(torch.bfloat16),  # 2 MiB
        "sparse.weight": torch.randn(1 << 20, generator=g).to(torch.bfloat16),
    }


def test_only_the_tensors_that_changed_on_most_pages_are_warmed(tmp_path: Path) -> None:
    sd0 = _state(0)
    sd1 = mutate(sd0, 0.03, seed=1, names=["dense.weight"])  # ~61 a page
    sd1 = mutate(sd1, 0.0001, seed=2, names=["sparse.weight"])  # ~0.2 a page
    layout = {
        name: TensorLocation(name, "m.safetensors", t.dtype, tuple(t.shape), 0, t.nbytes)
        for name, t in sd0.items()
    }
    delta = te.build_manifest(sd1, 1, base=sd0)
    assert [loc.name for loc in inplace.likely_dense(delta, layout)] == ["dense.weight"]
    assert inplace.likely_dense(te.build_manifest(sd0, 0), layout) == []  # no base: all changed
    everything = te.build_manifest(mutate(sd0, 0.9, seed=3), 1, base=sd0)
    assert inplace.likely_dense(everything, layout) == []  # the patch prefaults it as it goes


@needs_kernel
async def test_a_delta_begun_warms_its_dense_tensors_before_any_shard_is_applied(
    tmp_path: Path,
) -> None:
    sd0 = _state(0)
    ck = await te.init_checkpoint(tmp_path, sd0)
    sd1 = mutate(sd0, 0.03, seed=1, names=["dense.weight"])
    sd1 = mutate(sd1, 0.0001, seed=2, names=["sparse.weight"])
    m1 = te.build_manifest(sd1, 1, base=sd0)
    await te.apply_version(ck, m1, te.delta_batches(m1, sd0, sd1, "xor"), "delta")
    await ck.flushed()  # v1 durable: its pages clean, unmapped
    sd2 = mutate(sd1, 0.03, seed=4, names=["dense.weight"])
    m2 = te.build_manifest(sd2, 2, base=sd1)
    await ck.begin(m2, "delta")
    txn = ck._txn
    assert txn is not None and txn.maps is not None
    _warmer(txn.maps).join(60)
    dense = ck._layout["dense.weight"]
    file = tmp_path / dense.file
    assert _dirty_kb(file) >= (dense.nbytes >> 10) - 8  # its pages, before any shard
    for batch in te.delta_batches(m2, sd1, sd2, "xor"):
        await ck.apply(batch)
    await ck.commit()
    await ck.acknowledged()
    te.assert_same(ck.load_state_dict(), sd2)
    await ck.close()


@needs_kernel
async def test_a_warm_up_that_cannot_start_its_thread_leaves_the_delta_to_apply(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under a thread limit (a container's ``pids.max``) ``Thread.start`` raises RuntimeError:
    the warm-up is best effort, so the delta applies without it (every delta failed, each
    leaving its descriptors open, where the receiver without the warm-up applied them)."""
    real = threading.Thread.start

    def start(self: threading.Thread) -> None:
        if self.name == "asyncsync-warm":
            raise RuntimeError("can't start new thread")
        real(self)

    sd0 = _state(0)
    ck = await te.init_checkpoint(tmp_path, sd0)
    monkeypatch.setattr(threading.Thread, "start", start)
    sd = sd0
    for v in (1, 2):
        new = mutate(sd, 0.03, seed=v, names=["dense.weight"])
        m = te.build_manifest(new, v, base=sd)
        await te.apply_version(ck, m, te.delta_batches(m, sd, new, "xor"), "delta")
        await ck.flushed()
        sd = new
    te.assert_same(ck.load_state_dict(), sd)
    await ck.close()
    assert not [fd for fd in _fds() if Path(fd).parent == tmp_path]  # none left open


def _fds() -> list[str]:
    """Where this process's open descriptors point."""
    out = []
    for fd in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):
            out.append(os.readlink(fd))
    return out


@contextlib.contextmanager
def _memory_cgroup(name: str) -> Iterator[Path]:
    """A fresh memory cgroup (v1 or v2), removed after; skips where none can be made."""
    v1, v2 = Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup")
    if os.geteuid() != 0:
        pytest.skip("needs root to make a memory cgroup")
    if (v1 / "memory.limit_in_bytes").exists():
        at = v1 / name
    elif "memory" in (v2 / "cgroup.controllers").read_text(errors="replace").split():
        at = v2 / name
    else:
        pytest.skip("no memory cgroup controller")
    try:
        at.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot make a memory cgroup: {exc}")
    try:
        yield at
    finally:
        os.rmdir(at)


_WARM_IN_CGROUP = """
import asyncio, os, pickle, sys, threading
from pathlib import Path
from receiver.engines.checkpoint import LocalCheckpoint

async def main(ck_dir, manifest, cgroup, limit):
    ck = LocalCheckpoint(Path(ck_dir))
    await ck.open()
    for p in Path(ck_dir).glob("*.safetensors"):  # not in the page cache (nor charged)
        fd = os.open(p, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    Path(cgroup, "cgroup.procs").write_text(str(os.getpid()))
    v1 = Path(cgroup, "memory.limit_in_bytes")
    (v1 if v1.exists() else Path(cgroup, "memory.max")).write_text(str(limit))
    read = lambda: int(Path("/proc/self/io").read_text().split("read_bytes: ")[1].split()[0])
    before = read()
    with open(manifest, "rb") as f:
        await ck.begin(pickle.load(f), "delta")
    for t in threading.enumerate():
        if t.name == "asyncsync-warm":
            t.join()
    print(read() - before)
    await ck.abort()
    await ck.close()

asyncio.run(main(*sys.argv[1:4], int(sys.argv[4])))
"""


@needs_kernel
async def test_a_warm_up_brings_in_no_more_than_memory_holds(tmp_path: Path) -> None:
    """In a cgroup whose memory holds less than the dense tensors (a model larger than the
    receiver's memory), a warm-up of all of them pushed out the pages it faulted first (after
    writing them back, unchanged) before the patch came to them: at 1 GiB in 640 MiB, twice
    the reads and the writes of the version. It stops at half the room the cgroup has (the
    kernel's readahead may read a little past it)."""
    g = torch.Generator().manual_seed(0)
    sd0 = {
        f"l{i:02d}.weight": torch.randn(8 << 20, generator=g).to(torch.bfloat16) for i in range(16)
    }  # fmt: skip  (16 x 16 MiB)
    ck = await te.init_checkpoint(tmp_path / "ck", sd0)
    await ck.close()
    m1 = te.build_manifest(mutate(sd0, 0.03, seed=1), 1, base=sd0)
    assert len(inplace.likely_dense(m1, ck._layout)) == 16
    (tmp_path / "m1.pkl").write_bytes(pickle.dumps(m1))
    limit = 128 * _MIB
    with _memory_cgroup(f"asyncsync-warm-{os.getpid()}") as cgroup:
        r = subprocess.run(
            [sys.executable, "-c", _WARM_IN_CGROUP, str(tmp_path / "ck"), str(tmp_path / "m1.pkl"),
             str(cgroup), str(limit)],
            capture_output=True, text=True, timeout=120, cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    # half the room, and the readahead past it (read_ahead_kb): was all 256 MiB, some twice
    assert int(r.stdout.split()[-1]) <= limit


_RECEIVE = """
import asyncio, pickle, sys
from pathlib import Path
from asyncsync.errors import ApplyFailed
from receiver.engines.checkpoint import LocalCheckpoint

async def main(ck_dir, delta):
    with open(delta, "rb") as f:
        m, batches = pickle.load(f)
    ck = LocalCheckpoint(Path(ck_dir))
    await ck.open()
    try:
        await ck.begin(m, "delta")
        for b in batches:
            await ck.apply(b)
        await ck.commit()
    except ApplyFailed as exc:
        await ck.abort()  # (raised where the rollback failed)
        print("refused:", exc)
    await ck.close()

asyncio.run(main(*sys.argv[1:]))
"""


@needs_kernel
@pytest.mark.parametrize(("leave", "applies"), [(2 << 20, False), (24 << 20, True)])
async def test_no_warm_up_holds_the_space_of_a_nearly_full_copy_on_write_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, leave: int, applies: bool
) -> None:
    """Files that are copy-on-write on btrfs (made before the directory was ``chattr +C``, by
    an older receiver): each page the warm-up dirtied held new space for every dense tensor
    at once, from the begin on. With 24 MiB free a dense delta of a 32 MiB model applied; it
    failed there, and with 2 MiB free its rollback failed too (rc 1, where it was refused
    and rolled back). Never SIGBUS either way; the files hold the version the state names."""
    monkeypatch.setattr("receiver.engines.checkpoint.recovery.no_copy_on_write", lambda _d: False)
    g = torch.Generator().manual_seed(0)
    sd0 = {
        f"l{i:02d}.weight": torch.randn(1 << 20, generator=g).to(torch.bfloat16) for i in range(16)
    }  # fmt: skip  (16 x 2 MiB)
    sd1 = mutate(sd0, 0.03, seed=1)
    m1 = te.build_manifest(sd1, 1, base=sd0)
    (tmp_path / "d1.pkl").write_bytes(pickle.dumps((m1, te.delta_batches(m1, sd0, sd1, "xor"))))
    with btrfs(tmp_path / "cow") as mnt:
        await (await te.init_checkpoint(mnt / "ck", sd0)).close()
        fill(mnt, leave)
        r = subprocess.run(
            [sys.executable, "-c", _RECEIVE, str(mnt / "ck"), str(tmp_path / "d1.pkl")],
            capture_output=True, text=True, timeout=120, cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )  # fmt: skip
        assert r.returncode == 0, (r.returncode, r.stderr[-2000:])  # -7 would be SIGBUS
        assert ("refused:" not in r.stdout) == applies, r.stdout
        (mnt / "ballast").unlink()
        ck = te.LocalCheckpoint(mnt / "ck")
        assert (await ck.open()).version == (1 if applies else 0)
        te.assert_same(ck.load_state_dict(), sd1 if applies else sd0)
        await ck.close()
