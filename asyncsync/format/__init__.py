"""The on-disk protocol both sides share: paths, manifest and ack records, JSON, validation.

``docs/FORMAT.md`` is the normative spec; this package is its executable form:
:mod:`~asyncsync.format.names` (constants, dtypes, paths), :mod:`~asyncsync.format.fields`
(strict JSON field readers), :mod:`~asyncsync.format.entries` (shards, tensor entries, refs,
parts), :mod:`~asyncsync.format.manifest` (the manifest, totals, fingerprint),
:mod:`~asyncsync.format.checksum` (XXH3 checksums of bytes, tensors, files, parts),
:mod:`~asyncsync.format.acks` (ack records; reading, writing and waiting for them),
:mod:`~asyncsync.format.store` (reading a root: committed versions, manifests, root identity)
and :mod:`~asyncsync.format.log` (the manifest log). It imports nothing of the two sides.

Everything read from the shared directory goes through :func:`Manifest.from_json` /
:func:`AckRecord.from_json`, which reject anything malformed, unsafe (path escapes) or of an unknown
format version with a :class:`~asyncsync.errors.ManifestError`.

Layout of a root::

    ROOT/
      asyncsync.json              root identity (format, format_version, run_id)
      log.jsonl                   one JSON line per committed version (append-only)
      acks/<engine_id>.json       one ack record per engine, replaced atomically
      v000000000000/              one directory per version, zero-padded, sortable
        manifest.json             the commit marker, written last
        delta-00000.safetensors   delta shards (uint8 blobs)
        full-00000.safetensors    full shards (tensors by name) for keyframes
        r0003-<attempt>-delta-00000.safetensors   the same, written by rank 3 of a multi-rank
                                  publisher (asyncsync.publish.distributed), with its part record
                                  part-r0003-<attempt>.json until the commit

Format version 2 added tensors published in parts (:class:`TensorPart`, one part per rank of a
tensor sliced across ranks); readers accept versions 1 and 2.
"""

from __future__ import annotations

from typing import Any

from asyncsync.format.acks import AckRecord
from asyncsync.format.entries import DeltaRef, FullRef, ShardInfo, TensorEntry, TensorPart
from asyncsync.format.manifest import Manifest, Totals, fingerprint
from asyncsync.format.names import (
    ACKS_DIR,
    DEFAULT_ENCODING,
    DTYPE_SIZES,
    ENCODINGS,
    FORMAT_NAME,
    FORMAT_VERSION,
    LOG_NAME,
    MANIFEST_NAME,
    MAX_VERSION,
    READ_FORMAT_VERSIONS,
    ROOT_INFO_NAME,
    VERSION_DIGITS,
    ack_path,
    check_engine_id,
    check_file_name,
    dtype_from_name,
    dtype_name,
    manifest_path,
    parse_version_dir,
    version_dir,
    version_dir_name,
)

__all__ = [
    "ACKS_DIR",
    "DEFAULT_ENCODING",
    "DTYPES",
    "DTYPE_SIZES",
    "ENCODINGS",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "LOG_NAME",
    "MANIFEST_NAME",
    "MAX_VERSION",
    "READ_FORMAT_VERSIONS",
    "ROOT_INFO_NAME",
    "VERSION_DIGITS",
    "AckRecord",
    "DeltaRef",
    "FullRef",
    "Manifest",
    "ShardInfo",
    "TensorEntry",
    "TensorPart",
    "Totals",
    "ack_path",
    "check_engine_id",
    "check_file_name",
    "dtype_from_name",
    "dtype_name",
    "fingerprint",
    "manifest_path",
    "parse_version_dir",
    "version_dir",
    "version_dir_name",
]


def __getattr__(name: str) -> Any:
    if name == "DTYPES":  # {name: torch.dtype}: torch is imported on first use only
        from asyncsync.format import names

        return names.DTYPES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
