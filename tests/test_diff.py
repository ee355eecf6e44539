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
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncsync import FileRendezvous, Publisher, codec
from asyncsync.codec import diff as diff_mod
from asyncsync.codec import native
from asyncsync.format.checksum import checksum_tensor
from receiver import ReceiverAgent
from receiver.engines.checkpoint import LocalCheckpoint
from tests.conftest import ALL_DTYPES, assert_holds, mixed_state, mutate, same_bytes, sync_to
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


_DTYPES = [*ALL_DTYPES, torch.int16]


def _pair(data: st.DataObject, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """An old and a new tensor of a drawn dtype, size (0, small, around the batch threshold or
    above it) and layout (each contiguous or a strided view), a drawn share of bytes changed."""
    dtype = data.draw(st.sampled_from(_DTYPES))
    width = torch.empty(0, dtype=dtype).element_size()
    cut = diff_mod.BATCH_BYTES // width
    numel = data.draw(
        st.one_of(st.integers(0, 70), st.sampled_from([cut - 1, cut, cut + 1, 2048 // width]))
    )
    numel -= numel % 2  # (a 2-row view of it)
    raw = torch.randint(0, 256, (2 * numel * width,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:  # (0/1: the per-tensor path advances a strided old by a bool copy)
        raw &= 1
    base = raw.view(dtype)
    old = base[::2] if data.draw(st.booleans(), "strided old") else base[:numel].clone()
    flip = torch.rand(numel, generator=g) < data.draw(st.sampled_from([0.0, 0.03, 0.9, 1.0]))
    new_base = codec.raw_clone(old)
    codec.raw_view(new_base)[flip] ^= 1  # (a bool stays 0/1)
    new = new_base.reshape(2, -1) if numel and data.draw(st.booleans(), "2-D new") else new_base
    if data.draw(st.booleans(), "strided new"):
        twice = torch.empty(2 * numel, dtype=dtype)
        codec.raw_view(twice)[::2] = codec.raw_view(new_base)
        new = twice[::2]
    return old.reshape(new.shape), new


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_small_tensors_diffed_many_to_a_call_give_each_ones_change(data: st.DataObject) -> None:
    """The native diff takes the small tensors (below BATCH_BYTES, a contiguous old) many to a
    C call: each change, checksum and advanced old is the one the per-tensor path gives, and
    each encoding of it is the same bytes (from the change alone, as the publisher encodes it,
    and through encode_delta)."""
    if not hasattr(native.kernels, "diff_many"):
        pytest.skip("the C kernels are not built")
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1), "seed"))
    pairs = [_pair(data, g) for _ in range(data.draw(st.integers(1, 8), "tensors"))]
    algorithm = data.draw(st.sampled_from([None, "xxh3-64", "xxh3-128"]))
    advance = data.draw(st.booleans(), "advance")
    news = [n for _, n in pairs]
    olds = {way: [o.clone() if o.is_contiguous() else _strided_copy(o) for o, _ in pairs]
            for way in ("many", "one")}  # fmt: skip
    calls, real = [], native.diff_many
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(native, "diff_many", lambda *a, **k: calls.append(1) or real(*a, **k))
        got = codec.diff_tensors(olds["many"], news, algorithm=algorithm, advance=advance)
    small = [o.is_contiguous() and n.nbytes < diff_mod.BATCH_BYTES for o, n in pairs]
    assert bool(calls) == any(small)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(diff_mod, "BATCH_BYTES", 0)
        want = codec.diff_tensors(olds["one"], news, algorithm=algorithm, advance=advance)
    for (old, new), a, b, oa, ob in zip(pairs, got, want, olds["many"], olds["one"], strict=True):
        assert torch.equal(a.positions, b.positions) and a.checksum == b.checksum
        for x, y in ((a.values, b.values), (a.xor, b.xor)):  # (int views: bytewise equal)
            assert x.dtype == y.dtype == codec.int_dtype(new.dtype) and torch.equal(x, y)
        assert _same(oa, ob) and _same(oa, new if advance else old)
        for encoding in codec.ENCODINGS:
            enc = codec.encode_change(a.positions, a.values, a.xor, new.numel(), encoding)
            ref = codec.encode_delta(
                codec.int_view(old), codec.int_view(new), a.positions, encoding
            )
            assert enc == ref


def _strided_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of a strided view ``t`` that is as strided (every other element of a buffer)."""
    twice = torch.empty(2 * t.numel(), dtype=t.dtype)
    codec.raw_view(twice)[::2] = codec.raw_view(t).reshape(-1)
    return twice[::2].reshape(t.shape)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (any layout, empty ones too)."""
    ints = [codec.raw_view(t).reshape(-1) for t in (a, b)]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(*ints)


@pytest.mark.parametrize("encoding", codec.ENCODINGS)
def test_a_bucket_of_small_tensors_makes_the_same_shard_either_way(encoding: str) -> None:
    """A publisher's bucket of many small tensors (a MoE's experts, mixed dtypes, one large)
    gives the same items, checksums and delta shard bytes whether its small tensors are diffed
    many to a call or one by one, and leaves the same snapshot."""
    from asyncsync.codec.shards import BucketItem, delta_shard_blob, diff_bucket, encode_bucket

    if not hasattr(native.kernels, "diff_many"):
        pytest.skip("the C kernels are not built")
    g = torch.Generator().manual_seed(7)
    dtypes = [torch.bfloat16, torch.float8_e4m3fn, torch.int32, torch.float32]
    news = [
        torch.randint(0, 256, (4096 if i != 5 else 1 << 20,), dtype=torch.uint8, generator=g)
        .view(dtypes[i % 4])
        .reshape(4, -1)
        for i in range(300)
    ]
    olds = [codec.raw_clone(n) for n in news]
    for n in news:
        codec.raw_view(n).view(-1)[:: 7 + n.numel() % 5] ^= 3
    shards, snapshots = [], []
    for batch in (diff_mod.BATCH_BYTES, 0):
        snap = [codec.raw_clone(o) for o in olds]
        items = [BucketItem(i, f"e{i}", news[i], snap[i]) for i in range(len(news))]
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(diff_mod, "BATCH_BYTES", batch)
            d = diff_bucket(items, delta=True, algorithm="xxh3-128", advance=True)
        e = encode_bucket(
            d, version=3, run_id="r", delta=True, full=False, encoding=encoding, level=3,
            algorithm="xxh3-128",
        )  # fmt: skip
        blob = delta_shard_blob(e.delta_blobs, version=3, run_id="r")
        shards.append((e.items, e.raw_bytes, blob))
        snapshots.append(snap)
    assert shards[0] == shards[1]
    assert all(_same(a, b) and _same(a, n) for a, b, n in zip(*snapshots, news, strict=True))
