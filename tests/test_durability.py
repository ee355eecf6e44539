"""Crash consistency of publish, apply and gc: every crash state POSIX allows is recoverable.

A killed process keeps the page cache, so ``kill -9`` tests never see a missing ``fsync``. Here
the filesystem calls of one real publish (a delta, a keyframe), one receiver apply (a delta
in place, a full version; LocalCheckpoint with and without ``sync_before_ack``) and one ``gc``
are recorded with the trees they change (:mod:`tests.crashfs`), and every crash state the
persistence model of :mod:`tests.crashfs` allows after each call (a weak POSIX model: file
bytes durable only after the file's ``fsync``, torn before; any subset of a directory's entry
changes durable before the directory's ``fsync``; renames atomic) is written as a real tree
and recovered for real:

* publish: a new ``Publisher`` opens the root; every committed version is intact (its manifest
  reads, every shard it names has its size and checksum); a receiver at the previous version
  reaches the newest committed one bit-exact; the trainer seeds again and the receiver follows;
* apply: the ack in the crashed root never names more than the reopened engine holds (with
  ``sync_before_ack=False`` an engine that lost unflushed pages wipes itself and the agent's
  open reconciles the ack, docs/RELIABILITY.md); the engine's bytes are the published bytes of
  the version its state names; the agent then reaches the newest version and acks it;
* gc: every committed version is intact and the newest keyframe's chain is there; ``gc`` runs
  again; a new receiver reaches the newest version bit-exact.

Nothing may raise. ``make test`` takes at most :data:`CAP` crash states per crash point (all of
them where there are fewer; the rest drawn with a fixed seed); ``ASYNCSYNC_LONG=1`` (``make
stress``) takes :data:`CAP_LONG` (all of them, at these sizes). States that differ only in
temp and lock files are recovered once; recovery itself runs with ``fsync`` a no-op (it is not
recorded, and the disk is shared).

The ordering rules R1-R4 (:func:`violations`) are also checked on every recorded window: they
name the broken barrier where a failing crash state only shows its effect.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import threading
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncsync import Publisher
from asyncsync.format.acks import read_ack
from asyncsync.format.checksum import checksum_file
from asyncsync.format.store import list_versions, read_manifest
from asyncsync.publish.retention import RetentionPolicy, collect
from receiver import ReceiverAgent
from receiver.engines.checkpoint import LocalCheckpoint, inplace
from receiver.engines.st_layout import FileMaps
from receiver.stream import StreamApplier
from tests.conftest import eventually, mixed_state, mutate, same_bytes
from tests.crashfs import CrashState, Recorder, Window, crash_states, materialise

LONG = os.environ.get("ASYNCSYNC_LONG") == "1"
CAP = 64
CAP_LONG = 1 << 13
BUCKET = 1 << 16  # a version is one or two shards: fewer calls, the same barriers
_VDIR = re.compile(r"v\d{12}$")
States = dict[int, dict[str, torch.Tensor]]


@dataclass
class Scenario:
    """A recorded window and what recovery from each of its crash states must see."""

    tmp: Path
    trees: dict[str, Path]  # name -> the watched tree (root, ck)
    published: States = field(default_factory=dict)
    window: Window | None = None
    ops: list[tuple[str, ...]] = field(default_factory=list)
    stats: dict[str, int] = field(default_factory=dict)
    cap: int = CAP  # crash states per crash point in make test (CAP_LONG with ASYNCSYNC_LONG)

    async def record(self, action: Callable[[], Awaitable[Any]]) -> None:
        rec = Recorder(*self.trees.values())
        with pytest.MonkeyPatch.context() as mp:
            rec.install(mp)
            await action()
        self.window, self.ops = rec.window, rec.ops

    def states(self) -> list[CrashState]:
        assert self.window is not None and self.window.calls
        seen: dict[str, CrashState] = {}
        for s in crash_states(self.window, CAP_LONG if LONG else self.cap, stats=self.stats):
            seen.setdefault(s.key(), s)
        return list(seen.values())

    def materialise(self, state: CrashState, n: int) -> dict[str, Path]:
        out = {name: self.tmp / f"crash{n}" / name for name in self.trees}
        real = {os.path.realpath(p): out[name] for name, p in self.trees.items()}
        materialise(state, real)
        return out


def _agent(root: Path, ck: Path, **kw: Any) -> ReceiverAgent:
    return ReceiverAgent(
        root, LocalCheckpoint(ck, **kw), "e1", use_inotify=False, verify_deadline=0.05
    )


def _holds(ck: LocalCheckpoint, want: dict[str, torch.Tensor]) -> bool:
    got = ck.load_state_dict()
    return set(got) == set(want) and all(same_bytes(got[k], t) for k, t in want.items())


def _ack_within(ack: Any, state: Any) -> bool:
    """The ack names no more than the engine holds (same version: same fingerprint)."""
    if state.version is None or ack.version > state.version:
        return False
    return bool(ack.version < state.version or ack.fingerprint == state.fingerprint)


def committed_and_intact(root: Path) -> list[int]:
    """The committed versions of ``root``; fails if one lacks a shard or has other bytes."""
    versions = list_versions(root)
    for v in versions:
        m = read_manifest(root, v)  # raises for an empty, torn or missing manifest
        for s in m.shards:
            p = root / f"v{v:012d}" / s.file
            assert p.is_file(), f"committed v{v} lacks its shard {s.file}"
            assert checksum_file(p, m.checksum_algorithm) == (s.checksum, s.bytes), (
                f"committed v{v}: shard {s.file} has other bytes than its manifest says"
            )
    return versions


async def _follow(root: Path, ck: Path, published: States, newest: int) -> None:
    """A receiver on ``ck`` reaches ``newest`` bit-exact and acks it."""
    agent = _agent(root, ck)
    async with agent:
        for _ in range(2):
            if await agent.sync_once() == newest:
                break
        assert agent.version == newest, f"the receiver is at v{agent.version}, not v{newest}"
        if not _holds(agent.engine, published[newest]):  # type: ignore[arg-type]
            raise AssertionError(f"the receiver's bytes are not those published for v{newest}")
    ack = read_ack(root, "e1")
    assert ack is not None and ack.version == newest


def _no_fsync(fd: int) -> None:
    os.fstat(fd)  # still refuses a bad descriptor


async def _check_all(sc: Scenario, recover: Callable[[dict[str, Path]], Awaitable[None]]) -> int:
    """Recover from every crash state of ``sc``; fail naming the unrecoverable ones."""
    states = sc.states()
    assert sc.window is not None

    bad: list[str] = []
    for n, state in enumerate(states):
        paths = sc.materialise(state, n)
        try:
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(os, "fsync", _no_fsync)  # recovery is not recorded: save the disk
                await recover(paths)
        except Exception as exc:
            op = sc.window.calls[state.point][0]
            bad.append(
                f"crash state {n} after call {state.point} {op[0]} "
                f"{' -> '.join(os.path.basename(x) for x in op[1:])} ({state.how}): "
                f"{type(exc).__name__}: {exc}"
            )
        shutil.rmtree(sc.tmp / f"crash{n}")
    assert not bad, f"{len(bad)} of {len(states)} crash states are not recoverable:\n" + "\n".join(
        bad[:5]
    )
    assert violations(sc.ops) == []
    print(f"{len(sc.window.calls)} calls, {sc.stats} allowed, {len(states)} distinct recovered")
    return len(states)


# ------------------------------------------------------------------------------- publish


def _state(i: int) -> dict[str, torch.Tensor]:
    sd = {k: v for k, v in mixed_state(0).items() if not k.startswith("model.layers.1")}
    return mutate(sd, 0.05, seed=i) if i else sd


@pytest.mark.parametrize("keyframe", [False, True], ids=["delta", "keyframe"])
async def test_every_crash_state_of_a_publish_recovers(tmp_path: Path, keyframe: bool) -> None:
    root, ck = tmp_path / "root", tmp_path / "ck"
    sc = Scenario(tmp_path, {"root": root})
    pub = Publisher(root, bucket_bytes=BUCKET, keyframe_interval=0)
    async with pub:
        for i in range(2):
            sd = _state(i)
            sc.published[(await (pub.seed(sd) if i == 0 else pub.publish(sd))).version] = sd
        await _follow(root, ck, sc.published, 1)
        sd = _state(2)

        async def publish() -> None:
            sc.published[(await pub.publish(sd, keyframe=keyframe)).version] = sd

        await sc.record(publish)
    nxt = _state(3)

    async def recover(p: dict[str, Path]) -> None:
        ckc = p["root"].parent / "ck"
        shutil.copytree(ck, ckc)
        async with Publisher(p["root"], bucket_bytes=BUCKET) as pub2:
            versions = committed_and_intact(p["root"])
            assert {0, 1} <= set(versions) <= {0, 1, 2}, versions
            await _follow(p["root"], ckc, sc.published, versions[-1])
            v = (await pub2.seed(nxt)).version
            await _follow(p["root"], ckc, {**sc.published, v: nxt}, v)

    await _check_all(sc, recover)


# ------------------------------------------------------------------------------- apply


@pytest.mark.parametrize(
    "full, sync_before_ack, deltas",
    [
        (False, True, 1),
        (False, False, 1),
        (True, False, 1),
        # ~55 s on 2 shared cores (every interleaving of two versions' calls): heavy
        pytest.param(False, False, 2, marks=pytest.mark.heavy),
    ],
    ids=["delta-sync-before-ack", "delta", "full", "two-deltas-flush-overlapped"],
)
async def test_every_crash_state_of_an_apply_recovers(
    tmp_path: Path, full: bool, sync_before_ack: bool, deltas: int
) -> None:
    """``two-deltas-flush-overlapped``: v2 and v3 in one sync, v3 journaled and patched while
    v2's flush (after its ack) still runs, so the window holds the calls of both in any
    interleaving the threads took."""
    root, ck = tmp_path / "root", tmp_path / "ck"
    sc = Scenario(tmp_path, {"root": root, "ck": ck})
    async with Publisher(root, bucket_bytes=BUCKET, keyframe_interval=0) as pub:
        for i in range(2 + deltas):
            if i == 2 and not full:  # the engine is at v1 when v2 (a delta) comes
                await _follow(root, ck, sc.published, 1)
            sd = _state(i)
            res = await (pub.seed(sd) if i == 0 else pub.publish(sd, keyframe=full and i == 2))
            sc.published[res.version] = sd
    newest = max(sc.published)

    async def apply() -> None:
        agent = _agent(root, ck, sync_before_ack=sync_before_ack)
        async with agent:
            await agent.sync_once()

    journaled, overlapped = threading.Event(), []
    if deltas == 2:  # hold v2's flush until v3 has journaled and patched its first group
        sync, journal_and_patch = FileMaps.sync, inplace.journal_and_patch

        def held_sync(self: FileMaps) -> None:
            if not overlapped:
                overlapped.append(journaled.wait(20))  # 20 s: only a broken run waits it out
            sync(self)

        def noted(*args: Any, **kw: Any) -> Any:
            out = journal_and_patch(*args, **kw)
            if args[3] == 3:  # (maps, journal_dir, seq, version, ...)
                journaled.set()
            return out

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(FileMaps, "sync", held_sync)
            mp.setattr(inplace, "journal_and_patch", noted)
            await sc.record(apply)
        assert overlapped == [True], "v3 was not journaled while v2's flush was running"
    else:
        await sc.record(apply)

    async def recover(p: dict[str, Path]) -> None:
        held = LocalCheckpoint(p["ck"], sync_before_ack=sync_before_ack)
        ack = read_ack(p["root"], "e1")
        state = await held.open()
        try:
            strict = state.version is not None or sync_before_ack  # else reconciled at open
            if ack is not None and strict and not _ack_within(ack, state):
                raise AssertionError(f"the ack names v{ack.version}, the engine holds {state}")
            if state.version is not None and not _holds(held, sc.published[state.version]):
                raise AssertionError(f"the engine's state names v{state.version}, its bytes differ")
        finally:
            await held.close()
        await _follow(p["root"], p["ck"], sc.published, newest)

    await _check_all(sc, recover)


# ------------------------------------------------------------------------------- streaming


async def test_every_crash_state_of_a_streaming_apply_recovers(tmp_path: Path) -> None:
    """The receiver applies v2's self-describing shards while the publisher writes v2 (the
    manifest waits until every shard is applied), then commits it: the publisher's and the
    receiver's calls in one window. Recovery as for an apply: the ack never names more than the
    reopened engine holds, its bytes are those published for the version its state names, and
    the agent reaches the newest version committed in the crashed root."""
    root, ck = tmp_path / "root", tmp_path / "ck"
    # both sides' directories change at once: their pending entries combine into ~15x the
    # states of one side's window, so make test draws 5 per crash point (make stress: all)
    sc = Scenario(tmp_path, {"root": root, "ck": ck}, cap=5)
    small = 6 << 10  # two or three delta shards
    pub = Publisher(root, bucket_bytes=small, delta_shard_bytes=small, keyframe_interval=0)
    async with pub:
        for i in range(2):
            sd = _state(i)
            sc.published[(await (pub.seed(sd) if i == 0 else pub.publish(sd))).version] = sd
        await _follow(root, ck, sc.published, 1)
        sd = _state(2)
        agent = ReceiverAgent(
            root, LocalCheckpoint(ck), "e1", use_inotify=False, poll_interval=0.01,
            verify_deadline=0.05,
        )  # fmt: skip
        streamed: list[int] = []

        async def hook(vdir: Path) -> None:
            n = len(list(vdir.glob("delta-*.safetensors")))
            await eventually(
                lambda: isinstance(s := agent._early.reader, StreamApplier) and len(s.applied) == n,
                "every shard of v2 applied before its manifest",
            )
            streamed.append(n)

        pub.pre_commit_hook = hook

        async def stream_and_commit() -> None:  # the window: the agent is open and running
            sc.published[(await pub.publish(sd)).version] = sd
            await eventually(
                lambda: (a := read_ack(root, "e1")) is not None and a.version == 2, "the v2 ack"
            )

        stop = asyncio.Event()
        async with agent, asyncio.TaskGroup() as tg:
            tg.create_task(agent.run(stop=stop))
            await eventually(lambda: agent.version == 1, "the agent at v1")
            try:
                await sc.record(stream_and_commit)
            finally:
                stop.set()
        assert streamed and streamed[0] > 1 and agent.status().streamed_shards == streamed[0]

    async def recover(p: dict[str, Path]) -> None:
        held = LocalCheckpoint(p["ck"])
        ack = read_ack(p["root"], "e1")
        state = await held.open()
        try:
            if ack is not None and state.version is not None and not _ack_within(ack, state):
                raise AssertionError(f"the ack names v{ack.version}, the engine holds {state}")
            if state.version is not None and not _holds(held, sc.published[state.version]):
                raise AssertionError(f"the engine's state names v{state.version}, its bytes differ")
        finally:
            await held.close()
        await _follow(p["root"], p["ck"], sc.published, list_versions(p["root"])[-1])

    await _check_all(sc, recover)


# ------------------------------------------------------------------------------- gc


async def test_every_crash_state_of_a_gc_recovers(tmp_path: Path) -> None:
    root = tmp_path / "root"
    sc = Scenario(tmp_path, {"root": root})
    async with Publisher(root, bucket_bytes=BUCKET, keyframe_interval=0) as pub:
        for i in range(5):
            sd = _state(i)
            res = await (pub.seed(sd) if i == 0 else pub.publish(sd, keyframe=i == 3))
            sc.published[res.version] = sd
    policy = RetentionPolicy(keep_versions=1, ack_ttl=None)

    async def gc() -> None:
        assert collect(root, policy).deleted == (0, 1, 2)

    await sc.record(gc)

    async def recover(p: dict[str, Path]) -> None:
        assert {3, 4} <= set(committed_and_intact(p["root"]))
        async with Publisher(p["root"], bucket_bytes=BUCKET):
            collect(p["root"], policy)
            assert committed_and_intact(p["root"]) == [3, 4]
        await _follow(p["root"], p["root"].parent / "ck", sc.published, 4)

    await _check_all(sc, recover)


# ------------------------------------------------------------------------------- R1-R4


def violations(ops: list[tuple[str, ...]]) -> list[str]:
    """The ordering rules ``ops`` (a recorder's call log) breaks. Each names a barrier whose
    absence the crash enumeration shows only by its effect:

    * R1 a file renamed into place was fsynced after it was written (else a crash after the
      rename can leave an empty or partial file under the final name), except a progressive
      undo record (``*.progressive``), which is not durable by design: the engine's state
      marks the delta ``progressive`` first, durably, and a crash state that lost or tore the
      record is then recovered by checking every tensor (the crash states below show it); nor
      a checkpoint's ``.asyncsync/stamps.json`` (its data files' stamps,
      ``receiver.engines.checkpoint.stamps``): lost or torn, the files are stamped again;
    * R2 when ``vN/manifest.json`` is renamed in, every shard entry of ``vN`` and ``vN``'s own
      entry in the root are durable (else a committed version can lack a shard);
    * R3 gc removes a version's manifest, and makes that durable, before any other file of it
      (else a crash can leave a committed manifest naming deleted shards);
    * R4 an ack is renamed in only after the engine's ``state.json`` naming that version is
      durable (else an ack can name a version the engine does not hold after a crash).
    """
    out: list[str] = []
    written: set[str] = set()  # created, not fsynced since
    pending: dict[str, set[str]] = defaultdict(set)  # dir -> entries changed, not yet durable
    uncommitting: dict[str, str] = {}  # vdir -> "gone" (unlinked) / "durable" (dir fsynced)
    for op, *args in ops:
        if op == "create":
            (p,) = args
            written.add(p)
            pending[os.path.dirname(p)].add(p)
        elif op == "fsync":
            written.discard(args[0])
        elif op == "fsync_dir":
            (d,) = args
            pending[d].clear()
            if uncommitting.get(d) == "gone":
                uncommitting[d] = "durable"
        elif op == "mkdir":
            pending[os.path.dirname(args[0])].add(args[0])
        elif op == "rename":
            s, d = args
            if s in written and not d.endswith((".progressive", "/.asyncsync/stamps.json")):
                out.append(f"R1: {d} renamed in before its data was fsynced")
            written.discard(s)
            dd = os.path.dirname(d)
            if os.path.basename(d) == "manifest.json" and _VDIR.search(dd):
                late = pending[dd] - {s, d}
                if late:
                    out.append(f"R2: {d} committed before {sorted(late)} were durable")
                if dd in pending[os.path.dirname(dd)]:
                    out.append(f"R2: {d} committed before {dd}'s entry was durable")
            if os.path.basename(dd) == "acks":
                state_dirs = [
                    k for k, v in pending.items() if any(x.endswith("state.json") for x in v)
                ]
                if state_dirs:
                    out.append(f"R4: ack {d} written before {state_dirs} were durable")
            pending[os.path.dirname(s)].add(s)
            pending[dd].add(d)
        elif op == "unlink":
            (p,) = args
            vd = os.path.dirname(p)
            if _VDIR.search(vd):
                if os.path.basename(p) == "manifest.json":
                    uncommitting[vd] = "gone"
                elif uncommitting.get(vd) != "durable" and not os.path.basename(p).startswith("."):
                    out.append(f"R3: {p} removed before {vd}'s manifest removal was durable")
            pending[vd].add(p)
    return out


@pytest.mark.parametrize(
    "ops, rule",
    [
        ([("create", "/r/v000000000001/.tmp.a"), ("rename", "/r/v000000000001/.tmp.a",
          "/r/v000000000001/a")], "R1"),
        ([("mkdir", "/r/v000000000001"), ("fsync_dir", "/r"),
          ("create", "/r/v000000000001/.tmp.s"), ("fsync", "/r/v000000000001/.tmp.s"),
          ("rename", "/r/v000000000001/.tmp.s", "/r/v000000000001/s"), ("fsync_dir", "/r"),
          ("create", "/r/v000000000001/.tmp.m"), ("fsync", "/r/v000000000001/.tmp.m"),
          ("rename", "/r/v000000000001/.tmp.m", "/r/v000000000001/manifest.json")], "R2"),
        ([("unlink", "/r/v000000000001/s"), ("unlink", "/r/v000000000001/manifest.json")], "R3"),
        ([("create", "/c/.asyncsync/.tmp.st"), ("fsync", "/c/.asyncsync/.tmp.st"),
          ("rename", "/c/.asyncsync/.tmp.st", "/c/.asyncsync/state.json"),
          ("create", "/r/acks/.tmp.e"), ("fsync", "/r/acks/.tmp.e"),
          ("rename", "/r/acks/.tmp.e", "/r/acks/e.json")], "R4"),
    ],
)  # fmt: skip
def test_the_checker_sees_each_broken_rule(ops: list[tuple[str, ...]], rule: str) -> None:
    """The mutations no kill test noticed: no fsync before the rename (R1), the root fsynced
    twice instead of the version dir (R2), files removed before the manifest (R3)."""
    found = violations(ops)
    assert found and all(v.startswith(rule) for v in found), found
