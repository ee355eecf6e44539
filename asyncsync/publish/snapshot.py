"""The publisher's snapshot: the CPU copy of the last committed version that deltas diff against.

Pure functions over ``dict[str, torch.Tensor]``: cutting a state dict into buckets, wrapping a
bucket's tensors for the diff stage, and advancing the snapshot once a version is committed
(scattering the changed positions in, or copying whole tensors). The snapshot lives in CPU
memory, pinned when CUDA is present so device-to-host copies of the next state are fast.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from asyncsync import codec
from asyncsync.codec.shards import BucketItem, PendingUpdate

__all__ = ["advance", "bucket_items", "plan_buckets", "same_schema"]


def plan_buckets(sizes: Sequence[int], bucket_bytes: int) -> list[list[int]]:
    """Consecutive indices of ``sizes`` (bytes per tensor) grouped into buckets of about
    ``bucket_bytes``; a tensor larger than that is a bucket of its own."""
    buckets: list[list[int]] = []
    cur: list[int] = []
    size = 0
    for i, nbytes in enumerate(sizes):
        if cur and size + nbytes > bucket_bytes:
            buckets.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += nbytes
    if cur:
        buckets.append(cur)
    return buckets


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
) -> list[BucketItem]:
    """The bucket's tensors as CPU, contiguous BucketItems (device-to-host copies happen here).

    With a snapshot, each item carries its old value and its last checksum (reused when the
    tensor did not change)."""
    items = []
    for i in bucket:
        name = names[i]
        new = state_dict[name].detach()
        if new.device.type != "cpu":
            new = new.to("cpu")
        items.append(
            BucketItem(
                index=i,
                name=name,
                new=new.contiguous(),
                old=snap[name] if snap is not None else None,
                cached_checksum=checksums.get(name) if snap is not None else None,
            )
        )
    return items


def advance(
    snap: Mapping[str, torch.Tensor] | None,
    names: Sequence[str],
    pending: Sequence[PendingUpdate],
) -> dict[str, torch.Tensor]:
    """The snapshot of the committed version: ``snap`` with ``pending`` applied, in ``names``
    order (tensors no longer named are dropped). Updates ``snap``'s tensors in place."""
    old = snap or {}
    out: dict[str, torch.Tensor] = {}
    by_name = {p.name: p for p in pending}
    pin = torch.cuda.is_available()
    for name in names:
        p = by_name.get(name)
        cur = old.get(name)
        if p is None:
            assert cur is not None, f"no snapshot and no update for {name!r}"
            out[name] = cur
        elif p.positions is not None:
            assert cur is not None, f"a sparse update for {name!r} needs its snapshot"
            codec.apply_patch(codec.int_view(cur), codec.Patch("set", p.positions, p.values))
            out[name] = cur
        elif cur is not None and cur.dtype == p.values.dtype and cur.shape == p.values.shape:
            cur.copy_(p.values)
            out[name] = cur
        else:
            t = p.values.detach().to("cpu").clone().contiguous()
            out[name] = t.pin_memory() if pin else t
    return out
