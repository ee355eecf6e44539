"""The fields of :class:`asyncsync.training.config.SyncConfig`: what each means, how it is
written as a string (command line, environment, files), and its range.

Strings are accepted for every field: sizes as ``33554432``, ``32MiB`` or ``1G`` (K/M/G/T and
KiB/MiB/... are powers of 1024, KB/MB/... powers of 1000), ``none`` for an optional value,
``true``/``false`` (``1``/``0``, ``yes``/``no``, ``on``/``off``) for booleans, comma-separated
engine ids, hooks as import paths ``pkg.module:function``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from asyncsync.codec import ENCODINGS
from asyncsync.console.args import parse_size
from asyncsync.errors import MAX_BYTES, MAX_SECONDS, ConfigError, ManifestError, shown
from asyncsync.format import check_engine_id
from asyncsync.format.checksum import ALGORITHMS
from asyncsync.publish.hooks import check_import_path

__all__ = ["FIELD_SPECS", "FieldSpec", "parse_size", "parse_value"]

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
_NONE = frozenset({"", "none", "null"})


@dataclass(frozen=True)
class FieldSpec:
    """How one field is written as a string, parsed and range-checked."""

    kind: Literal["path", "choice", "int", "size", "float", "bool", "hook", "engines"]
    help: str
    choices: tuple[str, ...] = ()
    minimum: float | None = None
    maximum: float | None = None
    optional: bool = False
    fix: str = ""  # appended to a failed check: how to fix it


FIELD_SPECS: dict[str, FieldSpec] = {
    "root": FieldSpec(
        "path", "shared directory the versions are written to (one publisher per root)"
    ),
    "mode": FieldSpec(
        "choice",
        "delta: sparse deltas against the previous version (+ keyframes); full: a complete "
        "safetensors checkpoint per version",
        choices=("delta", "full"),
    ),
    "transport": FieldSpec(
        "choice",
        "how weights travel; asyncsync moves them through the shared directory only",
        choices=("disk",),
        fix="asyncsync writes versions to a shared directory that the receivers read; it has no "
        "NCCL/RDMA transport. Use 'disk' (and set root), or keep your framework's own updater "
        "for in-cluster broadcast",
    ),
    "colocate": FieldSpec("bool", "engines share the trainer's GPUs (refused with mode 'delta')"),
    "encoding": FieldSpec(
        "choice",
        "delta encoding (ignored in full mode)",
        choices=ENCODINGS,
        fix="xef is asyncsync's and the smallest; indices, deltas and deltas_zstd are slime's "
        "generation-1 encodings",
    ),
    "checksum": FieldSpec("choice", "checksum of shards and tensors", choices=ALGORITHMS),
    "bucket_bytes": FieldSpec(
        "size", "tensors per bucket and most bytes per delta shard (e.g. 32MiB)", minimum=1
    ),
    "max_in_flight": FieldSpec(
        "int", "encoded buckets waiting for the writer (bounds memory)", minimum=1
    ),
    "keyframe_interval": FieldSpec(
        "int",
        "every N-th version also carries full data, for engines that join late (0: never)",
        minimum=0,
    ),
    "zstd_level": FieldSpec("int", "zstd level of delta payloads (1-22)", minimum=1, maximum=22),
    "keep_versions": FieldSpec(
        "int",
        "retention: keep the newest N versions, older ones unless an engine or the newest keyframe "
        "needs them (none, with keep_bytes none: keep everything)",
        minimum=1,
        optional=True,
    ),
    "keep_bytes": FieldSpec(
        "size",
        "retention: keep, from the newest, the versions whose total size fits (none: no size rule)",
        minimum=1,
        optional=True,
    ),
    "pre_commit_hook": FieldSpec(
        "hook",
        "hook(version_dir) run after the shards are durable, before the commit; an import path "
        "pkg.module:function",
        optional=True,
    ),
    "start_version": FieldSpec(
        "int",
        "the trainer's weight version of the first publish (slime's update_weight_start_version)",
        minimum=0,
    ),
    "ack_engines": FieldSpec("engines", "engine ids that must all acknowledge (comma-separated)"),
    "ack_quorum": FieldSpec(
        "int", "or: how many engines (any) must acknowledge", minimum=1, optional=True
    ),
    "ack_timeout": FieldSpec(
        "float", "seconds to wait for acks before failing (none: forever)", optional=True
    ),
    "max_staleness": FieldSpec(
        "int",
        "versions the trainer may run ahead of the engines it waits for (0: wait for each "
        "version; 1: publish N, wait for N-1)",
        minimum=0,
    ),
}


def parse_value(spec: FieldSpec, raw: Any) -> Any:
    """``raw`` (a string, or a value of the field's type) parsed and range-checked.

    Raises ValueError (or TypeError) saying what was expected; the caller names the field.
    """
    if isinstance(raw, str) and spec.kind not in ("path", "hook", "choice"):
        raw = raw.strip()
    if spec.optional and (raw is None or (isinstance(raw, str) and raw.lower() in _NONE)):
        return None
    if raw is None:
        raise ValueError("is required")
    kind = spec.kind
    value: Any
    if kind == "path":
        if not isinstance(raw, str | os.PathLike) or not str(raw).strip():
            raise ValueError(f"expected a directory path, got {raw!r}")
        return Path(os.path.expanduser(str(raw).strip()))
    if kind == "choice":
        if not isinstance(raw, str) or raw.strip() not in spec.choices:
            raise ValueError(f"must be one of {', '.join(spec.choices)}; got {raw!r}")
        return raw.strip()
    if kind == "bool":
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.lower() in _TRUE | _FALSE:
            return raw.lower() in _TRUE
        raise ValueError(f"expected true or false, got {raw!r}")
    if kind == "hook":
        if callable(raw):
            return raw
        if not isinstance(raw, str):
            raise ValueError(f"expected a callable or 'pkg.module:function', got {raw!r}")
        try:
            return check_import_path(raw, what="pre_commit_hook")
        except ConfigError as exc:
            raise ValueError(str(exc).removeprefix("pre_commit_hook: ")) from None
    if kind == "engines":
        items = raw.split(",") if isinstance(raw, str) else raw
        if not isinstance(items, list | tuple):
            raise ValueError(f"expected engine ids (a list or 'a,b,c'), got {raw!r}")
        out = []
        for item in items:
            try:
                out.append(check_engine_id(item.strip() if isinstance(item, str) else item))
            except ManifestError as exc:
                raise ValueError(str(exc)) from None
        if len(set(out)) != len(out):
            raise ValueError(f"engine ids repeat: {out}")
        return tuple(out)
    if isinstance(raw, bool):
        raise ValueError(f"expected a number, got {raw!r}")
    if kind == "float":
        try:
            value = float(raw) if isinstance(raw, int | float | str) else math.nan
        except (ValueError, OverflowError):  # (float(10**400) overflows)
            value = math.nan
        if not math.isfinite(value) or value > MAX_SECONDS:
            raise ValueError(
                f"expected a finite number of seconds (at most {MAX_SECONDS:.0f}), got {shown(raw)}"
            )
    elif kind == "size":
        if isinstance(raw, str):
            value = parse_size(raw)
        elif isinstance(raw, int):
            value = raw
        else:
            raise ValueError(f"expected a size such as 33554432 or 32MiB, got {raw!r}")
        if value > MAX_BYTES:
            raise ValueError(f"must be at most 1 PiB ({MAX_BYTES} bytes), got {shown(value)}")
    else:  # int
        if isinstance(raw, str):
            try:
                value = int(raw)
            except ValueError:
                raise ValueError(f"expected a whole number, got {raw!r}") from None
        elif isinstance(raw, int):
            value = raw
        else:
            raise ValueError(f"expected a whole number, got {raw!r}")
    if spec.minimum is not None and value < spec.minimum:
        raise ValueError(f"must be >= {spec.minimum:g}, got {value}")
    if spec.maximum is not None and value > spec.maximum:
        raise ValueError(f"must be <= {spec.maximum:g}, got {value}")
    return value
