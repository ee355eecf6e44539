"""Multi-rank publish: 4 trainer processes, one manifest per version, receivers bit-exact.

The ranks run ``tests/dist_worker.py`` in processes forked from a forkserver that imported
torch once (a fresh interpreter per rank would spend seconds importing torch on a small box).
Each rank publishes its own tensors and its share of two sliced tensors; the test rebuilds the
whole model and checks every committed version against it, and receivers (LocalCheckpoint,
TorchModule) that follow the chain end bit-exact.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import time
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncsync import (
    ConfigError,
    FileRendezvous,
    OutcomeUnknown,
    Publisher,
    PublishError,
    TensorSlice,
    TorchDistCoordinator,
)
from asyncsync.format import manifest_path
from asyncsync.format.checksum import entry_checksum
from asyncsync.format.store import list_versions, read_manifest
from asyncsync.ops.cli import main as cli_main
from receiver import ReceiverAgent
from receiver.engines.checkpoint import LocalCheckpoint, verify_checkpoint
from receiver.engines.torch_module import TorchModule
from tests import dist_worker
from tests.conftest import Holder, assert_holds, same_bytes
from tests.dist_worker import DENSE_STEP, KEYFRAME_STEP, ZERO_STEP, MissOutcome, full_state
from tests.ports import free_port

WORLD = 4


def _ctx() -> Any:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.dist_worker"])
    return ctx


def _spawn(cfg: dict[str, Any]) -> BaseProcess:
    p = _ctx().Process(target=dist_worker.main, args=(cfg,), name=f"rank{cfg['rank']}")
    p.start()
    return p


def _logs(out: Path) -> dict[int, list[dict[str, Any]]]:
    logs: dict[int, list[dict[str, Any]]] = {}
    for p in sorted(out.glob("rank*.json")):
        rank = int(p.name[4 : p.name.index("-")])
        logs.setdefault(rank, []).extend(json.loads(p.read_text()))
    return logs


def _check_versions(root: Path, logs: dict[int, list[dict[str, Any]]]) -> dict[int, int]:
    """Every committed version holds exactly the model of the step the ranks published."""
    step_of = {r["version"]: r["step"] for r in logs[0] if "version" in r}
    for rank, recs in logs.items():
        for r in recs:
            if "version" in r:
                assert step_of[r["version"]] == r["step"], (rank, r)
    assert sorted(step_of) == list_versions(root)
    for v, step in step_of.items():
        m = read_manifest(root, v)
        want = full_state(step, WORLD)
        assert {e.name for e in m.tensors} == set(want)
        assert m.attempt is not None and m.producer["world_size"] == WORLD
        for e in m.tensors:
            assert (e.torch_dtype, e.shape) == (want[e.name].dtype, tuple(want[e.name].shape))
            assert entry_checksum(e, want[e.name], m.checksum_algorithm) == e.checksum, (v, e.name)
        files = {p.name for p in (root / f"v{v:012d}").iterdir()}
        assert files == {"manifest.json", *(s.file for s in m.shards)}  # part records removed
    return step_of


async def _wait_for(pred: Any, procs: list[BaseProcess], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def _run_group(
    tmp_path: Path, cfg: dict[str, Any], restart: tuple[int, int] | None = None
) -> tuple[Path, dict[int, list[dict[str, Any]]], list[ReceiverAgent]]:
    """Run the ranks; receivers take v0, then the rest; ``restart`` = (rank, step): start that
    rank again at that step once it was killed."""
    root, out, gate = tmp_path / "root", tmp_path / "out", tmp_path / "gate"
    out.mkdir()
    cfg = {**cfg, "world": WORLD, "root": str(root), "out": str(out), "gate": str(gate)}
    procs = [_spawn({**cfg, "rank": r}) for r in range(WORLD)]
    agents = [
        ReceiverAgent(root, LocalCheckpoint(tmp_path / "ckpt"), "ckpt", use_inotify=False),
        ReceiverAgent(root, TorchModule(Holder(full_state(0, WORLD))), "mod", use_inotify=False),
    ]
    try:
        await _wait_for(manifest_path(root, 0).exists, procs, 60, "version 0")
        for a in agents:
            await a.open()
            assert await a.sync_once() == 0
        assert_holds(agents[0].engine.load_state_dict(), full_state(0, WORLD))  # type: ignore[attr-defined]
        gate.touch()
        restarted = False
        while any(p.is_alive() for p in procs):
            if restart is not None and not restarted and procs[restart[0]].exitcode is not None:
                assert procs[restart[0]].exitcode == -9  # SIGKILL
                start = {"start": restart[1], "incarnation": 1}
                procs.append(_spawn({**cfg, "rank": restart[0], **start}))
                restarted = True
            await asyncio.sleep(0.05)
        codes = {i: p.exitcode for i, p in enumerate(procs)}
        killed = restart[0] if restart is not None else None
        assert restarted == (restart is not None)
        assert all(c == 0 for i, c in codes.items() if i != killed), codes
        logs = _logs(out)
        for a in agents:
            await a.sync_once()
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for a in agents:
            await a.close()
    return root, logs, agents


async def _final_checks(
    root: Path, tmp_path: Path, logs: dict[int, list[dict[str, Any]]], agents: list[Any]
) -> dict[int, int]:
    step_of = _check_versions(root, logs)
    final = full_state(max(step_of.values()), WORLD)
    assert_holds(agents[0].engine.load_state_dict(), final)
    assert_holds(agents[1].engine.module.state_dict(), final)
    fresh = Holder(final)  # an empty engine starts from the newest keyframe
    async with ReceiverAgent(root, TorchModule(fresh), "fresh", use_inotify=False) as a:
        assert await a.sync_once() == max(step_of)
    assert_holds(fresh.state_dict(), final)
    return step_of


def _version(logs: dict[int, list[dict[str, Any]]], step: int) -> int:
    return next(int(r["version"]) for r in logs[0] if r.get("step") == step and "version" in r)


async def test_torch_distributed_four_ranks(tmp_path: Path) -> None:
    """gloo on 127.0.0.1; rank 3 misses the outcome of a committed version (stale snapshot)."""
    cfg = {"coord": "torch", "port": free_port(), "steps": 5, "miss": [3, DENSE_STEP]}
    root, logs, agents = await _run_group(tmp_path, cfg)
    step_of = await _final_checks(root, tmp_path, logs, agents)
    assert sorted(step_of.values()) == list(range(6))
    # rank 3 learned nothing about the dense step, the others saw it committed ...
    assert "unknown" in next(r for r in logs[3] if r["step"] == DENSE_STEP)
    # ... and resolved it at the next plan: the keyframe after it still carries a delta,
    # which needs every rank's snapshot at the dense step's version (bit-exactness proves it)
    kf = read_manifest(root, _version(logs, KEYFRAME_STEP))
    assert kf.kind == "full" and kf.base_version is not None
    zero = read_manifest(root, _version(logs, ZERO_STEP))
    assert zero.totals.changed == 0 and zero.shards == ()
    dense = read_manifest(root, _version(logs, DENSE_STEP)).tensor_map()["shared.weight"]
    assert dense.parts is not None and len(dense.parts) == WORLD
    assert [p.delta.mode for p in dense.parts if p.delta] == ["dense"] + ["sparse"] * 3
    emb = read_manifest(root, 0).tensor_map()["shared.emb"]
    assert emb.layout == ((0, 13), (13, 27), (40, 1), (41, 29))


async def test_file_rendezvous_four_ranks(tmp_path: Path) -> None:
    """No torch.distributed; rank 2 fails once (all ranks retry), rank 1 misses an outcome."""
    cfg = {"coord": "file", "steps": 5, "fail": [2, 1], "miss": [1, DENSE_STEP]}
    root, logs, agents = await _run_group(tmp_path, cfg)
    step_of = await _final_checks(root, tmp_path, logs, agents)
    assert sorted(step_of.values()) == list(range(6))
    first = [next(r for r in logs[rank] if r["step"] == 1) for rank in range(WORLD)]
    assert all("error" in r for r in first)  # the version failed for every rank ...
    assert first[0]["ranks"] == [2] and "rank 2 failed" in first[0]["error"]  # ... naming rank 2
    assert "No space left" in first[0]["error"]
    assert "unknown" in next(r for r in logs[1] if r["step"] == DENSE_STEP)
    assert read_manifest(root, _version(logs, KEYFRAME_STEP)).base_version is not None


async def test_killed_rank_leaves_the_version_uncommitted(tmp_path: Path) -> None:
    """Rank 2 is SIGKILLed after writing a shard; rank 0 names it; restarted, the group goes on."""
    cfg = {"coord": "file", "steps": 4, "timeout": 8.0, "kill": [2, 1]}
    root, logs, agents = await _run_group(tmp_path, cfg, restart=(2, 1))
    err = next(r for r in logs[0] if r["step"] == 1)
    assert err["ranks"] == [2] and "ranks [2] went silent" in err["error"]
    assert err["at"] == 0 and not err["manifest_after_error"]  # v1 was not committed then
    assert all("error" in next(r for r in logs[k] if r["step"] == 1) for k in (1, 3))
    step_of = await _final_checks(root, tmp_path, logs, agents)
    assert sorted(step_of.values()) == list(range(5))
    v1 = read_manifest(root, _version(logs, 1))  # the restarted rank had no snapshot: full
    assert v1.kind == "full" and v1.base_version is None
    assert read_manifest(root, _version(logs, 2)).base_version == v1.version  # deltas again


async def test_torch_killed_rank_then_the_group_restarts(tmp_path: Path) -> None:
    """gloo: a dead rank breaks the group; rank 0 names it (not rank 1, still writing its
    part when the collective broke: a CI failure), the group restarts and goes on."""
    root, out = tmp_path / "root", tmp_path / "out"
    out.mkdir()
    cfg = {"coord": "torch", "world": WORLD, "root": str(root), "out": str(out), "steps": 3,
           "kill": [2, 1], "slow": [1, 1], "exit_on_error": True}  # fmt: skip
    port = free_port()
    procs = [_spawn({**cfg, "rank": r, "port": port}) for r in range(WORLD)]
    await _wait_for(lambda: not any(p.is_alive() for p in procs), procs, 60, "the first group")
    assert [p.exitcode for p in procs] == [3, 3, -9, 3]
    err = _logs(out)[0][-1]
    assert err["step"] == 1 and err["ranks"] == [2] and "ranks [2] went silent" in err["error"]
    assert list_versions(root) == [0] and not (root / "v000000000001").exists()
    again = {**cfg, "start": 1, "incarnation": 1, "port": free_port(), "kill": None}
    procs = [_spawn({**again, "rank": r}) for r in range(WORLD)]
    await _wait_for(lambda: not any(p.is_alive() for p in procs), procs, 60, "the second group")
    assert [p.exitcode for p in procs] == [0] * WORLD and port != again["port"]
    logs = _logs(out)
    step_of = _check_versions(root, logs)
    assert step_of == {0: 0, 1: 1, 2: 2, 3: 3}
    assert read_manifest(root, 1).base_version is None  # fresh processes: no snapshot, full
    assert read_manifest(root, 2).base_version == 1
    mod = Holder(full_state(3, WORLD))
    async with ReceiverAgent(root, TorchModule(mod), "m", use_inotify=False) as a:
        assert await a.sync_once() == 3
    assert_holds(mod.state_dict(), full_state(3, WORLD))


async def test_torch_a_hung_rank_is_found_by_the_process_groups_timeout(tmp_path: Path) -> None:
    """gloo: rank 1 hangs in its first shard write of step 1 (8 s; a stuck mount). The torch
    coordinator has no heartbeat (a collective every rank joined cannot be left): rank 0 finds
    rank 1 only at the process group's timeout (here 3 s; 30 minutes by default) and names it,
    saying so; it said "no part record and no heartbeat within the timeout", of a heartbeat
    that never existed, and the docs promised liveness by heartbeats."""
    root, out = tmp_path / "root", tmp_path / "out"
    out.mkdir()
    cfg = {"coord": "torch", "world": 2, "root": str(root), "out": str(out), "steps": 2,
           "port": free_port(), "pg_timeout": 3, "slow": [1, 1, 8.0],
           "exit_on_error": True}  # fmt: skip
    procs = [_spawn({**cfg, "rank": r}) for r in range(2)]
    await _wait_for(lambda: not any(p.is_alive() for p in procs), procs, 120, "the group")
    assert [p.exitcode for p in procs] == [3, 3]
    err = _logs(out)[0][-1]
    assert err["step"] == 1 and err["ranks"] == [1], err
    assert (
        "ranks [1] went silent: nothing from it within the process group's timeout"
        in (err["error"])
    ), err
    assert "heartbeat" not in err["error"]
    assert list_versions(root) == [0]


@pytest.mark.parametrize("gone", [0, 1])
async def test_torch_a_broken_plan_exchange_says_what_broke(tmp_path: Path, gone: int) -> None:
    """gloo: one rank of two ends before its call of step 1, and the other's plan exchange
    breaks. Rank 1 read "could not agree on the next version with rank 0", rank 0 "ranks [1]
    did not join the publish of v1 in time (slow to call publish, or not running)", whatever
    broke; now each says that the exchange failed in torch.distributed, gloo's words, and what
    to do."""
    root, out = tmp_path / "root", tmp_path / "out"
    out.mkdir()
    cfg = {"coord": "torch", "world": 2, "root": str(root), "out": str(out), "steps": 2,
           "port": free_port(), "exit_at": [gone, 1], "exit_on_error": True}  # fmt: skip
    procs = [_spawn({**cfg, "rank": r}) for r in range(2)]
    await _wait_for(lambda: not any(p.is_alive() for p in procs), procs, 120, "the group")
    assert procs[gone].exitcode == 5 and procs[1 - gone].exitcode == 3
    err = _logs(out)[1 - gone][-1]
    assert err["step"] == 1, err
    assert f"rank {1 - gone}: the plan exchange failed in torch.distributed (" in err["error"]
    assert "restart every rank" in err["error"], err
    assert "could not agree" not in err["error"] and "did not join" not in err["error"], err


async def test_torch_a_cancelled_call_leaves_the_group_whole(tmp_path: Path) -> None:
    """gloo: rank 1's publish of step 2 is cancelled while it waits in the plan (rank 0 comes
    later). Its gather went on in its thread without the broadcast after it, so the next
    collectives paired with another kind on the other ranks and the process group stayed broken
    for good: every later publish failed, as would the trainer's own collectives on the group
    (helper-43). A cancelled exchange now runs to its end first: a step or two fail, then the
    group commits again."""
    root, out = tmp_path / "root", tmp_path / "out"
    out.mkdir()
    cfg = {"coord": "torch", "world": WORLD, "root": str(root), "out": str(out), "steps": 5,
           "stepped": True, "cancel_in_plan": [1, 2, 0.3], "port": free_port()}  # fmt: skip
    procs = [_spawn({**cfg, "rank": r}) for r in range(WORLD)]
    await _wait_for(lambda: not any(p.is_alive() for p in procs), procs, 120, "the group")
    assert [p.exitcode for p in procs] == [0] * WORLD
    logs = _logs(out)
    assert next(r for r in logs[1] if r["step"] == 2).get("cancelled")
    step_of = _check_versions(root, logs)
    assert {0, 1, 5} <= set(step_of.values()), step_of


def test_worker_model_tiles() -> None:
    """The test model itself: the ranks' portions tile the sliced tensors."""
    full = full_state(3, WORLD)
    for name in ("shared.weight", "shared.emb"):
        flat = torch.cat(
            [dist_worker.portion(3, r, WORLD)[0][name].reshape(-1) for r in range(WORLD)]
        )
        assert same_bytes(flat, full[name].reshape(-1))


# --------------------------------------------------------------------------- in one process
# Two ranks as two Publishers in one event loop (FileRendezvous): the protocol's edge cases.


def _pair(root: Path, timeout: float = 5.0, **kw: Any) -> tuple[Publisher, Publisher, MissOutcome]:
    coords = [FileRendezvous(root, r, 2, timeout=timeout, poll_interval=0.001) for r in (0, 1)]
    miss = MissOutcome(coords[1])
    kw.setdefault("keyframe_interval", 0)
    return Publisher(root, coordinator=coords[0], **kw), Publisher(root, coordinator=miss), miss


def _step(step: int) -> list[tuple[dict[str, torch.Tensor], dict[str, TensorSlice]]]:
    return [dist_worker.portion(step, r, 2) for r in (0, 1)]


async def _both(calls: list[Any]) -> list[Any]:
    return list(await asyncio.gather(*calls, return_exceptions=True))


async def _received(root: Path, tmp_path: Path, step: int) -> None:
    mod = Holder(full_state(step, 2))
    async with ReceiverAgent(root, TorchModule(mod), "m", use_inotify=False) as a:
        await a.sync_once()
    assert_holds(mod.state_dict(), full_state(step, 2))


async def test_missed_failure_drops_the_kept_changes(tmp_path: Path) -> None:
    """Rank 1 misses the outcome of an attempt rank 0 failed: its kept changes are dropped."""
    root = tmp_path / "root"
    hook_fails = {"on": False}

    def hook(vdir: Path) -> None:
        if hook_fails["on"]:
            raise RuntimeError("hook failed (injected)")

    p0, p1, miss = _pair(root, pre_commit_hook=hook)
    async with p0, p1:
        (s0, l0), (s1, l1) = _step(0)
        await _both([p0.seed(s0, slices=l0), p1.seed(s1, slices=l1)])
        hook_fails["on"], miss.armed = True, True
        (s0, l0), (s1, l1) = _step(1)
        r0, r1 = await _both([p0.publish(s0, slices=l0), p1.publish(s1, slices=l1)])
        assert isinstance(r0, PublishError) and "hook failed" in str(r0)
        assert isinstance(r1, OutcomeUnknown) and not manifest_path(root, 1).exists()
        hook_fails["on"] = False
        (s0, l0), (s1, l1) = _step(3)  # training went on
        r0, r1 = await _both([p0.publish(s0, slices=l0), p1.publish(s1, slices=l1)])
        assert r0.version == r1.version == 1 and r0.base_version == 0  # a delta on v0 again
    await _received(root, tmp_path, 3)


async def test_missed_commit_in_one_process(tmp_path: Path) -> None:
    root = tmp_path / "root"
    p0, p1, miss = _pair(root)
    async with p0, p1:
        (s0, l0), (s1, l1) = _step(0)
        miss.armed = True  # even the seed's outcome
        r0, r1 = await _both([p0.seed(s0, slices=l0), p1.seed(s1, slices=l1)])
        assert r0.version == 0 and isinstance(r1, OutcomeUnknown) and r1.ranks == (0,)
        (s0, l0), (s1, l1) = _step(1)
        r0, r1 = await _both([p0.publish(s0, slices=l0), p1.publish(s1, slices=l1)])
        assert r0.version == r1.version == 1 and r1.base_version == 0
        assert p1.statistics().last_version == 1
    await _received(root, tmp_path, 1)


async def test_a_rank_with_bad_input_fails_the_group_fast(tmp_path: Path) -> None:
    root = tmp_path / "root"
    p0, p1, _ = _pair(root, timeout=30)
    async with p0, p1:
        (s0, l0), _ = _step(0)
        t0 = time.monotonic()
        r0, r1 = await _both(
            [p0.seed(s0, slices=l0), p1.seed({"x": torch.ones(2).to(torch.cdouble)})]
        )
        assert time.monotonic() - t0 < 5
    assert isinstance(r1, ConfigError) and "dtype" in str(r1)
    assert isinstance(r0, PublishError) and r0.ranks == (1,) and "rank 1" in str(r0)
    assert list_versions(root) == []


async def test_a_group_whose_ranks_all_publish_nothing_commits_nothing(tmp_path: Path) -> None:
    """(helper-23, finding 8, for a group) A rank may hold none of the tensors, but a version
    that no rank gave a tensor would leave every engine with none."""
    root = tmp_path / "root"
    p0, p1, _ = _pair(root)
    async with p0, p1:
        r0, r1 = await _both([p0.seed({}), p1.seed({})])
        assert isinstance(r0, PublishError) and isinstance(r1, PublishError), (r0, r1)
        assert "no rank of 2 published a tensor" in str(r0)
        r0, r1 = await _both([p0.seed(full_state(0, 2)), p1.seed({})])  # one empty rank: fine
        assert r0.version == r1.version == 0, (r0, r1)
    assert list_versions(root) == [0]


def _also_rank0s(s: dict[str, torch.Tensor], sl: dict[str, TensorSlice]) -> Any:
    return {**s, "rank0.model.scalar": torch.ones(())}, sl


def _gap(s: dict[str, torch.Tensor], sl: dict[str, TensorSlice]) -> Any:
    return {**s, "shared.emb": s["shared.emb"][1:]}, {**sl, "shared.emb": TensorSlice(36, (10, 7))}


def _overlap(s: dict[str, torch.Tensor], sl: dict[str, TensorSlice]) -> Any:
    return s, {**sl, "shared.emb": TensorSlice(34, (10, 7))}


def _other_shape(s: dict[str, torch.Tensor], sl: dict[str, TensorSlice]) -> Any:
    return s, {**sl, "shared.emb": TensorSlice(35, (70,))}


@pytest.mark.parametrize(
    ("make1", "match"),
    [
        (_also_rank0s, "published by ranks 0 and 1"),
        (_gap, "leave a gap at element 35"),
        (_overlap, "overlap at element 34"),
        (_other_shape, "disagree"),
    ],
)
async def test_ranks_that_do_not_fit_together_commit_nothing(
    tmp_path: Path, make1: Any, match: str
) -> None:
    root = tmp_path / "root"
    p0, p1, _ = _pair(root)
    async with p0, p1:
        (s0, l0), (s1, l1) = _step(0)
        s1, l1 = make1(s1, l1)
        r0, r1 = await _both([p0.seed(s0, slices=l0), p1.seed(s1, slices=l1)])
    assert isinstance(r0, PublishError) and isinstance(r1, PublishError), (r0, r1)
    assert match in str(r0) and match in str(r1)
    assert list_versions(root) == [] and not (root / "v000000000000").exists()


async def test_differently_configured_ranks_and_a_missing_rank(tmp_path: Path) -> None:
    root = tmp_path / "root"
    c0 = FileRendezvous(root, 0, 2, timeout=0.5, poll_interval=0.001)
    c1 = FileRendezvous(root, 1, 2, timeout=0.5, poll_interval=0.001)
    async with (
        Publisher(root, coordinator=c0) as p0,
        Publisher(root, coordinator=c1, encoding="indices") as p1,
    ):
        (s0, l0), (s1, l1) = _step(0)
        r0, r1 = await _both([p0.seed(s0, slices=l0), p1.seed(s1, slices=l1)])
        assert isinstance(r0, PublishError) and "configured differently" in str(r0)
        assert isinstance(r1, PublishError) and r0.ranks == r1.ranks == (1,)
        t0 = time.monotonic()
        with pytest.raises(PublishError, match=r"ranks \[1\] did not join") as ei:
            await p0.seed(s0, slices=l0)  # rank 1 never comes
        assert ei.value.ranks == (1,) and time.monotonic() - t0 < 3
    assert list_versions(root) == []


async def test_torch_module_state_dir_and_verify_keep_parted_tensors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "root"
    p0, p1, _ = _pair(root)
    async with p0, p1:
        for step in (0, 1):
            (s0, l0), (s1, l1) = _step(step)
            call = (lambda p: p.seed) if step == 0 else (lambda p: p.publish)
            await _both([call(p0)(s0, slices=l0), call(p1)(s1, slices=l1)])
    mod = Holder(full_state(1, 2))
    async with ReceiverAgent(
        root, TorchModule(mod, state_dir=tmp_path / "st"), "m", use_inotify=False
    ) as a:
        assert await a.sync_once() == 1
    again = TorchModule(mod, state_dir=tmp_path / "st")  # verifies the module at open
    assert (await again.open()).version == 1
    await again.close()
    async with ReceiverAgent(root, LocalCheckpoint(tmp_path / "ck"), "c", use_inotify=False) as a:
        assert await a.sync_once() == 1
    assert verify_checkpoint(tmp_path / "ck", read_manifest(root, 1)) == []
    assert cli_main(["inspect", str(root), "1"]) == 0
    assert "sparse (2 parts)" in capsys.readouterr().out


async def test_single_rank_slices_must_cover_the_tensor(tmp_path: Path) -> None:
    w = torch.arange(12, dtype=torch.float32)
    async with Publisher(tmp_path / "a") as pub:
        r = await pub.seed({"w": w}, slices={"w": TensorSlice(0, (3, 4))})
        m = read_manifest(tmp_path / "a", r.version)
        assert m.tensors[0].shape == (3, 4) and m.tensors[0].layout == ((0, 12),)
        await pub.publish({"w": w + 1}, slices={"w": TensorSlice(0, (3, 4))})
    mod = Holder({"w": w.reshape(3, 4)})
    async with ReceiverAgent(tmp_path / "a", TorchModule(mod), "m", use_inotify=False) as a:
        assert await a.sync_once() == 1
    assert same_bytes(mod.state_dict()["w"], (w + 1).reshape(3, 4))
    async with Publisher(tmp_path / "b") as pub:
        with pytest.raises(ConfigError, match="slices must tile"):
            await pub.seed({"w": w[:6]}, slices={"w": TensorSlice(0, (3, 4))})
        with pytest.raises(ConfigError, match="do not fit"):
            await pub.seed({"w": w}, slices={"w": TensorSlice(4, (3, 4))})


def test_torch_coordinator_needs_an_initialised_group() -> None:
    with pytest.raises(ConfigError, match="init_process_group"):
        TorchDistCoordinator()
    for bad in (-1.0, float("nan"), "5"):
        with pytest.raises(ConfigError, match="broken_grace"):
            TorchDistCoordinator(broken_grace=bad)  # type: ignore[arg-type]
