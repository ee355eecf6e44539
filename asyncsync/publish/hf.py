"""Existing Hugging Face safetensors checkpoints: registering one as a root's base version.

A trainer often starts from a checkpoint that already sits on the shared filesystem. Instead of
writing it again, ``Publisher.seed(path)`` references its files from the base manifest
(``shard_dir``): they are read once here to checksum them and to build the publisher's snapshot.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import safetensors.torch
import torch

from asyncsync import fsio
from asyncsync.errors import AsyncSyncError, ConfigError
from asyncsync.format import FullRef, ShardInfo, TensorEntry, check_file_name, dtype_name
from asyncsync.format.checksum import checksum_file, checksum_tensor
from asyncsync.publish.merge import check_state_dict

__all__ = [
    "checkpoint_files",
    "checkpoint_path",
    "register_scan",
    "resolve_files",
    "scan_checkpoint",
]


def checkpoint_path(source: object) -> Path:
    """What ``Publisher.seed`` was given when it is no mapping: a checkpoint directory's path,
    or ConfigError (the module itself, None, pairs: what it is and what seed takes)."""
    if isinstance(source, str | os.PathLike) and not isinstance(source, bytes):
        try:
            return Path(source)
        except TypeError:  # an os.PathLike whose path is bytes
            pass
    raise ConfigError(
        "seed takes a mapping of names to tensors (model.state_dict(), a dict) or the path "
        f"of a safetensors checkpoint directory, got {type(source).__name__}"
    )


def checkpoint_files(path: Path) -> list[str]:
    """The safetensors files of a checkpoint directory (from its index when there is one)."""
    if not path.is_dir():
        raise ConfigError(f"{path} is not a directory of safetensors files")
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:  # a regular file of at most 256 MiB (a FIFO there is refused, not waited on)
            data = fsio.read_bytes(index, limit=256 << 20, follow_symlinks=True)
            weight_map = json.loads(data)["weight_map"]
            files = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"{index} is not a valid safetensors index: {exc!r}") from exc
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{path} holds no .safetensors files")
    for f in files:
        check_file_name(f, "checkpoint file name")
    return files


def resolve_files(path: Path, files: list[str]) -> tuple[Path, list[str]]:
    """The one directory the files of ``path`` really are in, and their names there.

    A Hugging Face cache snapshot (``.../snapshots/<rev>/``) holds symlinks into ``../../blobs/``;
    receivers refuse symlinked shards, so a root references the blobs themselves. Refused, with
    what to do, before anything is committed: a named file that is missing or not a regular
    file, or files that resolve into several directories.
    """
    dirs, names = set(), []
    for f in files:
        p = path / f
        try:
            real = p.resolve(strict=True)
        except (OSError, RuntimeError) as exc:
            raise ConfigError(
                f"{p} is named by the checkpoint but cannot be read ({exc.__class__.__name__}: "
                f"{exc}): complete the download, or fix {path / 'model.safetensors.index.json'}"
            ) from None
        if not real.is_file():
            raise ConfigError(f"{p} is not a regular file ({real}): seed from safetensors files")
        dirs.add(real.parent)
        names.append(check_file_name(real.name, "checkpoint file name"))
    if len(dirs) > 1:
        raise ConfigError(
            f"the files of {path} resolve into several directories ({', '.join(map(str, dirs))}): "
            "a version's shards are in one directory; copy the checkpoint into one (e.g. "
            "`huggingface-cli download REPO --local-dir DIR`) and seed from that"
        )
    return dirs.pop(), names


def scan_checkpoint(
    path: Path, algorithm: str
) -> tuple[list[ShardInfo], list[TensorEntry], dict[str, torch.Tensor], Path]:
    """Checksum a checkpoint's files and tensors: (full shards, tensor entries, the tensors,
    the directory the shards are in: ``path``, or the blobs a snapshot's symlinks point to)."""
    shards, entries, tensors = [], [], {}
    shard_dir, names = resolve_files(path, checkpoint_files(path))
    for i, f in enumerate(names):
        digest, size = checksum_file(shard_dir / f, algorithm)
        shards.append(ShardInfo(f, "full", size, digest))
        try:
            loaded = safetensors.torch.load_file(shard_dir / f)
        except Exception as exc:  # safetensors raises its own error types
            raise ConfigError(f"{shard_dir / f} is not a readable safetensors file: {exc}") from exc
        try:  # what a state dict must be: dtypes, shapes and names a manifest holds
            check_state_dict(loaded, None)
        except ConfigError as exc:
            raise ConfigError(f"{shard_dir / f}: {exc}") from None
        for name, t in loaded.items():
            if name in tensors:
                raise ConfigError(f"{path}: tensor {name!r} appears in two files")
            tensors[name] = t
            entries.append(
                TensorEntry(
                    name=name,
                    dtype=dtype_name(t.dtype),
                    shape=tuple(t.shape),
                    checksum=checksum_tensor(t, algorithm),
                    changed=t.numel(),
                    full=FullRef(i, name),
                )
            )
    return shards, entries, tensors, shard_dir


def register_scan(
    path: Path, root: Path, algorithm: str
) -> tuple[list[ShardInfo], list[TensorEntry], dict[str, torch.Tensor], Path]:
    """:func:`scan_checkpoint` of a checkpoint to register as a root's version (``seed(path)``):
    one inside the root is refused (readers never follow a symlink there), and any failure to
    read it is a ConfigError naming it."""
    path = path.resolve()
    if path.is_relative_to(root.resolve()):
        raise ConfigError(
            f"cannot register {path}: it is inside the root {root}; register a "
            "checkpoint directory outside the shared root"
        )
    try:
        return scan_checkpoint(path, algorithm)
    except AsyncSyncError:
        raise
    except Exception as exc:
        raise ConfigError(f"cannot register checkpoint {path}: {exc!r}") from exc
