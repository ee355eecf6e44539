"""Checks of a :class:`~asyncsync.publish.publisher.Publisher`'s options: every bad value is a
:class:`~asyncsync.errors.ConfigError` naming it, raised before anything is touched."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from asyncsync import codec, fsio, memory, pipeline
from asyncsync.errors import ConfigError, check_bytes, check_number
from asyncsync.format import Manifest
from asyncsync.format.checksum import new_hasher
from asyncsync.format.names import root_path
from asyncsync.publish.distributed import Coordinator
from asyncsync.publish.retention import RetentionPolicy

__all__ = ["ShardSizer", "adaptive_shard_bytes", "check_options", "check_round"]

#: the adaptive delta shard size: about SHARDS_PER_DELTA shards per delta, each within
#: [MIN_DELTA_SHARD_BYTES, min(bucket_bytes, MAX_DELTA_SHARD_BYTES)]
SHARDS_PER_DELTA = 8
MIN_DELTA_SHARD_BYTES = 1 << 20
MAX_DELTA_SHARD_BYTES = 4 << 20


def adaptive_shard_bytes(last_delta: int | None, model_bytes: int, ceiling: int) -> int:
    """A delta shard size of about an eighth of the last delta's bytes (the model's bytes / 512
    before the first: ~1.6 % of bf16 changes at ~3 % density) within [1 MiB, ``ceiling``].

    Small enough that a receiver applies most shards while the rest are written (at 256 MiB,
    4 MiB shards made a version two shards, the first landing late), large enough to keep
    files few (each costs a round trip on a network filesystem)."""
    estimate = model_bytes // 512 if last_delta is None else last_delta // SHARDS_PER_DELTA
    return max(min(estimate, ceiling), min(MIN_DELTA_SHARD_BYTES, ceiling))


class ShardSizer:
    """A publisher's delta shard size: ``fixed`` when given, else :func:`adaptive_shard_bytes`
    of the last delta committed, up to ``min(bucket_bytes, MAX_DELTA_SHARD_BYTES)``.

    Given the model's bytes (``model_bytes``: the sum of the sizes the publisher reads once per
    version for its plan), not the state: it summed the tensors again, three passes per version
    before the first delta (~12 ms each per 100,000 tensors)."""

    def __init__(self, fixed: int | None, bucket_bytes: int) -> None:
        self.fixed = fixed
        self.ceiling = fixed or min(bucket_bytes, MAX_DELTA_SHARD_BYTES)
        self.last_delta: int | None = None  # the shard bytes of the last delta committed

    def next(self, model_bytes: int) -> int:
        """The shard size of the next version of a model of ``model_bytes``."""
        if self.fixed is not None:
            return self.fixed
        return adaptive_shard_bytes(self.last_delta, model_bytes, self.ceiling)

    def tapers(self, model_bytes: int) -> bool:
        """Whether the next delta's plan leads with a small bucket and its shards taper
        (:class:`~asyncsync.publish.writer.VersionWriter`'s ``taper``): at the default size,
        when the delta is expected to fill two shards or more (the last delta's bytes, or the
        model's / 64 before the first); a smaller one stays one or two files, and a given
        ``delta_shard_bytes`` is a size, nothing else."""
        if self.fixed is not None:
            return False
        expected = model_bytes // 64 if self.last_delta is None else self.last_delta
        return expected >= 2 * self.next(model_bytes)

    def committed(self, manifest: Manifest) -> None:
        """Note a committed version (for a rank of a group: the merged one, every rank's shards,
        so its next estimate errs large, within the ceiling)."""
        if manifest.kind == "delta":
            self.last_delta = sum(s.bytes for s in manifest.shards)


def check_options(
    *,
    root: Any,
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
    producer: Any = None,
    pipelined: Any = True,
) -> None:
    """Raise ConfigError for the first option out of its range or of the wrong type (see
    Publisher's Args)."""
    root_path(root)  # "" (the working directory), None, bytes: a ConfigError
    memory.check_env()  # read at the first device copy: said at start-up instead
    pipeline.check_threads_env()  # read at the first parallel map: said at start-up too
    fsio.check_throttle_env()  # ASYNCSYNC_THROTTLE, read at import (a bad one: no throttle)
    if producer is not None:  # every manifest holds it as JSON (FORMAT.md 11.3)
        try:
            if not isinstance(producer, Mapping) or not all(isinstance(k, str) for k in producer):
                raise TypeError("not a mapping of str keys")
            json.dumps(dict(producer), allow_nan=False)
        except (TypeError, ValueError, RecursionError) as exc:
            raise ConfigError(
                f"producer must be a mapping of str keys to JSON values (no NaN): {exc}"
            ) from None
    check_bytes("bucket_bytes", bucket_bytes)
    check_bytes("delta_shard_bytes", delta_shard_bytes, optional=True)
    for name, value in (
        ("max_in_flight", max_in_flight),
        ("keyframe_interval", keyframe_interval),
        ("zstd_level", zstd_level),
    ):
        check_number(name, value, integer=True)
    if not isinstance(encoding, str) or encoding not in codec.ENCODINGS:
        raise ConfigError(f"encoding {encoding!r} unknown; use one of {codec.ENCODINGS}")
    new_hasher(checksum)  # raises ConfigError for an unknown algorithm
    if not isinstance(pipelined, bool):  # "no" ran pipelined, as keyframe="no" was a keyframe
        raise ConfigError(f"pipelined must be True or False, got {pipelined!r}")
    if max_in_flight < 1:
        raise ConfigError(f"max_in_flight must be >= 1, got {max_in_flight}")
    if not isinstance(mode, str) or mode not in ("delta", "full"):
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


def check_round(*, keyframe: object, step: object) -> None:
    """Raise ConfigError for a publish call's ``keyframe`` that is not a bool (``keyframe="no"``
    was taken as True: a truthy string published a full version) or ``step`` that is not an
    int or None. Checked before the round begins: nothing is written."""
    if not isinstance(keyframe, bool):
        raise ConfigError(f"keyframe must be True or False, got {keyframe!r}")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        raise ConfigError(f"step must be an int (the training step) or None, got {step!r}")
