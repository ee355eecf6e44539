"""Filesystem primitives: atomic writes, directory fsync tolerance, locks, the throttle."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from asyncsync import fsio
from asyncsync.fsio import FileLock, Throttle, atomic_write, fsync_dir, read_bytes


def test_atomic_write_replaces_whole_or_not_at_all(tmp_path: Path) -> None:
    p = tmp_path / "f"
    atomic_write(p, b"old")

    def chunks():  # type: ignore[no-untyped-def]
        yield b"new"
        raise RuntimeError("writer died")

    with pytest.raises(RuntimeError):
        atomic_write(p, chunks())
    assert p.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["f"]  # no temp file left
    assert atomic_write(p, [b"a", bytearray(b"b"), memoryview(b"c")]) == 3
    assert p.read_bytes() == b"abc" and oct(p.stat().st_mode & 0o777) == oct(fsio.FILE_MODE)


def test_dir_fsync_unsupported_is_not_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def einval(fd: int) -> None:
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(os, "fsync", einval)
    fsync_dir(tmp_path)  # NFS/FUSE answer EINVAL: "not needed"

    def eio(fd: int) -> None:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(os, "fsync", eio)
    with pytest.raises(OSError):
        fsync_dir(tmp_path)


def test_read_bytes_limit(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"x" * 10)
    assert read_bytes(tmp_path / "f", limit=10) == b"x" * 10
    with pytest.raises(ValueError):
        read_bytes(tmp_path / "f", limit=9)


def test_file_lock_is_exclusive_and_names_holder(tmp_path: Path) -> None:
    a, b = FileLock(tmp_path / "lock"), FileLock(tmp_path / "lock")
    assert a.acquire() and a.held
    assert not b.acquire()
    assert str(os.getpid()) in b.holder()
    a.release()
    assert b.acquire()
    b.release()


def test_throttle_parse_and_scope() -> None:
    t = Throttle.parse("200MB/s,5ms@/shared/root")
    assert (t.bandwidth, t.latency, t.root) == (200e6, 0.005, "/shared/root")
    assert t.applies_to("/shared/root/v000000000001/delta-00000.safetensors")
    assert not t.applies_to("/shared/rootless/x")
    assert not t.applies_to("/local/ckpt/model.safetensors")
    assert Throttle.parse("1GiB/s").applies_to("/anywhere")
    assert Throttle.parse("10ms").cost(10**9) == 0.01
    assert Throttle(bandwidth=100.0).cost(50) == 0.5
    with pytest.raises(ValueError, match="cannot parse"):
        Throttle.parse("fast")
    with pytest.raises(ValueError):
        Throttle(bandwidth=0)
