"""Shard contents: turning a bucket of tensors into shard bytes and back. No file I/O.

A *delta shard* is a safetensors file of 1-D ``uint8`` tensors: for the tensor at index ``i`` of
the manifest, ``t{i}.pos`` holds its encoded positions and ``t{i}.val`` its encoded values. The
deltas of consecutive buckets share a shard up to a size limit (:class:`DeltaPacker`).
A *full shard* is a safetensors file of complete tensors stored under their own names, like a
Hugging Face checkpoint file. Both carry header metadata naming the version and run, so a
shard copied from another version is refused even if its checksum is intact.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from asyncsync import codec
from asyncsync.codec.views import BY_CODE
from asyncsync.errors import FormatError, PublishError
from asyncsync.format.checksum import checksum_bytes, checksum_tensor, tensor_bytes
from asyncsync.format.names import SAFETENSORS_CODES, dtype_name
from asyncsync.memory import gc_paused
from asyncsync.pipeline import parallel_map

__all__ = [
    "BucketItem",
    "DeltaPacker",
    "DiffedBucket",
    "EncodedBucket",
    "ItemResult",
    "PendingUpdate",
    "delta_keys",
    "delta_shard_blob",
    "delta_shard_parts",
    "diff_bucket",
    "encode_bucket",
    "parse_delta_shard",
    "parse_shard",
    "ShardData",
    "read_header",
    "shard_metadata",
]

MAX_HEADER = 100 << 20  # safetensors' own limit

#: A parsed shard: a delta shard's blobs as read-only views of its bytes
#: (:func:`parse_delta_shard`), a full shard's tensors (:func:`parse_shard`).
ShardData = Mapping[str, "torch.Tensor | memoryview"]


def delta_keys(index: int) -> tuple[str, str]:
    return f"t{index}.pos", f"t{index}.val"


def shard_metadata(version: int, run_id: str, role: str) -> dict[str, str]:
    return {
        "format": "asyncsync",
        "asyncsync.version": str(version),
        "asyncsync.run_id": run_id,
        "asyncsync.role": role,
    }


@dataclass(frozen=True)
class BucketItem:
    """One tensor of a bucket: its index in the manifest, name, snapshot (old) and new value."""

    index: int
    name: str
    new: torch.Tensor  # CPU
    old: torch.Tensor | None  # CPU snapshot, None when there is no base
    cached_checksum: str | None = None  # checksum of ``old`` (reused when nothing changed)
    owned: bool = False  # ``new`` is a fresh copy nothing else refers to (the snapshot may keep it)


@dataclass(frozen=True)
class PendingUpdate:
    """How to bring the snapshot to the new value after commit (sparse scatter or full copy)."""

    name: str
    positions: torch.Tensor | None  # None: copy the whole ``values`` tensor
    values: torch.Tensor
    owned: bool = False  # ``values`` is a fresh copy: the snapshot takes it instead of copying


@dataclass(frozen=True)
class ItemResult:
    index: int
    name: str
    changed: int
    checksum: str
    mode: Literal["sparse", "dense"] | None  # None: no delta data
    has_full: bool


@dataclass
class EncodedBucket:
    items: list[ItemResult] = field(default_factory=list)
    delta_blobs: dict[str, bytes] = field(default_factory=dict)  # t{i}.pos / t{i}.val -> blob
    full_blob: list[bytes | memoryview] | None = None  # the full shard's pieces, in order
    raw_bytes: int = 0  # delta payload before compression
    pending: list[PendingUpdate] = field(default_factory=list)


@dataclass(frozen=True)
class DiffedBucket:
    """A bucket after the diff stage: its items and, for deltas, each one's change (positions,
    new values and XORs there)."""

    items: Sequence[BucketItem]
    changes: list[codec.Change] | None  # None: no delta (a full version)
    advanced: bool = False  # the olds already hold the new bytes (diff_bucket's ``advance``)


def diff_bucket(
    items: Sequence[BucketItem],
    *,
    delta: bool,
    algorithm: str | None = None,
    advance: bool = False,
) -> DiffedBucket:
    """The diff stage: bytewise compare against ``old`` (:func:`asyncsync.codec.diff_tensors`,
    the fused C kernel on CPU when built). ``algorithm``: checksum each new tensor in the same
    pass; ``advance``: make each ``old`` equal to its ``new`` in it (the publisher's snapshot;
    :func:`asyncsync.codec.revert` undoes it)."""
    if not delta:
        return DiffedBucket(items, None)
    olds = [it.old for it in items]
    if any(o is None for o in olds):
        raise ValueError("delta encoding needs the old value of every tensor")
    news = [it.new for it in items]
    changes = codec.diff_tensors(
        [o for o in olds if o is not None], news, algorithm=algorithm, advance=advance
    )
    return DiffedBucket(items, changes, advanced=advance)


def encode_bucket(
    items: Sequence[BucketItem] | DiffedBucket,
    *,
    version: int,
    run_id: str,
    delta: bool,
    full: bool,
    encoding: str,
    level: int,
    algorithm: str,
) -> EncodedBucket:
    """Encode and serialise one bucket (diffing it first unless given a DiffedBucket).

    Pure: tensors in, shard bytes out. ``delta``: encode each tensor against ``old``.
    ``full``: also store every tensor whole (a keyframe).
    """
    diffed = items if isinstance(items, DiffedBucket) else diff_bucket(items, delta=delta)
    changes = diffed.changes
    full_blob, full_sums = _full_blob(diffed, version, run_id, algorithm) if full else (None, {})

    def one(k: int) -> tuple[ItemResult, codec.EncodedDelta | None, PendingUpdate | None]:
        """Encode and checksum item ``k`` (on the pool: tensors are independent)."""
        it = diffed.items[k]
        mode: Literal["sparse", "dense"] | None = None
        ch: codec.Change | None = None
        enc: codec.EncodedDelta | None = None
        pending: PendingUpdate | None = None
        if changes is not None:
            assert it.old is not None
            ch = changes[k]
            pos = ch.positions
            changed = int(pos.numel())
            if changed:
                numel = it.new.numel()
                enc = codec.encode_change(pos, ch.values, ch.xor, numel, encoding, level=level)
                changed = enc.changed  # what the decoder will check
                mode = enc.mode
                if not diffed.advanced:  # (else the diff brought the snapshot to the new bytes)
                    # the values the diff read, never ``it.new`` again: the trainer may have
                    # changed it since, and the snapshot must hold what was shipped
                    pending = PendingUpdate(it.name, pos, ch.values)
        else:
            changed = it.new.numel()
            pending = PendingUpdate(it.name, None, it.new, it.owned)
        if it.name in full_sums:  # the bytes the full shard carries (read once)
            checksum = full_sums[it.name]
            if ch is not None and ch.checksum is not None and ch.checksum != checksum:
                raise PublishError(
                    f"tensor {it.name!r} changed while it was published (its delta and its "
                    "whole bytes differ): do not change the tensors passed to publish() "
                    "before it returns"
                )
        elif ch is not None and ch.checksum is not None:
            checksum = ch.checksum  # taken in the diff's pass
        elif changed == 0 and it.cached_checksum is not None:
            checksum = it.cached_checksum
        else:
            checksum = checksum_tensor(it.new, algorithm)
        return ItemResult(it.index, it.name, changed, checksum, mode, full), enc, pending

    out = EncodedBucket(full_blob=full_blob)
    delta_blobs: dict[str, bytes] = {}
    for it, (res, enc, pending) in zip(
        diffed.items,
        parallel_map(one, range(len(diffed.items)), cost=lambda k: diffed.items[k].new.nbytes),
        strict=True,
    ):
        if enc is not None:
            pkey, vkey = delta_keys(it.index)
            delta_blobs[pkey] = enc.positions
            delta_blobs[vkey] = enc.values
            out.raw_bytes += enc.raw_bytes
        if pending is not None:
            out.pending.append(pending)
        out.items.append(res)
    out.delta_blobs = delta_blobs
    return out


def _shipped(it: BucketItem, advanced: bool) -> torch.Tensor:
    """``it``'s bytes as its delta ships them: the snapshot, once the diff advanced it."""
    return it.old if advanced and it.old is not None and it.old.is_contiguous() else it.new


def _full_blob(
    d: DiffedBucket, version: int, run_id: str, algorithm: str
) -> tuple[list[bytes | memoryview] | None, dict[str, str]]:
    """The full shard of a bucket, as the pieces to write one after another (its header, then
    each tensor's bytes), and the checksum of each tensor's bytes in it.

    A tensor is read once and checksummed there, never read again: the trainer may change its
    tensors while publish() reads them (an optimizer step in another thread), and a checksum
    taken of the tensor itself, before or after, could be of other bytes than those shipped.
    The publisher's own bytes are written from where they are: a copy :func:`bucket_items`
    read (``owned``), or the snapshot the diff advanced (a keyframe's tensor is saved from it:
    the bytes its delta ships, so that the two parts of the keyframe agree, attack-58). Any
    other tensor (the trainer's own) is copied first. The shard was one
    ``safetensors.torch.save`` buffer, a second copy of every owned tensor held until written:
    a seed's publisher peaked at 2.27x the model (1 GiB), against 2.0 for the trainer's tensors
    and the snapshot."""
    items = d.items
    if not items:
        return None, {}

    def one(it: BucketItem) -> tuple[torch.Tensor, memoryview, str]:
        t = _shipped(it, d.advanced)
        if not (it.owned or t is it.old):  # the trainer's tensor: read once, into a copy
            t = codec.raw_clone(t)
        view = tensor_bytes(t)  # (``t`` is kept beside it: the bytes stay until written)
        return t, view, checksum_bytes(view, algorithm)

    got = parallel_map(one, items, cost=lambda it: it.new.nbytes)
    # widest elements first: each tensor starts at a multiple of its element size
    order = sorted(range(len(items)), key=lambda k: -got[k][0].element_size())
    entries = [(items[k].name, got[k][0], got[k][1]) for k in order]
    parts = safetensors_parts(shard_metadata(version, run_id, "full"), entries)
    return parts, {it.name: sum_ for it, (_, _, sum_) in zip(items, got, strict=True)}


def safetensors_parts(
    meta: dict[str, str],
    entries: Sequence[tuple[str, torch.Tensor | None, bytes | memoryview]],
    *,
    ensure_ascii: bool = True,
) -> list[bytes | memoryview]:
    """A safetensors file as the pieces to write one after another: its header (metadata
    ``meta``; each entry's dtype and shape, a 1-D ``U8`` where the entry has no tensor; the
    data offsets in ``entries``' order, with no hole), then each entry's bytes. The header is
    padded with spaces to a multiple of 8 bytes, as safetensors' own writer does; its names are
    ``\\u``-escaped unless ``ensure_ascii`` is False (UTF-8, as safetensors writes them: the
    checkpoint's staging writes ``save_file``'s bytes); no ``__metadata__`` where ``meta`` is
    empty, as safetensors writes none (a shard always has it)."""
    header: dict[str, object] = {"__metadata__": meta} if meta else {}
    offset = 0
    for key, t, data in entries:
        n = len(data)
        header[key] = {
            "dtype": "U8" if t is None else SAFETENSORS_CODES[dtype_name(t.dtype)],
            "shape": [n] if t is None else list(t.shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=ensure_ascii).encode()
    text += b" " * (-(8 + len(text)) % 8)
    return [struct.pack("<Q", len(text)) + text, *(data for _, _, data in entries)]


def delta_shard_blob(
    blobs: dict[str, bytes],
    *,
    version: int,
    run_id: str,
    stream: dict[str, str] | None = None,
) -> bytes:
    """The bytes of one delta shard holding ``blobs``: :func:`delta_shard_parts` joined."""
    return b"".join(delta_shard_parts(blobs, version=version, run_id=run_id, stream=stream))


def delta_shard_parts(
    blobs: dict[str, bytes],
    *,
    version: int,
    run_id: str,
    stream: dict[str, str] | None = None,
) -> list[bytes | memoryview]:
    """The bytes of one delta shard holding ``blobs`` (``t{i}.pos``/``t{i}.val``), in order, as
    the pieces to write one after another: the header, then each blob (not copied into one
    buffer: a fresh buffer of a shard's size is faulted in page by page, ~15 ms per GiB of
    model at 3 %).

    A plain safetensors file of 1-D ``U8`` tensors, written directly: ``safetensors.torch.save``
    needs a tensor per blob and costs ~30 us per tensor, more than the rest of the write for a
    sparse version of a few hundred tensors (:func:`safetensors_parts`).
    """
    meta = shard_metadata(version, run_id, "delta")
    if stream is not None:  # a self-describing shard (format 3, FORMAT.md section 4.3)
        meta.update(stream)
    return safetensors_parts(meta, [(key, None, blob) for key, blob in blobs.items()])


@dataclass
class DeltaPacker:
    """Groups the delta blobs of consecutive buckets into delta shards of about ``limit`` bytes.

    Buckets are cut by *model* bytes, so at 3 % density a bucket's delta is ~1/50 of its size;
    one shard per bucket would make many small files, and each file costs a round trip on a
    network filesystem. A shard therefore collects buckets' blobs until adding the next
    bucket would pass ``limit`` (a bucket whose delta alone exceeds it is a shard of its own).

    Told where the version stands (:meth:`add`'s ``model`` and ``left``: model bytes), a
    packer for a receiver that applies shards as they land (FORMAT.md 4.3) also cuts the
    first bucket that has blobs into a shard of its own, so the receiver starts early, and
    a shard once it holds as many model bytes as the buckets still to come, so the version's
    last shards halve down to one bucket and what a receiver has left to apply after the
    last shard lands is one bucket's delta, not a whole shard's: about log2(limit / a
    bucket's delta) more files in all.
    """

    limit: int
    blobs: dict[str, bytes] = field(default_factory=dict)
    nbytes: int = 0
    model: int = 0  # model bytes of the buckets whose blobs are held
    taken: int = 0  # shards cut so far

    def add(
        self, blobs: dict[str, bytes], *, model: int = 0, left: int | None = None
    ) -> list[dict[str, bytes]]:
        """Take one bucket's blobs (``model``: the bytes of its tensors; ``left``: of the
        buckets still to come, None where unknown: the size limit alone cuts); return the
        groups now complete (in order), each a shard."""
        size = sum(len(b) for b in blobs.values())
        out = []
        if self.blobs and self.nbytes + size > self.limit:
            out.append(self.take())
        self.blobs.update(blobs)
        self.nbytes += size
        self.model += model
        early = left is not None and bool(self.blobs) and (not self.taken or self.model >= left)
        if self.nbytes >= self.limit or early:
            out.append(self.take())
        return out

    def take(self) -> dict[str, bytes]:
        """The blobs collected so far (possibly none), emptying the packer."""
        out, self.blobs, self.nbytes, self.model = self.blobs, {}, 0, 0
        self.taken += bool(out)
        return out


def read_header(data: bytes | bytearray | memoryview, *, where: str) -> dict[str, object]:
    """The JSON header of a safetensors blob (validated for size and shape)."""
    if len(data) < 8:
        raise FormatError(f"{where}: too short to be a safetensors file ({len(data)} bytes)")
    (n,) = struct.unpack("<Q", bytes(data[:8]))
    if n > MAX_HEADER or 8 + n > len(data):
        raise FormatError(f"{where}: safetensors header length {n} is invalid")
    try:  # as safetensors reads it: UTF-8 (no BOM), strict JSON (no NaN or Infinity)
        header = json.loads(bytes(data[8 : 8 + n]).decode("utf-8"), parse_constant=_no_constant)
    except ValueError as exc:  # (UnicodeDecodeError and JSONDecodeError are ValueErrors)
        raise FormatError(f"{where}: safetensors header is not JSON: {exc}") from exc
    except RecursionError:
        raise FormatError(f"{where}: safetensors header is nested too deeply") from None
    if not isinstance(header, dict):
        raise FormatError(f"{where}: safetensors header is not an object")
    return header


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


def parse_shard(
    data: bytes | bytearray,
    *,
    where: str,
    version: int | None = None,
    run_id: str | None = None,
    role: str | None = None,
) -> dict[str, torch.Tensor]:
    """Parse a shard's bytes (already checksum-verified) into tensors; check its metadata.

    With ``version``/``run_id``/``role``, a shard whose header names another version, run or
    role is refused (it was copied or renamed from elsewhere). Registered external checkpoints
    carry no asyncsync metadata and are read with those left as None.

    Each tensor is a view of ``data``, not a copy (``safetensors.deserialize`` copied every
    tensor while holding the GIL: ~0.5 s of CPU and a second copy of the shard in memory a
    GiB): a ``bytearray`` is viewed as it is (the receiver reads a full shard into one,
    :func:`asyncsync.fsio.read_buffer`), immutable ``bytes`` are copied once first (torch has
    no read-only tensors: a consumer could write into them). A tensor at an offset that is not
    a multiple of its element size is copied (torch views only aligned memory). The views keep
    ``data`` alive. The header is checked as safetensors checks it: every entry a dtype of the
    format, a shape of non-negative ints whose bytes are its offsets' span, and the entries'
    byte ranges tiling the data after the header exactly; else FormatError.
    """
    with gc_paused():  # (the header's dicts and lists: three per tensor)
        header = read_header(data, where=where)
        _check_metadata(header, where, version, run_id, role)
        entries = [_entry(k, info, where) for k, info in header.items() if k != "__metadata__"]
        start = 8 + struct.unpack("<Q", bytes(data[:8]))[0]
        _tiled([(e[0], e[1], e[4]) for e in entries], len(data) - start, where, "tensor")
        if not isinstance(data, bytearray):
            data = bytearray(data)
        flat = torch.frombuffer(data, dtype=torch.uint8)
        return {e[4]: _view(flat, start, e, where) for e in entries}


_Entry = tuple[int, int, torch.dtype, list[int], str]  # (begin, stop, dtype, shape, key)


def _entry(key: str, info: object, where: str) -> _Entry:
    """One full-shard header entry, checked (see :func:`parse_shard`)."""
    fields = info if isinstance(info, dict) else {}
    code, shape, span = fields.get("dtype"), fields.get("shape"), _span(fields)
    if not (
        span is not None
        and type(shape) is list
        and all(type(d) is int and d >= 0 for d in shape)
        and type(code) is str
    ):
        raise FormatError(f"{where}: tensor {key!r} is not a safetensors entry: {_brief(info)}")
    begin, stop = span
    dtype = BY_CODE.get(code)
    if dtype is None:
        raise FormatError(
            f"{where}: tensor {key!r}: dtype {code!r} is not one of the format's "
            f"({', '.join(BY_CODE)})"
        )
    if math.prod(shape) * dtype.itemsize != stop - begin:
        raise FormatError(
            f"{where}: tensor {key!r}: {code}{shape} is {math.prod(shape) * dtype.itemsize} "
            f"bytes, its data_offsets span {stop - begin}"
        )
    return begin, stop, dtype, shape, key


def _span(fields: dict[str, object]) -> tuple[int, int] | None:
    """An entry's ``data_offsets`` as (begin, stop): two ints (``type(...) is int``: not True,
    not 4.0), 0 <= begin <= stop; None when they are not."""
    offs = fields.get("data_offsets")
    if (
        type(offs) is list
        and len(offs) == 2
        and type(begin := offs[0]) is int
        and type(stop := offs[1]) is int
        and 0 <= begin <= stop
    ):
        return begin, stop
    return None


def _brief(info: object) -> str:
    text = repr(info)
    return text if len(text) <= 200 else text[:200] + "..."


def _view(flat: torch.Tensor, start: int, entry: _Entry, where: str) -> torch.Tensor:
    begin, stop, dtype, shape, key = entry
    try:  # (a valid file may hold a shape torch cannot make: [0, 2**63])
        if begin == stop:
            return torch.empty(shape, dtype=dtype)
        raw = flat[start + begin : start + stop]
        if (start + begin) % dtype.itemsize:  # torch views a dtype only at a multiple of its size
            raw = raw.clone()
        return raw.view(dtype).reshape(shape)
    except (RuntimeError, TypeError, ValueError, OverflowError) as exc:
        raise FormatError(f"{where}: tensor {key!r} of shape {_brief(shape)}: {exc}") from exc


def _tiled(ranges: list[tuple[int, int, str]], size: int, where: str, what: str) -> None:
    """Raise FormatError unless the byte ranges (begin, stop, key), sorted, tile [0, size)."""
    end = 0
    for begin, stop, key in sorted(ranges):
        if begin != end:
            raise FormatError(f"{where}: {what} {key!r} does not start where the one before ends")
        end = stop
    if end != size:
        noun = what.split()[-1]  # "the blobs hold", "the tensors hold"
        raise FormatError(
            f"{where}: the {noun}s hold {end} bytes, the data after the header {size}"
        )


def parse_delta_shard(
    data: bytes | bytearray | memoryview,
    *,
    where: str,
    version: int | None = None,
    run_id: str | None = None,
) -> dict[str, memoryview]:
    """The blobs of a delta shard's bytes (already checksum-verified) as read-only views of
    ``data``, by name; its metadata checked as :func:`parse_shard` checks it (role ``delta``).

    What :func:`parse_shard` would give as 1-D ``uint8`` tensors, without copying each blob into
    a tensor (~15 us a blob: a version of thousands of small tensors spent more on that than on
    decoding them). Every entry must be a 1-D ``U8`` tensor, and the entries' byte ranges must
    tile the data after the header exactly, as safetensors requires; else FormatError. The
    header's dicts and lists (three per blob) are made and freed with the cyclic garbage
    collector paused (:func:`asyncsync.memory.gc_paused`).
    """
    with gc_paused():
        return _delta_blobs(data, where, version, run_id)


def _delta_blobs(
    data: bytes | bytearray | memoryview, where: str, version: int | None, run_id: str | None
) -> dict[str, memoryview]:
    header = read_header(data, where=where)
    _check_metadata(header, where, version, run_id, "delta")
    (n,) = struct.unpack("<Q", bytes(data[:8]))
    body = memoryview(data)[8 + n :]
    ranges: list[tuple[int, int, str]] = []
    for key, info in header.items():
        if key == "__metadata__":
            continue
        # (no generator per blob: two blobs a tensor)
        span = _span(info) if isinstance(info, dict) else None
        shape = info.get("shape") if isinstance(info, dict) else None
        if not (
            span is not None
            and isinstance(info, dict)
            and info.get("dtype") == "U8"
            and type(shape) is list
            and len(shape) == 1
            and type(shape[0]) is int
            and shape[0] == span[1] - span[0]
        ):
            raise FormatError(f"{where}: delta blob {key!r} is not a 1-D U8 tensor: {info!r}")
        ranges.append((span[0], span[1], key))
    _tiled(ranges, len(body), where, "delta blob")
    return {key: body[begin:stop] for begin, stop, key in ranges}


def _check_metadata(
    header: dict[str, object], where: str, version: int | None, run_id: str | None, role: str | None
) -> None:
    """Refuse a shard whose metadata names another version, run or role than those given."""
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise FormatError(f"{where}: __metadata__ is not an object of strings")
    expect = {"asyncsync.version": version, "asyncsync.run_id": run_id, "asyncsync.role": role}
    for key, want in expect.items():
        if want is not None and meta.get(key) != str(want):
            raise FormatError(
                f"{where}: shard belongs to {key.split('.')[-1]}={meta.get(key)!r}, "
                f"expected {want!r}: a shard from another version was put here"
            )
