"""Reading a root: which versions are committed, their manifests, the root identity.

Blocking functions (async callers wrap them in ``asyncio.to_thread``). A version exists for a
reader only when its ``manifest.json`` exists (FORMAT.md section 1): directories without one
are in-progress or abandoned writes and are invisible. Every access goes through
:mod:`asyncsync.fsio` with ``root=``: nothing below the root is followed or blocked on, so a
symlinked version directory or a manifest that is a FIFO is a version that is *bad*
(:class:`~asyncsync.errors.ManifestError`), never a hang nor a read outside the root.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import stat
import threading
import time
from collections.abc import Callable, Collection, Generator
from pathlib import Path
from typing import Any, Generic, TypeVar

from asyncsync import fsio
from asyncsync.errors import ConfigError, ManifestError, ManifestUnreadable
from asyncsync.format import (
    ACKS_DIR,
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_NAME,
    READ_FORMAT_VERSIONS,
    ROOT_INFO_NAME,
    Manifest,
    manifest_path,
    parse_version_dir,
    version_dir,
)
from asyncsync.format.fields import load_json
from asyncsync.format.names import LEASES_DIR, MAX_VERSION

__all__ = [
    "MAX_GID",
    "MAX_MANIFEST_BYTES",
    "RootInfo",
    "ensure_root_info",
    "foreign_entries",
    "not_a_root",
    "is_committed",
    "is_root",
    "list_versions",
    "newest_committed",
    "next_version_after",
    "prepare_shared_dirs",
    "ManifestCache",
    "ManifestFiles",
    "read_manifest",
    "read_root_info",
    "uncommitted_dirs",
]

T = TypeVar("T")
MAX_MANIFEST_BYTES = 256 << 20
MAX_GID = 0xFFFF_FFFE  # 0xFFFFFFFF is (gid_t)-1: chown reads it as "leave the group unchanged"


class RootInfo(dict[str, Any]):
    """The root identity record (``asyncsync.json``): format, format_version, run_id, created_at."""

    @property
    def run_id(self) -> str:
        return str(self["run_id"])


def read_root_info(root: Path) -> RootInfo | None:
    try:
        data = fsio.read_bytes(root / ROOT_INFO_NAME, limit=1 << 20, root=root)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ManifestError(f"cannot read {root / ROOT_INFO_NAME}: {exc}") from exc
    d = load_json(data, str(root / ROOT_INFO_NAME))
    if d.get("format") != FORMAT_NAME or not isinstance(d.get("run_id"), str):
        raise ManifestError(f"{root / ROOT_INFO_NAME} is not an asyncsync root record")
    if d.get("format_version") not in READ_FORMAT_VERSIONS:
        raise ManifestError(
            f"{root} uses format_version {d.get('format_version')}; this asyncsync reads "
            f"{', '.join(map(str, READ_FORMAT_VERSIONS))}: use a new root or a matching asyncsync"
        )
    return RootInfo(d)


def ensure_root_info(root: Path) -> RootInfo:
    """Read the root identity, creating it (with a fresh run id) for a new root: a missing or
    empty directory, or one holding only what a root holds before its first publish (ConfigError
    for any other directory: a typo must not turn someone's folder into a root)."""
    info = read_root_info(root)
    if info is not None:
        return info
    foreign = not_a_root(root)
    if foreign:
        shown = ", ".join(foreign[:5]) + (
            f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
        )
        raise ConfigError(
            f"{root} is not an asyncsync root and is not empty (it holds {shown}): publish into "
            "a new or empty directory (a root's acks/ and leases/ may exist already)"
        )
    info = RootInfo(
        format=FORMAT_NAME,
        format_version=FORMAT_VERSION,
        run_id=secrets.token_hex(8),
        created_at=time.time(),
        created_by=f"{socket.gethostname()}:{os.getpid()}",
    )
    fsio.atomic_write(
        root / ROOT_INFO_NAME, (json.dumps(info, indent=1) + "\n").encode(), root=root
    )
    return info


def _committed(root: Path, name: str, st: os.stat_result) -> bool:
    """Whether the entry ``name`` (lstat ``st``) of the root is a committed version: a
    directory holding a ``manifest.json`` entry of any type, or a symlink (a bad version:
    readers refuse it without following it, FORMAT.md section 8)."""
    if stat.S_ISLNK(st.st_mode):
        return True
    if not stat.S_ISDIR(st.st_mode):
        return False
    try:
        return fsio.lstat(root / name / MANIFEST_NAME, root=root) is not None
    except OSError:  # unreadable or replaced by a symlink meanwhile: read_manifest says why
        return True


def is_committed(root: Path, version: int) -> bool:
    """Whether ``version`` is committed (an exact-path lookup, not a listing)."""
    if version > MAX_VERSION:  # none can be (a probe past a planted last version dir)
        return False
    path = version_dir(root, version)
    try:
        st = fsio.lstat(path, root=root)
    except OSError:
        return False  # the root itself is gone or unreadable
    return st is not None and _committed(root, path.name, st)


def _entries(
    root: Path, newest_first: bool = False
) -> Generator[tuple[int, str, os.stat_result], None, None]:
    """(version, name, lstat) of the entries of the root named like a version, in version
    order (only those are stat'ed, each as it is reached: a root holds acks, leases, the log
    and whatever else was put there, and a reader of the newest stops at its first). Close
    it (``contextlib.closing``) when it is not read to its end."""
    try:
        fd = fsio.open_dir(root)
    except (FileNotFoundError, NotADirectoryError):
        return
    try:
        named = [(v, name) for name in os.listdir(fd) if (v := parse_version_dir(name)) is not None]
        named.sort(reverse=newest_first)
        for v, name in named:
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:  # removed meanwhile
                continue
            yield v, name, st
    finally:
        os.close(fd)


def is_root(root: Path) -> bool:
    """Whether ``root`` is an asyncsync root: it has ``asyncsync.json`` (a regular file: a
    symlink, FIFO or directory of that name makes no root) or a committed version."""
    try:
        st = fsio.lstat(root / ROOT_INFO_NAME, root=root)
        has_info = st is not None and stat.S_ISREG(st.st_mode)
    except OSError:
        has_info = False
    return has_info or bool(list_versions(root))


# What a root may hold before its publisher first opened it: the directories receivers write
# (or an operator pre-made for them, `asyncsync prepare`), hidden files, a volume's lost+found.
_BEFORE_FIRST_PUBLISH = frozenset({ACKS_DIR, LEASES_DIR, "lost+found"})


def foreign_entries(root: Path) -> list[str]:
    """Entries of a directory that is not (yet) a root that no publisher writes: a non-empty
    list means ``root`` is some other directory (another engine's checkpoint, a typo).

    A version directory (``v`` + 12 digits, a real directory) is a publisher's: a mount that
    uploads a file only after a delay but makes a directory at once (rclone's
    ``--vfs-write-back``) shows another host the first versions' directories before their
    manifests and before ``asyncsync.json``, a root being opened, not some other directory."""
    try:
        names = sorted(os.listdir(root))
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [
        n
        for n in names
        if not n.startswith(".") and n not in _BEFORE_FIRST_PUBLISH and not _version_dir(root, n)
    ]


def _version_dir(root: Path, name: str) -> bool:
    if parse_version_dir(name) is None:
        return False
    try:
        st = fsio.lstat(root / name, root=root)
    except OSError:
        return False
    return st is not None and stat.S_ISDIR(st.st_mode)


def not_a_root(root: Path) -> list[str] | None:
    """``None`` for an asyncsync root; else its :func:`foreign_entries` (``[]``: a missing or
    empty directory, a root its publisher has not opened yet). The root is looked at again
    after the listing: a publisher that opened it between the two looks wrote its
    ``asyncsync.json``, which the listing shows."""
    if is_root(root):
        return None
    foreign = foreign_entries(root)
    return None if foreign and is_root(root) else foreign


def prepare_shared_dirs(root: Path, group: str | int) -> list[Path]:
    """Make ``ROOT/acks/`` and ``ROOT/leases/`` writable for ``group`` (receivers running as
    other uids than the publisher): created if missing, given the group, mode ``2775``
    (group-writable, new files inherit the group). The root is created (``0755``) if missing.
    """
    import grp

    try:
        gid = group if isinstance(group, int) else grp.getgrnam(group).gr_gid
    except KeyError:
        raise ConfigError(f"no group named {group!r} on this host (give a name or a gid)") from None
    if not 0 <= gid <= MAX_GID:  # checked before anything is created
        raise ConfigError(f"gid {gid} is out of range: give a gid from 0 to {MAX_GID} or a name")
    _check_enterable(root, gid)
    fsio.make_dir(root, parents=True, exist_ok=True)
    out = []
    for name in (ACKS_DIR, LEASES_DIR):
        d = fsio.make_dir(root / name, root=root, exist_ok=True)  # a symlink there: refused
        fd = fsio.open_dir(d, root=root)
        try:  # on the descriptor: never through a symlink put there meanwhile
            os.fchown(fd, -1, gid)
            os.fchmod(fd, fsio.DIR_MODE | 0o2020)  # 2775
        finally:
            os.close(fd)
        out.append(d)
    return out


def _check_enterable(root: Path, gid: int) -> None:
    """ConfigError when an existing ``root`` is a directory that receivers of group ``gid``
    may not read and enter (a root made with ``mkdir`` under umask 077 is 0700; the publisher
    leaves the mode of a root it did not create): they would fail on it, acks/ writable or not.
    Its mode is the operator's to loosen, so it is named, not changed."""
    try:
        st = os.stat(root)
    except FileNotFoundError:
        return  # created 0755 below
    need = 0o050 if st.st_gid == gid else 0o005
    if stat.S_ISDIR(st.st_mode) and st.st_mode & need != need and st.st_mode & 0o005 != 0o005:
        raise ConfigError(
            f"{root} is mode {stat.S_IMODE(st.st_mode):04o} (uid {st.st_uid}, gid {st.st_gid}):"
            f" receivers of group {gid} cannot read and enter it; chmod 755 {root} (or chgrp "
            f"{gid} and chmod 750), then run asyncsync prepare again"
        )


def list_versions(root: Path) -> list[int]:
    """Committed versions in the root, ascending (a directory scan; may lag on network FS)."""
    return [v for v, name, st in _entries(root) if _committed(root, name, st)]


def newest_committed(root: Path) -> int | None:
    """``list_versions(root)[-1]`` (None where there is none) for a receiver's every poll: the
    names listed, then looked at newest first until one is committed, one or two ``lstat``
    pairs instead of one per version the root ever kept. A root without retention keeps them
    all: at 1,000 versions each poll's scan cost ~50 ms of CPU (BENCHMARKS.md, thirty-sixth
    session), on a network filesystem as many round trips."""
    with contextlib.closing(_entries(root, newest_first=True)) as entries:
        return next((v for v, name, st in entries if _committed(root, name, st)), None)


def next_version_after(root: Path, versions: list[int]) -> int:
    """The version a publisher commits next on ``root``, whose committed ``versions`` (ascending)
    were listed: ConfigError when the newest is the last version number (none can follow it)."""
    if not versions:
        return 0
    if versions[-1] >= MAX_VERSION:
        raise ConfigError(
            f"{version_dir(root, versions[-1])} is the last version number a root can hold: no "
            "version can follow it. A trainer does not get there: remove that directory if it "
            "was put there (copied, planted), or publish into a new root"
        )
    return versions[-1] + 1


def uncommitted_dirs(root: Path) -> list[Path]:
    """Version directories without a manifest (interrupted publishes)."""
    return [
        root / name
        for _, name, st in _entries(root)
        if stat.S_ISDIR(st.st_mode) and not _committed(root, name, st)
    ]


def read_manifest(root: Path, version: int) -> Manifest:
    """Read and validate the manifest of ``version``.

    Raises FileNotFoundError when the version is not committed; ManifestError when the file is
    malformed, unsafe (a symlink, a FIFO or anything but a regular file, or in a version
    directory that is a symlink) or names another version; ManifestUnreadable when it cannot
    be read now (EACCES, EIO: a reader may try again, then the version is bad).
    """
    path = manifest_path(root, version)
    try:
        data = fsio.read_bytes(path, limit=MAX_MANIFEST_BYTES, root=root)
    except FileNotFoundError:
        raise
    except fsio.UnsafePath as exc:
        raise ManifestError(
            f"{exc.strerror}; the publisher writes a real directory and a regular file, so "
            "this version was changed by hand"
        ) from exc
    except ValueError as exc:
        raise ManifestError(f"{path}: {exc}") from exc
    except OSError as exc:
        raise ManifestUnreadable(f"{path}: cannot read the manifest ({exc})") from exc
    m = Manifest.from_json(data, where=str(path))
    if m.version != version:
        raise ManifestError(f"{path}: names version {m.version}, but lives in the dir of {version}")
    return m


class ManifestFiles(Generic[T]):
    """What ``derive`` makes of each version's manifest, by version, made again only when the
    file changes (its size, mtime and inode): a republished version is a new file, so the key
    catches it. ``size``: at most that many versions kept (the lowest dropped first); None:
    every one until :meth:`keep_only`. Safe to share between threads (a miss parses outside
    the lock: two threads may both parse)."""

    def __init__(self, derive: Callable[[Manifest], T], size: int | None) -> None:
        self.derive = derive
        self.size = size
        self._entries: dict[int, tuple[tuple[int, int, int], T]] = {}
        self._lock = threading.Lock()

    def get(self, root: Path, version: int) -> T:
        try:
            st = fsio.lstat(manifest_path(root, version), root=root)
        except OSError:  # a symlinked or unreadable version directory: read_manifest says why
            with self._lock:
                self._entries.pop(version, None)
            return self.derive(read_manifest(root, version))
        if st is None:
            with self._lock:
                self._entries.pop(version, None)
            raise FileNotFoundError(manifest_path(root, version))
        key = (st.st_size, st.st_mtime_ns, st.st_ino)
        with self._lock:
            hit = self._entries.get(version)
        if hit is not None and hit[0] == key:
            return hit[1]
        made = self.derive(read_manifest(root, version))
        with self._lock:
            self._entries[version] = (key, made)
            while self.size is not None and len(self._entries) > self.size:
                del self._entries[min(self._entries)]
        return made

    def keep_only(self, versions: Collection[int]) -> None:
        """Forget every version not in ``versions`` (those a listing no longer shows)."""
        with self._lock:
            for v in [v for v in self._entries if v not in versions]:
                del self._entries[v]


class ManifestCache(ManifestFiles[Manifest]):
    """Parsed manifests by version, re-read only when the file changes (size, mtime, inode).

    A receiver polls the newest version every second or so; a manifest lists every tensor, so
    parsing it again each time would be the largest cost of an idle poll. Safe to share between
    threads (a receiver's syncs and its stream read the same manifests: ~10 us per tensor to
    parse, ~1 s at 100,000).
    """

    def __init__(self, size: int = 8) -> None:
        super().__init__(_itself, size)


def _itself(m: Manifest) -> Manifest:
    return m
