"""The files of a checkpoint directory: data files, the HF index, the layout of each tensor.

Everything here reads or writes the directory's *data* (``model-*.safetensors`` and
``model.safetensors.index.json``); the receiver's own state lives in ``.asyncsync/``
(:mod:`receiver.state`). :func:`verify_checkpoint` compares a directory with a manifest.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
from collections.abc import Callable, Collection
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO

import safetensors.torch
import torch

from asyncsync import fsio
from asyncsync.codec import raw_clone
from asyncsync.errors import ConfigError, EngineStateError
from asyncsync.format import Manifest
from asyncsync.format.checksum import entry_checksum, new_hasher
from asyncsync.format.store import MAX_MANIFEST_BYTES
from receiver.engines.st_layout import TensorLocation, read_layout
from receiver.state import STATE_DIR_NAME, STATE_NAME

__all__ = ["CheckpointFiles", "verify_checkpoint"]

# An HF index names each tensor once (the manifest it was written from names it once or twice,
# with more fields): an index is smaller than its manifest, so the manifests' bound never
# refuses the index of a version this receiver applied (64 MiB did: 17000 tensors of
# 4096-character names, a 135 MiB manifest, left a checkpoint that no start could open).
_MAX_INDEX_BYTES = MAX_MANIFEST_BYTES


def _open_data(path: Path) -> BinaryIO:
    """A data file for reading: a regular file only (a FIFO or a device there raises
    :class:`~asyncsync.fsio.UnsafePath` at once instead of blocking); symlinks are followed."""
    return os.fdopen(fsio.open_file(path, follow_symlinks=True), "rb")


class CheckpointFiles:
    """The data files and index of a checkpoint directory named ``<file_prefix>-*``."""

    def __init__(self, directory: str | os.PathLike[str], file_prefix: str = "model") -> None:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,100}", file_prefix):
            raise ConfigError(
                f"invalid file_prefix {file_prefix!r}: use [A-Za-z0-9][A-Za-z0-9._-]*"
            )
        self.directory = Path(directory)
        self.file_prefix = file_prefix
        self.index_path = self.directory / f"{file_prefix}.safetensors.index.json"
        self._data_re = re.compile(
            rf"^{re.escape(file_prefix)}(-\d{{5}}-of-\d{{5}})?\.safetensors$"
        )

    def data_files(self) -> list[Path]:
        return sorted(p for p in self.directory.iterdir() if self._data_re.match(p.name))

    def file_name(self, k: int, n: int) -> str:
        """The name of data file ``k`` of ``n`` (1-based), as Hugging Face names shards."""
        return f"{self.file_prefix}-{k:05d}-of-{n:05d}.safetensors"

    def read_index(self) -> tuple[dict[str, Any], dict[str, str]]:
        try:
            data = fsio.read_bytes(self.index_path, limit=_MAX_INDEX_BYTES, follow_symlinks=True)
            index = json.loads(data)
        except (OSError, ValueError) as exc:  # UnsafePath: a FIFO, device or directory there
            raise EngineStateError(f"cannot read {self.index_path}: {exc}") from exc
        except RecursionError:
            raise EngineStateError(
                f"cannot read {self.index_path}: its JSON is nested too deeply to be an index; "
                "remove the checkpoint directory to re-initialise from the newest keyframe"
            ) from None
        wm = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(wm, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and self._data_re.match(v)
            for k, v in wm.items()
        ):
            raise EngineStateError(f"{self.index_path}: weight_map is missing or invalid")
        return index, wm

    def tensor_names(self) -> list[str]:
        """Names of the tensors in the index, in index order (none before the first version)."""
        return list(self.read_index()[1]) if self.index_path.exists() else []

    def load_state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor of the checkpoint, copied into memory (later writes do not alter it)."""
        if not self.index_path.exists():
            return {}
        weight_map = self.read_index()[1]
        out: dict[str, torch.Tensor] = {}
        for file in dict.fromkeys(weight_map.values()):
            out.update(safetensors.torch.load_file(self.directory / file))
        # load_file maps the file; cloned as ints: a bool's clone writes 0/1, not its bytes
        return {name: raw_clone(out[name]) for name in weight_map}

    def load_layout(self) -> dict[str, TensorLocation]:
        """Where each tensor of the index lies: its file and byte range (from the headers)."""
        _, weight_map = self.read_index()
        per_file = {f: read_layout(self.directory / f) for f in dict.fromkeys(weight_map.values())}
        layout = {}
        for name, file in weight_map.items():
            if name not in per_file[file]:
                raise EngineStateError(f"{self.index_path}: {name!r} is not in {file}")
            layout[name] = per_file[file][name]
        return layout

    def write_index(self, version: int, weight_map: dict[str, str], total: int) -> None:
        """Write the HF index atomically."""
        index = {
            "metadata": {"total_size": total, "asyncsync_version": version},
            "weight_map": weight_map,
        }
        fsio.atomic_write(self.index_path, (json.dumps(index, indent=2) + "\n").encode())

    def fsync_data_files(self) -> None:
        """fsync every data file: dirty pages of any version, whoever wrote them, reach disk."""
        for p in self.data_files():
            fd = fsio.open_file(p, follow_symlinks=True)  # a FIFO: refused, never waited on
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def stamps(self) -> dict[str, list[int]]:
        """Each data file's (inode, size, mtime in ns): what a change of it behind the
        receiver's back changes (a write, a truncate, a copy put in its place)."""
        out = {}
        for p in self.data_files():
            st = os.lstat(p)
            out[p.name] = [st.st_ino, st.st_size, st.st_mtime_ns]
        return out

    def own_data_files(self, chunk: int = 16 << 20) -> list[str]:
        """Make each data file the checkpoint's own before it is patched in place: one that is
        a symlink or has other hard links (an operator's ``cp -al`` backup, a file linked from a
        model store) is copied into a new file of one link, renamed over its name
        (:func:`~asyncsync.fsio.atomic_write`: a kill midway leaves a temp file that the next
        open removes). Patched through the link, the file elsewhere changed with every version.
        Returns the names copied."""
        copied = []
        for p in self.data_files():
            st = os.lstat(p)
            if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
                continue
            with _open_data(p) as f:  # a regular file at the end of a symlink, else refused
                fsio.atomic_write(p, iter(partial(f.read, chunk), b""), sync_dir=False)
            copied.append(p.name)
        if copied:
            fsio.fsync_dir(self.directory)
        return copied

    def rewrite_data_files(self, chunk: int = 16 << 20) -> None:
        """Write every data file's bytes over themselves, then fsync. After a flush that failed
        the kernel may have marked the pages it could not write clean (the error reported once,
        to that flush): a second fsync then succeeds and writes nothing, and the bytes are lost
        with the page cache. Written again, the pages are dirty, and the fsync writes them or
        fails."""
        for p in self.data_files():
            fd = os.open(p, os.O_RDWR | os.O_NONBLOCK)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise EngineStateError(f"{p}: not a regular file")
                off = 0
                while data := os.pread(fd, chunk, off):
                    view = memoryview(data)
                    while view:
                        n = os.pwrite(fd, view, off)
                        view, off = view[n:], off + n
                os.fsync(fd)
            finally:
                os.close(fd)

    def refuse_foreign(self) -> None:
        """Refuse a directory of safetensors files that this project did not write."""
        if self.index_path.exists() or any(
            p.name.endswith(".safetensors") for p in self.directory.iterdir()
        ):
            raise EngineStateError(
                f"{self.directory} holds safetensors files but is not an asyncsync checkpoint "
                f"(no {STATE_DIR_NAME}/{STATE_NAME}); point the receiver at an empty directory"
            )

    def remove_data(self) -> None:
        """Remove the data files and the index, durably."""
        for p in self.data_files():
            p.unlink()
        with contextlib.suppress(FileNotFoundError):
            self.index_path.unlink()
        fsio.fsync_dir(self.directory)


def verify_checkpoint(
    directory: str | os.PathLike[str],
    manifest: Manifest,
    *,
    file_prefix: str = "model",
    progress: Callable[[int, int], None] | None = None,
    skip: Collection[str] = (),
) -> list[str]:
    """Names of tensors whose bytes differ from ``manifest`` (missing, extra, other dtype/shape
    or other checksum). An empty list means the directory holds the version bit for bit.
    Read-only and lock-free: run it on a quiet checkpoint (e.g. ``asyncsync verify``).
    ``progress(done, total)`` is called after each tensor. ``skip``: tensors not compared."""
    files = CheckpointFiles(directory, file_prefix)
    layout = files.load_layout()
    bad: list[str] = sorted(set(layout) - {e.name for e in manifest.tensors})
    for i, e in enumerate(manifest.tensors):
        if progress is not None and i:
            progress(i, len(manifest.tensors))
        if e.name in skip:
            continue
        loc = layout.get(e.name)
        if loc is None or loc.dtype != e.torch_dtype or loc.shape != e.shape:
            bad.append(e.name)
            continue
        if e.parts is not None:  # per-part checksums: hash the tensor's bytes in one piece
            with _open_data(files.directory / loc.file) as f:
                f.seek(loc.begin)
                data = f.read(loc.nbytes)
            if (
                len(data) != loc.nbytes
                or entry_checksum(e, data, manifest.checksum_algorithm) != e.checksum
            ):
                bad.append(e.name)
            continue
        h = new_hasher(manifest.checksum_algorithm)
        with _open_data(files.directory / loc.file) as f:
            f.seek(loc.begin)
            left = loc.nbytes
            while left > 0:
                chunk = f.read(min(left, 8 << 20))
                if not chunk:
                    break
                h.update(chunk)
                left -= len(chunk)
        if left or h.hexdigest() != e.checksum:
            bad.append(e.name)
    return bad
