"""Reading a version's shards: verify the bytes, then decode them in groups the engine applies.

Pure except for :func:`read_verified` (one file read). The agent reads and verifies a shard
once, parses it, and decodes its tensors in *apply groups* of a bounded decoded size: a delta
shard can hold the deltas of many buckets (``asyncsync.codec.shards.DeltaPacker``), and decoding all
of it before the engine applies anything would hold every decoded patch (positions as int64,
~10 bytes per changed element) and the engine's undo journal for all of them at once. Groups
bound that memory and let the agent decode group k+1 while the engine applies group k.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asyncsync import codec
from asyncsync.codec import int_dtype, scratch
from asyncsync.codec.shards import ShardData, parse_delta_shard, parse_shard
from asyncsync.errors import (
    ChecksumMismatch,
    ConfigError,
    FormatError,
    IncompleteVersion,
    ManifestError,
)
from asyncsync.format import (
    DTYPE_SIZES,
    Manifest,
    ShardInfo,
    TensorEntry,
    TensorPart,
    version_dir,
)
from asyncsync.format.checksum import checksum_bytes
from asyncsync.format.names import dtype_from_name
from asyncsync.fsio import UnsafePath, read_buffer, read_into
from asyncsync.pipeline import SMALL_WORK_BYTES, pack_cap, parallel_map, threads
from receiver.engines.base import TensorUpdate
from receiver.parts import PartUpdate

__all__ = [
    "ShardData",
    "APPLY_GROUP_BYTES",
    "VERIFY_DEADLINE",
    "Piece",
    "apply_groups",
    "decode_pieces",
    "decode_shard",
    "group_bytes_for",
    "group_pieces",
    "int_dtype",
    "open_shard",
    "pieces_by_shard",
    "read_pooled",
    "pieces_in",
    "read_verified",
    "shard_source",
    "tensor_bytes",
    "verified",
]

# Decoded bytes (positions + values) handed to the engine at once. Each group is one undo
# record, made durable (two fsyncs) before it patches: at 1 MiB a 1 GiB model at 3 % made 162
# records and their fsyncs were a third of the apply (docs/bench/profile_apply_1g_before.txt);
# 16 MiB makes ~10, and two or three groups in flight are still ~2 % of a 4 GiB model.
APPLY_GROUP_BYTES = 16 << 20
# ... but never more than 1/64 of the model, at least 1 MiB: with two or three groups in flight
# (decoded patches and undo records) a 64 MB model kept 1.69x its size with 16 MiB groups
# (issue 26; 1.35x with 1 MiB), while a 1 GiB model keeps its ~10 records of 16 MiB.
MIN_APPLY_GROUP_BYTES = 1 << 20
#: the default ``verify_deadline`` (the agent's, the stream's): seconds a damaged or incomplete
#: shard is re-read (here, where the agent and receiver.stream both read shards: no cycle)
VERIFY_DEADLINE = 10.0


def group_bytes_for(model_bytes: int, limit: int = APPLY_GROUP_BYTES) -> int:
    """The apply group size for a model of ``model_bytes``: ``model_bytes / 64`` within
    [1 MiB, ``limit``] (``limit`` below 1 MiB wins)."""
    return min(limit, max(MIN_APPLY_GROUP_BYTES, model_bytes // 64))


Piece = tuple[TensorEntry, TensorPart | None, Any]  # entry, its part (None: whole), its ref


def shard_source(root: Path, m: Manifest, shard: ShardInfo) -> tuple[Path, Path | None]:
    """Where a shard is, and the root it must be read in without following anything (None: a
    registered checkpoint's file outside the root, whose symlinks are followed; FORMAT.md
    section 5)."""
    path = m.shard_path(version_dir(root, m.version), shard)
    if m.shard_dir is None or shard.role != "full":
        return path, root
    inside = os.path.abspath(path).startswith(os.path.abspath(root).rstrip(os.sep) + os.sep)
    return path, root if inside else None


def read_verified(
    path: Path, shard: ShardInfo, algorithm: str, *, root: Path | None
) -> bytes | bytearray | memoryview:
    """The shard's bytes, checked against the manifest's size and checksum.

    Read through :func:`asyncsync.fsio.read_bytes`: with ``root`` nothing below it is followed
    (a shard or version directory that is a symlink, a FIFO or not a regular file raises
    ManifestError); without, ``path`` is a registered checkpoint's file, whose symlinks are
    followed but which must still be a regular file. Raises IncompleteVersion (missing,
    short, unreadable: maybe not yet visible on this host) or ChecksumMismatch. A full shard
    is read into a ``bytearray`` (:func:`asyncsync.fsio.read_buffer`): its tensors are views of
    it (:func:`open_shard`), not copies; a delta shard into a buffer of the scratch pool
    (:func:`asyncsync.fsio.read_into`: pages already faulted in), its blobs read-only views.
    """
    read = read_pooled if shard.role == "delta" else read_buffer
    try:  # the size is checked from fstat before anything is allocated for the claim
        data = read(path, limit=shard.bytes, root=root, follow_symlinks=root is None)
    except FileNotFoundError as exc:
        raise IncompleteVersion(f"{path}: shard named by the manifest is missing") from exc
    except UnsafePath as exc:
        raise ManifestError(f"{exc.strerror} (a shard must be a regular file)") from exc
    except ValueError as exc:
        raise IncompleteVersion(
            f"{path}: larger than the {shard.bytes} bytes it should have"
        ) from exc
    except OSError as exc:  # EACCES, EIO, a stale NFS handle: maybe transient, re-read
        raise IncompleteVersion(f"{path}: cannot read the shard ({exc})") from exc
    return verified(data, path, shard, algorithm)


def read_pooled(
    path: Path, *, limit: int, root: Path | None, follow_symlinks: bool = False
) -> memoryview:
    """:func:`asyncsync.fsio.read_into` a buffer of the scratch pool (reused once nothing refers
    to it; its pages already faulted in): a delta shard's bytes, by the agent and the stream."""
    return read_into(path, _pooled, limit=limit, root=root, follow_symlinks=follow_symlinks)


def _pooled(size: int) -> Any:
    return scratch.empty(size, np.uint8)


def verified(
    data: bytes | bytearray | memoryview, path: Path, shard: ShardInfo, algorithm: str
) -> bytes | bytearray | memoryview:
    """``data`` if its size and checksum are the manifest's, else IncompleteVersion/Mismatch."""
    if len(data) != shard.bytes:
        raise IncompleteVersion(f"{path}: {len(data)} bytes, the manifest says {shard.bytes}")
    digest = checksum_bytes(data, algorithm)
    if digest != shard.checksum:
        raise ChecksumMismatch(
            f"{path}: checksum {digest} != manifest {shard.checksum}; the shard is corrupt "
            "or not yet fully visible on this host",
            path=str(path),
        )
    return data


def pieces_in(m: Manifest, mode: str, idx: int) -> list[Piece]:
    """(entry, part or None for a whole tensor, ref) of each piece of data in shard ``idx``."""
    return pieces_by_shard(m, mode).get(idx, [])


def pieces_by_shard(m: Manifest, mode: str) -> dict[int, list[Piece]]:
    """:func:`pieces_in` of every shard, in one pass over the manifest's entries. A version's
    shards each looked at every entry: S shards of N tensors cost S x N looks (~2.5 us each:
    ~250 ms a version for 20,000 tensors in 5 shards, a minute for a MoE's tens of thousands
    in the hundreds of 4 MiB shards of a 100 GB model's delta)."""
    out: dict[int, list[Piece]] = {}
    delta = mode == "delta"
    for e in m.tensors:
        for p in e.spans:
            ref = p.delta if delta else p.full
            if ref is not None:
                out.setdefault(ref.shard, []).append((e, p if e.parts is not None else None, ref))
    return out


def _decoded_bytes(piece: Piece) -> int:
    e, part, ref = piece
    if getattr(ref, "mode", "dense") == "sparse":
        return (e.changed if part is None else part.changed) * (8 + DTYPE_SIZES[e.dtype])
    return tensor_bytes(piece)


def tensor_bytes(piece: Piece) -> int:
    """The bytes of the tensor (or part) a piece updates: what its decode's work scales with
    (the pool's cost of it, as the patch's is its tensor's bytes)."""
    e, part, _ = piece
    return (e.numel if part is None else part.numel) * DTYPE_SIZES[e.dtype]


def apply_groups(
    m: Manifest,
    mode: str,
    idx: int,
    limit: int = APPLY_GROUP_BYTES,
    *,
    by_shard: dict[int, list[Piece]] | None = None,
) -> list[list[Piece]]:
    """The pieces of shard ``idx`` in consecutive groups of at most ``limit`` decoded bytes
    (a piece larger than that is a group of its own, or packed with the large ones next to it:
    :func:`group_pieces`). ``by_shard``: :func:`pieces_by_shard` of ``m`` and ``mode``, for a
    caller that groups every shard of a version (else one pass over the manifest per call).

    A full shard is one group (it holds one bucket of whole tensors, already in memory).
    """
    pieces = pieces_in(m, mode, idx) if by_shard is None else by_shard.get(idx, [])
    if mode != "delta":
        return [pieces] if pieces else []
    return group_pieces(pieces, limit, threads())


def group_pieces(pieces: list[Piece], limit: int, spread: int = 1) -> list[list[Piece]]:
    """Delta ``pieces`` in consecutive groups of at most ``limit`` decoded bytes (a piece larger
    than that is a group of its own).

    ``spread > 1``: consecutive pieces larger than ``limit`` are packed up to ``spread`` to a
    group instead, of at most ``max(spread * limit, 2 * the largest piece)`` decoded bytes: an
    engine applies a group's tensors on its pool one per worker, so a large tensor alone (an
    embedding, an ``lm_head``: the publisher puts them in one shard) keeps one core busy.
    """
    sizes = [_decoded_bytes(piece) for piece in pieces]
    cap = pack_cap(sizes, limit, spread)
    groups: list[list[Piece]] = []
    size, packing = 0, False
    for piece, n in zip(pieces, sizes, strict=True):
        big = n > limit
        if big:  # joins a pack of large pieces (never a group of small ones)
            joins = packing and len(groups[-1]) < spread and size + n <= cap
        else:
            joins = bool(groups) and not packing and size + n <= limit
        if joins:
            groups[-1].append(piece)
            size += n
        else:
            groups.append([piece])
            size, packing = n, big
    return groups


def open_shard(
    m: Manifest, shard: ShardInfo, data: bytes | bytearray | memoryview, where: str
) -> ShardData:
    """Parse verified shard bytes; refuse a shard whose metadata names another version/run (a
    delta shard's blobs come as views of ``data``, a full shard's tensors as tensors viewing
    ``data`` when it is a ``bytearray``: :func:`asyncsync.codec.shards.parse_shard`)."""
    if shard.role == "delta":
        return parse_delta_shard(data, where=where, version=m.version, run_id=m.run_id)
    if isinstance(data, memoryview):  # (only a delta shard is read into the scratch pool)
        data = bytearray(data)
    external = m.shard_dir is not None and shard.role == "full"
    return parse_shard(
        data,
        where=where,
        version=None if external else m.version,
        run_id=None if external else m.run_id,
        role=None if external else shard.role,
    )


def decode_pieces(
    m: Manifest, mode: str, tensors: ShardData, pieces: list[Piece], where: str
) -> list[TensorUpdate | PartUpdate]:
    """The updates of ``pieces`` from a parsed shard; a part of a tensor in parts is a
    PartUpdate (see receiver.parts). Anything malformed raises FormatError.

    The small sparse xef pieces are decoded many to a C call first (:func:`_decode_small`),
    the rest one by one on the pool; either way the first piece in order that is not valid
    raises its own error."""
    done = _decode_small(m, tensors, pieces) if mode == "delta" and m.encoding == "xef" else {}
    rest = parallel_map(
        lambda piece: _decode_piece(m, mode, tensors, piece, where),
        [piece for i, piece in enumerate(pieces) if i not in done] if done else pieces,
        cost=tensor_bytes,
    )
    if not done:
        return rest
    others = iter(rest)
    return [done[i] if i in done else next(others) for i in range(len(pieces))]


def _decode_small(
    m: Manifest, tensors: ShardData, pieces: list[Piece]
) -> dict[int, TensorUpdate | PartUpdate]:
    """The updates of the sparse pieces under :data:`SMALL_WORK_BYTES` (those the pool would
    decode in the calling thread, one by one), by index in ``pieces``: each dtype's decoded in
    one call (:func:`asyncsync.codec.decode_xef_many`). Empty when any of them is not valid:
    every piece is then decoded alone, and the first that is not valid says what is wrong."""
    by_dtype: dict[str, list[tuple[int, Any]]] = {}
    for i, (e, part, ref) in enumerate(pieces):
        if ref.mode != "sparse":
            continue
        numel, changed = (e.numel, e.changed) if part is None else (part.numel, part.changed)
        if numel * DTYPE_SIZES[e.dtype] >= SMALL_WORK_BYTES:
            continue
        pos_b, val_b = tensors.get(ref.positions), tensors.get(ref.values)
        if not isinstance(pos_b, memoryview) or not isinstance(val_b, memoryview):
            return {}
        by_dtype.setdefault(e.dtype, []).append((i, (pos_b, val_b, changed, numel)))
    done: dict[int, TensorUpdate | PartUpdate] = {}
    for dtype, todo in by_dtype.items():
        try:  # (an unknown dtype: the pieces decoded alone raise it, in their order)
            view = int_dtype(dtype_from_name(dtype))
        except (ConfigError, ManifestError):
            return {}
        patches = codec.decode_xef_many([d for _, d in todo], view)
        if patches is None:
            return {}
        for (i, _), patch in zip(todo, patches, strict=True):
            e, part, _ = pieces[i]
            done[i] = TensorUpdate(e, patch=patch) if part is None else PartUpdate(e, part, patch)
    return done


def _decode_piece(
    m: Manifest, mode: str, tensors: ShardData, piece: Piece, where: str
) -> TensorUpdate | PartUpdate:
    """One piece's update (on the pool: the pieces of a group decode in parallel)."""
    e, part, ref = piece
    span = part or e.spans[0]
    if mode == "delta":
        pos_b, val_b = tensors.get(ref.positions), tensors.get(ref.values)
        if not isinstance(pos_b, memoryview) or not isinstance(val_b, memoryview):
            raise FormatError(f"{where}: missing {ref.positions!r}/{ref.values!r} for {e.name!r}")
        try:
            patch = codec.decode_delta(
                m.encoding,
                ref.mode,
                pos_b,
                val_b,
                changed=span.changed,
                numel=span.numel,
                dtype=int_dtype(e.torch_dtype),
            )
        except FormatError as exc:
            raise FormatError(f"{where}: tensor {e.name!r}: {exc}") from exc
        return TensorUpdate(e, patch=patch) if part is None else PartUpdate(e, part, patch)
    t = tensors.get(ref.key)
    if not isinstance(t, torch.Tensor):
        raise FormatError(f"{where}: tensor {ref.key!r} for {e.name!r} is not in the shard")
    if t.dtype != e.torch_dtype or (
        tuple(t.shape) != e.shape if part is None else t.numel() != part.numel
    ):
        raise FormatError(
            f"{where}: tensor {e.name!r} is {t.dtype}{list(t.shape)}, the manifest says "
            f"{e.dtype}{list(e.shape)}" + ("" if part is None else f" ({span.numel} here)")
        )
    return TensorUpdate(e, full=t) if part is None else PartUpdate(e, part, full=t)


def decode_shard(
    m: Manifest, mode: str, idx: int, shard: ShardInfo, data: bytes, where: str
) -> list[TensorUpdate | PartUpdate]:
    """Every update of one verified shard (all its groups at once)."""
    return decode_pieces(m, mode, open_shard(m, shard, data, where), pieces_in(m, mode, idx), where)
