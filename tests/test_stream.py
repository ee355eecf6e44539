"""Streaming apply (format 3, receiver/stream.py): a version's self-describing delta shards are
applied into the engine while the publisher still writes the version, the manifest only
confirms; nothing is served or acked before it; a version whose manifest never comes is rolled
back; a manifest that does not match what was applied sends the version down the ordinary path;
roots written by format 2 (no streaming metadata) are read as before."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncsync import Publisher
from asyncsync.codec.stream_shard import StreamEntry, stream_header
from asyncsync.errors import FormatError
from asyncsync.format import MANIFEST_NAME, version_dir
from asyncsync.format.acks import ack_path, read_ack
from asyncsync.format.store import read_manifest
from receiver import ReceiverAgent, inotify
from receiver.engines.checkpoint import LocalCheckpoint
from receiver.stream import StreamApplier
from tests.conftest import eventually, mixed_state, mutate, running, same_bytes

SMALL = 2048  # delta shard bytes: a version is several shards


def _state(i: int) -> dict[str, torch.Tensor]:
    sd = mixed_state(0, scale=4)
    return mutate(sd, 0.05, seed=i) if i else sd


def _holds(ck: LocalCheckpoint, want: dict[str, torch.Tensor]) -> bool:
    got = ck.load_state_dict()
    return set(got) == set(want) and all(same_bytes(got[k], t) for k, t in want.items())


def _delta_files(vdir: Path) -> list[Path]:
    return sorted(vdir.glob("delta-*.safetensors"))


def _recorded_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the files the stream reads (receiver.stream's ``read_pooled``), in order."""
    import receiver.stream as stream_mod

    reads: list[str] = []
    real_read = stream_mod.read_pooled

    def recording(path: Path, **kw: Any) -> memoryview:
        data = real_read(path, **kw)
        reads.append(Path(path).name)
        return data

    monkeypatch.setattr(stream_mod, "read_pooled", recording)
    return reads


def _apply_after_manifest(
    monkeypatch: pytest.MonkeyPatch, engine: LocalCheckpoint, root: Path
) -> None:
    """The engine applies nothing before v2's manifest is there (slower than the publisher)."""
    real_apply = engine.apply
    manifest = version_dir(root, 2) / MANIFEST_NAME

    async def slow_apply(updates: Any) -> None:
        await eventually(manifest.exists, "v2's manifest")
        await real_apply(updates)

    monkeypatch.setattr(engine, "apply", slow_apply)


async def _stream_begun(agent: ReceiverAgent, vdir: Path) -> None:
    """(A publisher's ``pre_commit_hook``:) wait until the stream has begun the engine's
    transaction: on a loaded machine the agent may start it only after the manifest, and a
    stream that has begun nothing when the agent takes it over stops there."""
    await eventually(lambda: (s := _streamer(agent)) is not None and s.txn_open, "the stream")


async def _with_agent(
    tmp: Path,
    body: Callable[[Publisher, ReceiverAgent, LocalCheckpoint], Awaitable[None]],
    **agent_kw: Any,
) -> None:
    root = tmp / "root"
    engine, agent = _agent(tmp, **agent_kw)
    async with Publisher(
        root, bucket_bytes=SMALL, delta_shard_bytes=SMALL, keyframe_interval=0
    ) as pub:
        await pub.seed(_state(0))
        await pub.publish(_state(1))
        async with running(agent, 1):
            await body(pub, agent, engine)


def _agent(tmp: Path, **agent_kw: Any) -> tuple[LocalCheckpoint, ReceiverAgent]:
    """A checkpoint ``tmp/ck`` and an agent (polling, unless ``use_inotify=True``) syncing it
    from ``tmp/root``."""
    engine = LocalCheckpoint(tmp / "ck")
    agent = ReceiverAgent(
        tmp / "root", engine, "e1", poll_interval=0.02, **{"use_inotify": False, **agent_kw}
    )
    return engine, agent


def _at(agent: ReceiverAgent, version: int) -> bool:
    return agent.version == version


def _streamer(agent: ReceiverAgent) -> StreamApplier | None:
    s = agent._early.reader
    return s if isinstance(s, StreamApplier) else None


async def test_shards_are_applied_before_the_manifest_and_committed_by_it(tmp_path: Path) -> None:
    sd2 = _state(2)
    seen: dict[str, Any] = {}

    async def body(pub: Publisher, agent: ReceiverAgent, engine: LocalCheckpoint) -> None:
        async def hook(vdir: Path) -> None:  # the shards are durable, the manifest not yet
            n = len(_delta_files(vdir))
            await eventually(
                lambda: (s := _streamer(agent)) is not None and len(s.applied) == n,
                "every shard applied before the manifest",
            )
            seen["shards"], seen["held"] = n, engine.state.version
            seen["ack"] = read_ack(pub.root, "e1")
            seen["streamed"] = _streamer(agent)

        pub.pre_commit_hook = hook
        res = await pub.publish(sd2)
        await eventually(lambda: agent.version == 2, "the agent at v2")
        assert _holds(engine, sd2)
        assert agent.status().streamed_shards == seen["shards"] == res.shards > 1
        assert seen["held"] == 1 and seen["ack"].version == 1  # not served nor acked before
        hdr = stream_header(_delta_files(res.path)[0].read_bytes(), where="shard 0")
        assert hdr is not None and (hdr.version, hdr.base_version, hdr.shard_index) == (2, 1, 0)
        assert read_manifest(pub.root, 2).format_version == 3

    await _with_agent(tmp_path, body)


async def test_the_next_shard_is_read_while_the_engine_applies_this_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slow filesystem's transfer overlaps the apply: while the engine still applies shard 0,
    shard 1 has been read, checked and decoded (tests/test_stream_overlap.py) and shard 2 read
    and its data checked; shard 3 not yet (one shard read ahead of the one decoded, no more)."""
    reads = _recorded_reads(monkeypatch)
    sd2 = _state(2)

    async def body(pub: Publisher, agent: ReceiverAgent, engine: LocalCheckpoint) -> None:
        applying, gate = asyncio.Event(), asyncio.Event()
        real_apply = engine.apply

        async def held_apply(updates: Any) -> None:
            if not applying.is_set():  # the first group of shard 0
                applying.set()
                await gate.wait()
            await real_apply(updates)

        monkeypatch.setattr(engine, "apply", held_apply)

        async def hook(vdir: Path) -> None:  # every shard written, the manifest not yet
            assert len(_delta_files(vdir)) > 3
            await eventually(
                lambda: applying.is_set() and "delta-00002.safetensors" in reads,
                "shard 2 read while shard 0 is being applied",
            )
            await asyncio.sleep(0.2)  # time enough to read further, were it to
            try:
                assert "delta-00003.safetensors" not in reads
            finally:  # (the stream's abort waits for the apply held here)
                gate.set()

        pub.pre_commit_hook = hook
        res = await pub.publish(sd2)
        await eventually(lambda: agent.version == 2, "the agent at v2")
        assert _holds(engine, sd2) and agent.status().streamed_shards >= 2  # then the manifest
        names = [p.name for p in _delta_files(res.path)]
        assert reads == names[: len(reads)]  # each once, in order

    await _with_agent(tmp_path, body)


async def test_the_shards_left_when_the_manifest_comes_are_applied_by_the_stream(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine slower than the publisher: when the manifest comes, the stream has read three
    shards and applied none. It reads and applies the shards left while the agent reads the
    manifest, each once and in order, and the agent takes them all (before, the stream stopped
    at the manifest and the agent read the rest, after the stream's last apply)."""
    reads = _recorded_reads(monkeypatch)
    sd2 = _state(2)

    async def body(pub: Publisher, agent: ReceiverAgent, engine: LocalCheckpoint) -> None:
        _apply_after_manifest(monkeypatch, engine, pub.root)
        pub.pre_commit_hook = partial(_stream_begun, agent)
        res = await pub.publish(sd2)
        await eventually(lambda: agent.version == 2, "the agent at v2")
        assert _holds(engine, sd2)
        names = [p.name for p in _delta_files(res.path)]
        assert len(names) > 3 and reads == names  # each once, in order, by the stream
        assert agent.status().streamed_shards == res.shards

    await _with_agent(tmp_path, body)


@pytest.mark.parametrize("extra", ["another shard's", "damaged", "too large", "a FIFO"])
async def test_a_file_after_the_last_shard_ends_the_stream_not_the_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, extra: str
) -> None:
    """After the manifest the stream reads on until a shard is missing: a file after the
    last one (a leftover of a killed attempt: here shard 0's bytes, or them damaged; a sparse
    file larger than any shard; a FIFO) ends the reading there, read once at most. Neither
    rolled back what was streamed nor was re-read until the verify deadline (60 s here) as a
    shard before the manifest is: the manifest does not name it, and the agent commits what
    the stream applied."""
    sd2 = _state(2)
    seen: dict[str, Any] = {}

    async def body(pub: Publisher, agent: ReceiverAgent, engine: LocalCheckpoint) -> None:
        _apply_after_manifest(monkeypatch, engine, pub.root)  # read up to shard 2, then waits

        async def plant(vdir: Path) -> None:
            await _stream_begun(agent, vdir)
            shards = _delta_files(vdir)
            after = vdir / f"delta-{len(shards):05d}.safetensors"
            data = bytearray(shards[0].read_bytes())
            if extra == "damaged":
                data[-1] ^= 0xFF  # the data no longer matches the header's data checksum
            if extra == "a FIFO":
                os.mkfifo(after)  # (opened, it would block the reader)
            elif extra == "too large":
                with open(after, "wb") as f:
                    f.truncate(1 << 30)  # sparse, ~100x what a shard of this model can be
            else:
                _land(vdir, after, bytes(data))
            seen["stream"] = _streamer(agent)

        pub.pre_commit_hook = plant
        res = await pub.publish(sd2)
        await eventually(lambda: agent.version == 2, "the agent at v2")
        assert _holds(engine, sd2) and agent.status().streamed_shards == res.shards > 3
        assert seen["stream"] is not None and seen["stream"].failed is None

    await _with_agent(tmp_path, body, verify_deadline=60.0)


async def test_a_damaged_file_after_the_last_shard_before_the_manifest_holds_nothing(
    tmp_path: Path,
) -> None:
    """Every shard applied, a damaged file lands in the next shard's place (a hostile or buggy
    writer) before the manifest: the stream re-reads it (its bytes may not be visible yet),
    but stops as the manifest shows, which does not name it. Before, it re-read it for the
    whole verify deadline (60 s here) with the manifest there, then rolled back every shard
    streamed and the agent applied them all again."""
    sd2 = _state(2)

    async def body(pub: Publisher, agent: ReceiverAgent, engine: LocalCheckpoint) -> None:
        stream = None

        async def plant(vdir: Path) -> None:
            nonlocal stream
            shards = _delta_files(vdir)
            await eventually(
                lambda: (s := _streamer(agent)) is not None and len(s.applied) == len(shards),
                "every shard applied",
            )
            stream = _streamer(agent)  # (taken here: gone once the agent has taken over)
            data = bytearray(shards[0].read_bytes())
            data[-1] ^= 0xFF  # its data no longer matches its header's data checksum
            _land(vdir, vdir / f"delta-{len(shards):05d}.safetensors", bytes(data))
            await asyncio.sleep(0.2)  # the stream reads it, and reads it again

        pub.pre_commit_hook = plant
        res = await pub.publish(sd2)
        await eventually(lambda: agent.version == 2, "the agent at v2 (not after the deadline)")
        assert _holds(engine, sd2) and agent.status().streamed_shards == res.shards > 3
        assert stream is not None and stream.failed is None

    await _with_agent(tmp_path, body, verify_deadline=60.0)


async def test_a_version_whose_manifest_never_comes_is_rolled_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sd1, sd2 = _state(1), _state(2)

    async def body(pub: Publisher, agent: ReceiverAgent, engine: LocalCheckpoint) -> None:
        async def hook(vdir: Path) -> None:
            n = len(_delta_files(vdir))
            await eventually(
                lambda: (s := _streamer(agent)) is not None and len(s.applied) == n,
                "every shard applied",
            )
            assert not _holds(engine, sd1)  # the checkpoint's bytes are patched in place
            raise RuntimeError("the trainer dies before the commit (injected)")

        pub.pre_commit_hook = hook
        with pytest.raises(Exception, match="injected"):
            await pub.publish(sd2)
        # the version directory is gone: the streamed transaction is rolled back
        await eventually(lambda: (s := _streamer(agent)) is not None and not s.txn_open, "abort")
        assert engine.state.version == 1 and _holds(engine, sd1)
        assert read_ack(pub.root, "e1").version == 1  # type: ignore[union-attr]
        assert "is gone and no manifest of it was seen: the publish was abandoned" in caplog.text
        pub.pre_commit_hook = None
        await pub.publish(sd2)  # the retry (another attempt) goes through
        await eventually(lambda: agent.version == 2, "the agent at v2")
        assert _holds(engine, sd2)

    await _with_agent(tmp_path, body)


async def test_a_publish_that_stops_writing_is_rolled_back_after_stream_timeout(
    tmp_path: Path,
) -> None:
    """The trainer stalls after its shards (the directory stays, no manifest): after
    ``stream_timeout`` without a shard the stream gives up and rolls the engine back."""
    sd1, sd2 = _state(1), _state(2)

    async def body(pub: Publisher, agent: ReceiverAgent, engine: LocalCheckpoint) -> None:
        async def hook(vdir: Path) -> None:
            await eventually(
                lambda: (s := _streamer(agent)) is not None and bool(s.failed) and not s.txn_open,
                "the stream to give up and roll back",
            )
            s = _streamer(agent)
            assert s is not None and "abandoned" in (s.failed or "") and not s.txn_open
            assert vdir.is_dir() and engine.state.version == 1 and _holds(engine, sd1)
            raise RuntimeError("the stalled trainer dies (injected)")

        pub.pre_commit_hook = hook
        with pytest.raises(Exception, match="injected"):
            await pub.publish(sd2)
        pub.pre_commit_hook = None
        await pub.publish(sd2)
        await eventually(lambda: agent.version == 2, "the agent at v2")
        assert _holds(engine, sd2)

    await _with_agent(tmp_path, body, stream_timeout=0.5)


async def test_a_shard_applied_for_longer_than_stream_timeout_is_progress(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each group takes longer to apply than ``stream_timeout``: the stream waits for the next
    shard meanwhile (read ahead, the last one has none), which is not a stalled publish."""
    sd2 = _state(2)

    async def body(pub: Publisher, agent: ReceiverAgent, engine: LocalCheckpoint) -> None:
        real_apply = engine.apply

        async def slow_apply(updates: Any) -> None:
            await asyncio.sleep(0.8)
            await real_apply(updates)

        monkeypatch.setattr(engine, "apply", slow_apply)

        async def hook(vdir: Path) -> None:
            n = len(_delta_files(vdir))
            await eventually(
                lambda: (s := _streamer(agent)) is not None and len(s.applied) == n,
                "every shard applied before the manifest",
                timeout=120,
            )

        pub.pre_commit_hook = hook
        res = await pub.publish(sd2)
        await eventually(lambda: agent.version == 2, "the agent at v2", timeout=60)
        assert _holds(engine, sd2) and agent.status().streamed_shards == res.shards

    await _with_agent(tmp_path, body, stream_timeout=0.5)


async def test_cancelling_the_agent_while_it_takes_the_stream_over_stops_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by attack (helper-20): ``agent.run`` cancelled while its sync waits in
    ``StreamApplier.take`` for the shard being applied. ``finish`` swallowed the cancel (it
    passes to the stream task, which rolled back), the sync went on, applied and acked the
    version, and the agent kept running."""
    root, ck = tmp_path / "root", tmp_path / "ck"
    engine = LocalCheckpoint(ck)
    agent = ReceiverAgent(root, engine, "e1", use_inotify=False, poll_interval=0.02)
    async with Publisher(
        root, bucket_bytes=SMALL, delta_shard_bytes=SMALL, keyframe_interval=0
    ) as pub:
        await pub.seed(_state(0))
        await pub.publish(_state(1))
        async with agent:
            run = asyncio.create_task(agent.run())
            await eventually(lambda: agent.version == 1, "the agent at v1")
            gate, entered, in_take = asyncio.Event(), asyncio.Event(), asyncio.Event()
            calls = [0]
            real_apply, real_take = engine.apply, StreamApplier.take

            async def held(updates: Any) -> None:
                calls[0] += 1
                if calls[0] == 3:  # a group of a later shard
                    entered.set()
                    await gate.wait()
                await real_apply(updates)

            async def take(self: StreamApplier, *args: Any) -> Any:
                in_take.set()
                return await real_take(self, *args)

            monkeypatch.setattr(engine, "apply", held)
            monkeypatch.setattr(StreamApplier, "take", take)
            publishing = asyncio.create_task(pub.publish(_state(2)))
            await asyncio.wait_for(entered.wait(), 10)
            await publishing  # the manifest is there: the sync takes the stream over
            await asyncio.wait_for(in_take.wait(), 10)
            run.cancel()
            await asyncio.sleep(0.05)
            gate.set()
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(run, 10)
            assert engine.state.version == 1 and _holds(engine, _state(1))
            assert read_ack(root, "e1").version == 1  # type: ignore[union-attr]


async def test_an_agent_stopped_while_the_stream_begins_leaves_no_transaction(
    tmp_path: Path,
) -> None:
    """Found by attack (helper-20): the agent stopped while the stream's ``engine.begin`` ran
    in its thread; the cancel landed before the stream knew it had a transaction, so nothing
    aborted it and the same engine refused every later version ("begin v2 while v2 is in
    progress") until closed."""
    root, ck = tmp_path / "root", tmp_path / "ck"
    engine = LocalCheckpoint(ck)
    agent = ReceiverAgent(root, engine, "e1", use_inotify=False, poll_interval=0.02)
    sds = [_state(i) for i in range(4)]
    async with Publisher(
        root, bucket_bytes=SMALL, delta_shard_bytes=SMALL, keyframe_interval=0
    ) as pub:
        await pub.seed(sds[0])
        await pub.publish(sds[1])
        async with agent:
            stop = asyncio.Event()
            run = asyncio.create_task(agent.run(stop=stop))
            await eventually(lambda: agent.version == 1, "the agent at v1")
            entered, begun = asyncio.Event(), asyncio.Event()
            loop = asyncio.get_running_loop()
            real_begin = engine._begin

            def slow_begin(m: Any, mode: Any) -> None:  # a slow fsync of the state, say
                loop.call_soon_threadsafe(entered.set)
                time.sleep(0.5)
                try:
                    real_begin(m, mode)
                finally:
                    loop.call_soon_threadsafe(begun.set)

            engine._begin = slow_begin  # type: ignore[method-assign]

            async def hook(vdir: Path) -> None:
                await asyncio.wait_for(entered.wait(), 10)
                stop.set()
                await run
                await asyncio.wait_for(begun.wait(), 10)  # the begin's thread has finished

            pub.pre_commit_hook = hook
            await pub.publish(sds[2])
            engine._begin = real_begin  # type: ignore[method-assign]
            assert engine._txn is None and engine.state.version == 1 and _holds(engine, sds[1])
            stop = asyncio.Event()
            run = asyncio.create_task(agent.run(stop=stop))
            pub.pre_commit_hook = None
            await pub.publish(sds[3])
            await eventually(lambda: agent.version == 3, "the agent at v3")
            assert _holds(engine, sds[3])
            stop.set()
            await run


async def test_a_mismatching_manifest_sends_the_version_down_the_ordinary_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sd2 = _state(2)
    monkeypatch.setattr(StreamApplier, "mismatch", lambda self, m: "injected")

    async def body(pub: Publisher, agent: ReceiverAgent, engine: LocalCheckpoint) -> None:
        async def hook(vdir: Path) -> None:
            await eventually(
                lambda: (s := _streamer(agent)) is not None and len(s.applied) >= 1,
                "a shard applied early",
            )

        pub.pre_commit_hook = hook
        await pub.publish(sd2)
        await eventually(lambda: agent.version == 2, "the agent at v2")
        assert _holds(engine, sd2) and agent.status().streamed_shards == 0

    await _with_agent(tmp_path, body)


@pytest.mark.parametrize(("forced", "expected"), [("1", False), ("", True)])
def test_a_stream_built_without_use_inotify_follows_force_polling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, forced: str, expected: bool
) -> None:
    """Left out, ``use_inotify`` is what the agent's is (ASYNCSYNC_FORCE_POLLING): a stream
    built directly took inotify whatever the operator had said (attack-109's leftover)."""

    async def run() -> None:
        root = tmp_path / "root"
        async with Publisher(root) as pub:
            await pub.seed(_state(0))
        monkeypatch.setenv("ASYNCSYNC_FORCE_POLLING", forced)
        engine = LocalCheckpoint(tmp_path / "ck")
        base = read_manifest(root, 0)
        s = StreamApplier(root, engine, base, on_manifest=asyncio.Event(), group_bytes=1 << 20)
        assert s.use_inotify is expected
        pinned = StreamApplier(
            root, engine, base, on_manifest=asyncio.Event(), group_bytes=1 << 20,
            use_inotify=not expected,
        )  # fmt: skip
        assert pinned.use_inotify is (not expected)

    asyncio.run(run())


def test_mismatch_names_what_differs(tmp_path: Path) -> None:
    """StreamApplier.mismatch compares files, sizes, checksums and entries with the manifest."""

    async def run() -> None:
        root, ck = tmp_path / "root", tmp_path / "ck"
        async with Publisher(root, bucket_bytes=SMALL, delta_shard_bytes=SMALL) as pub:
            await pub.seed(_state(0))
            await pub.publish(_state(1))
            await pub.publish(_state(2))
        base, m = read_manifest(root, 1), read_manifest(root, 2)
        engine = LocalCheckpoint(ck)
        s = StreamApplier(root, engine, base, on_manifest=asyncio.Event(), group_bytes=1 << 20)
        from receiver.stream import AppliedShard

        for k, path in enumerate(_delta_files(version_dir(root, 2))):
            data = path.read_bytes()
            hdr = stream_header(data, where=str(path))
            assert hdr is not None and hdr.shard_index == k
            info = m.shards[k]
            s.applied.append(AppliedShard(path.name, len(data), info.checksum, hdr))
            s._names.update(e.name for e in hdr.entries)
        assert s.mismatch(m) is None
        bad = dataclasses.replace(m.shards[0], checksum="0" * 32)
        assert "checksum" in (s.mismatch(dataclasses.replace(m, shards=(bad, *m.shards[1:]))) or "")
        e0 = s.applied[0].header.entries[0]
        forged = dataclasses.replace(e0, checksum="f" * 32)
        hdr0 = dataclasses.replace(s.applied[0].header, entries=(forged,))
        s.applied[0] = dataclasses.replace(s.applied[0], header=hdr0)
        assert "differs" in (s.mismatch(m) or "")
        assert isinstance(forged, StreamEntry)

    asyncio.run(run())


def test_malformed_streaming_metadata_is_refused() -> None:
    from asyncsync.codec.shards import delta_shard_blob

    meta = {"asyncsync.format_version": "3", "asyncsync.entries": "not json"}
    blob = delta_shard_blob({"t0.pos": b"x"}, version=2, run_id="r", stream=meta)
    with pytest.raises(FormatError, match="malformed streaming metadata"):
        stream_header(blob, where="s")
    assert stream_header(delta_shard_blob({}, version=2, run_id="r"), where="s") is None


async def test_a_format_2_root_is_applied_after_its_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shards without streaming metadata and manifests saying format_version 2 (as today's
    roots hold): the agent reads them as before, applying nothing early."""
    import asyncsync.publish.publisher as publisher_mod

    real = publisher_mod.build_manifest
    monkeypatch.setattr(
        publisher_mod,
        "build_manifest",
        lambda **kw: dataclasses.replace(real(**kw), format_version=2),
    )
    sd2 = _state(2)

    async def body(pub: Publisher, agent: ReceiverAgent, engine: LocalCheckpoint) -> None:
        pub._base.fingerprint = ""  # what a format-2 writer does: no self-describing shards
        res = await pub.publish(sd2)
        assert json.loads((res.path / "manifest.json").read_text())["format_version"] == 2
        assert stream_header(_delta_files(res.path)[0].read_bytes(), where="s") is None
        await eventually(lambda: agent.version == 2, "the agent at v2")
        assert _holds(engine, sd2) and agent.status().streamed_shards == 0

    await _with_agent(tmp_path, body)


async def test_a_keyframe_confirms_the_delta_shards_streamed_before_it(tmp_path: Path) -> None:
    """A keyframe carries its delta too: an engine at N-1 streams the delta shards and the
    keyframe's manifest confirms them (the full shards are never read)."""
    sd2 = _state(2)

    async def body(pub: Publisher, agent: ReceiverAgent, engine: LocalCheckpoint) -> None:
        async def hook(vdir: Path) -> None:
            n = len(_delta_files(vdir))
            await eventually(
                lambda: (s := _streamer(agent)) is not None and len(s.applied) == n,
                "every delta shard applied before the manifest",
            )

        pub.pre_commit_hook = hook
        res = await pub.publish(sd2, keyframe=True)
        assert res.kind == "full"
        await eventually(lambda: agent.version == 2, "the agent at v2")
        assert _holds(engine, sd2) and agent.status().streamed_shards == len(_delta_files(res.path))

    await _with_agent(tmp_path, body)


@pytest.mark.parametrize("damage", ["manifest", "zeros"])
async def test_a_stream_that_ends_without_a_valid_manifest_is_rolled_back(
    tmp_path: Path, damage: str
) -> None:
    """Found by attacking it (helper-19): the shards of v2 applied early, then either a
    manifest that does not read appears (the stream ends at the sight of the name, the sync
    refuses it), or a shard lands as zeros (a network filesystem shows a renamed file before
    its bytes) and the publisher is gone. The transaction stayed open for good: the
    checkpoint held part of v2 while the agent reported and acked v1. Now the agent rolls it
    back once the manifest is refused, and the stream gives up on a shard that does not become
    a complete self-describing one in time."""
    root = tmp_path / "root"
    (shards,) = await _attempts(tmp_path, root, "aside")
    assert len(shards) >= 2
    vdir = version_dir(root, 2)
    engine, agent = _agent(tmp_path, verify_deadline=0.5)
    async with running(agent, 1):
        vdir.mkdir()  # what the dead publisher left, and then what lands in it
        early = shards if damage == "manifest" else shards[:1]
        for src in early:
            _land(vdir, src)
        await eventually(
            lambda: (s := _streamer(agent)) is not None and len(s.applied) == len(early),
            "the landed shards applied early",
        )
        assert not _holds(engine, _state(1))  # patched in place, not served
        if damage == "manifest":
            _land(vdir, shards[0].with_name("manifest.json"), b'{"format": "asyncsync", "tru')
        else:
            _land(vdir, shards[1], bytes(shards[1].stat().st_size))
        state = engine.directory / ".asyncsync" / "state.json"
        await eventually(lambda: json.loads(state.read_text())["status"] == "clean", "the rollback")
        assert engine.state.version == 1 and _holds(engine, _state(1))
        assert read_ack(root, "e1").version == 1  # type: ignore[union-attr]


@pytest.mark.skipif(not inotify.available(), reason="no inotify here")
async def test_the_streams_watch_is_closed_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a timeline of the bench (the loop's slow callbacks): closing an inotify
    instance waits in the kernel for a grace period, 5-22 ms with both cores busy; the stream
    closed its watch of each version directory on the event loop, in the version's tail, with
    the engine's last groups, the commit and the ack waiting behind it. A close made slow here
    (1 s) must not hold the loop, and every watch is still closed."""
    closes: list[float] = []
    real = inotify._close_quietly

    def slow_close(fd: int) -> None:
        time.sleep(1.0)
        real(fd)
        closes.append(time.monotonic())

    monkeypatch.setattr(inotify, "_close_quietly", slow_close)
    gaps: list[float] = []

    async def tick() -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.01)
            gaps.append(time.monotonic() - last)
            last = time.monotonic()

    async def body(pub: Publisher, agent: ReceiverAgent, engine: LocalCheckpoint) -> None:
        pub.pre_commit_hook = partial(_stream_begun, agent)  # streamed on a loaded host too
        ticker = asyncio.create_task(tick())
        try:
            for v in (2, 3):
                res = await pub.publish(_state(v))
                assert res.shards > 1
                await eventually(partial(_at, agent, v), f"the agent at v{v}")
                assert agent.status().streamed_shards > 0
            await eventually(lambda: len(closes) >= 2, "the streams' watches closed")
        finally:
            ticker.cancel()
        assert _holds(engine, _state(3))

    await _with_agent(tmp_path, body, use_inotify=True)
    assert max(gaps) < 0.6, f"the loop was held {max(gaps):.2f}s"


def test_the_stream_waits_as_long_as_the_agent_for_a_shard_to_verify() -> None:
    """One default for how long a shard that does not verify yet is read again, whether the
    agent reads it or the stream does: the stream kept a 10.0 of its own."""
    from receiver.agent import VERIFY_DEADLINE

    defaults = StreamApplier.__init__.__kwdefaults__
    assert defaults is not None and defaults["verify_deadline"] is VERIFY_DEADLINE


async def test_a_streamed_version_retention_removed_is_not_called_abandoned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A receiver behind: v2's shards were streamed, then v2 committed, v3 committed and
    retention removed v2 before the stream looked again. The stream rolls back (the agent
    applies what is committed); its log line said "v2 ... was removed before its manifest",
    untrue: it was committed. Found by attack-50 (the line named only the abandoned case)."""
    from asyncsync.publish.retention import RetentionPolicy

    root = tmp_path / "root"
    async with _at_v1(tmp_path, open_engine=False) as (pub, engine):
        ack = ack_path(root, "e1")
        os.utime(ack, (ack.stat().st_atime, ack.stat().st_mtime - 7200))  # acked 2 h ago
        await engine.open()
        applying, gate = asyncio.Event(), asyncio.Event()
        real_apply = engine.apply

        async def held_apply(updates: Any) -> None:  # the stream's first apply waits for the
            if not applying.is_set():  # test; meanwhile its reader, one shard ahead, waits too
                applying.set()
                await gate.wait()
            await real_apply(updates)

        monkeypatch.setattr(engine, "apply", held_apply)
        stream = StreamApplier(
            root, engine, read_manifest(root, 1), on_manifest=asyncio.Event(), group_bytes=1 << 20
        )

        async def hook(vdir: Path) -> None:
            assert len(_delta_files(vdir)) > 1  # shard 1 is read ahead while shard 0 applies
            await eventually(lambda: applying.is_set() and len(stream._names) > 0, "shard 0")

        task = asyncio.create_task(stream.run())
        pub.pre_commit_hook = hook
        await pub.publish(_state(2))  # committed while the stream is held
        pub.pre_commit_hook = None
        pub.retention = RetentionPolicy(keep_versions=1, ack_ttl=3600)
        await pub.publish(_state(3), keyframe=True)  # and removed by retention
        assert not version_dir(root, 2).exists()
        with caplog.at_level("WARNING", logger="receiver.stream"):
            gate.set()
            await task
        await engine.close()
    assert stream.failed and not stream.txn_open and engine.state.version == 1
    assert _holds(engine, _state(1))
    line = next(r.getMessage() for r in caplog.records if "stopped" in r.getMessage())
    assert "v2 was committed" in line and "retention" in line and "abandoned" not in line, line


async def test_a_version_abandoned_then_written_again_is_streamed_again(tmp_path: Path) -> None:
    """v2's stream is rolled back when the trainer's failed publish removes v2; the retry
    writes v2 again (another attempt). Its shards are applied before its manifest again (the
    stream of v2 was never started again: v2 was applied only after its manifest), and still
    nothing is served or acked before the manifest."""
    sd1, sd2 = _state(1), _state(2)

    async def body(pub: Publisher, agent: ReceiverAgent, engine: LocalCheckpoint) -> None:
        async def die(vdir: Path) -> None:
            n = len(_delta_files(vdir))
            await eventually(
                lambda: (s := _streamer(agent)) is not None and len(s.applied) == n,
                "every shard applied",
            )
            raise RuntimeError("the trainer dies before the commit (injected)")

        pub.pre_commit_hook = die
        with pytest.raises(Exception, match="injected"):
            await pub.publish(sd2)
        first = _streamer(agent)
        assert first is not None
        await eventually(lambda: bool(first.failed) and not first.txn_open, "the rollback")
        assert _holds(engine, sd1)
        seen: dict[str, Any] = {}

        def again() -> bool:
            s = _streamer(agent)
            return s is not None and s is not first and s.txn_open and len(s.applied) == seen["n"]

        async def hook(vdir: Path) -> None:
            seen["n"] = len(_delta_files(vdir))
            await eventually(again, "the retry's shards applied before its manifest")
            seen["held"], seen["ack"] = engine.state.version, read_ack(pub.root, "e1")

        pub.pre_commit_hook = hook
        await pub.publish(sd2)
        await eventually(lambda: agent.version == 2, "the agent at v2")
        assert _holds(engine, sd2)
        assert seen["held"] == 1 and seen["ack"].version == 1  # not served nor acked before
        assert agent.status().streamed_shards == seen["n"] > 1

    await _with_agent(tmp_path, body)


async def test_a_stream_stopped_by_another_attempt_streams_that_attempt(tmp_path: Path) -> None:
    """v2's stream applied shard 0 of attempt A; shard 1 of attempt B lands (another trainer's
    try): the stream rolls back. Then B's shard 0 is in place (another file than the one read):
    the stream starts again and applies B's shards before any manifest. The same files never
    start it again (a stream that failed on them would fail again, rolling back each time)."""
    root = tmp_path / "root"
    vdir = version_dir(root, 2)
    a, b = await _attempts(tmp_path, root, "a", "b")
    assert len(a) > 1 and len(b) > 1
    engine, agent = _agent(tmp_path)
    async with running(agent, 1):
        first = await _first_shard_streamed(agent, vdir, a[0])
        _land(vdir, b[1])
        await eventually(lambda: bool(first.failed) and not first.txn_open, "the rollback")
        assert "another publish attempt" in (first.failed or "")
        await _not_streamed_again(agent, first)
        _land(vdir, b[0])
        for p in b[2:]:
            _land(vdir, p)
        await eventually(
            lambda: (s := _streamer(agent)) is not None and s is not first and s.txn_open
            and len(s.applied) == len(b), "B's shards applied",
        )  # fmt: skip
        assert engine.state.version == 1 and read_ack(root, "e1").version == 1  # type: ignore[union-attr]
    assert engine.state.version == 1 and _holds(engine, _state(1))  # rolled back at the stop


async def test_a_version_directory_briefly_gone_is_streamed_again(tmp_path: Path) -> None:
    """v2's directory goes for a moment while its shards are streamed (a mount's cache; here
    renamed away and back, the same files): the stream rolls back, then streams the same shards
    again once the directory shows again, and the manifest confirms them."""
    sd2 = _state(2)

    async def body(pub: Publisher, agent: ReceiverAgent, engine: LocalCheckpoint) -> None:
        seen: dict[str, Any] = {}

        async def hook(vdir: Path) -> None:
            n = len(_delta_files(vdir))
            await eventually(
                lambda: (s := _streamer(agent)) is not None and len(s.applied) == n, "streamed"
            )
            first = _streamer(agent)
            assert first is not None
            vdir.rename(tmp_path / "away")
            await eventually(lambda: bool(first.failed) and not first.txn_open, "the rollback")
            assert first.gone and "abandoned" in (first.failed or "")
            (tmp_path / "away").rename(vdir)
            await eventually(
                lambda: (s := _streamer(agent)) is not None and s is not first and s.txn_open
                and len(s.applied) == n, "the same shards streamed again",
            )  # fmt: skip
            seen["n"], seen["held"] = n, engine.state.version

        pub.pre_commit_hook = hook
        await pub.publish(sd2)
        await eventually(lambda: agent.version == 2, "the agent at v2")
        assert _holds(engine, sd2) and seen["held"] == 1
        assert agent.status().streamed_shards == seen["n"] > 1

    await _with_agent(tmp_path, body)


async def _attempts(tmp_path: Path, root: Path, *names: str) -> list[list[Path]]:
    """Publish v0, v1, then for each of ``names`` an attempt at v2 (each of other bytes) that
    dies before its commit, its shards kept aside in ``tmp_path / name`` (the publisher
    removes v2): returns each attempt's shards, to be landed one by one."""
    import shutil

    async with Publisher(
        root, bucket_bytes=SMALL, delta_shard_bytes=SMALL, keyframe_interval=0
    ) as pub:
        await pub.seed(_state(0))
        await pub.publish(_state(1))
        for i, name in enumerate(names):

            async def die(vdir: Path, aside: Path = tmp_path / name) -> None:
                shutil.copytree(vdir, aside)  # the shards are durable: keep them, then die
                raise RuntimeError("the trainer dies before the commit (injected)")

            pub.pre_commit_hook = die
            with pytest.raises(Exception, match="injected"):
                await pub.publish(_state(2 + i))
    return [sorted((tmp_path / name).glob("delta-*.safetensors")) for name in names]


def _land(vdir: Path, src: Path, data: bytes | None = None) -> None:
    """Put ``data`` (by default ``src``'s bytes) in ``vdir`` under ``src``'s name, atomically."""
    tmp = vdir / f".{src.name}.tmp"
    tmp.write_bytes(src.read_bytes() if data is None else data)
    tmp.rename(vdir / src.name)


async def _first_shard_streamed(agent: ReceiverAgent, vdir: Path, shard: Path) -> StreamApplier:
    """Make v2's directory ``vdir`` and land ``shard`` in it: returns the stream applying it."""
    vdir.mkdir()
    _land(vdir, shard)
    await eventually(lambda: (s := _streamer(agent)) is not None and len(s.applied) == 1,
                     f"{shard.name} applied")  # fmt: skip
    first = _streamer(agent)
    assert first is not None
    return first


async def _not_streamed_again(agent: ReceiverAgent, first: StreamApplier) -> None:
    """Wake-ups with the same files (the agent polls every 0.02 s): no stream starts again."""
    for _ in range(5):
        await asyncio.sleep(0.05)
        assert _streamer(agent) is first


async def test_a_stream_stalled_past_stream_timeout_is_streamed_again_once_it_goes_on(
    tmp_path: Path,
) -> None:
    """v2's publisher stalls after its first shard (a slow mount) for longer than
    ``stream_timeout``: the stream rolls back. Then the next shard lands (the publisher went
    on, the same attempt): the version was applied only after its manifest; it is streamed
    again now, on the same files. With no new shard, the same files never start it again."""
    root = tmp_path / "root"
    (a,) = await _attempts(tmp_path, root, "aside")
    assert len(a) > 2
    vdir = version_dir(root, 2)
    engine, agent = _agent(tmp_path, stream_timeout=0.5)
    async with running(agent, 1):
        first = await _first_shard_streamed(agent, vdir, a[0])
        await eventually(lambda: bool(first.failed) and not first.txn_open, "the rollback")
        assert "abandoned" in (first.failed or "")
        await _not_streamed_again(agent, first)
        for p in a[1:]:
            _land(vdir, p)
        await eventually(
            lambda: (s := _streamer(agent)) is not None and s is not first
            and len(s.applied) == len(a), "the same shards streamed again",
        )  # fmt: skip
        assert engine.state.version == 1
    assert engine.state.version == 1 and _holds(engine, _state(1))  # rolled back at the stop


async def test_a_stream_wakes_as_its_shard_lands_not_at_its_next_poll(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stream's reader waits for the next shard on the version directory's inotify events
    where they work (this host's writes), polling as well (other hosts'): with a poll of 60 s,
    shard 0, written while the reader sleeps, is still read and applied as it lands. Polling
    alone, a shard was seen up to ~20 ms late at the bench's sizes (the poll backed off while
    the publisher diffed the next bucket)."""
    import threading

    from asyncsync.publish.writer import VersionWriter
    from receiver import inotify

    root = tmp_path / "root"
    async with _at_v1(tmp_path) as (pub, engine):
        gate, napping = threading.Event(), asyncio.Event()
        real_write, real_nap = VersionWriter._write_shard, inotify.nap

        def held_write(self: VersionWriter, *a: Any, **kw: Any) -> int:
            assert gate.wait(30), "the shards were never let through"
            return real_write(self, *a, **kw)

        async def nap(watch: Any, seconds: float, stop: asyncio.Event, *a: Any) -> None:
            assert watch is not None and seconds >= 60  # (inotify works here, on local disk)
            napping.set()
            await real_nap(watch, seconds, stop, *a)

        monkeypatch.setattr(VersionWriter, "_write_shard", held_write)
        monkeypatch.setattr(inotify, "nap", nap)
        publishing = asyncio.create_task(pub.publish(_state(2)))
        await eventually(lambda: version_dir(root, 2).is_dir(), "v2's directory")
        stream = StreamApplier(
            root, engine, read_manifest(root, 1), on_manifest=asyncio.Event(),
            group_bytes=1 << 20, interval=60.0,
        )  # fmt: skip
        streaming = asyncio.create_task(stream.run())
        try:
            await eventually(napping.is_set, "the reader asleep, no shard there yet")
            assert not _delta_files(version_dir(root, 2))
            gate.set()
            await eventually(lambda: len(stream.applied) >= 1, "shard 0 applied as it landed")
            await publishing  # (the reader returns at the manifest: the shards it had not
            # read by then are the agent's, so not every one need be applied here)
            await eventually(stream.on_manifest.is_set, "the manifest seen as it landed")
        finally:
            gate.set()
            await stream.abandon(streaming, "the test is over")
            await engine.close()
    assert stream.applied and engine.state.version == 1


async def test_a_streamed_version_parses_each_manifest_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stream checks its shards against the base, the version the agent just applied:
    read through the agent's manifest cache, not parsed again (~10 us per tensor: ~1 s per
    version at 100,000 tensors). One parse per version, that of its own manifest."""
    from asyncsync.format.manifest import Manifest

    parsed: list[int] = []
    real = Manifest._from_json.__func__  # type: ignore[attr-defined]

    def counted(cls: type[Manifest], text: str | bytes, where: str) -> Manifest:
        m = real(cls, text, where)
        parsed.append(m.version)
        return m

    async def body(pub: Publisher, agent: ReceiverAgent, engine: LocalCheckpoint) -> None:
        monkeypatch.setattr(Manifest, "_from_json", classmethod(counted))
        for i in (2, 3, 4):
            await pub.publish(_state(i))
            await eventually(lambda: agent.version == i, f"the agent at v{i}")  # noqa: B023
        assert agent.status().streamed_shards > 0
        assert sorted(parsed) == [2, 3, 4], parsed

    await _with_agent(tmp_path, body)


async def test_a_flood_of_other_files_in_the_version_directory_does_not_wake_the_reader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by attack (attack-109): the reader woke on an event naming any entry of the version
    directory but a hidden one, so a process creating, writing or renaming other files there
    (other ranks' shards, a full shard, a hostile writer) woke it at each event: ~65% of a core
    while a loop appended to a junk file, 1% polling. It wakes only for the entry it waits for
    (the next shard, the manifest) and for entries arriving (not each write), polling as before."""
    from receiver import inotify

    root = tmp_path / "root"
    async with _at_v1(tmp_path) as (_, engine):
        pass
    vdir = version_dir(root, 2)
    vdir.mkdir()
    fds: list[int] = []
    woken: list[str] = []
    real_nap = inotify.nap

    async def nap(watch: Any, seconds: float, stop: asyncio.Event, *a: Any) -> None:
        assert watch is not None  # (inotify works here, on local disk)
        fds.append(watch.fd)
        await real_nap(watch, 3600, stop, *a)  # no poll: only an event wakes it
        woken.append("stop" if stop.is_set() else "event")

    monkeypatch.setattr(inotify, "nap", nap)
    stream = StreamApplier(
        root, engine, read_manifest(root, 1), on_manifest=asyncio.Event(), group_bytes=1 << 20
    )
    streaming = asyncio.create_task(stream.run())
    try:
        await eventually(lambda: fds, "the reader asleep, no shard there yet")
        for i in range(20):  # (at once: read together, not FUTILE_READS reads)
            junk = vdir / f"r0001-a-delta-{i:05d}.safetensors"
            junk.write_bytes(b"x")
            junk.rename(vdir / f"full-{i:05d}.safetensors")
        await eventually(lambda: _queued_bytes(fds[-1]) == 0, "the events read")
        with (vdir / "junk").open("ab") as f:  # written in a loop: no arrival, no event
            await eventually(lambda: _queued_bytes(fds[-1]) == 0, "its creation read")
            for _ in range(100):
                f.write(b"x")
                f.flush()
                assert _queued_bytes(fds[-1]) == 0
        await asyncio.sleep(0)
        assert woken == []  # the events were read and dropped
        (vdir / "delta-00000.safetensors").mkdir()  # the name it waits for (not a file: no shard)
        await eventually(lambda: woken == ["event"], "the reader woken by its shard's name")
    finally:
        await stream.abandon(streaming, "the test is over")
        await engine.close()


async def test_a_version_directory_made_again_while_the_reader_waits_is_watched_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by attack (attack-109): the watch was of the directory the reader started on; a
    publish attempt that failed before its first shard removed it and the next made it again,
    and the new one's shards were seen by polls alone (the watch of the old one dead). The
    reader watches the directory its path names again after the old one went."""
    from receiver import inotify

    async with _at_v1(tmp_path) as (_, engine):
        pass
    vdir = version_dir(tmp_path / "root", 2)
    vdir.mkdir()
    naps: list[float] = []
    woken: list[str] = []
    real_nap = inotify.nap

    async def nap(watch: Any, seconds: float, stop: asyncio.Event, *a: Any) -> None:
        naps.append(seconds)
        await real_nap(watch, 3600, stop, *a)  # no poll: only an event wakes it
        woken.append("stop" if stop.is_set() else "event")

    monkeypatch.setattr(inotify, "nap", nap)
    stream = StreamApplier(
        tmp_path / "root", engine, read_manifest(tmp_path / "root", 1),
        on_manifest=asyncio.Event(), group_bytes=1 << 20,
    )  # fmt: skip
    streaming = asyncio.create_task(stream.run())
    try:
        await eventually(lambda: naps, "the reader asleep, no shard there yet")
        vdir.rmdir()
        vdir.mkdir()  # another attempt's, before the reader saw the first go
        await eventually(lambda: woken == ["event"], "the reader woken by the directory gone")
        (vdir / "delta-00000.safetensors").mkdir()  # (not a file: no shard)
        await eventually(lambda: woken == ["event"] * 2, "the reader woken in the new one")
    finally:
        await stream.abandon(streaming, "the test is over")
        await engine.close()


@contextlib.asynccontextmanager
async def _at_v1(
    tmp: Path, *, open_engine: bool = True
) -> AsyncIterator[tuple[Publisher, LocalCheckpoint]]:
    """A publisher of ``tmp/root`` at v1 (seeded, one delta) and a checkpoint ``tmp/ck``
    synced to it by an agent closed again (no run(): nothing takes a stream of v2 over),
    the checkpoint open again unless ``open_engine`` is false."""
    engine = LocalCheckpoint(tmp / "ck")
    async with Publisher(
        tmp / "root", bucket_bytes=SMALL, delta_shard_bytes=SMALL, keyframe_interval=0
    ) as pub:
        await pub.seed(_state(0))
        await pub.publish(_state(1))
        async with ReceiverAgent(pub.root, engine, "e1", use_inotify=False) as agent:
            assert await agent.sync_once() == 1
        if open_engine:
            await engine.open()
        yield pub, engine


def _queued_bytes(fd: int) -> int:
    """Bytes of events waiting on an inotify descriptor (FIONREAD)."""
    import array
    import fcntl
    import termios

    buf = array.array("i", [0])
    fcntl.ioctl(fd, termios.FIONREAD, buf, True)
    return int(buf[0])
