"""Filesystem primitives: safe access to a shared root, atomic durable writes, locks.

Any host that runs a receiver can write a root, so any name in it may be a symlink, a FIFO, a
socket or a hard link (FORMAT.md 11.1). Below ``root=`` nothing is followed: each directory is
opened ``O_NOFOLLOW | O_DIRECTORY`` from its parent's descriptor (the root, as the caller
names it, is trusted; without ``root`` only the last component is not followed). Reading opens
through :func:`open_file` only (``O_NOFOLLOW | O_NONBLOCK``, ``fstat``: regular files, within a
``limit``), writing through :func:`_open_write` only (temp names ``O_EXCL | O_NOFOLLOW``
renamed into place by :func:`atomic_write`, or a spare file rewritten and renamed by
:func:`rewrite_as`; a file written in place, the log or a lock, must be
a regular file with one link); removal, listing, ``lstat`` and ``mkdir`` go by descriptor too.
A crash leaves the old or the complete new file of an :func:`atomic_write`, plus at most a temp
file (:data:`TMP_PREFIX`, ignored by readers). Blocking: async callers use ``to_thread``. A
:class:`Throttle` (``ASYNCSYNC_THROTTLE=200MB/s,5ms``) simulates a slow shared filesystem."""

from asyncsync.fsio.files import (
    DIR_MODE,
    FILE_MODE,
    TMP_PREFIX,
    UnsafePath,
    append_bytes,
    append_line,
    atomic_write,
    fs_now,
    fsync_dir,
    is_temp_name,
    lstat,
    make_dir,
    open_dir,
    open_file,
    read_buffer,
    read_bytes,
    read_file,
    read_into,
    remove,
    remove_temp_files,
    remove_tree,
    rewrite_as,
    scan,
)
from asyncsync.fsio.lock import FileLock
from asyncsync.fsio.throttle import Throttle, check_throttle_env, get_throttle, set_throttle

__all__ = [
    "DIR_MODE", "FILE_MODE", "TMP_PREFIX", "FileLock", "Throttle", "UnsafePath", "append_bytes",
    "append_line", "atomic_write", "check_throttle_env", "fs_now", "fsync_dir", "get_throttle",
    "is_temp_name", "lstat", "make_dir", "open_dir", "open_file", "read_buffer", "read_bytes",
    "read_file", "read_into", "remove", "remove_temp_files", "remove_tree", "rewrite_as", "scan",
    "set_throttle",
]  # fmt: skip
