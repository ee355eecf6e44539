"""The streaming apply's own pipeline (receiver/stream.py): the checks and the decode of shard
k+1 run while the engine applies shard k, with at most one decoded group waiting for the
engine; a check of k+1 failing meanwhile, or the stream cancelled between k+1's decode and its
apply, leaves nothing of k+1 applied and rolls the engine back only after k's apply returned.

Each test records, in one list, what the stream does in order (a decode's start and end, in
its thread; an ``engine.apply`` called and returned; ``engine.abort``) and holds shard 0's
apply on an event: the order is what the events show, never a sleep."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

import receiver.stream as stream_mod
from asyncsync import Publisher
from asyncsync.errors import ApplyFailed, FormatError
from receiver import ReceiverAgent
from receiver.engines.checkpoint import LocalCheckpoint
from receiver.stream import StreamApplier
from tests.conftest import eventually
from tests.test_stream import SMALL, _delta_files, _holds, _state, _streamer

ONE_GROUP = 1 << 30  # apply group bytes: each (small) shard is one group
DEADLINE = 10.0  # a held apply waits this long at most for what it waits for (then the test fails)

Log = list[tuple[str, int]]


class Recorder:
    """Records the stream's decodes and the engine's applies and aborts (shard index of each,
    from the shard file's name the decode is given), and holds shard 0's apply until
    ``release`` is set."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, engine: LocalCheckpoint) -> None:
        self.log: Log = []
        self.loop = asyncio.get_running_loop()
        self.shard_of: dict[str, int] = {}
        self.decoding: dict[int, asyncio.Event] = {}  # a decode of shard k has started
        self.decoded: dict[int, asyncio.Event] = {}  # ... and ended
        self.release = asyncio.Event()
        self.held = asyncio.Event()  # shard 0's apply is being held
        real_decode, real_apply, real_abort = stream_mod.decode_pieces, engine.apply, engine.abort

        def decode(m: Any, mode: Any, tensors: Any, group: Any, where: str) -> Any:
            k = int(Path(where).name.split("-")[1].split(".")[0])
            for entry, _part, _ref in group:
                self.shard_of[entry.name] = k
            self.log.append(("decode", k))
            self._set(self.decoding, k)
            try:
                return real_decode(m, mode, tensors, group, where)
            finally:
                self.log.append(("decoded", k))
                self._set(self.decoded, k)

        def apply(updates: Any) -> Awaitable[None]:  # logged when called, not when first run
            k = self.shard_of.get(updates[0].entry.name, -1)
            self.log.append(("apply", k))

            async def go() -> None:
                if k == 0 and not self.held.is_set():
                    self.held.set()
                    await asyncio.wait_for(self.release.wait(), DEADLINE)
                await real_apply(updates)
                self.log.append(("applied", k))

            return go()

        async def abort() -> None:
            self.log.append(("abort", -1))
            await real_abort()

        monkeypatch.setattr(stream_mod, "decode_pieces", decode)
        monkeypatch.setattr(engine, "apply", apply)
        monkeypatch.setattr(engine, "abort", abort)

    def _set(self, events: dict[int, asyncio.Event], k: int) -> None:
        def go() -> None:
            events.setdefault(k, asyncio.Event()).set()

        self.loop.call_soon_threadsafe(go)

    async def wait(self, events: dict[int, asyncio.Event], k: int) -> None:
        await asyncio.wait_for(events.setdefault(k, asyncio.Event()).wait(), DEADLINE)

    def at(self, what: str, k: int) -> int:
        return self.log.index((what, k))


async def _publish_into_running_agent(
    tmp: Path,
    body: Callable[[Publisher, ReceiverAgent, LocalCheckpoint, asyncio.Event], Awaitable[None]],
) -> None:
    """v0 and v1 published and held by an agent (one apply group a shard); ``body`` then runs
    with the agent's run task going until the event it is given is set."""
    engine = LocalCheckpoint(tmp / "ck")
    agent = ReceiverAgent(
        tmp / "root", engine, "e1", use_inotify=False, poll_interval=0.02,
        apply_group_bytes=ONE_GROUP,
    )  # fmt: skip
    async with Publisher(
        tmp / "root", bucket_bytes=SMALL, delta_shard_bytes=SMALL, keyframe_interval=0
    ) as pub:
        await pub.seed(_state(0))
        await pub.publish(_state(1))
        async with agent:
            stop = asyncio.Event()
            run = asyncio.create_task(agent.run(stop=stop))
            try:
                await eventually(lambda: agent.version == 1, "the agent at v1")
                await body(pub, agent, engine, stop)
            finally:
                stop.set()
                await run


async def test_shard_1_is_decoded_while_the_engine_applies_shard_0(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shard 0's apply is held until shard 1's decode has started (so its checks have passed):
    it starts, and the version is then applied early and committed as usual. Every decode
    starts with no decoded group waiting for the engine: at most one waits, as in the agent."""
    sd2 = _state(2)

    async def body(
        pub: Publisher, agent: ReceiverAgent, engine: LocalCheckpoint, stop: asyncio.Event
    ) -> None:
        rec = Recorder(monkeypatch, engine)

        async def hook(vdir: Path) -> None:  # every shard written, the manifest not yet
            n = len(_delta_files(vdir))
            assert n > 2
            await rec.wait(rec.decoding, 1)
            assert rec.held.is_set() and ("applied", 0) not in rec.log
            rec.release.set()
            await eventually(
                lambda: (s := _streamer(agent)) is not None and len(s.applied) == n,
                "every shard applied before the manifest",
            )

        pub.pre_commit_hook = hook
        res = await pub.publish(sd2)
        await eventually(lambda: agent.version == 2, "the agent at v2")
        assert _holds(engine, sd2) and agent.status().streamed_shards == res.shards
        assert rec.at("apply", 0) < rec.at("decode", 1) < rec.at("applied", 0)
        waiting = 0  # decoded groups not yet handed to the engine
        for what, _k in rec.log:
            if what == "decode":
                assert waiting == 0, rec.log
            waiting += {"decoded": 1, "apply": -1}.get(what, 0)

    await _publish_into_running_agent(tmp_path, body)


async def test_a_check_of_shard_1_failing_while_shard_0_is_applied_rolls_back_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shard 1 fails a check (it does not parse) while shard 0's apply is in flight: nothing of
    shard 1 is applied, the engine is rolled back only once shard 0's apply has returned, and
    the version is applied the ordinary way after its manifest."""
    sd2 = _state(2)
    failed: list[asyncio.Event] = []
    real_parse = stream_mod.parse_delta_shard

    def parse(data: bytes, *, where: str, **kw: Any) -> Any:
        if Path(where).name == "delta-00001.safetensors":
            loop.call_soon_threadsafe(failed[0].set)
            raise FormatError(f"{where}: damaged (injected)")
        return real_parse(data, where=where, **kw)

    async def body(
        pub: Publisher, agent: ReceiverAgent, engine: LocalCheckpoint, stop: asyncio.Event
    ) -> None:
        rec = Recorder(monkeypatch, engine)
        failed.append(asyncio.Event())
        monkeypatch.setattr(stream_mod, "parse_delta_shard", parse)

        async def hook(vdir: Path) -> None:
            await asyncio.wait_for(failed[0].wait(), DEADLINE)
            assert rec.held.is_set() and ("applied", 0) not in rec.log  # the apply in flight
            rec.release.set()
            await eventually(
                lambda: (s := _streamer(agent)) is not None and bool(s.failed) and not s.txn_open,
                "the stream to fail and roll back",
            )
            assert engine.state.version == 1 and _holds(engine, _state(1))
            streamed = rec.log[: rec.at("abort", -1) + 1]
            assert ("apply", 1) not in streamed and ("decode", 1) not in streamed
            assert rec.at("applied", 0) < rec.at("abort", -1)

        pub.pre_commit_hook = hook
        await pub.publish(sd2)
        await eventually(lambda: agent.version == 2, "the agent at v2")
        assert _holds(engine, sd2) and agent.status().streamed_shards == 0

    loop = asyncio.get_running_loop()
    await _publish_into_running_agent(tmp_path, body)


async def test_a_stream_cancelled_between_a_decode_and_its_apply_aborts_after_the_apply(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worst moment: shard 1 decoded, waiting for shard 0's apply, which is in flight, and
    the agent stopped (its stream task cancelled). The stream's abort waits for that apply to
    return before the engine's abort runs; shard 1's group is never applied; the engine is
    back at v1, with no transaction left, and a new run of the agent takes v2."""
    sd1, sd2 = _state(1), _state(2)
    aborting = asyncio.Event()
    real_abort = StreamApplier._abort

    async def abort(self: StreamApplier, why: str) -> None:
        aborting.set()
        await real_abort(self, why)

    monkeypatch.setattr(StreamApplier, "_abort", abort)

    async def body(
        pub: Publisher, agent: ReceiverAgent, engine: LocalCheckpoint, stop: asyncio.Event
    ) -> None:
        rec = Recorder(monkeypatch, engine)

        async def hook(vdir: Path) -> None:
            await rec.wait(rec.decoded, 1)
            assert rec.held.is_set() and ("applied", 0) not in rec.log
            stop.set()  # the agent stops: it cancels its stream task
            await asyncio.wait_for(aborting.wait(), DEADLINE)
            assert ("abort", -1) not in rec.log  # not while shard 0's apply runs
            rec.release.set()
            await eventually(lambda: engine._txn is None, "the rollback")
            assert rec.at("applied", 0) < rec.at("abort", -1)
            assert ("apply", 1) not in rec.log
            assert engine.state.version == 1 and _holds(engine, sd1)

        pub.pre_commit_hook = hook
        await pub.publish(sd2)

    await _publish_into_running_agent(tmp_path, body)
    monkeypatch.undo()
    engine = LocalCheckpoint(tmp_path / "ck")
    agent = ReceiverAgent(tmp_path / "root", engine, "e1", use_inotify=False, poll_interval=0.02)
    async with agent:
        await agent.sync_once()
        assert agent.version == 2 and _holds(engine, sd2)


@pytest.mark.parametrize("which", ["first", "last"])
async def test_an_engine_apply_raising_while_the_stream_goes_on_rolls_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, which: str
) -> None:
    """The engine's apply of a shard raises after patching its bytes: shard 0's while shard 1
    is checked and decoded, or the last shard's while the stream waits for the manifest. The
    stream fails and rolls the engine back to v1 (no transaction left), the agent applies v2
    after its manifest, and a reopen holds v2 (attack-104)."""
    sd2 = _state(2)

    async def body(
        pub: Publisher, agent: ReceiverAgent, engine: LocalCheckpoint, stop: asyncio.Event
    ) -> None:
        rec = Recorder(monkeypatch, engine)
        inner = engine.apply
        n_box: list[int] = []
        raised: list[int] = []

        def apply(updates: Any) -> Any:
            k = rec.shard_of.get(updates[0].entry.name, -1)
            coro = inner(updates)
            bad = k == 0 if which == "first" else (bool(n_box) and k == n_box[0] - 1)
            bad = bad and not raised
            if bad:
                raised.append(k)

            async def go() -> None:
                await coro  # the bytes patched, then the engine fails
                if bad:
                    raise ApplyFailed(f"injected failure applying shard {k}")

            return go()

        monkeypatch.setattr(engine, "apply", apply)

        async def hook(vdir: Path) -> None:
            n_box.append(len(_delta_files(vdir)))
            if which == "first":
                await rec.wait(rec.decoded, 1)
            rec.release.set()
            await eventually(
                lambda: (s := _streamer(agent)) is not None and bool(s.failed) and not s.txn_open,
                "the stream to fail and roll back",
            )
            s = _streamer(agent)
            assert s is not None and s.failed is not None and "injected" in s.failed, s.failed
            assert engine._txn is None and raised == [0 if which == "first" else n_box[0] - 1]
            assert engine.state.version == 1 and _holds(engine, _state(1))

        pub.pre_commit_hook = hook
        await pub.publish(sd2)
        await eventually(lambda: agent.version == 2, "the agent at v2")
        assert _holds(engine, sd2)

    await _publish_into_running_agent(tmp_path, body)
    engine = LocalCheckpoint(tmp_path / "ck")
    async with ReceiverAgent(tmp_path / "root", engine, "e1", use_inotify=False) as agent:
        assert agent.version == 2 and _holds(engine, sd2)
