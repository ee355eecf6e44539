"""Reading a root: which versions are committed, their manifests, the root identity.

Blocking functions (async callers wrap them in ``asyncio.to_thread``). A version exists for a
reader only when its ``manifest.json`` exists: directories without one are in-progress or
abandoned writes and are invisible.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from pathlib import Path
from typing import Any

from asyncsync.errors import ConfigError, ManifestError
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
)
from asyncsync.format.names import LEASES_DIR
from asyncsync.fsio import DIR_MODE, atomic_write, make_dir, read_bytes

__all__ = [
    "MAX_MANIFEST_BYTES",
    "RootInfo",
    "ensure_root_info",
    "foreign_entries",
    "is_root",
    "list_versions",
    "prepare_shared_dirs",
    "ManifestCache",
    "read_manifest",
    "read_root_info",
    "uncommitted_dirs",
]

MAX_MANIFEST_BYTES = 256 << 20


class RootInfo(dict[str, Any]):
    """The root identity record (``asyncsync.json``): format, format_version, run_id, created_at."""

    @property
    def run_id(self) -> str:
        return str(self["run_id"])


def read_root_info(root: Path) -> RootInfo | None:
    try:
        data = read_bytes(root / ROOT_INFO_NAME, limit=1 << 20)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ManifestError(f"cannot read {root / ROOT_INFO_NAME}: {exc}") from exc
    try:
        d = json.loads(data)
    except ValueError as exc:
        raise ManifestError(f"{root / ROOT_INFO_NAME} is not valid JSON: {exc}") from exc
    if (
        not isinstance(d, dict)
        or d.get("format") != FORMAT_NAME
        or not isinstance(d.get("run_id"), str)
    ):
        raise ManifestError(f"{root / ROOT_INFO_NAME} is not an asyncsync root record")
    if d.get("format_version") not in READ_FORMAT_VERSIONS:
        raise ManifestError(
            f"{root} uses format_version {d.get('format_version')}; this asyncsync reads "
            f"{', '.join(map(str, READ_FORMAT_VERSIONS))}: use a new root or a matching asyncsync"
        )
    return RootInfo(d)


def ensure_root_info(root: Path) -> RootInfo:
    """Read the root identity, creating it (with a fresh run id) for a new root."""
    info = read_root_info(root)
    if info is not None:
        return info
    info = RootInfo(
        format=FORMAT_NAME,
        format_version=FORMAT_VERSION,
        run_id=secrets.token_hex(8),
        created_at=time.time(),
        created_by=f"{socket.gethostname()}:{os.getpid()}",
    )
    atomic_write(root / ROOT_INFO_NAME, (json.dumps(info, indent=1) + "\n").encode())
    return info


def is_root(root: Path) -> bool:
    """Whether ``root`` is an asyncsync root: it has ``asyncsync.json`` or a committed version."""
    return (root / ROOT_INFO_NAME).exists() or bool(list_versions(root))


# What a root may hold before its publisher first opened it: the directories receivers write
# (or an operator pre-made for them, `asyncsync prepare`), hidden files, a volume's lost+found.
_BEFORE_FIRST_PUBLISH = frozenset({ACKS_DIR, LEASES_DIR, "lost+found"})


def foreign_entries(root: Path) -> list[str]:
    """Entries of a directory that is not (yet) a root that no publisher writes: a non-empty
    list means ``root`` is some other directory (another engine's checkpoint, a typo)."""
    try:
        names = sorted(os.listdir(root))
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [n for n in names if not n.startswith(".") and n not in _BEFORE_FIRST_PUBLISH]


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
    make_dir(root, parents=True, exist_ok=True)
    out = []
    for name in (ACKS_DIR, LEASES_DIR):
        d = make_dir(root / name, exist_ok=True)
        os.chown(d, -1, gid)
        os.chmod(d, DIR_MODE | 0o2020)  # 2775
        out.append(d)
    return out


def list_versions(root: Path) -> list[int]:
    """Committed versions in the root, ascending (a directory scan; may lag on network FS)."""
    out = []
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return []
    for e in entries:
        v = parse_version_dir(e.name)
        if v is not None and os.path.isfile(os.path.join(e.path, MANIFEST_NAME)):
            out.append(v)
    out.sort()
    return out


def uncommitted_dirs(root: Path) -> list[Path]:
    """Version directories without a manifest (interrupted publishes)."""
    out = []
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return []
    for e in entries:
        if (
            parse_version_dir(e.name) is not None
            and e.is_dir(follow_symlinks=False)
            and not os.path.exists(os.path.join(e.path, MANIFEST_NAME))
        ):
            out.append(Path(e.path))
    return sorted(out)


def read_manifest(root: Path, version: int) -> Manifest:
    """Read and validate the manifest of ``version``.

    Raises FileNotFoundError when the version is not committed, ManifestError when the file is
    malformed, unsafe (the manifest or its version directory is a symlink), or names another
    version.
    """
    path = manifest_path(root, version)
    if path.parent.is_symlink():
        raise ManifestError(
            f"{path.parent}: a version directory may not be a symlink (it can lead outside "
            "the root); the publisher writes real directories, so this one was put there by hand"
        )
    if path.is_symlink():
        raise ManifestError(f"{path}: a manifest may not be a symlink")
    try:
        data = read_bytes(path, limit=MAX_MANIFEST_BYTES)
    except ValueError as exc:
        raise ManifestError(f"{path}: {exc}") from exc
    m = Manifest.from_json(data, where=str(path))
    if m.version != version:
        raise ManifestError(f"{path}: names version {m.version}, but lives in the dir of {version}")
    return m


class ManifestCache:
    """Parsed manifests by version, re-read only when the file changes (size, mtime, inode).

    A receiver polls the newest version every second or so; a manifest lists every tensor, so
    parsing it again each time would be the largest cost of an idle poll. A republished
    version is a new file, so the key catches it.
    """

    def __init__(self, size: int = 8) -> None:
        self.size = size
        self._entries: dict[int, tuple[tuple[int, int, int], Manifest]] = {}

    def get(self, root: Path, version: int) -> Manifest:
        try:
            st = os.stat(manifest_path(root, version), follow_symlinks=False)
        except FileNotFoundError:
            self._entries.pop(version, None)
            raise
        key = (st.st_size, st.st_mtime_ns, st.st_ino)
        hit = self._entries.get(version)
        if hit is not None and hit[0] == key:
            return hit[1]
        m = read_manifest(root, version)
        self._entries[version] = (key, m)
        while len(self._entries) > self.size:
            del self._entries[min(self._entries)]
        return m
