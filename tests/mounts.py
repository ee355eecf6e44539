"""Real mounts for tests: two ``rclone mount`` views of one directory; a bindfs view (FUSE:
inotify is blind to writes through the other path); a small tmpfs; a small btrfs on a loop
device; and a way to fill a filesystem.

rclone, like gcsfuse and s3fs, has no ``link()`` and no create or rename that excludes across
mounts. The mounts need root, ``/dev/fuse``, rclone and fuse3 (``.ci/run`` installs them); the
btrfs needs root, ``losetup``, ``mkfs.btrfs`` (btrfs-progs) and the kernel's btrfs. A test
skips with the reason when any is missing or the mount fails; every mount is undone after it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

# A short directory cache and write-back delay: a file written through one mount shows in the
# other within about 1 s (measured; at most write-back + dir cache + attr cache, 3 s). The
# defaults (a 5 min directory cache) hide every version and lease from the other mount for
# minutes. Not `--vfs-write-back 0s`: rclone 1.60 then starts the upload at close and loses a
# file renamed right after (every atomic write): "corrupted on transfer", never uploaded.
RCLONE_FLAGS = ("--vfs-cache-mode", "writes", "--dir-cache-time", "1s", "--vfs-write-back", "1s")
RCLONE_SETTLE = 4.0  # the lease settle for those mounts: above their 3 s visibility bound


def why_no_fuse(tool: str) -> str | None:
    if os.geteuid() != 0:
        return "needs root to mount"
    if not shutil.which(tool):
        package = "fuse3" if tool == "fusermount3" else tool
        return f"{tool} is not installed (.ci/run installs {package})"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    return None


@contextlib.contextmanager
def rclone_mounts(
    src: Path, *dsts: Path, flags: Sequence[str] = RCLONE_FLAGS
) -> Iterator[tuple[Path, ...]]:
    """Mount ``src`` at each of ``dsts`` with rclone (a local remote, ``flags``)."""
    why = why_no_fuse("rclone") or why_no_fuse("fusermount3")  # mounts and unmounts with it
    if why:
        pytest.skip(why)
    src.mkdir(parents=True, exist_ok=True)
    mounted: list[Path] = []
    try:
        for i, dst in enumerate(dsts):
            dst.mkdir(parents=True, exist_ok=True)
            cache = src.parent / f".rclone-cache-{dst.name}-{i}"
            r = subprocess.run(
                ["rclone", "mount", str(src), str(dst), *flags, "--cache-dir", str(cache),
                 "--daemon", "--log-level", "ERROR"],
                capture_output=True, text=True, timeout=60, env={**os.environ, "RCLONE_CONFIG": ""},
            )  # fmt: skip
            if r.returncode or not os.path.ismount(dst):
                pytest.skip(f"rclone mount failed: {r.stderr.strip() or r.returncode}")
            mounted.append(dst)
        yield dsts
    finally:
        for dst in mounted:
            if subprocess.run(["fusermount3", "-u", str(dst)], capture_output=True).returncode:
                subprocess.run(["umount", "-l", str(dst)], check=False, capture_output=True)
        deadline = time.monotonic() + 10
        while any(os.path.ismount(d) for d in mounted) and time.monotonic() < deadline:
            time.sleep(0.1)


def kill_rclone(dst: Path) -> None:
    """SIGKILL the ``rclone mount`` daemon serving ``dst`` (one :func:`rclone_mounts` started):
    the mount stays, dead (every access fails with ENOTCONN) until it is unmounted, as after
    a crash of the FUSE daemon."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            os.path.basename(argv[0]) == b"rclone"
            and b"mount" in argv
            and str(dst).encode() in argv
        ):
            os.kill(int(pid), signal.SIGKILL)
            return
    raise AssertionError(f"no rclone mount serves {dst}")


@contextlib.contextmanager
def _mounted(argv: list[str], at: Path, failed: str) -> Iterator[Path]:
    """Run the mount command ``argv``, which mounts at ``at`` (made first); skip the test with
    ``failed`` and the command's complaint when it fails; unmount (lazily) after."""
    at.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(argv, capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"{failed}: {r.stderr.strip()}")
    try:
        yield at
    finally:
        subprocess.run(["umount", "-l", str(at)], check=False)


@contextlib.contextmanager
def bindfs_mount(src: Path, dst: Path, *, read_only: bool = False) -> Iterator[Path]:
    """``dst`` shows ``src`` through FUSE: writes to ``src`` raise no inotify event in ``dst``.
    ``read_only``: mounted ``-o ro`` (every write through ``dst`` fails with EROFS)."""
    why = why_no_fuse("bindfs")
    if why:
        pytest.skip(why)
    src.mkdir(parents=True, exist_ok=True)
    ro = ["-o", "ro"] if read_only else []
    with _mounted(["bindfs", *ro, str(src), str(dst)], dst, "bindfs mount failed") as path:
        yield path


def go_stale(dst: Path, empty: Path) -> None:
    """The mount at ``dst`` (a :func:`bindfs_mount`) shows nothing, as a stale NFS/FUSE mount
    that went: a read-only view of the empty ``empty`` mounted over it (no moment where the
    bare directory under it could be written). :func:`come_back` undoes it."""
    empty.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(
        ["bindfs", "-r", "-o", "nonempty", str(empty), str(dst)], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr


def come_back(dst: Path) -> None:
    """The mount at ``dst`` shows its files again (:func:`go_stale` undone). A receiver's
    thread that is looking at the mount right then (a stat, a listing) makes the unmount fail
    with "target is busy" though no file is held open: tried again for up to 10 s."""
    deadline = time.monotonic() + 10
    while (r := subprocess.run(["umount", str(dst)], capture_output=True, text=True)).returncode:
        assert "busy" in r.stderr and time.monotonic() < deadline, r.stderr
        time.sleep(0.05)


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (e.g. ``"4m"``) mounted at ``path``."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount")
    argv = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]
    with _mounted(argv, path, "cannot mount a tmpfs here") as mounted:
        yield mounted


@contextlib.contextmanager
def btrfs(path: Path, size: int = 192 << 20) -> Iterator[Path]:
    """A btrfs of ``size`` bytes on a loop device backed by a sparse file beside ``path``,
    mounted at ``path`` (its metadata apart from the data: a full one still renames a file)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount")
    for tool in ("losetup", "mkfs.btrfs"):
        if not shutil.which(tool):
            pytest.skip(f"{tool} is not installed (btrfs-progs, util-linux)")
    image = path.parent / f".{path.name}.img"
    with open(image, "wb") as f:
        f.truncate(size)
    r = subprocess.run(["losetup", "-f", "--show", str(image)], capture_output=True, text=True)
    if r.returncode:
        image.unlink()
        pytest.skip(f"no loop device: {r.stderr.strip()}")
    dev = r.stdout.strip()
    mounted = False
    try:
        r = subprocess.run(["mkfs.btrfs", "-q", "-f", dev], capture_output=True, text=True)
        if r.returncode:
            pytest.skip(f"mkfs.btrfs failed: {r.stderr.strip()}")
        path.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(["mount", "-t", "btrfs", dev, str(path)], capture_output=True, text=True)
        if r.returncode:
            pytest.skip(f"cannot mount a btrfs here: {r.stderr.strip()}")
        mounted = True
        yield path
    finally:
        if mounted:
            subprocess.run(["umount", str(path)], check=False)
        subprocess.run(["losetup", "-d", dev], check=False)
        image.unlink()


def fill(mount: Path, leave: int) -> int:
    """Fill the filesystem at ``mount`` with ``mount/ballast`` up to ENOSPC but for about
    ``leave`` bytes (a reserve file written first, removed last: a full btrfs may refuse even
    a truncate); returns the bytes free then. Removing ``ballast`` frees the space again."""
    reserve = mount / "reserve"
    reserve.write_bytes(b"\x55" * leave)
    fd = os.open(mount / "ballast", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        for chunk in (1 << 20, 1 << 16, 4096):
            for _ in range(2):  # a copy-on-write filesystem frees some space at a sync
                with contextlib.suppress(OSError):
                    while True:
                        os.write(fd, b"\xaa" * chunk)
                subprocess.run(["sync", "-f", str(mount)], check=False)
    finally:
        os.close(fd)
    reserve.unlink()
    deadline = time.monotonic() + 10
    while (free := free_bytes(mount)) < leave // 2 and time.monotonic() < deadline:
        subprocess.run(["sync", "-f", str(mount)], check=False)  # btrfs frees at a commit
        time.sleep(0.1)
    return free


def free_bytes(mount: Path) -> int:
    st = os.statvfs(mount)
    return st.f_bavail * st.f_frsize


@contextlib.contextmanager
def ext4_on_tmpfs(path: Path, size: str = "40m") -> Iterator[tuple[Path, Path]]:
    """An ext4 of 32 MiB mounted at ``path`` on a loop device whose backing file lies on a tmpfs
    of ``size`` (mounted beside ``path``): yields (``path``, the backing file). A block punched
    out of the backing file (:func:`punch_pages`) while that tmpfs is full (:func:`fill`)
    cannot be written again: its writeback fails, as on a failing disk; the others can.
    :func:`remount` drops its page cache (a reboot)."""
    for tool in ("losetup", "mkfs.ext4", "filefrag", "fallocate"):
        if not shutil.which(tool):
            pytest.skip(f"{tool} is not installed (util-linux, e2fsprogs)")
    with tmpfs(path.parent / f".{path.name}.lower", size) as lower:
        image = lower / "img"
        with open(image, "wb") as f:  # every block allocated but the ones punched later
            os.posix_fallocate(f.fileno(), 0, 32 << 20)
        r = subprocess.run(["losetup", "-f", "--show", str(image)], capture_output=True, text=True)
        if r.returncode:
            pytest.skip(f"no loop device: {r.stderr.strip()}")
        dev = r.stdout.strip()
        mounted = False
        try:
            # no discard: mkfs.ext4 discards the whole device by default, which punched every
            # free block out of the backing file (then every new block, state or journal, failed)
            subprocess.run(["mkfs.ext4", "-q", "-F", "-E", "nodiscard", dev], check=True,
                           capture_output=True)  # fmt: skip
            path.mkdir(parents=True, exist_ok=True)
            subprocess.run(["mount", dev, str(path)], check=True, capture_output=True)
            mounted = True
            yield path, image
        finally:
            if mounted:
                subprocess.run(["umount", str(path)], check=False)
            subprocess.run(["losetup", "-d", dev], check=False)


def remount(path: Path) -> None:
    """Unmount the filesystem at ``path`` and mount its device again (its page cache gone)."""
    dev = subprocess.run(["findmnt", "-n", "-o", "SOURCE", str(path)], capture_output=True,
                         text=True, check=True).stdout.strip()  # fmt: skip
    subprocess.run(["umount", str(path)], check=True)
    subprocess.run(["mount", dev, str(path)], check=True)


def punch_pages(file: Path, image: Path, pages: set[int]) -> int:
    """Punch the blocks holding ``file``'s 4 KiB ``pages`` (their indexes) out of ``image``,
    the backing file of its ext4 (``filefrag``); returns how many."""
    out = subprocess.run(["filefrag", "-v", "-b4096", str(file)], capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    n = 0
    for line in out.splitlines():
        f = line.replace(":", " ").replace("..", " ").split()
        if len(f) > 5 and f[0].isdigit():  # extent: logical first, last, physical first, last
            logical, physical, length = int(f[1]), int(f[3]), int(f[5])
            for k in range(length):
                if logical + k in pages:
                    off = str((physical + k) * 4096)
                    subprocess.run(["fallocate", "--punch-hole", "-o", off, "-l", "4096",
                                    str(image)], check=True)  # fmt: skip
                    n += 1
    return n
