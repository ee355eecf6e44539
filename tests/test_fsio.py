"""Filesystem primitives: atomic writes, directory fsync tolerance, locks, the throttle."""

from __future__ import annotations

import errno
import os
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from asyncsync import fsio
from asyncsync.fsio import FileLock, Throttle, atomic_write, fsync_dir


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


@pytest.mark.parametrize("read", [fsio.read_bytes, fsio.read_buffer])
def test_read_bytes_limit(tmp_path: Path, read: Any) -> None:
    (tmp_path / "f").write_bytes(b"x" * 10)
    assert read(tmp_path / "f", limit=10) == b"x" * 10
    with pytest.raises(ValueError):
        read(tmp_path / "f", limit=9)
    (tmp_path / "e").write_bytes(b"")
    assert read(tmp_path / "e", limit=0) == b""


def test_read_buffer_is_a_private_writable_copy_of_the_whole_file(tmp_path: Path) -> None:
    """What a full shard's tensors view (parse_shard): a bytearray of exactly the file's bytes,
    not sharing memory with anything else (writing into it changes neither the file nor a
    second read)."""
    data = os.urandom(3 << 20)
    (tmp_path / "f").write_bytes(data)
    got = fsio.read_buffer(tmp_path / "f", limit=len(data))
    assert type(got) is bytearray and got == data
    got[0] ^= 0xFF
    again = fsio.read_buffer(tmp_path / "f", limit=len(data))
    assert again == data == (tmp_path / "f").read_bytes()


def test_read_buffer_reads_on_past_a_size_that_lies_up_to_the_limit() -> None:
    """procfs reports a size of 0 for files that hold bytes: both readers read on, to the
    limit (one over it raises ValueError)."""
    want = Path("/proc/self/cmdline").read_bytes()
    assert want and os.stat("/proc/self/cmdline").st_size == 0
    pooled = partial(fsio.read_into, alloc=bytearray)
    for read in (fsio.read_bytes, fsio.read_buffer, pooled):
        assert read("/proc/self/cmdline", limit=1 << 16) == want
        with pytest.raises(ValueError):
            read("/proc/self/cmdline", limit=len(want) - 1)


def test_read_into_reads_the_file_into_the_buffer_it_is_given(tmp_path: Path) -> None:
    """A delta shard's read (a buffer of the scratch pool): exactly the file's bytes, as a
    read-only view of the buffer ``alloc`` gave (no copy: the buffer's pages are reused), never
    a larger one than the limit, nothing followed, and a buffer that cannot hold them refused."""
    data = os.urandom((2 << 20) + 123)
    (tmp_path / "f").write_bytes(data)
    given: list[bytearray] = []

    def alloc(n: int) -> bytearray:
        given.append(bytearray(n + 4096))  # larger than asked: the view is cut to the file
        return given[-1]

    got = fsio.read_into(tmp_path / "f", alloc, limit=len(data))
    assert type(got) is memoryview and got.readonly and got == data and len(got) == len(data)
    given[0][0] ^= 0xFF  # the view is the buffer's bytes
    assert got[0] == data[0] ^ 0xFF
    with pytest.raises(ValueError, match="larger than"):
        fsio.read_into(tmp_path / "f", alloc, limit=len(data) - 1)
    assert len(given) == 1  # refused before anything was allocated
    (tmp_path / "link").symlink_to(tmp_path / "f")
    with pytest.raises(fsio.UnsafePath):
        fsio.read_into(tmp_path / "link", alloc, limit=len(data))
    for bad in (lambda n: bytes(n), lambda n: bytearray(n - 1)):
        with pytest.raises(TypeError, match="no writable buffer"):
            fsio.read_into(tmp_path / "f", bad, limit=len(data))
    (tmp_path / "empty").write_bytes(b"")
    assert fsio.read_into(tmp_path / "empty", alloc, limit=10) == b""


def test_file_lock_is_exclusive_and_names_holder(tmp_path: Path) -> None:
    a, b = FileLock(tmp_path / "lock"), FileLock(tmp_path / "lock")
    assert a.acquire() and a.held
    assert not b.acquire()
    assert str(os.getpid()) in b.holder()
    a.release()
    assert b.acquire()
    b.release()


def test_file_lock_tells_when_its_file_is_no_longer_the_one_it_holds(tmp_path: Path) -> None:
    """An flock holds the inode it opened: once the file is removed or replaced, a second taker
    locks a new one at the same path. Each lock's token tells them apart (one process's too)."""
    path = tmp_path / "lock"
    a = FileLock(path)
    assert not a.intact()  # not held
    assert a.acquire() and a.intact()
    path.unlink()
    b = FileLock(path)
    assert b.acquire() and b.intact() and not a.intact()
    assert a.text != b.text and a.text.split()[:2] == b.text.split()[:2]  # pid host token
    path.unlink()
    (tmp_path / "elsewhere").write_bytes(b.text)
    path.symlink_to(tmp_path / "elsewhere")
    assert not b.intact()  # never read through a symlink
    a.release()
    b.release()
    assert not b.intact()


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


# --------------------------------------------------------------------------- issue 22
# The one way into a root: nothing below ``root`` is followed, nothing blocks on a FIFO.


@pytest.fixture
def hostile(tmp_path: Path) -> tuple[Path, Path]:
    """A root beside an outside directory holding a 0600 file and a subdirectory."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    (outside / "dir").mkdir(parents=True)
    (outside / "file").write_bytes(b"outside\n")
    (outside / "file").chmod(0o600)
    return root, outside


def test_reading_refuses_symlinks_fifos_and_directories_without_blocking(
    hostile: tuple[Path, Path],
) -> None:
    root, outside = hostile
    (root / "link").symlink_to(outside / "file")
    os.mkfifo(root / "fifo")  # no writer: a blocking open would wait forever
    (root / "dir").mkdir()
    (root / "sub").symlink_to(outside / "dir", target_is_directory=True)
    (outside / "dir" / "f").write_bytes(b"x")
    for name in ("link", "fifo", "dir", "sub/f"):
        with pytest.raises(fsio.UnsafePath):
            fsio.read_bytes(root / name, limit=100, root=root)
        with pytest.raises(fsio.UnsafePath):
            fsio.read_buffer(root / name, limit=100, root=root)
    assert fsio.read_bytes(root / "link", limit=100, follow_symlinks=True) == b"outside\n"
    with pytest.raises(fsio.UnsafePath, match="symlink"):
        fsio.scan(root / "sub", root=root)
    with pytest.raises(FileNotFoundError):
        fsio.read_bytes(root / "missing", limit=100, root=root)


def test_writing_never_goes_through_a_symlink_a_fifo_or_a_hard_link(
    hostile: tuple[Path, Path],
) -> None:
    root, outside = hostile
    (root / "a").symlink_to(outside / "file")
    atomic_write(root / "a", b"new", root=root)  # the link is replaced, its target untouched
    assert not (root / "a").is_symlink() and (root / "a").read_bytes() == b"new"
    (root / "log").symlink_to(outside / "file")
    os.mkfifo(root / "pipe")
    os.link(outside / "file", root / "hard")
    for name in ("log", "pipe", "hard"):
        with pytest.raises(fsio.UnsafePath):
            fsio.append_line(root / name, "x", root=root)
        with pytest.raises(fsio.UnsafePath):
            FileLock(root / name, root=root).acquire()
    (root / "sub").symlink_to(outside / "dir", target_is_directory=True)
    with pytest.raises(fsio.UnsafePath):
        atomic_write(root / "sub" / "f", b"x", root=root)
    with pytest.raises(fsio.UnsafePath):
        fsio.make_dir(root / "sub", root=root, exist_ok=True)
    fsio.remove_tree(root / "sub", root=root)  # the link, not the directory it names
    assert not (root / "sub").exists() and (outside / "dir").is_dir()
    assert (outside / "file").read_bytes() == b"outside\n"
    assert (outside / "file").stat().st_mode & 0o777 == 0o600
    assert os.listdir(outside / "dir") == []


def test_a_bad_throttle_env_is_a_config_error_at_start_up_not_an_import_failure(
    tmp_path: Path,
) -> None:
    """(helper-64) ASYNCSYNC_THROTTLE=fast made `import asyncsync.fsio` (so every import of
    asyncsync, the CLI too) fail with a raw ValueError traceback. Importing works now (no
    throttle); a Publisher, a ReceiverAgent and `asyncsync bench` refuse it as they start,
    with a ConfigError naming the variable (bench: one line, exit 1)."""
    import subprocess
    import sys

    script = f"""
import sys
from asyncsync import fsio
assert fsio.get_throttle() is None
from asyncsync import ConfigError, Publisher
from asyncsync.ops.cli import main
from receiver import ReceiverAgent
from receiver.engines.checkpoint import LocalCheckpoint
root = {str(tmp_path / "root")!r}
engine = LocalCheckpoint(root + "c")
for make in (lambda: Publisher(root), lambda: ReceiverAgent(root, engine, "e")):
    try:
        make()
    except ConfigError as exc:
        print("refused:", exc)
print("bench", main(["bench", "--quick", "--workdir", root + "b"]))
"""
    env = {**os.environ, "ASYNCSYNC_THROTTLE": "fast"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    said = "ASYNCSYNC_THROTTLE='fast': cannot parse throttle 'fast': use e.g. '200MB/s,5ms@/root'"
    assert done.stdout.splitlines() == [f"refused: {said}"] * 2 + ["bench 1"], done.stdout
    assert said in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert not (tmp_path / "rootb").exists()


def test_an_error_below_a_root_names_the_whole_path_not_the_last_component(
    tmp_path: Path,
) -> None:
    """Calls below ``root=`` act on a name relative to a directory descriptor, so the kernel's
    error named only the basename (an ack the receiver could not remove read "Permission
    denied: 'e1.json'"): it names the path the caller gave."""
    d = tmp_path / "acks" / "e1.json"
    d.mkdir(parents=True)  # a directory where a file is removed: EISDIR from unlink
    with pytest.raises(IsADirectoryError) as err:
        fsio.remove(d, root=tmp_path)
    assert err.value.filename == str(d)
    assert str(d) in str(err.value)
    gone = tmp_path / "gone" / "sub"
    with pytest.raises(FileNotFoundError) as err2:  # a directory missing on the way
        fsio.scan(gone, root=tmp_path)
    assert err2.value.filename == str(gone)
