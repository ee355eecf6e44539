"""Checks of a :class:`~asyncsync.publish.publisher.Publisher`'s options: every bad value is a
:class:`~asyncsync.errors.ConfigError` naming it, raised before anything is touched."""

from __future__ import annotations

from typing import Any

from asyncsync import codec
from asyncsync.errors import ConfigError
from asyncsync.format.checksum import new_hasher
from asyncsync.publish.distributed import Coordinator
from asyncsync.publish.retention import RetentionPolicy

__all__ = ["check_options"]


def check_options(
    *,
    encoding: str,
    checksum: str,
    bucket_bytes: int,
    delta_shard_bytes: int | None,
    max_in_flight: int,
    mode: str,
    keyframe_interval: int,
    zstd_level: int,
    pre_commit_hook: Any,
    retention: Any,
    coordinator: Any,
) -> None:
    """Raise ConfigError for the first option out of its range (see Publisher's Args)."""
    if encoding not in codec.ENCODINGS:
        raise ConfigError(f"encoding {encoding!r} unknown; use one of {codec.ENCODINGS}")
    new_hasher(checksum)  # raises ConfigError for an unknown algorithm
    if bucket_bytes < 1:
        raise ConfigError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    if delta_shard_bytes is not None and delta_shard_bytes < 1:
        raise ConfigError(f"delta_shard_bytes must be >= 1, got {delta_shard_bytes}")
    if max_in_flight < 1:
        raise ConfigError(f"max_in_flight must be >= 1, got {max_in_flight}")
    if mode not in ("delta", "full"):
        raise ConfigError(f"mode must be 'delta' or 'full', got {mode!r}")
    if keyframe_interval < 0:
        raise ConfigError(f"keyframe_interval must be >= 0 (0 = never), got {keyframe_interval}")
    if not 1 <= zstd_level <= 22:
        raise ConfigError(f"zstd_level must be in 1..22, got {zstd_level}")
    if pre_commit_hook is not None and not callable(pre_commit_hook):
        raise ConfigError("pre_commit_hook must be callable: hook(version_dir)")
    if retention is not None and not isinstance(retention, RetentionPolicy):
        raise ConfigError("retention must be a RetentionPolicy or None")
    if coordinator is not None and not isinstance(coordinator, Coordinator):
        raise ConfigError("coordinator must be an asyncsync.publish.distributed.Coordinator")
