"""Receiver agent: apply in order, zero diff, catch-up, refusal of corrupt data, several engines."""

from __future__ import annotations

import asyncio
import gc
import itertools
import json
import shutil
from pathlib import Path

import pytest
import torch

from asyncsync import (
    ChainError,
    ChecksumMismatch,
    ConfigError,
    FormatError,
    IncompleteVersion,
    Manifest,
    Publisher,
)
from asyncsync.format.acks import read_acks
from asyncsync.format.checksum import checksum_bytes
from asyncsync.format.entries import TensorEntry
from asyncsync.format.store import read_manifest
from receiver import ReceiverAgent, shard_reader
from receiver.engines.base import TensorUpdate
from receiver.engines.checkpoint import LocalCheckpoint
from receiver.engines.torch_module import TorchModule
from tests.conftest import Holder, assert_holds, mixed_state, mutate


async def publish_chain(root: Path, n: int, **kw: object) -> list[dict[str, torch.Tensor]]:
    """Seed plus n versions; returns the state dict of every version."""
    states = [mixed_state(0)]
    async with Publisher(root, bucket_bytes=8192, **kw) as pub:  # type: ignore[arg-type]
        await pub.seed(states[0])
        for i in range(1, n + 1):
            states.append(mutate(states[-1], 0.03, seed=i))
            await pub.publish(states[-1])
    return states


@pytest.mark.parametrize(
    ("option", "bad"),
    [
        ("poll_interval", None), ("poll_interval", float("nan")), ("poll_interval", 0),
        ("poll_interval", float("inf")), ("verify_deadline", "1"), ("verify_deadline", -1),
        ("prefetch_bytes", -5), ("prefetch_bytes", None), ("apply_group_bytes", 1.5),
        ("apply_group_bytes", 0), ("stream_timeout", float("nan")), ("stream_timeout", None),
        ("lease_ttl", float("nan")), ("lease_ttl", 0), ("lease_ttl", True),
    ],
)  # fmt: skip
def test_options_of_the_wrong_type_or_range_are_config_errors(
    tmp_path: Path, option: str, bad: object
) -> None:
    """A ConfigError naming the option, at construction: never a TypeError from a comparison
    later, never a NaN that passes every range check (each comparison with NaN is False)."""
    engine = LocalCheckpoint(tmp_path / "ckpt")
    with pytest.raises(ConfigError, match=option):
        ReceiverAgent(tmp_path / "root", engine, "e1", **{option: bad})  # type: ignore[arg-type]
    ReceiverAgent(tmp_path / "root", engine, "e1", prefetch_bytes=0, verify_deadline=0)
    with pytest.raises(ConfigError, match="root must be a non-empty path"):
        ReceiverAgent("", engine, "e1")
    for bad_id in (5, "a/b", ""):  # was a ManifestError: the root's family, not the caller's
        with pytest.raises(ConfigError, match="invalid engine id"):
            ReceiverAgent(tmp_path / "root", engine, bad_id)  # type: ignore[arg-type]


async def test_local_checkpoint_follows_every_version(tmp_path: Path) -> None:
    root = tmp_path / "root"
    states = [mixed_state(0)]
    async with Publisher(root, bucket_bytes=8192, keyframe_interval=3) as pub:
        await pub.seed(states[0])
        agent = ReceiverAgent(root, LocalCheckpoint(tmp_path / "ckpt"), "e1", use_inotify=False)
        async with agent:
            assert await agent.sync_once() == 0
            for i in range(1, 7):
                sd = states[-1] if i == 4 else mutate(states[-1], 0.03, seed=i)  # v4: zero diff
                states.append(sd)
                r = await pub.publish(sd)
                assert await agent.sync_once() == r.version
                acks = await pub.wait_acked(r.version, engines=["e1"], timeout=5)
                assert acks["e1"].fingerprint == read_manifest(root, r.version).fingerprint
                assert_holds(agent.engine.load_state_dict(), sd)  # type: ignore[attr-defined]
            st = agent.status()
            assert (st.version, st.lag, st.failures) == (6, 0, 0)
            assert "version=6" in repr(agent)


async def test_torch_module_catch_up_replays_the_chain(tmp_path: Path) -> None:
    states = await publish_chain(tmp_path, 5, keyframe_interval=0)
    mod = Holder(states[0])
    async with ReceiverAgent(tmp_path, TorchModule(mod), "m1", use_inotify=False) as agent:
        assert await agent.sync_once() == 5
        assert agent.status().applied == 6  # the keyframe v0 then five deltas
    assert_holds(mod.state_dict(), states[5])
    assert read_acks(tmp_path)["m1"].version == 5


async def test_missing_version_restarts_from_newest_keyframe(tmp_path: Path) -> None:
    states = await publish_chain(tmp_path, 8, keyframe_interval=4)
    ckpt = LocalCheckpoint(tmp_path / "ckpt")
    async with ReceiverAgent(tmp_path / "x", ckpt, "e", use_inotify=False):
        pass  # engine exists, empty
    agent = ReceiverAgent(tmp_path, LocalCheckpoint(tmp_path / "ckpt"), "e", use_inotify=False)
    async with agent:
        # hold version 2 first
        for v in (3, 4, 5, 6, 7, 8):
            shutil.move(tmp_path / f"v{v:012d}", tmp_path / f"hidden{v}")
        assert await agent.sync_once() == 2
        for v in (4, 5, 6, 7, 8):
            shutil.move(tmp_path / f"hidden{v}", tmp_path / f"v{v:012d}")
        # version 3 is gone (retention): catch up from keyframe 8 (newest at or below target)
        assert await agent.sync_once() == 8
        assert_holds(agent.engine.load_state_dict(), states[8])  # type: ignore[attr-defined]


async def test_empty_engine_with_no_keyframe_is_a_chain_error(tmp_path: Path) -> None:
    await publish_chain(tmp_path, 3, keyframe_interval=0)
    shutil.rmtree(tmp_path / "v000000000000")
    async with ReceiverAgent(
        tmp_path, LocalCheckpoint(tmp_path / "c"), "e", use_inotify=False
    ) as a:
        with pytest.raises(ChainError, match="no keyframe"):
            await a.sync_once()
        assert a.version is None


async def test_no_keyframe_left_below_a_newer_version_says_retention_not_publish_one(
    tmp_path: Path,
) -> None:
    """Found by attack (`asyncsync gc --keep-versions 1` in a loop beside a publisher and two
    receivers): a receiver that read v1 as the newest found its keyframes removed by the time
    it looked for one, a keyframe v2 having just been committed; its error said to publish a
    keyframe or keep more versions. It says what happened now; the next sync takes v2."""
    from receiver.plan import newest_keyframe

    await publish_chain(tmp_path, 2, keyframe_interval=2)  # v0 and v2 full, v1 a delta
    shutil.rmtree(tmp_path / "v000000000000")
    with pytest.raises(ChainError, match=r"removed \(retention\?\) while v2 was committed") as info:
        newest_keyframe(tmp_path, 1)
    assert "publish one" not in str(info.value)
    shutil.rmtree(tmp_path / "v000000000002")  # none newer: the advice stands
    with pytest.raises(ChainError, match=r"publish one"):
        newest_keyframe(tmp_path, 1)


def delta_shard(root: Path, version: int) -> Path:
    m = read_manifest(root, version)
    s = next(s for s in m.shards if s.role == "delta")
    return root / f"v{version:012d}" / s.file


async def test_flipped_byte_is_refused_and_engine_keeps_last_good(tmp_path: Path) -> None:
    states = await publish_chain(tmp_path, 3, keyframe_interval=0)
    agent = ReceiverAgent(
        tmp_path, LocalCheckpoint(tmp_path / "ckpt"), "e1", use_inotify=False, verify_deadline=0.2
    )
    async with agent:
        shard = delta_shard(tmp_path, 2)
        good = shard.read_bytes()
        bad = bytearray(good)
        bad[len(bad) // 2] ^= 0x10
        shard.write_bytes(bytes(bad))
        with pytest.raises(ChecksumMismatch) as ei:
            await agent.sync_once()
        assert ei.value.path == str(shard) and shard.name in str(ei.value)
        assert agent.version == 1
        assert_holds(agent.engine.load_state_dict(), states[1])  # type: ignore[attr-defined]
        assert read_acks(tmp_path)["e1"].version == 1
        assert agent.status().last_error is not None
        shard.write_bytes(good)  # repaired (or fully visible now): the next sync goes through
        assert await agent.sync_once() == 3
        assert_holds(agent.engine.load_state_dict(), states[3])  # type: ignore[attr-defined]


async def test_truncated_or_missing_shard_refused(tmp_path: Path) -> None:
    await publish_chain(tmp_path, 3, keyframe_interval=0)
    hidden = tmp_path / "hidden"
    shutil.move(tmp_path / "v000000000003", hidden)
    agent = ReceiverAgent(
        tmp_path, TorchModule(Holder(mixed_state(0))), "m", use_inotify=False, verify_deadline=0.1
    )
    async with agent:
        assert await agent.sync_once() == 2
        shutil.move(hidden, tmp_path / "v000000000003")
        s3 = delta_shard(tmp_path, 3)
        s3.write_bytes(s3.read_bytes()[:-7])
        with pytest.raises(IncompleteVersion, match="bytes"):
            await agent.sync_once()
        assert agent.version == 2
        s3.unlink()
        with pytest.raises(IncompleteVersion, match="missing"):
            await agent.sync_once()
        assert agent.version == 2


async def test_shard_from_another_version_is_refused(tmp_path: Path) -> None:
    await publish_chain(tmp_path, 3, keyframe_interval=0)
    # Put v2's shard in place of v3's, and make v3's manifest agree on size and checksum:
    # only the shard's own metadata tells the truth.
    s2, s3 = delta_shard(tmp_path, 2), delta_shard(tmp_path, 3)
    shutil.copy(s2, s3)
    mpath = tmp_path / "v000000000003" / "manifest.json"
    d = json.loads(mpath.read_text())
    for s in d["shards"]:
        if s["file"] == s3.name:
            s["bytes"] = s3.stat().st_size
            s["checksum"] = checksum_bytes(s3.read_bytes())
    d["totals"]["wire_bytes"] = sum(s["bytes"] for s in d["shards"])
    d["totals"]["delta_bytes"] = d["totals"]["wire_bytes"]
    mpath.write_text(json.dumps(d))
    agent = ReceiverAgent(tmp_path, LocalCheckpoint(tmp_path / "c"), "e", use_inotify=False)
    async with agent:
        with pytest.raises(FormatError, match="another version"):
            await agent.sync_once()
        assert agent.version == 2


async def test_two_receivers_follow_a_live_publisher(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    stop = asyncio.Event()
    agents = [
        ReceiverAgent(root, LocalCheckpoint(tmp_path / "c1"), "e1", poll_interval=0.05),
        ReceiverAgent(
            root, TorchModule(Holder(mixed_state(0))), "e2", poll_interval=0.05, use_inotify=False
        ),
    ]
    sd = mixed_state(0)
    async with asyncio.TaskGroup() as tg:
        for a in agents:
            tg.create_task(a.run(stop=stop))
        async with Publisher(root, bucket_bytes=8192, keyframe_interval=4) as pub:
            await pub.seed(sd)
            for i in range(1, 9):
                sd = mutate(sd, 0.02, seed=i)
                r = await pub.publish(sd)
                if i % 3 == 0:  # let the receivers fall behind sometimes
                    await pub.wait_acked(r.version, engines=["e1", "e2"], timeout=20)
            await pub.wait_acked(8, engines=["e1", "e2"], timeout=20)
        stop.set()
    assert_holds(agents[0].engine.load_state_dict(), sd)  # type: ignore[attr-defined]
    assert_holds(agents[1].engine.module.state_dict(), sd)  # type: ignore[attr-defined]
    for a in agents:
        await a.close()


async def test_full_mode_versions_replace_the_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "root"
    sd = mixed_state(0)
    async with Publisher(root, mode="full") as pub:
        agent = ReceiverAgent(root, LocalCheckpoint(tmp_path / "c"), "e", use_inotify=False)
        async with agent:
            for i in range(3):
                sd = mutate(sd, 0.05, seed=i)
                r = await pub.publish(sd)
                assert await agent.sync_once() == r.version
                assert_holds(agent.engine.load_state_dict(), sd)  # type: ignore[attr-defined]


async def test_streaming_receive_reads_shards_before_the_manifest(tmp_path: Path) -> None:
    """On a slow filesystem the receiver reads shards while the publisher still writes."""
    from asyncsync import fsio

    root = tmp_path / "root"
    root.mkdir()
    sd = mixed_state(0, scale=4)
    agent = ReceiverAgent(root, LocalCheckpoint(tmp_path / "c"), "e", poll_interval=0.05)
    stop = asyncio.Event()
    fsio.set_throttle(fsio.Throttle(bandwidth=50e6, latency=0.03))
    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(agent.run(stop=stop))
            async with Publisher(root, bucket_bytes=2048, keyframe_interval=0) as pub:
                await pub.seed(sd)
                await pub.wait_acked(0, engines=["e"], timeout=30)
                for i in range(1, 4):
                    sd = mutate(sd, 0.05, seed=i)
                    r = await pub.publish(sd)
                    assert r.shards > 3
                await pub.wait_acked(3, engines=["e"], timeout=30)
            stop.set()
    finally:
        fsio.set_throttle(None)
    st = agent.status()  # LocalCheckpoint streams: its shards are applied, not only read, early
    assert st.streamed_shards > 0 and st.prefetched_shards == 0
    assert_holds(agent.engine.load_state_dict(), sd)  # type: ignore[attr-defined]
    await agent.close()


async def test_prefetched_bytes_are_verified_not_trusted(tmp_path: Path) -> None:
    from receiver.prefetch import Prefetcher

    states = await publish_chain(tmp_path, 2, keyframe_interval=0)
    agent = ReceiverAgent(tmp_path, LocalCheckpoint(tmp_path / "c"), "e", use_inotify=False)
    async with agent:
        shutil.move(tmp_path / "v000000000002", tmp_path / "hidden")
        assert await agent.sync_once() == 1
        shutil.move(tmp_path / "hidden", tmp_path / "v000000000002")
        # a prefetcher that read garbage for v2's first shard (e.g. a torn read on NFS)
        p = Prefetcher(tmp_path, 2, on_manifest=asyncio.Event())
        p.shards["delta-00000.safetensors"] = b"garbage"
        agent._early.reader = p
        assert await agent.sync_once() == 2  # re-read from disk after the mismatch
        assert agent.status().prefetched_shards == 0
        assert_holds(agent.engine.load_state_dict(), states[2])  # type: ignore[attr-defined]


async def test_the_prefetch_holds_no_more_than_its_budget(tmp_path: Path) -> None:
    """Found by attack (forty-third session): the prefetch checked its budget before a read,
    then read a shard of up to the whole budget, so it held up to twice the budget at once. A
    shard that would pass what is left is left to the read after the commit now."""
    from receiver.prefetch import Prefetcher

    vdir = tmp_path / "v000000000001"
    vdir.mkdir()
    for k, size in enumerate((600, 600, 300)):
        (vdir / f"delta-{k:05d}.safetensors").write_bytes(b"x" * size)
    p = Prefetcher(tmp_path, 1, on_manifest=asyncio.Event(), max_bytes=1000)
    task = asyncio.create_task(p.run())
    for _ in range(400):
        if "delta-00002.safetensors" in p.shards:
            break
        await asyncio.sleep(0.01)
    (vdir / "manifest.json").write_bytes(b"{}")
    await asyncio.wait_for(task, 10)
    assert sorted(p.shards) == ["delta-00000.safetensors", "delta-00002.safetensors"]
    assert p.bytes == 900 <= p.max_bytes


async def test_serialized_mode_gives_the_same_result(tmp_path: Path) -> None:
    states = [mixed_state(0)]
    async with Publisher(tmp_path / "r", bucket_bytes=4096, pipelined=False) as pub:
        await pub.seed(states[0])
        for i in range(1, 3):
            states.append(mutate(states[-1], 0.03, seed=i))
            r = await pub.publish(states[-1])
            assert r.seconds["diff"] > 0 and r.seconds["encode"] > 0
    ref = await publish_chain(tmp_path / "p", 2)
    assert [read_manifest(tmp_path / "r", v).fingerprint for v in range(3)] == [
        read_manifest(tmp_path / "p", v).fingerprint for v in range(3)
    ]
    eng = LocalCheckpoint(tmp_path / "c")
    async with ReceiverAgent(tmp_path / "r", eng, "e", pipelined=False, prefetch=False) as a:
        assert await a.sync_once() == 2
    assert_holds(eng.load_state_dict(), ref[2])


async def test_new_run_is_never_mistaken_for_the_old_one(tmp_path: Path) -> None:
    """A wiped root restarts version numbers under a new run id: the engine re-seeds."""
    root = tmp_path / "root"
    old = await publish_chain(root, 4)
    ckpt = tmp_path / "ckpt"
    async with ReceiverAgent(root, LocalCheckpoint(ckpt), "e", use_inotify=False) as a:
        assert await a.sync_once() == 4
        old_run = a.engine.state.run_id
    shutil.rmtree(root)
    new = [mutate(old[0], 0.5, seed=77)]
    async with Publisher(root) as pub:
        await pub.seed(new[0])
        new.append(mutate(new[0], 0.03, seed=78))
        await pub.publish(new[1])
        new_run = pub.run_id
    assert new_run != old_run
    async with ReceiverAgent(root, LocalCheckpoint(ckpt), "e", use_inotify=False) as a:
        assert await a.sync_once() == 1  # not "4 > 1: nothing to do"
        assert a.engine.state.run_id == new_run
        assert_holds(a.engine.load_state_dict(), new[1])  # type: ignore[attr-defined]
    ack = read_acks(root)["e"]
    assert (ack.run_id, ack.version) == (new_run, 1)


async def test_republished_version_is_not_acked_on_its_number(tmp_path: Path) -> None:
    """v1 removed and published again with other contents: an engine holding the old v1 is
    re-seeded, not acked because the number matches."""
    root = tmp_path / "root"
    sd0 = mixed_state(0)
    async with Publisher(root, keyframe_interval=0) as pub:
        await pub.seed(sd0)
        await pub.publish(mutate(sd0, 0.03, seed=1))
    ckpt = tmp_path / "ckpt"
    async with ReceiverAgent(root, LocalCheckpoint(ckpt), "e", use_inotify=False) as agent:
        assert await agent.sync_once() == 1
    shutil.rmtree(root / "v000000000001")
    other = mutate(sd0, 0.03, seed=11)
    async with Publisher(root, keyframe_interval=0) as pub:
        await pub.seed(other)  # a restarted trainer re-seeds at the next free number: v1 again
        assert pub.version == 1
    async with ReceiverAgent(root, LocalCheckpoint(ckpt), "e", use_inotify=False) as agent:
        assert await agent.sync_once() == 1
        assert_holds(agent.engine.load_state_dict(), other)  # type: ignore[attr-defined]
        assert agent.engine.state.fingerprint == read_manifest(root, 1).fingerprint
    assert read_acks(root)["e"].fingerprint == read_manifest(root, 1).fingerprint


async def test_delta_that_does_not_fit_the_engine_falls_back_to_a_keyframe(tmp_path: Path) -> None:
    """The engine's bytes were changed behind its back: v2's delta fails its checksums after
    apply (rolled back); instead of retrying forever the agent re-seeds from keyframe v3."""
    root = tmp_path / "root"
    states = [mixed_state(0)]
    ckpt = tmp_path / "ckpt"
    async with Publisher(root, keyframe_interval=0) as pub:
        await pub.seed(states[0])
        states.append(mutate(states[0], 0.03, seed=1))
        await pub.publish(states[1])
        async with ReceiverAgent(root, LocalCheckpoint(ckpt), "e", use_inotify=False) as a:
            assert await a.sync_once() == 1
        # flip every byte of one tensor in the checkpoint file, behind the engine's back
        from receiver.engines.st_layout import read_layout

        name = "model.layers.0.weight"
        for f in ckpt.glob("model-*.safetensors"):
            loc = read_layout(f).get(name)
            if loc is not None:
                data = bytearray(f.read_bytes())
                data[loc.begin : loc.end] = bytes(b ^ 0xFF for b in data[loc.begin : loc.end])
                f.write_bytes(bytes(data))
        states.append(mutate(states[1], 0.03, seed=2))
        await pub.publish(states[2])  # v2: a delta
        states.append(mutate(states[2], 0.03, seed=3))
        await pub.publish(states[3], keyframe=True)  # v3: a keyframe
    async with ReceiverAgent(root, LocalCheckpoint(ckpt), "e", use_inotify=False) as agent:
        assert await agent.sync_once() == 3
        assert_holds(agent.engine.load_state_dict(), states[3])  # type: ignore[attr-defined]


def test_apply_groups_cover_a_shard_in_order_within_the_limit(tmp_path: Path) -> None:
    asyncio.run(publish_chain(tmp_path, 1, keyframe_interval=0))
    m = read_manifest(tmp_path, 1)
    (idx,) = [i for i, s in enumerate(m.shards) if s.role == "delta"]  # one shard: it packs
    pieces = shard_reader.pieces_in(m, "delta", idx)
    groups = shard_reader.apply_groups(m, "delta", idx, limit=2000)
    assert len(groups) > 2 and [p for g in groups for p in g] == pieces
    for g in groups:
        sizes = [e.changed * (8 + e.torch_dtype.itemsize) for e, _, _ in g]
        assert sum(sizes) <= 2000 or min(sizes) > 2000  # or large ones packed together
    assert shard_reader.apply_groups(m, "delta", idx) == [pieces]  # default limit: 1 MiB
    assert shard_reader.apply_groups(read_manifest(tmp_path, 0), "full", 0) != []


@pytest.mark.parametrize("spread", [1, 2, 3, 16])
@pytest.mark.parametrize(
    "sizes",
    [[], [50], [500], [5, 200, 300, 5, 5, 150, 5000, 101, 101, 50], [300] * 5, [1] * 30],
)
def test_group_pieces_packs_consecutive_large_pieces(
    sizes: list[int], spread: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every piece once, in order; small ones up to the limit a group, never with a large one;
    consecutive large ones (> limit) packed up to ``spread`` a group, within max(spread *
    limit, twice the largest) decoded bytes; spread 1: each large piece alone, as before."""
    monkeypatch.setattr(shard_reader, "_decoded_bytes", lambda piece: piece)
    groups = shard_reader.group_pieces(sizes, 100, spread)  # type: ignore[arg-type]
    assert [n for g in groups for n in g] == sizes
    cap = max([spread * 100] + [2 * n for n in sizes if n > 100])
    for g in groups:
        if any(n > 100 for n in g):
            assert all(n > 100 for n in g) and len(g) <= spread and sum(g) <= cap
            assert spread > 1 or len(g) == 1
        else:
            assert sum(g) <= 100
    for g, after in itertools.pairwise(groups):  # no group could have taken the next piece
        if all(n > 100 for n in g + after):
            assert len(g) == spread or sum(g) + after[0] > cap
        elif not any(n > 100 for n in g + after):
            assert sum(g) + after[0] > 100


async def test_a_packed_delta_shard_is_applied_in_groups(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine gets bounded groups of one shard, each journaled; the result is exact."""
    states = await publish_chain(tmp_path, 2, keyframe_interval=0)
    eng = LocalCheckpoint(tmp_path / "c")
    calls: list[int] = []
    apply = eng.apply

    async def counting(updates: list[TensorUpdate]) -> None:
        calls.append(len(updates))
        await apply(updates)

    monkeypatch.setattr(eng, "apply", counting)
    with pytest.raises(ConfigError, match="apply_group_bytes"):
        ReceiverAgent(tmp_path, eng, "e", apply_group_bytes=0)
    agent = ReceiverAgent(tmp_path, eng, "e", use_inotify=False, apply_group_bytes=1500)
    async with agent:
        assert await agent.sync_once() == 2  # v0 (full), v1, v2
    m0, m1, m2 = (read_manifest(tmp_path, v) for v in range(3))
    full, delta = len(m0.shards), sum(s.role == "delta" for m in (m1, m2) for s in m.shards)
    assert len(calls) > full + 2 * delta
    assert sum(calls) == len(m0.tensors) + sum(
        e.delta is not None for m in (m1, m2) for e in m.tensors
    )
    assert_holds(eng.load_state_dict(), states[2])


def test_an_agent_serves_one_asyncio_run_after_another(tmp_path: Path) -> None:
    """The agent's sync lock and its presence's renewal lock were ``asyncio.Lock`` objects,
    bound to the first loop that waited on them: contended under a later ``asyncio.run`` (two
    syncs at once; a renew meeting a renew or an ack), they raised RuntimeError ("bound to a
    different event loop"). Both are LoopLocks now, made anew in each running loop."""
    asyncio.run(publish_chain(tmp_path, 1))
    agent = ReceiverAgent(tmp_path, LocalCheckpoint(tmp_path / "ckpt"), "e", use_inotify=False)

    async def contended() -> list[int | None]:
        await agent.open()
        presence = agent._presence
        await asyncio.gather(presence.renew(), presence.renew())
        return await asyncio.gather(agent.sync_once(), agent.sync_once())

    assert asyncio.run(contended()) == [1, 1]
    assert asyncio.run(contended()) == [1, 1]

    async def audit_meets_sync() -> int | None:
        async with agent.exclusive():
            task = asyncio.create_task(agent.sync_once())
            await asyncio.sleep(0.01)
            assert not task.done()  # waits for the audit's hold
        return await task

    assert asyncio.run(audit_meets_sync()) == 1
    asyncio.run(agent.close())


async def test_a_stop_during_a_catch_up_stops_after_the_version_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(attack-42) SIGTERM to a receiver catching up through a chain applied every version to
    the newest before it stopped (5 s for 100 versions of 4 MiB; past the 120 s grace, or a
    pod's 30 s, on a long chain of a large model): the stop is checked after each version
    now, as the CLI's help says ("stops it after the version in flight")."""
    states = await publish_chain(tmp_path, 8, keyframe_interval=0)
    agent = ReceiverAgent(tmp_path, LocalCheckpoint(tmp_path / "c"), "s1", use_inotify=False)
    stop = asyncio.Event()
    acked = agent._ack

    async def ack_then_stop(m: Manifest) -> None:
        await acked(m)
        if m.version == 2:
            stop.set()  # as the CLI's signal handler does

    monkeypatch.setattr(agent, "_ack", ack_then_stop)
    async with agent:
        await asyncio.wait_for(agent.run(stop=stop), 60)
        assert agent.version == 2
    assert read_acks(tmp_path)["s1"].version == 2
    assert_holds(LocalCheckpoint(tmp_path / "c").load_state_dict(), states[2])


class _GcWatch(LocalCheckpoint):
    """Records whether the cyclic collector was on at each apply."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.enabled: list[bool] = []

    async def apply(self, updates: list[TensorUpdate]) -> None:
        self.enabled.append(gc.isenabled())
        await super().apply(updates)


async def test_a_version_is_applied_with_the_collector_paused(tmp_path: Path) -> None:
    """Issue 26: the collector's passes over what a version keeps alive were a tenth to a
    quarter of a small tensor's apply; the agent pauses it over each version's apply (begin, stream,
    commit), and it is on again once the version is applied."""
    assert gc.isenabled()
    states = await publish_chain(tmp_path / "root", 2, keyframe_interval=0)
    engine = _GcWatch(tmp_path / "ckpt")
    async with ReceiverAgent(tmp_path / "root", engine, "e1", use_inotify=False) as agent:
        assert await agent.sync_once() == 2
        assert gc.isenabled()
        assert len(engine.enabled) >= 3 and not any(engine.enabled)
    assert_holds(LocalCheckpoint(tmp_path / "ckpt").load_state_dict(), states[2])


async def test_a_version_of_many_shards_looks_at_each_entry_once_not_once_a_shard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent grouped each shard's pieces with a pass over every manifest entry: S shards
    of N tensors cost S x N looks (~2.5 us each; a minute a version for a MoE's tens of
    thousands of tensors in the hundreds of 4 MiB shards of a large model's delta)."""
    g = torch.Generator().manual_seed(0)
    sd = {f"t{i}": torch.randn(512, generator=g).to(torch.bfloat16) for i in range(120)}
    eng = LocalCheckpoint(tmp_path / "c")
    looks = itertools.count()
    spans = TensorEntry.spans

    def counted(self: TensorEntry) -> object:
        next(looks)
        return spans.fget(self)  # type: ignore[attr-defined]

    root = tmp_path / "r"
    async with (
        Publisher(root, bucket_bytes=8192, delta_shard_bytes=1024) as pub,
        ReceiverAgent(root, eng, "e", prefetch=False, use_inotify=False) as agent,
    ):
        await pub.seed(sd)
        assert await agent.sync_once() == 0
        sd = mutate(sd, 0.03, seed=1)
        await pub.publish(sd)
        monkeypatch.setattr(TensorEntry, "spans", property(counted))
        assert await agent.sync_once() == 1
        monkeypatch.undo()
    m = read_manifest(root, 1)
    shards, n = sum(s.role == "delta" for s in m.shards), len(m.tensors)
    assert shards >= 8, shards  # (the point: many shards)
    assert next(looks) <= 3 * n, f"{shards} shards of {n} tensors"  # was ~shards x n
    assert_holds(eng.load_state_dict(), sd)
