"""The publisher's plan: its buckets (snapshot.plan_buckets, plan_for: large tensors spread
over the pool, a small lead bucket) and its delta shards (DeltaPacker: by size, shard 0 alone
and a tapering tail), as pure functions, then on real publishes."""

from __future__ import annotations

import itertools
import math
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncsync import Publisher
from asyncsync.codec.shards import DeltaPacker
from asyncsync.format.names import MAX_SHARD_BYTES
from asyncsync.format.store import read_manifest
from asyncsync.publish import snapshot
from tests.conftest import mutate

SIZES = [
    [],
    [50],
    [500],
    [10, 200, 5, 5, 300, 5, 250, 5],
    [300, 300, 300],
    [1] * 40,
    [101, 5, 99, 100],
    [5000, 101, 101, 101, 5, 2600, 2500, 150],  # the byte cap binds
    [400, 30, 30, 30, 30, 400],  # an LLM's shape: embedding, layers, lm_head
]


@pytest.mark.parametrize("spread", [1, 2, 3, 16])
@pytest.mark.parametrize("sizes", SIZES)
def test_plan_buckets_packs_large_tensors_spread_to_a_bucket(sizes: list[int], spread: int) -> None:
    """Every tensor in exactly one bucket; the small ones in order, at most bucket_bytes a
    bucket (one alone may be more); the large ones (> bucket_bytes) packed up to ``spread`` to
    a bucket in order, where the first of the pack was, each pack at most max(spread *
    bucket_bytes, twice the largest); spread 1 is the plain plan."""
    buckets = snapshot.plan_buckets(sizes, 100, spread)
    assert sorted(i for b in buckets for i in b) == list(range(len(sizes)))
    big = [i for i, n in enumerate(sizes) if n > 100]
    if spread == 1:
        assert [b for b in buckets if set(b) & set(big)] == [[i] for i in big]
    packs = [b for b in buckets if set(b) & set(big)]
    assert all(set(b) <= set(big) for b in packs)
    assert [i for b in packs for i in b] == big
    cap = max([spread * 100] + [2 * sizes[i] for i in big])
    assert all(len(b) <= spread and sum(sizes[i] for i in b) <= cap for b in packs)
    for b, after in itertools.pairwise(packs):  # each pack as full as it may be
        assert len(b) == spread or sum(sizes[i] for i in b) + sizes[after[0]] > cap
    small = [b for b in buckets if not set(b) & set(big)]
    assert [i for b in small for i in b] == [i for i in range(len(sizes)) if i not in big]
    assert all(len(b) == 1 or sum(sizes[i] for i in b) <= 100 for b in small)
    first = {b[0]: k for k, b in enumerate(buckets)}
    assert [first[b[0]] for b in buckets] == sorted(first[b[0]] for b in buckets)
    with pytest.raises(ValueError, match="spread"):
        snapshot.plan_buckets(sizes, 100, 0)


def test_plan_for_spreads_only_the_changes_of_cpu_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """A delta of CPU tensors spreads its large tensors over the pool; full data (a keyframe,
    a seed) or a tensor on an accelerator (copied to the host a bucket at a time) keeps one
    large tensor per bucket, so memory stays what bucket_bytes says."""
    monkeypatch.setattr(snapshot, "threads", lambda: 2)
    sd = {"a": torch.zeros(300, dtype=torch.uint8), "b": torch.zeros(5, dtype=torch.uint8),
          "c": torch.zeros(300, dtype=torch.uint8)}  # fmt: skip
    sizes = [300, 5, 300]
    assert snapshot.plan_for(sd, sizes, 100, True) == [[0, 2], [1]]
    assert snapshot.plan_for(sd, sizes, 100, False) == [[0], [1], [2]]
    meta = {**sd, "c": torch.zeros(300, dtype=torch.uint8, device="meta")}
    assert snapshot.plan_for(meta, sizes, 100, True) == [[0], [1], [2]]


@pytest.mark.parametrize("spread", [1, 2, 16])
@pytest.mark.parametrize("first", [1, 25, 60, 100])
@pytest.mark.parametrize("sizes", SIZES)
def test_first_bucket_is_small_and_leads(sizes: list[int], first: int, spread: int) -> None:
    """With ``first``: the version begins with at most ``first`` bytes (or one tensor) of the
    first small tensors, cut from the front of the first bucket of small tensors; every other
    bucket is the plan's without ``first``, in its order (the rest of the cut bucket where the
    bucket was)."""
    plain = snapshot.plan_buckets(sizes, 100, spread)
    buckets = snapshot.plan_buckets(sizes, 100, spread, first)
    assert sorted(i for b in buckets for i in b) == list(range(len(sizes)))
    small = [b for b in plain if all(sizes[i] <= 100 for i in b)]
    if not small:
        assert buckets == plain
        return
    head = buckets[0]
    assert head == small[0][: len(head)]  # the first small tensors, in order
    assert len(head) == 1 or sum(sizes[i] for i in head) <= first
    assert len(head) == len(small[0]) or sum(sizes[i] for i in small[0][: len(head) + 1]) > first
    rest = [[i for i in b if i not in head] for b in plain]
    assert buckets[1:] == [b for b in rest if b]


def test_first_must_be_positive() -> None:
    with pytest.raises(ValueError, match="first"):
        snapshot.plan_buckets([10], 100, 1, 0)


def test_plan_for_leads_only_a_tapered_delta_with_a_small_bucket(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A delta whose shards taper (``lead``) starts with a quarter bucket of small tensors,
    ahead of the large ones; full data and an untapered delta keep the plain plan."""
    monkeypatch.setattr(snapshot, "threads", lambda: 2)
    sd = {n: torch.zeros(k, dtype=torch.uint8) for n, k in
          (("embed", 400), ("a", 30), ("b", 30), ("c", 30), ("head", 400))}  # fmt: skip
    sizes = [t.numel() for t in sd.values()]
    assert snapshot.plan_for(sd, sizes, 100, True) == [[0, 4], [1, 2, 3]]
    assert snapshot.plan_for(sd, sizes, 100, True, lead=True) == [[1], [0, 4], [2, 3]]
    assert snapshot.plan_for(sd, sizes, 100, False, lead=True) == [[0], [1, 2, 3], [4]]


def pack(buckets: list[tuple[int, int]], limit: int, stream: bool = True) -> list[list[int]]:
    """The buckets (delta bytes, model bytes) that each shard of a DeltaPacker holds."""
    p = DeltaPacker(limit)
    left = sum(m for _, m in buckets)
    out: list[list[int]] = []
    for k, (d, m) in enumerate(buckets):
        left -= m
        blobs = {f"t{k}.pos": bytes(d)} if d else {}
        groups = p.add(blobs, model=m, left=left if stream else None)
        out += [sorted({int(key[1:].split(".")[0]) for key in g}) for g in groups]
    if g := p.take():
        out.append(sorted({int(key[1:].split(".")[0]) for key in g}))
    return out


def test_delta_packer_cuts_the_first_bucket_and_halves_the_tail() -> None:
    """Ten like buckets, four to a shard by size: shard 0 is the first bucket alone (the
    receiver starts), then full shards, then shards of at most the model bytes still to
    come, down to one bucket (the receiver's tail after the last one lands)."""
    ten = [(25, 1000)] * 10
    assert pack(ten, 100) == [[0], [1, 2, 3, 4], [5, 6, 7], [8], [9]]
    assert pack(ten, 100, stream=False) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    # a first bucket without changes: the first with changes is shard 0
    assert pack([(0, 1000), (25, 1000), *ten], 100)[:2] == [[1], [2, 3, 4, 5]]


@pytest.mark.parametrize("seed", range(40))
def test_delta_packer_plan_properties(seed: int) -> None:
    """Every bucket with changes in exactly one shard, in order; a shard passes the limit only
    as one bucket; shard 0 is one bucket; a shard of several buckets was cut when full or
    when it held the model bytes still to come (never before); and the shards are few:
    at most the size limit's count plus one for shard 0 plus the tail's halvings."""
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 60, (1,), generator=g))
    deltas = torch.randint(0, 300, (n,), generator=g).tolist()
    models = torch.randint(1, 10_000, (n,), generator=g).tolist()
    limit = int(torch.randint(50, 1000, (1,), generator=g))
    buckets = list(zip(deltas, models, strict=True))
    shards = pack(buckets, limit)
    assert [k for s in shards for k in s] == [k for k, d in enumerate(deltas) if d]
    assert not shards or len(shards[0]) == 1
    for s in shards:
        assert len(s) == 1 or sum(deltas[k] for k in s) <= limit
        if len(s) > 1:  # not cut at its next-to-last bucket: below the limit and the tail
            before = s[:-1]
            assert sum(deltas[k] for k in before) < limit
            assert sum(models[before[0] : before[-1] + 1]) < sum(models[before[-1] + 1 :])
    # each cut by the tail at least halves the model bytes still to come
    plain = pack(buckets, limit, stream=False)
    assert len(shards) <= len(plain) + 3 + math.log2(sum(models) / min(models))


def test_plan_at_absurd_sizes_stays_within_the_receivers_limits() -> None:
    """One tensor of 4 GiB is one bucket and one shard (its delta below MAX_SHARD_BYTES);
    100,000 tiny tensors are a few buckets and a few shards, never one per tensor."""
    big = [4 << 30]
    assert snapshot.plan_buckets(big, 32 << 20, 16, 8 << 20) == [[0]]
    delta = (4 << 30) * 3 // 100 * 6  # 3 % changed, 6 bytes each: far above any limit
    assert delta < MAX_SHARD_BYTES and pack([(delta, 4 << 30)], 4 << 20) == [[0]]
    tiny = [64] * 100_000
    buckets = snapshot.plan_buckets(tiny, 32 << 20, 16, 8 << 20)
    assert len(buckets) == 1 and len(buckets[0]) == 100_000
    buckets = snapshot.plan_buckets(tiny, 1 << 20, 16, 256 << 10)
    assert [len(b) for b in buckets] == [4096, 12288] + [16384] * 5 + [100_000 - 6 * 16384]
    per = [(len(b) * 10, len(b) * 64) for b in buckets]  # ~10 bytes of delta per tensor
    assert len(pack(per, 1 << 20)) <= len(buckets)


async def publish_two(root: Path, **kw: int) -> list[list[str]]:
    """The tensors of each delta shard of the second delta of a small LLM-shaped state."""
    g = torch.Generator().manual_seed(0)
    names = ["embed"] + [f"l{i}" for i in range(24)] + ["head"]
    numel = {n: 64 << 10 for n in names} | {"embed": 1 << 20, "head": 1 << 20}
    sd0 = {n: torch.randn(numel[n], generator=g) for n in names}
    sd1 = mutate(sd0, 0.15, seed=1)  # ~2.7 MB of delta: more than two 1 MiB shards
    async with Publisher(root, bucket_bytes=1 << 20, **kw) as pub:
        await pub.seed(sd0)
        await pub.publish(sd1)
        await pub.publish(mutate(sd1, 0.15, seed=2))
    m = read_manifest(root, 2)
    where = {e.name: e.delta.shard for e in m.tensors if e.delta is not None}
    assert sorted(where) == sorted(names)
    return [[n for n in names if where[n] == k] for k in range(len(m.shards))]


async def test_a_streamed_publish_starts_small_and_ends_with_one_bucket(tmp_path: Path) -> None:
    """On a real publish with the default shard size (self-describing shards): shard 0 holds
    the lead bucket's tensor only, the large tensors follow, and the last shard holds the
    last bucket's deltas only; a ``delta_shard_bytes`` given is a size, nothing else."""
    by_shard = await publish_two(tmp_path / "auto")
    assert by_shard[0] == ["l0"]  # a quarter of 1 MiB: one 256 KiB tensor
    assert by_shard[1] == ["embed", "head"]  # the large ones, packed side by side
    assert by_shard[-1] == ["l20", "l21", "l22", "l23"]  # the last bucket alone
    assert [n for s in by_shard[2:] for n in s] == [f"l{i}" for i in range(1, 24)]
    assert len(by_shard) <= 6
    fixed = await publish_two(tmp_path / "fixed", delta_shard_bytes=4 << 20)
    assert len(fixed) == 1  # the whole delta (< 4 MiB) in one


async def test_a_small_delta_does_not_taper(tmp_path: Path) -> None:
    """A delta expected to fit in fewer than two shards is packed by size alone: no lead
    bucket, no tapering, as few files as before (each costs a round trip on a network
    filesystem)."""
    sd0 = {f"l{i}": torch.randn(64 << 10, generator=torch.Generator().manual_seed(i))
           for i in range(24)}  # fmt: skip
    sd1 = mutate(sd0, 0.03, seed=1)
    async with Publisher(tmp_path, bucket_bytes=1 << 20) as pub:
        await pub.seed(sd0)
        r1 = await pub.publish(sd1)  # ~300 KB of delta: one shard
        r2 = await pub.publish(mutate(sd1, 0.03, seed=2))
    assert r1.shards == r2.shards == 1


async def test_the_lead_bucket_is_encoded_before_the_next_bucket_is_diffed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tapered delta's lead bucket is encoded before the next bucket's diff starts (that
    diff spreads the large tensors over every worker of the pool, where the lead's encode
    would wait behind it and its shard land late). The lead's encode here waits (up to 2 s)
    for the large tensors' diff to start, as an encode queued behind it does: without the
    gate that diff starts first."""
    from asyncsync.publish import publisher as mod

    events: list[tuple[str, tuple[str, ...]]] = []
    big_diff = threading.Event()
    real_diff, real_encode = mod.diff_bucket, mod.encode_bucket

    def diff(items: Any, **kw: Any) -> Any:
        names = tuple(it.name for it in items)
        events.append(("diff", names))
        if names == ("l0",):  # a tapered version's lead bucket
            big_diff.clear()
        if "embed" in names:
            big_diff.set()
        return real_diff(items, **kw)

    def encode(d: Any, **kw: Any) -> Any:
        names = tuple(it.name for it in d.items)
        if names == ("l0",):
            big_diff.wait(2.0)
        out = real_encode(d, **kw)
        events.append(("encoded", names))
        return out

    monkeypatch.setattr(mod, "diff_bucket", diff)
    monkeypatch.setattr(mod, "encode_bucket", encode)
    assert (await publish_two(tmp_path))[0] == ["l0"]  # the last version was tapered
    lead = [k for k, e in enumerate(events) if e == ("encoded", ("l0",))]
    big = [k for k, (what, names) in enumerate(events) if what == "diff" and "embed" in names]
    assert lead and big
    assert lead[-1] < big[-1], events  # in the last version
