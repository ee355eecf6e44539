"""The publisher's snapshot: the CPU copy of the last committed version that deltas diff against.

Functions over ``dict[str, torch.Tensor]``: cutting a state dict into buckets, wrapping a
bucket's tensors for the diff stage, and advancing the snapshot once a version is committed
(scattering the changed positions in, or copying whole tensors), or reverting the advance the
diff made in its own pass for a version that was not committed (:class:`UndoLog`, whose
``revert`` checks for the manifest: its only I/O). The snapshot lives in CPU
memory, pinned when CUDA is present so device-to-host copies of the next state are fast.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from asyncsync import codec, fsio, memory
from asyncsync.codec.shards import (
    BucketItem,
    DiffedBucket,
    EncodedBucket,
    PendingUpdate,
    delta_keys,
)
from asyncsync.errors import PublishError
from asyncsync.format import MANIFEST_NAME, dtype_from_name
from asyncsync.format.checksum import checksum_tensor
from asyncsync.pipeline import pack_cap, parallel_map, threads

logger = logging.getLogger(__name__)

__all__ = [
    "Undo",
    "UndoLog",
    "advance",
    "bucket_items",
    "check_unchanged",
    "plan_buckets",
    "plan_for",
    "same_schema",
    "undo_records",
]


#: a tapered delta's first bucket holds at most bucket_bytes / this (:func:`plan_for`)
FIRST_BUCKET_FRACTION = 4


def plan_buckets(
    sizes: Sequence[int], bucket_bytes: int, spread: int = 1, first: int | None = None
) -> list[list[int]]:
    """Consecutive indices of ``sizes`` (bytes per tensor) grouped into buckets of about
    ``bucket_bytes``; a tensor larger than that is a bucket of its own.

    ``spread > 1`` (a delta of CPU tensors: the buckets hold only the changes): the tensors
    larger than ``bucket_bytes`` are instead packed up to ``spread`` to a bucket, in order, each
    such bucket where its first tensor was. A bucket is diffed and encoded by the pool one tensor
    per worker, so one large tensor alone (an LLM's embedding, its ``lm_head``) keeps one core
    busy and leaves the others idle; packed, the workers take them side by side, and the
    version's last shards hold the small tensors, which a receiver applies on every core. A pack
    holds at most ``max(spread * bucket_bytes, 2 * the largest tensor)`` bytes: a bucket's
    memory stays within twice what the largest tensor's own bucket would hold.

    ``first`` (a delta a receiver applies shard by shard as it lands): the version begins
    with a bucket of at most ``first`` bytes (or one tensor) of the first small tensors,
    ahead of any large one, so that its shard, and the receiver, start early; the rest of
    the bucket it came from stays where it was.
    """
    if spread < 1:
        raise ValueError(f"spread must be >= 1, got {spread}")
    if first is not None and first < 1:
        raise ValueError(f"first must be >= 1, got {first}")
    big = [i for i, n in enumerate(sizes) if n > bucket_bytes] if spread > 1 else []
    cap = pack_cap(sizes, bucket_bytes, spread)
    packs: dict[int, list[int]] = {}
    pack: list[int] = []
    for i in big:
        if pack and (len(pack) == spread or sum(sizes[j] for j in pack) + sizes[i] > cap):
            packs[pack[0]], pack = pack, []
        pack.append(i)
    if pack:
        packs[pack[0]] = pack
    packed = set(big)
    buckets: list[list[int]] = []
    cur: list[int] = []
    size = 0
    for i, nbytes in enumerate(sizes):
        if i in packed:
            if i in packs:
                if cur:
                    buckets.append(cur)
                    cur, size = [], 0
                buckets.append(packs[i])
            continue
        if cur and size + nbytes > bucket_bytes:
            buckets.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += nbytes
    if cur:
        buckets.append(cur)
    if first is not None:
        return _first_small(buckets, sizes, bucket_bytes, first)
    return buckets


def _first_small(
    buckets: list[list[int]], sizes: Sequence[int], bucket_bytes: int, first: int
) -> list[list[int]]:
    """``buckets`` led by at most ``first`` bytes (or one tensor) of the first bucket of small
    tensors, cut from its front."""
    k = next((k for k, b in enumerate(buckets) if all(sizes[i] <= bucket_bytes for i in b)), None)
    if k is None:
        return buckets
    b, n, size = buckets[k], 1, sizes[buckets[k][0]]
    while n < len(b) and size + sizes[b[n]] <= first:
        size += sizes[b[n]]
        n += 1
    return [b[:n], *buckets[:k], *([b[n:]] if n < len(b) else []), *buckets[k + 1 :]]


def plan_for(
    state_dict: Mapping[str, torch.Tensor],
    sizes: Sequence[int],
    bucket_bytes: int,
    changes: bool,
    *,
    lead: bool = False,
) -> list[list[int]]:
    """The publisher's buckets: :func:`plan_buckets`, with the large tensors spread over the
    pool's workers when the buckets hold only changes (``changes``: a single publisher's
    delta, no full data, which receivers apply as its shards land) of CPU tensors (a GPU
    tensor is copied to the host a bucket at a time: not two large ones). ``lead`` (a delta
    whose shards taper): led by a bucket of a quarter of ``bucket_bytes`` of small tensors,
    whose shard lands early."""
    cpu = changes and all(t.device.type == "cpu" for t in state_dict.values())
    first = max(1, bucket_bytes // FIRST_BUCKET_FRACTION) if lead and changes else None
    return plan_buckets(sizes, bucket_bytes, threads() if cpu else 1, first)


def same_schema(snap: Mapping[str, torch.Tensor], state_dict: Mapping[str, torch.Tensor]) -> bool:
    """Same names, dtypes and shapes (the condition for publishing a delta)."""
    if len(state_dict) != len(snap) or any(k not in snap for k in state_dict):
        return False
    return all(
        t.dtype == snap[k].dtype and tuple(t.shape) == tuple(snap[k].shape)
        for k, t in state_dict.items()
    )


def schema_changes(
    snap: Mapping[str, torch.Tensor], state_dict: Mapping[str, torch.Tensor], limit: int = 8
) -> str:
    """What differs between the snapshot's tensors and ``state_dict``'s, for people: the added,
    removed and re-typed (dtype or shape) names, at most ``limit`` of each."""

    def some(names: list[str]) -> str:
        more = f", ... ({len(names)} in all)" if len(names) > limit else ""
        return ", ".join(names[:limit]) + more

    added = sorted(k for k in state_dict if k not in snap)
    removed = sorted(k for k in snap if k not in state_dict)
    retyped = [
        f"{k} {snap[k].dtype}{list(snap[k].shape)} -> {t.dtype}{list(t.shape)}"
        for k, t in sorted(state_dict.items())
        if k in snap and (t.dtype != snap[k].dtype or tuple(t.shape) != tuple(snap[k].shape))
    ]
    parts = [f"{what}: {some(names)}" for what, names in
             (("added", added), ("removed", removed), ("re-typed", retyped)) if names]  # fmt: skip
    return "; ".join(parts) or "the tensors' slices across ranks"


def bucket_items(
    bucket: Sequence[int],
    names: Sequence[str],
    state_dict: Mapping[str, torch.Tensor],
    snap: Mapping[str, torch.Tensor] | None,
    checksums: Mapping[str, str],
    own: bool = False,
) -> list[BucketItem]:
    """The bucket's tensors as CPU, contiguous BucketItems (device-to-host copies happen here).

    With a snapshot, each item carries its old value and its last checksum (reused when the
    tensor did not change). ``own``: every item's ``new`` is a copy, never the caller's
    tensor: the bucket's bytes are read once, here, for every use after (a keyframe's delta
    and its full shard, a full version's shard and the snapshot copied after the commit),
    whatever the trainer writes to its tensors meanwhile (helper-68)."""
    news = [state_dict[names[i]].detach() for i in bucket]
    if not own and all(_plain_cpu(new) for new in news):  # each is its own host copy (the
        # common case, a CPU state dict: the path below would hand each back as it is, after
        # an int view, a contiguous() and a view back: ~2 us a tensor)
        raws = news
    else:
        # copied as ints (a bool's copy writes 0/1, not its bytes); a device tensor through
        # a reused pinned buffer (40x fresh pageable memory), the bucket's copies waited for
        # once
        raws = memory.host_copies([codec.raw_view(new) for new in news])
        if own:  # a CPU tensor that host_copies did not copy (contiguous: itself), as ints
            raws = [r.clone() if _shares(r, n) else r for r, n in zip(raws, news, strict=True)]
        raws = [raw.view(new.dtype) for raw, new in zip(raws, news, strict=True)]
    # a CPU tensor's copy is fresh memory (a clone, or ``contiguous`` of a strided one); a
    # device tensor's may be a reused pinned buffer: never kept
    return [
        BucketItem(
            index=i,
            name=names[i],
            new=raw,
            old=snap[names[i]] if snap is not None else None,
            cached_checksum=checksums.get(names[i]) if snap is not None else None,
            owned=own and new.device.type == "cpu",
        )
        for i, new, raw in zip(bucket, news, raws, strict=True)
    ]


def _plain_cpu(t: torch.Tensor) -> bool:
    """A contiguous CPU tensor that is not a bool: :func:`memory.host_copies` of its
    :func:`codec.raw_view` viewed back as its dtype is ``t`` itself."""
    return t.device.type == "cpu" and t.dtype != torch.bool and t.is_contiguous()


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` is (a view of) ``b``'s memory."""
    return a.numel() > 0 and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def check_unchanged(
    items: Sequence[BucketItem], meta: Mapping[str, tuple[str, tuple[int, ...]]]
) -> None:
    """Raise PublishError for an item whose dtype or shape is no longer ``meta``'s (what the
    manifest says): ``param.data = other`` while publish read it (FSDP's flat parameters and
    ZeRO-3's partitioned ones swap theirs)."""
    for it in items:
        dtype, shape = meta[it.name]
        if it.new.dtype != dtype_from_name(dtype) or tuple(it.new.shape) != shape:
            raise PublishError(
                f"tensor {it.name!r} changed from {dtype}{list(shape)} to {it.new.dtype}"
                f"{list(it.new.shape)} while it was published (its .data swapped?): no other "
                "thread may reshape it until publish() returns"
            )


def advance(
    snap: Mapping[str, torch.Tensor] | None,
    names: Sequence[str],
    pending: Sequence[PendingUpdate],
) -> dict[str, torch.Tensor]:
    """The snapshot of the committed version: ``snap`` with ``pending`` applied, in ``names``
    order (tensors no longer named are dropped). Updates ``snap``'s tensors in place.

    The tensors are done side by side on the pool (the copies and the native scatter release
    the GIL): 1 GiB of a full version into new pinned tensors took 238 ms one at a time and
    38 ms on 16 cores. No temporaries: a tensor is patched or copied in place, or copied once
    into its new (pinned) snapshot tensor (it was cloned, then pinned: two copies), so memory
    stays the new snapshot's, however many workers."""
    old = snap or {}
    by_name = {p.name: p for p in pending}
    pin = torch.cuda.is_available()

    def one(name: str) -> torch.Tensor:
        p = by_name.get(name)
        cur = old.get(name)
        if p is None:
            assert cur is not None, f"no snapshot and no update for {name!r}"
            return cur
        if p.positions is not None:
            assert cur is not None, f"a sparse update for {name!r} needs its snapshot"
            codec.apply_patch(codec.int_view(cur), codec.Patch("set", p.positions, p.values))
            return cur
        if p.owned and not pin:  # the copy the version was read into: kept, not copied again
            return p.values  # (a seed's peak stays the trainer's tensors plus one copy)
        src = codec.raw_view(p.values.detach())  # copied as ints: a bool's bytes, not 0/1
        if cur is None or cur.dtype != p.values.dtype or cur.shape != p.values.shape:
            raw = torch.empty(src.shape, dtype=src.dtype, pin_memory=pin)  # contiguous
            cur = raw.view(p.values.dtype)
        codec.raw_view(cur).copy_(src)  # (from the device, if it is there)
        return cur

    def cost(name: str) -> int:  # the bytes a tensor's update walks
        p = by_name.get(name)
        if p is None or (p.positions is not None and name not in old):
            return 0
        return p.values.nbytes if p.positions is None else old[name].nbytes

    return dict(zip(names, parallel_map(one, names, cost=cost), strict=True))


def unshipped(
    snap: Mapping[str, torch.Tensor],
    pending: Sequence[PendingUpdate],
    sums: Mapping[str, str],
    algorithm: str,
) -> list[str]:
    """The tensors copied whole into ``snap`` whose bytes are not those shipped (``sums``).

    A full version's shards and the snapshot copied after the commit both come from the copy
    :func:`bucket_items` made (``own``), but a copy that went wrong would leave a snapshot
    that every later delta would be applied onto wrongly. One hash pass over the tensors
    copied whole (a full version's: rare) finds them; the caller then makes the next version
    a keyframe, which re-ships every tensor (helper-34)."""
    whole = [p.name for p in pending if p.positions is None and p.name in sums]
    got = parallel_map(  # on every core: a keyframe of a large model is many GB to hash
        lambda n: checksum_tensor(snap[n], algorithm), whole, cost=lambda n: snap[n].nbytes
    )
    bad = [n for n, d in zip(whole, got, strict=True) if d != sums[n]]
    if bad:
        logger.warning(
            "%d tensor(s) changed while the version was committed (%s): the snapshot is not "
            "what was shipped; the next version is a keyframe. Do not change the tensors "
            "passed to publish() before it returns",
            len(bad), ", ".join(bad[:5]),
        )  # fmt: skip
    return bad


#: one advanced tensor, compactly: (the snapshot tensor, its changed positions, old values)
Undo = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
#: one advanced tensor of an xef bucket: (the snapshot tensor, mode, changed, positions blob,
#: values blob), the bytes its shard carries
_Encoded = tuple[torch.Tensor, str, int, bytes, bytes]


def undo_records(d: DiffedBucket) -> list[Undo]:
    """What :meth:`UndoLog.revert` needs of a bucket the diff advanced, compactly (positions
    as int32 where they fit, the old values): ~6 bytes per changed bf16 element, kept until the
    commit, while the diff's own outputs (16 bytes each) go once the bucket is encoded."""
    out: list[Undo] = []
    for it, ch in zip(d.items, d.changes or (), strict=True):
        if it.old is not None and ch.positions.numel():
            small = it.old.numel() < 2**31
            pos = ch.positions.to(torch.int32) if small else ch.positions
            out.append((it.old, pos, ch.values ^ ch.xor))
    return out


class UndoLog:
    """What puts back the snapshot tensors the diff advanced in its own pass
    (``diff_bucket(advance=True)``) for a version that is not committed (:meth:`revert`).

    A bucket is noted when diffed (:meth:`diffed`: its changes, which the encode stage holds
    anyway) and again when encoded (:meth:`encoded`). An ``xef`` bucket then keeps only the
    bytes its shard carries, from which a revert decodes the XORs (``old = new ^ xor``): no
    work and ~1 byte per changed element at 3 % density. Other encodings carry the new values
    only, so their old values are kept (:func:`undo_records`, ~6 bytes per changed bf16
    element). Safe to call from the pipeline's threads.
    """

    def __init__(self, encoding: str) -> None:
        self.encoding = encoding
        self._lock = threading.Lock()
        self._diffed: dict[int, DiffedBucket] = {}  # id -> bucket, until it is encoded
        self._compact: list[Undo] = []
        self._encoded: list[_Encoded] = []

    def __bool__(self) -> bool:
        with self._lock:
            return bool(self._diffed or self._compact or self._encoded)

    def diffed(self, d: DiffedBucket) -> None:
        if d.advanced:
            with self._lock:
                self._diffed[id(d)] = d

    def encoded(self, d: DiffedBucket, e: EncodedBucket) -> None:
        with self._lock:
            if self._diffed.pop(id(d), None) is None:
                return
        if self.encoding != "xef":
            compact = undo_records(d)
            with self._lock:
                self._compact.extend(compact)
            return
        kept: list[_Encoded] = []
        for it, res in zip(d.items, e.items, strict=True):
            if it.old is not None and res.mode is not None and res.changed:
                pkey, vkey = delta_keys(it.index)
                kept.append(
                    (it.old, res.mode, res.changed, e.delta_blobs[pkey], e.delta_blobs[vkey])
                )
        with self._lock:
            self._encoded.extend(kept)

    def revert(self, vdir: Path) -> None:
        """Put the snapshot back, unless the version's manifest is in place after all
        (committed: the snapshot is right as it is)."""
        with contextlib.suppress(OSError):  # never through a symlink (fsio, FORMAT.md 11.1)
            if fsio.lstat(vdir / MANIFEST_NAME, root=vdir.parent) is not None:
                return
        with self._lock:
            diffed, compact, encoded = list(self._diffed.values()), self._compact, self._encoded
            self._diffed, self._compact, self._encoded = {}, [], []
        for d in diffed:  # not encoded yet: the diff's own outputs
            olds = [it.old for it in d.items if it.old is not None]
            codec.revert(olds, d.changes or [])
        for old, pos, values in compact:
            codec.revert(
                [old], [codec.Change(pos.to(torch.int64), values, torch.zeros_like(values))]
            )
        for old, mode, changed, pblob, vblob in encoded:
            flat = codec.int_view(old)  # the new bytes (a copy if ``old`` is not contiguous)
            patch = codec.decode_delta(
                self.encoding, mode, pblob, vblob, changed=changed, numel=flat.numel(),
                dtype=flat.dtype,
            )  # fmt: skip
            xor = patch.values
            if patch.positions is None:  # dense: every element's XOR
                pos = torch.nonzero(xor).view(-1)
                xor = xor[pos]
            else:
                pos = patch.positions
            codec.revert([old], [codec.Change(pos, codec.gather(flat, pos), xor)])
