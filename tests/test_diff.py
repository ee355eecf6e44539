"""The diff reads each new tensor once (helper-68).

The NumPy/torch fallback (no C kernel) found the changed positions in one read of the new
tensor, gathered their values in a second and hashed the tensor in a third: a tensor the trainer
changed between the reads gave a change whose positions, values and checksum were of different
bytes, a version no engine accepts (an element changed after the first read is not in the delta
but is in the checksum; one changed back reads as a zero XOR, which a reader refuses). The
fallback now reads each new tensor once, into a copy, and derives all three from it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncsync import FileRendezvous, Publisher, codec
from asyncsync.codec import diff as diff_mod
from asyncsync.codec import native
from asyncsync.format.checksum import checksum_tensor
from receiver import ReceiverAgent
from receiver.engines.checkpoint import LocalCheckpoint
from tests.conftest import assert_holds, mixed_state, mutate, same_bytes, sync_to
from tests.dist_worker import full_state, portion


def _steps_at_first_gather(
    monkeypatch: pytest.MonkeyPatch, tensors: list[torch.Tensor]
) -> list[int]:
    """The first gather of the diff (after its positions were read) first changes every
    element of ``tensors`` in place, as a trainer's step in another thread would."""
    real, calls = diff_mod.gather, [0]

    def gather(*a: Any, **k: Any) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == 1:
            for t in tensors:
                codec.raw_view(t).bitwise_xor_(1)
        return real(*a, **k)

    monkeypatch.setattr(diff_mod, "gather", gather)
    return calls


@pytest.mark.parametrize("advance", [False, True])
def test_the_fallback_diffs_one_read_of_the_new_tensor(
    monkeypatch: pytest.MonkeyPatch, advance: bool
) -> None:
    monkeypatch.setattr(native, "kernels", None)
    g = torch.Generator().manual_seed(0)
    old = torch.randint(0, 1000, (4096,), dtype=torch.int32, generator=g)
    new = old.clone()
    new[::7] += 1
    read = new.clone()  # what the diff reads before the trainer steps
    base = old.clone()
    calls = _steps_at_first_gather(monkeypatch, [new])
    (ch,) = codec.diff_tensors([old], [new], algorithm="xxh3-128", advance=advance)
    assert calls[0] >= 1  # (the gather ran: the step happened mid-diff)
    assert bool((ch.xor != 0).all())  # no zero XOR: every listed element changed
    applied = base.clone()
    applied[ch.positions] = ch.values
    assert torch.equal(applied, read)  # the delta makes the tensor as read
    assert ch.checksum == checksum_tensor(read, "xxh3-128")  # and its checksum says so
    if advance:
        assert torch.equal(old, read)


async def test_a_ranks_fallback_delta_is_one_every_engine_accepts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank of a group diffs without advancing its snapshot: without the C kernel its
    delta and its checksum came from two reads of the trainer's tensors, and the receiver
    refused the version (a checksum mismatch after applying it)."""
    root, ckpt = tmp_path / "root", tmp_path / "ckpt"
    pubs = [
        Publisher(root, keyframe_interval=0,
                  coordinator=FileRendezvous(root, r, 2, timeout=30, poll_interval=0.002))
        for r in range(2)
    ]  # fmt: skip
    monkeypatch.setattr(native, "kernels", None)
    async with pubs[0], pubs[1]:
        parts = [portion(0, r, 2) for r in range(2)]
        await asyncio.gather(
            *(p.seed(sd, slices=sl) for p, (sd, sl) in zip(pubs, parts, strict=True))
        )
        parts = [portion(1, r, 2) for r in range(2)]
        read = {k: codec.raw_clone(v) for k, v in parts[1][0].items()}  # rank 1's, as read
        _steps_at_first_gather(monkeypatch, [parts[1][0]["rank1.model.layers.0.weight"]])
        await asyncio.gather(
            *(p.publish(sd, slices=sl) for p, (sd, sl) in zip(pubs, parts, strict=True))
        )
    name = "rank1.model.layers.0.weight"
    stepped = codec.raw_clone(read[name])
    codec.raw_view(stepped).bitwise_xor_(1)
    async with ReceiverAgent(root, LocalCheckpoint(ckpt), "e", use_inotify=False) as agent:
        await sync_to(agent, root, 0)
        assert await agent.sync_once() == 1  # accepted
        got = LocalCheckpoint(ckpt).load_state_dict()
    # the tensor as one read saw it: before the step, or after it (rank 0's diff, in the
    # same process, may have made the first gather before rank 1 read its tensor)
    assert same_bytes(got[name], read[name]) or same_bytes(got[name], stepped)
    assert_holds({k: v for k, v in got.items() if k != name},
                 {k: v for k, v in full_state(1, 2).items() if k != name})  # fmt: skip


def test_mixed_state_round_trips_through_the_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every dtype and layout of mixed_state through the fallback, against the C kernel."""
    olds, news = mixed_state(0), mutate(mixed_state(0), 0.1, seed=5)
    keys = list(olds)
    with_c = codec.diff_tensors(
        [olds[k] for k in keys], [news[k] for k in keys], algorithm="xxh3-128"
    )
    monkeypatch.setattr(native, "kernels", None)
    without = codec.diff_tensors(
        [olds[k] for k in keys], [news[k] for k in keys], algorithm="xxh3-128"
    )
    for a, b in zip(with_c, without, strict=True):
        assert torch.equal(a.positions, b.positions) and torch.equal(a.values, b.values)
        assert torch.equal(a.xor, b.xor) and a.checksum == b.checksum
