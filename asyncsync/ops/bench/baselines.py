"""Wire bytes of one version's change under our encoding and the published baselines (pure).

Each function takes the same tensors (``olds``/``news``: the publish view before and after one
training step, in state-dict order) and returns a byte count; nothing touches the filesystem.

Baselines, implemented from their published descriptions (``/work/shared/REFERENCE.md``):

``indices``, ``deltas``, ``deltas_zstd``
    slime generation 1 (PR #1806): positions as int32 absolute indices, as uint16/uint32 gaps,
    or as zstd-1 compressed gaps; values raw. Encoded with :func:`asyncsync.codec.encode_delta`
    (the codec carries them as alternative encodings).
``xor_zstd``
    slime generation 2: zstd level 1 of ``new XOR old`` over the whole tensor, for every tensor
    with a change (tensors without one are not sent, which favours the baseline).
``trl``
    TRL delta sync: int32 indices plus the raw new values of the changed elements.
``full``
    a full checkpoint of the publish view (the tensors' bytes; the safetensors header of a few
    KiB is left out).

``ours`` is the size of the delta shards the publisher writes: xef-encoded blobs in
safetensors files, headers included (:func:`asyncsync.codec.shards.encode_bucket`, bucketed like the
publisher), so it is never flattered against the bare payloads of the baselines.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
import zstandard

from asyncsync import codec
from asyncsync.codec.shards import BucketItem, encode_bucket
from asyncsync.format import dtype_name
from asyncsync.format.checksum import DEFAULT_ALGORITHM
from asyncsync.publish.snapshot import plan_buckets
from asyncsync.publish.writer import VersionWriter

__all__ = [
    "BASELINES",
    "LABELS",
    "all_sizes",
    "bucketed",
    "full_bytes",
    "gen1_bytes",
    "ours_bytes",
    "trl_bytes",
    "xor_zstd_bytes",
]

#: Baseline keys, in the order tables show them.
BASELINES: tuple[str, ...] = ("indices", "deltas", "deltas_zstd", "xor_zstd", "trl", "full")
#: Human names for tables and plots.
LABELS: dict[str, str] = {
    "ours": "ours (xef shards)",
    "indices": "slime gen-1 indices",
    "deltas": "slime gen-1 deltas",
    "deltas_zstd": "slime gen-1 deltas_zstd",
    "xor_zstd": "slime gen-2 XOR+zstd-1",
    "trl": "TRL int32 idx + values",
    "full": "full checkpoint",
}
_XOR_ZSTD_LEVEL = 1


def _views(
    olds: Sequence[torch.Tensor], news: Sequence[torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return [codec.int_view(o) for o in olds], [codec.int_view(n) for n in news]


def gen1_bytes(
    olds: Sequence[torch.Tensor],
    news: Sequence[torch.Tensor],
    positions: Sequence[torch.Tensor],
    encoding: str,
) -> int:
    """Positions + values bytes of a slime gen-1 encoding (indices, deltas, deltas_zstd)."""
    if encoding not in ("indices", "deltas", "deltas_zstd"):
        raise ValueError(f"not a generation-1 encoding: {encoding!r}")
    o, n = _views(olds, news)
    return sum(
        codec.encoded_size(codec.encode_delta(a, b, p, encoding))
        for a, b, p in zip(o, n, positions, strict=True)
        if p.numel()
    )


def xor_zstd_bytes(
    olds: Sequence[torch.Tensor],
    news: Sequence[torch.Tensor],
    positions: Sequence[torch.Tensor],
    level: int = _XOR_ZSTD_LEVEL,
) -> int:
    """slime gen-2: zstd(``new ^ old``) over each changed tensor, element bytes in memory order."""
    o, n = _views(olds, news)
    cctx = zstandard.ZstdCompressor(level=level)
    total = 0
    for a, b, p in zip(o, n, positions, strict=True):
        if p.numel():
            xor = torch.bitwise_xor(a, b)
            total += len(cctx.compress(xor.view(torch.uint8).numpy().data))
    return total


def trl_bytes(news: Sequence[torch.Tensor], positions: Sequence[torch.Tensor]) -> int:
    """TRL: 4-byte indices plus the raw new values of every changed element."""
    return sum(p.numel() * (4 + t.element_size()) for t, p in zip(news, positions, strict=True))


def full_bytes(news: Sequence[torch.Tensor]) -> int:
    """A full checkpoint: every tensor's bytes."""
    return sum(t.numel() * t.element_size() for t in news)


def bucketed(sizes: Sequence[int], bucket_bytes: int) -> list[list[int]]:
    """Indices grouped in order into buckets of about ``bucket_bytes`` (the publisher's rule)."""
    return plan_buckets(sizes, bucket_bytes)


def ours_bytes(
    olds: Sequence[torch.Tensor],
    news: Sequence[torch.Tensor],
    positions: Sequence[torch.Tensor],
    *,
    bucket_bytes: int = 32 << 20,
    level: int = 1,
    names: Sequence[str] | None = None,
) -> tuple[int, int]:
    """(delta shard bytes, bare xef payload bytes) of the version the publisher would write:
    its writer's own shards (self-describing, format 3, ``delta_shard_bytes`` as the
    publisher's default), written into a scratch directory and measured there."""
    sizes = [t.numel() * t.element_size() for t in news]
    names = list(names) if names is not None else [f"t{i}" for i in range(len(news))]
    with tempfile.TemporaryDirectory(prefix="asyncsync-ours-bytes-") as tmp:
        w = VersionWriter(
            vdir=Path(tmp),
            algorithm=DEFAULT_ALGORITHM,
            version=1,
            run_id="0" * 16,  # the length of a real run id: same header size
            shard_bytes=min(bucket_bytes, 4 << 20),  # the publisher's default delta shard size
            meta={
                k: (dtype_name(t.dtype), tuple(t.shape)) for k, t in zip(names, news, strict=True)
            },
            stream=(0, "0" * 32, "0" * 12, "xef"),  # base fingerprint, attempt: real lengths
        )
        for bucket in bucketed(sizes, bucket_bytes):
            items = [
                BucketItem(i, names[i], news[i].contiguous(), olds[i].contiguous()) for i in bucket
            ]
            w.write(
                encode_bucket(
                    items,
                    version=1,
                    run_id="0" * 16,
                    delta=True,
                    full=False,
                    encoding="xef",
                    level=level,
                    algorithm=DEFAULT_ALGORITHM,
                )
            )
        w.finish()
        shard_bytes = sum(s.bytes for s in w.shards)
    o, n = _views(olds, news)
    payload = sum(
        codec.encoded_size(codec.encode_delta(a, b, p, "xef", level=level))
        for a, b, p in zip(o, n, positions, strict=True)
        if p.numel()
    )
    return shard_bytes, payload


def all_sizes(
    old: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    *,
    bucket_bytes: int = 32 << 20,
    level: int = 1,
) -> dict[str, int]:
    """Wire bytes of the change ``old -> new`` for ``ours``, ``ours_payload`` and each baseline,
    plus ``changed`` (elements whose bytes differ) and ``elements``."""
    names = list(new)
    olds = [old[k].contiguous() for k in names]
    news = [new[k].contiguous() for k in names]
    o, n = _views(olds, news)
    positions = codec.changed_positions(o, n)
    shards, payload = ours_bytes(
        olds, news, positions, bucket_bytes=bucket_bytes, level=level, names=names
    )
    out = {
        "changed": sum(p.numel() for p in positions),
        "elements": sum(t.numel() for t in news),
        "ours": shards,
        "ours_payload": payload,
    }
    for enc in ("indices", "deltas", "deltas_zstd"):
        out[enc] = gen1_bytes(olds, news, positions, enc)
    out["xor_zstd"] = xor_zstd_bytes(olds, news, positions)
    out["trl"] = trl_bytes(news, positions)
    out["full"] = full_bytes(news)
    return out
