"""Multi-rank publish under faults: a committed version is immutable and is one training step.

The five failures of issue 15, each reproduced as it was found: a cancel after the manifest
rename (rank 0 removed the version), a cancel during the clean-up after a commit (the next
publish rewrote the manifest), messages of another round or run (a leftover ``.rendezvous/``, a
late rank), a kill after the rename (part records left in a committed directory, no log line),
and uneven ranks (the timeout measured work, not silence). Two ranks run as two Publishers in
one event loop (FileRendezvous) where that is enough, as processes where a kill or
torch.distributed matters.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncsync import FileRendezvous, OutcomeUnknown, Publisher, PublishError
from asyncsync.format import manifest_path
from asyncsync.format.checksum import entry_checksum
from asyncsync.format.log import read_log
from asyncsync.format.store import list_versions, read_manifest
from asyncsync.fsio import Throttle, set_throttle
from asyncsync.publish import group as group_mod
from asyncsync.publish import rendezvous as rendezvous_mod
from asyncsync.publish.rendezvous import RENDEZVOUS_DIR
from tests.conftest import Holder, assert_holds, sync_to
from tests.dist_worker import full_state, portion
from tests.ports import free_port
from tests.test_distributed import _logs, _spawn, _wait_for

W = 2


@pytest.fixture
def throttle() -> Iterator[Callable[[Throttle | None], None]]:
    yield set_throttle
    set_throttle(None)


def _pair(root: Path, timeout: float = 10.0, **kw: Any) -> tuple[Publisher, Publisher]:
    c = [FileRendezvous(root, r, W, timeout=timeout, poll_interval=0.002) for r in (0, 1)]
    kw.setdefault("keyframe_interval", 0)
    return Publisher(root, coordinator=c[0], **kw), Publisher(root, coordinator=c[1], **kw)


def _call(p: Publisher, rank: int, step: int) -> Any:
    sd, sl = _args(step, rank)
    return p.seed(sd, slices=sl) if step == 0 else p.publish(sd, slices=sl)


def _calls(p0: Publisher, p1: Publisher, step: int) -> list[Any]:
    return [_call(p0, 0, step), _call(p1, 1, step)]


def _args(step: int, rank: int) -> tuple[dict[str, torch.Tensor], Any]:
    return portion(step, rank, W)


async def _both(p0: Publisher, p1: Publisher, step: int) -> list[Any]:
    return list(await asyncio.gather(*_calls(p0, p1, step), return_exceptions=True))


def steps_of_version(root: Path, version: int, world: int, steps: range) -> set[int]:
    """The steps whose whole model ``version`` holds (AssertionError if none: a mix)."""
    m = read_manifest(root, version)
    found = set()
    for step in steps:
        want = full_state(step, world)
        if {e.name for e in m.tensors} == set(want) and all(
            entry_checksum(e, want[e.name], m.checksum_algorithm) == e.checksum for e in m.tensors
        ):
            found.add(step)
    assert found, f"v{version} holds no step's model (a mix of steps?)"
    return found


def assert_steps(root: Path, steps: list[int]) -> None:
    """The root's versions are 0, 1, ... and version i holds the model of ``steps[i]``."""
    assert list_versions(root) == list(range(len(steps)))
    for v, step in enumerate(steps):
        assert step in steps_of_version(root, v, W, range(max(steps) + 1)), (v, step)


def assert_finished(root: Path) -> None:
    """Every committed directory holds only its manifest and the files it names, and the log
    lists every committed version once."""
    for v in list_versions(root):
        m = read_manifest(root, v)
        files = {p.name for p in manifest_path(root, v).parent.iterdir()}
        assert files == {"manifest.json", *(s.file for s in m.shards)}, (v, files)
    logged = [r["version"] for r in read_log(root)]
    assert logged == list_versions(root), logged


async def _until(pred: Callable[[], bool]) -> None:
    while not pred():
        await asyncio.sleep(0.002)


async def _received(root: Path, step: int) -> None:
    from receiver import ReceiverAgent
    from receiver.engines.torch_module import TorchModule

    mod = Holder(full_state(step, W))
    async with ReceiverAgent(root, TorchModule(mod), "m", use_inotify=False) as a:
        await a.sync_once()
    assert_holds(mod.state_dict(), full_state(step, W))


# --------------------------------------------------------------------------- 1. after the rename


async def test_cancel_after_the_rename_keeps_the_version(
    tmp_path: Path, throttle: Callable[[Throttle | None], None]
) -> None:
    """A slow rendezvous (0.4 s per operation): rank 0 is cancelled while it tells the others
    that v1 is committed. v1 stays, rank 1 learns it, the next publish is v2 on v1."""
    root = tmp_path / "root"
    p0, p1 = _pair(root, timeout=20)
    async with p0, p1:
        await _both(p0, p1, 0)
        throttle(Throttle(latency=0.4, root=str(root / RENDEZVOUS_DIR)))
        t0, t1 = (asyncio.ensure_future(c) for c in _calls(p0, p1, 1))
        await _until(manifest_path(root, 1).exists)
        renamed = manifest_path(root, 1).read_bytes()
        await asyncio.sleep(0.1)  # rank 0 is now writing the commit result (0.4 s)
        t0.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t0
        assert (await t1).version == 1 and p0.version == 1
        throttle(None)
        r0, r1 = await _both(p0, p1, 2)
        assert (r0.version, r0.base_version) == (r1.version, r1.base_version) == (2, 1)
    assert manifest_path(root, 1).read_bytes() == renamed
    assert_steps(root, [0, 1, 2])
    assert_finished(root)
    await _received(root, 2)


async def test_failing_to_send_the_result_after_the_rename_keeps_the_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Writing rank 0's commit result fails: v1 stays; rank 1 resolves it at the next plan."""
    root = tmp_path / "root"
    p0, p1 = _pair(root, timeout=1)
    real = rendezvous_mod.atomic_write

    def fail_result(path: Path, *a: Any, **k: Any) -> int:
        if path.name == "commit.json":
            monkeypatch.setattr(rendezvous_mod, "atomic_write", real)
            raise OSError(5, "Input/output error (injected)")
        return real(path, *a, **k)

    async with p0, p1:
        await _both(p0, p1, 0)
        monkeypatch.setattr(rendezvous_mod, "atomic_write", fail_result)
        r0, r1 = await _both(p0, p1, 1)
        assert r0.version == 1 and isinstance(r1, OutcomeUnknown), (r0, r1)
        r0, r1 = await _both(p0, p1, 2)
        assert (r0.version, r1.version, r1.base_version) == (2, 2, 1)  # rank 1 adopted v1
    assert_steps(root, [0, 1, 2])
    assert_finished(root)
    await _received(root, 2)


# --------------------------------------------------------------------------- 2. the clean-up


async def test_cancel_during_the_cleanup_never_rewrites_the_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "root"
    p0, p1 = _pair(root)
    cleaning, real = threading.Event(), group_mod._remove_unnamed

    def slow_cleanup(*a: Any) -> None:
        cleaning.set()
        time.sleep(0.3)
        real(*a)

    async with p0, p1:
        await _both(p0, p1, 0)
        monkeypatch.setattr(group_mod, "_remove_unnamed", slow_cleanup)
        t0, t1 = (asyncio.ensure_future(c) for c in _calls(p0, p1, 1))
        await asyncio.to_thread(cleaning.wait, 30)
        renamed = manifest_path(root, 1).read_bytes()
        t0.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t0
        assert (await t1).version == 1 and p0.version == 1
        assert_finished(root)  # the clean-up and the log line were completed
        r0, _ = await _both(p0, p1, 2)
        assert (r0.version, r0.base_version) == (2, 1), r0
    assert manifest_path(root, 1).read_bytes() == renamed
    assert_steps(root, [0, 1, 2])
    assert_finished(root)
    await _received(root, 2)


# --------------------------------------------------------------------------- 3. other rounds


@pytest.mark.parametrize("first", [0, 1])
async def test_a_previous_runs_rendezvous_is_never_taken(tmp_path: Path, first: int) -> None:
    """A group restarted on a root whose .rendezvous/ holds the last run's files (a clean exit):
    its first publish commits at once, whichever rank comes first."""
    root = tmp_path / "root"
    p0, p1 = _pair(root)
    async with p0, p1:
        for step in (0, 1):
            await _both(p0, p1, step)
    assert (root / RENDEZVOUS_DIR / "plan-r0001.json").exists()  # the leftover
    p0, p1 = _pair(root, timeout=5)
    pubs = (p0, p1)
    async with pubs[first]:
        t_first = asyncio.ensure_future(_call(pubs[first], first, 2))
        await asyncio.sleep(0.5)  # the other rank comes later
        async with pubs[1 - first]:
            r_other = await _call(pubs[1 - first], 1 - first, 2)
            r_first = await t_first
    assert r_first.version == r_other.version == 2, (r_first, r_other)
    assert_steps(root, [0, 1, 2])


async def test_a_late_rank_never_joins_the_next_round(tmp_path: Path) -> None:
    """Rank 1 comes 1.3 s late with timeout=1: its call fails like rank 0's did, and the next
    calls pair up; no version mixes two steps."""
    root = tmp_path / "root"
    p0, p1 = _pair(root, timeout=1)
    async with p0, p1:
        await _both(p0, p1, 0)

        async def rank(r: int, p: Publisher, late: float) -> list[Any]:
            await asyncio.sleep(late)
            out: list[Any] = []
            for step in (1, 2, 2, 2, 2, 2):  # step 1 once, then step 2 until it commits
                sd, sl = _args(step, r)
                try:
                    out.append((step, (await p.publish(sd, slices=sl)).version))
                except PublishError as exc:
                    out.append((step, exc))
                if step == 2 and isinstance(out[-1][1], int):
                    break
            return out

        o0, o1 = await asyncio.gather(rank(0, p0, 0.0), rank(1, p1, 1.3))
    assert isinstance(o0[0][1], PublishError) and isinstance(o1[0][1], PublishError), (o0, o1)
    assert o0[-1] == o1[-1] == (2, 1), (o0, o1)
    assert_steps(root, [0, 2])


# --------------------------------------------------------------------------- 4. killed after it


@pytest.mark.parametrize("restart", ["rank0", "all"])
async def test_a_restarted_group_finishes_a_commit_a_kill_interrupted(
    tmp_path: Path, restart: str
) -> None:
    """Rank 0 is SIGKILLed right after renaming step 2's manifest: part records are left and
    no log line; the restarted rank 0 (alone, or with every rank) finishes that commit."""
    root, out = tmp_path / "root", tmp_path / "out"
    out.mkdir()
    cfg = {"coord": "file", "world": W, "root": str(root), "out": str(out), "steps": 4,
           "timeout": 2.0, "kill_after_rename": [0, 2],
           "exit_on_error": restart == "all"}  # fmt: skip
    procs = [_spawn({**cfg, "rank": r}) for r in range(W)]
    await _wait_for(lambda: procs[0].exitcode is not None, procs, 120, "rank 0's kill")
    assert procs[0].exitcode == -9 and manifest_path(root, 2).exists()
    assert any(p.name.startswith("part-") for p in manifest_path(root, 2).parent.iterdir())
    if restart == "all":
        await _wait_for(lambda: procs[1].exitcode is not None, procs, 120, "rank 1's exit")
        assert procs[1].exitcode == 3  # OutcomeUnknown for step 2
    again = {**cfg, "start": 3, "incarnation": 1}
    procs += [_spawn({**again, "rank": r}) for r in ([0] if restart == "rank0" else range(W))]
    await _wait_for(lambda: not any(p.is_alive() for p in procs), procs, 120, "the group")
    assert [p.exitcode for p in procs[2:]] == [0] * len(procs[2:])
    if restart == "rank0":
        assert procs[1].exitcode == 0
        assert "unknown" in next(r for r in _logs(out)[1] if r["step"] == 2)
    assert_steps(root, [0, 1, 2, 3, 4])
    assert_finished(root)
    assert read_manifest(root, 4).base_version == 3  # deltas go on


# --------------------------------------------------------------------------- 5. uneven ranks


def _uneven(rank: int, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    n = 4 if rank == 0 else 2 << 20  # 16 B against 8 MB
    return {f"r{rank}": torch.rand(n, generator=g)}


async def test_a_slow_rank_is_waited_for_and_a_silent_one_named(
    tmp_path: Path, throttle: Callable[[Throttle | None], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """16 B against 8 MB over a 4 MB/s filesystem with timeout=1.5: rank 1 writes for 2 s while
    it beats, and the version commits; a rank that stops beating is called silent (stopped by
    a cancel that tells nobody, as a rank that dies)."""
    root = tmp_path / "root"
    throttle(Throttle(bandwidth=4e6, root=str(root)))

    async def tells_nobody(*a: Any) -> None:
        return None

    monkeypatch.setattr(FileRendezvous, "abandon", tells_nobody)
    p0, p1 = _pair(root, timeout=1.5)
    async with p0, p1:
        t = time.monotonic()
        r0, r1 = await asyncio.gather(p0.seed(_uneven(0, 0)), p1.seed(_uneven(1, 0)))
        assert r0.version == r1.version == 0 and time.monotonic() - t > 1.5
        t1 = asyncio.ensure_future(p1.publish(_uneven(1, 1), keyframe=True))
        t0 = asyncio.ensure_future(p0.publish(_uneven(0, 1), keyframe=True))
        await asyncio.sleep(0.5)  # rank 1 is writing its 8 MB: it stops for good
        t1.cancel()
        with pytest.raises(PublishError, match=r"ranks \[1\] went silent") as ei:
            await t0
        assert ei.value.ranks == (1,)
        with pytest.raises(asyncio.CancelledError):
            await t1
    assert list_versions(root) == [0]


async def test_a_rank_past_max_wait_is_called_slow(
    tmp_path: Path, throttle: Callable[[Throttle | None], None]
) -> None:
    root = tmp_path / "root"
    throttle(Throttle(bandwidth=4e6, root=str(root)))
    c0 = FileRendezvous(root, 0, W, timeout=1.5, poll_interval=0.002, max_wait=0.5)
    c1 = FileRendezvous(root, 1, W, timeout=1.5, poll_interval=0.002)
    async with Publisher(root, coordinator=c0) as p0, Publisher(root, coordinator=c1) as p1:
        r0, r1 = await asyncio.gather(
            p0.seed(_uneven(0, 0)), p1.seed(_uneven(1, 0)), return_exceptions=True
        )
    assert isinstance(r0, PublishError) and r0.ranks == (1,), r0
    assert "alive but slow" in str(r0) and "silent" not in str(r0)
    assert isinstance(r1, PublishError), r1
    assert list_versions(root) == []


# --------------------------------------------------------------------------- torch.distributed


async def test_torch_cancel_during_the_broadcast_keeps_the_version(tmp_path: Path) -> None:
    """gloo, 2 processes: rank 0 is cancelled while it broadcasts that step 1 is committed
    (rank 1 joins the broadcast a second late): v1 stays, and the group goes on from it."""
    root, out = tmp_path / "root", tmp_path / "out"
    out.mkdir()
    cfg = {"coord": "torch", "world": W, "root": str(root), "out": str(out), "steps": 3,
           "port": free_port(), "cancel_after_rename": [0, 1],
           "slow_broadcast": [1, 1]}  # fmt: skip
    procs = [_spawn({**cfg, "rank": r}) for r in range(W)]
    await _wait_for(lambda: not any(p.is_alive() for p in procs), procs, 120, "the group")
    assert [p.exitcode for p in procs] == [0, 0]
    logs = _logs(out)
    cancelled = next(r for r in logs[0] if r["step"] == 1)
    assert cancelled.get("cancelled") and cancelled["version"] == 1, cancelled
    assert next(r for r in logs[1] if r["step"] == 1)["version"] == 1
    assert_steps(root, [0, 1, 2, 3])
    assert read_manifest(root, 2).base_version == 1
    assert_finished(root)


@pytest.mark.parametrize(
    ("coord", "fault"),
    [("torch", ["after_commit", 1, 3, "cancel"]), ("file", ["in_adopt", 1, 3, "kill"])],
)
async def test_a_rank_stopped_while_it_brings_its_snapshot_up(
    tmp_path: Path, coord: str, fault: list[Any]
) -> None:
    """Rank 1, as a process, is stopped half-way through bringing its snapshot up to a
    committed version: its call cancelled after v3's commit (gloo: it must see the cancel, which
    it did not, and the group stay whole), or SIGKILLed while it adopts v2, whose outcome it
    missed (restarted: no snapshot, so the group publishes full). Every version is then one
    step's whole model, and a receiver walking the versions holds each one."""
    from receiver import ReceiverAgent
    from receiver.engines.torch_module import TorchModule

    root, out = tmp_path / "root", tmp_path / "out"
    out.mkdir()
    cfg = {"coord": coord, "world": W, "root": str(root), "out": str(out), "steps": 5,
           "port": free_port(), "timeout": 3.0, "miss": [1, 2], fault[0]: fault[1:]}  # fmt: skip
    procs = [_spawn({**cfg, "rank": r}) for r in range(W)]
    if fault[-1] == "kill":
        await _wait_for(lambda: procs[1].exitcode is not None, procs, 120, "rank 1's kill")
        assert procs[1].exitcode == -9
        procs.append(_spawn({**cfg, "rank": 1, "start": 3, "incarnation": 1}))
    await _wait_for(lambda: not any(p.is_alive() for p in procs), procs, 120, "the group")
    assert [p.exitcode for p in procs if p is not procs[1] or fault[-1] != "kill"] == [0, 0]
    logs = _logs(out)
    if fault[-1] == "cancel":
        assert next(r for r in logs[1] if r["step"] == 3).get("cancelled"), logs[1]
    steps = [min(steps_of_version(root, v, W, range(6))) for v in list_versions(root)]
    assert steps == sorted(steps) and steps[-1] == 5, steps
    mod = Holder(full_state(0, W))
    async with ReceiverAgent(root, TorchModule(mod), "walk", use_inotify=False) as agent:
        for v, step in enumerate(steps):
            await sync_to(agent, root, v)
            assert_holds(mod.state_dict(), full_state(step, W))


# --------------------------------------------------------------------------- a skipped step


@pytest.mark.parametrize("coord", ["torch", "file"])
@pytest.mark.parametrize("skipper", [0, 1])
async def test_a_rank_that_skips_a_step_costs_the_group_that_step_only(
    tmp_path: Path, coord: str, skipper: int
) -> None:
    """Issue 23: rank ``skipper`` skips steps 2 and 3 (they failed before it could publish).
    With the caller's step in every round, the other rank's step 2 is never paired with the
    skipper's step 4 (over gloo the calls pair in order: that made a version of two steps); the
    other rank fails step 2 with StepBehind blaming itself and naming the group's step (rank 0
    behind used to blame rank 1, "already at step 3 ... (rank 0 late)", and the worker retried
    step 2 until it gave up), and step 4 commits on both. The worker stepped by one after the
    error, not to the step it names: its step 3 failed the same way (helper-56)."""
    root, out = tmp_path / "root", tmp_path / "out"
    out.mkdir()
    cfg = {"coord": coord, "world": W, "root": str(root), "out": str(out), "steps": 4,
           "port": free_port(), "timeout": 10.0, "stepped": True,
           "skip": [skipper, 2, 2]}  # fmt: skip
    procs = [_spawn({**cfg, "rank": r}) for r in range(W)]
    await _wait_for(lambda: not any(p.is_alive() for p in procs), procs, 150, "the group")
    assert [p.exitcode for p in procs] == [0, 0]
    logs = _logs(out)
    behind = 1 - skipper
    assert [r["step"] for r in logs[skipper] if "version" in r] == [0, 1, 4]
    failed = [r for r in logs[behind] if "error" in r]
    assert len(failed) == 1 and failed[0]["ranks"] == [behind], logs[behind]  # one call only
    assert "step 2 while the group is at step 4" in failed[0]["error"], failed[0]
    assert [r["step"] for r in logs[behind] if "version" in r] == [0, 1, 4]
    assert_steps(root, [0, 1, 4])
    assert_finished(root)


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_slime_updater_check_failing_on_rank0_fails_the_step_on_every_rank(
    tmp_path: Path,
) -> None:
    """Issue 23, slime's real call sequence over gloo (two trainer processes): rank 0's check
    of its engines raises at step 2. Rank 1 fails step 2 too (it used to publish it, and the
    collectives then paired rank 0's step 3 with rank 1's step 2: versions of two steps), and
    every committed version holds exactly one step's model."""
    import json
    import subprocess
    import sys

    from tests.slime_stubs import megatron

    root = tmp_path / "disk"
    cfg = {
        "world": 2, "init": str(tmp_path / "pg-init"), "gen": "gen2", "steps": 5,
        "checkpoints": [], "out": str(tmp_path / "rank{rank}.json"), "fail_check": [0, 2],
        "args": {
            "update_weight_mode": "full", "update_weight_transport": "disk",
            "update_weight_disk_dir": str(root), "asyncsync_receivers": "none",
            "update_weight_disk_keep_files": True,
            "update_weight_local_checkpoint_dir": str(tmp_path / "local"),
            "asyncsync_converter": "tests.slime_stubs.megatron:convert",
        },
    }  # fmt: skip
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(repo), "ASYNCSYNC_LOG_LEVEL": "WARNING"}
    cmd = [sys.executable, "-m", "tests.slime_stubs.actor_loop", str(tmp_path / "cfg.json")]
    ranks = [subprocess.Popen([*cmd, str(r)], cwd=repo, env=env) for r in range(2)]
    try:
        codes = [await asyncio.to_thread(p.wait, 200) for p in ranks]
    finally:
        for p in ranks:
            p.kill()
    assert codes == [0, 0]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [e[0] for e in reports[0]["errors"]] == [2] and "receiver died" in reports[0]["errors"][
        0
    ][1]
    assert [e[0] for e in reports[1]["errors"]] == [2], reports[1]
    assert "rank 0" in reports[1]["errors"][0][1] and "receiver died" in reports[1]["errors"][0][1]
    # slime's weight_version of asyncsync version v is v + 1 (full mode: no receivers needed, the
    # engines reload weight_v{N}; delta mode refuses --asyncsync-receivers none since issue 25)
    assert reports[0]["versions"] == reports[1]["versions"] == [1, 2, 3, 4]
    for v, step in enumerate([0, 1, 3, 4]):  # version v holds the model of that step, exactly
        m = read_manifest(root, v)
        want = megatron.hf_state(step)
        assert {e.name for e in m.tensors} == set(want)
        assert all(
            entry_checksum(e, want[e.name], m.checksum_algorithm) == e.checksum for e in m.tensors
        ), (v, step)
    assert list_versions(root) == [0, 1, 2, 3]
