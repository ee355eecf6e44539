"""Which filesystem a path is on, and the lease *settle* that follows from it (FORMAT.md 7.1).

A file written through one host's mount of a network or FUSE filesystem shows in another
host's listing only after a delay; a taker of an engine-id lease waits that long between its
claim and reading its rivals' (:mod:`asyncsync.format.lease`). On a filesystem of this kernel a
write is visible at once.
"""

from __future__ import annotations

import os
import re

__all__ = ["LOCAL_FILESYSTEMS", "NETWORK_SETTLE", "default_settle", "filesystem_type"]

NETWORK_SETTLE = 5.0  # the default settle on a network or FUSE filesystem (FORMAT.md 7.1)
# Filesystems of this kernel only: a write is visible to every reader at once (settle 0).
LOCAL_FILESYSTEMS = frozenset(
    {
        "ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "ramfs", "zfs", "f2fs", "overlay",
        "bcachefs", "jfs", "reiserfs", "nilfs2", "hfsplus", "vfat", "exfat", "ntfs", "ntfs3",
    }
)  # fmt: skip


def filesystem_type(path: str | os.PathLike[str]) -> str:
    """The type of the filesystem holding ``path`` (``ext4``, ``nfs4``, ``fuse.rclone``...)."""
    target = os.path.realpath(path)
    best, kind = "", ""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return ""
    for line in lines:
        left, _, right = line.partition(" - ")
        fields = left.split()
        if len(fields) < 5 or not right:
            continue
        mnt = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])  # \040: " "
        inside = target == mnt or target.startswith(mnt.rstrip("/") + "/")
        if inside and len(mnt) >= len(best):
            best, kind = mnt, right.split()[0]
    return kind


def default_settle(path: str | os.PathLike[str]) -> float:
    """0 on a filesystem of this kernel; :data:`NETWORK_SETTLE` on NFS, FUSE and the rest."""
    return 0.0 if filesystem_type(path) in LOCAL_FILESYSTEMS else NETWORK_SETTLE
