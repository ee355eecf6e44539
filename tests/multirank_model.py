"""A model-based test of the multi-rank publish: ranks as processes, faults at the commit path.

A seeded driver (:func:`run_model`) plays a trainer whose ranks publish in lockstep: at each
step every live rank publishes its portion of the step's model (``tests/dist_worker.py``) once,
whatever happened before, through FileRendezvous (odd seeds pass the step to every publish,
even seeds let the calls pair by count). Before a step the driver may arm one fault in one
rank: a cancellation of its publish or a SIGKILL at one of the awaits of the commit path
(:data:`POINTS`: messages sent, shards and part record written, the hook, before and after the
manifest rename, the result sent, the clean-up, the log line); a rank late past the timeout
(2.5 timeouts); a cancel during the plan, on any rank (it calls first and is cancelled while it
waits for the other); an error raised on one rank only (its encode stage fails; with steps,
half the time it skips the step's call instead, as a step that failed before it could
publish); a second job on the root (rank 1 killed, and a rank 1 of another job token publishes
other weights into the root at that step); or restart one rank or all of them (all: a clean
exit, leaving ``.rendezvous/`` behind). Killed ranks are restarted alone at the next step.
After every step it checks the invariants: at most one new version, which holds exactly that
step's whole model of this job, every manifest it has seen is unchanged, and a group whose
ranks are all alive and call together (a step with no fault armed) commits within
:data:`LIVENESS` such steps. At the end one clean step, then: every committed directory holds
only what its manifest names, the log lists every version once, and a receiver replays the
root bit-exact.

``tests/test_multirank_model.py`` runs it short in ``make test``; ``stress/multirank.py`` long
in ``make stress``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import multiprocessing
import os
import random
import signal
import time
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from asyncsync import FileRendezvous, OutcomeUnknown, Publisher, PublishError
from asyncsync.format import manifest_path
from asyncsync.format.store import list_versions
from asyncsync.publish import commit as commit_mod
from asyncsync.publish import group as group_mod
from asyncsync.publish import rendezvous as rendezvous_mod
from asyncsync.publish import writer as writer_mod
from tests.dist_worker import _arm_fail as arm_fail
from tests.dist_worker import portion

# (point, ranks it can happen on): the awaits of one publish, in order
POINTS = {
    "plan-sent": "others", "shard": "all", "part": "all", "commit-sent": "others",
    "hook": "0", "manifest-before": "0", "manifest-after": "0", "result-before": "0",
    "result-after": "0", "cleanup-before": "0", "cleanup-after": "0", "log-before": "0",
    "log-after": "0",
}  # fmt: skip
LIVENESS = 2  # steps with no fault, all ranks alive, within which the group commits
JOB, OTHER_JOB = "model-job", "intruder-job"

# --------------------------------------------------------------------------- one rank


class _Probes:
    """The fault armed for this step in this process, and the publish task it cancels."""

    def __init__(self) -> None:
        self.spec: dict[str, Any] | None = None
        self.task: asyncio.Future[Any] | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.fired = False

    def hit(self, point: str) -> None:
        spec = self.spec
        if spec is None or spec["point"] != point:
            return
        self.spec = None
        self.fired = True
        if spec["action"] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        assert self.loop is not None and self.task is not None
        self.loop.call_soon_threadsafe(self.task.cancel)
        time.sleep(0.05)  # the cancellation lands while this await is pending


PROBES = _Probes()


def _wrap(mod: Any, attr: str, points: Any) -> None:
    real = getattr(mod, attr)

    def probed(*a: Any, **k: Any) -> Any:
        name = Path(a[0]).name if a and isinstance(a[0], str | os.PathLike) else ""
        before, after = points(name)
        if before:
            PROBES.hit(before)
        out = real(*a, **k)
        if after:
            PROBES.hit(after)
        return out

    setattr(mod, attr, probed)


def _install_probes(rank: int) -> None:
    def rendezvous(name: str) -> tuple[str | None, str | None]:
        if name.startswith("plan-r"):
            return None, "plan-sent"
        if name.startswith("commit-r"):
            return None, "commit-sent"
        if name == "commit.json":
            return "result-before", "result-after"
        return None, None

    _wrap(rendezvous_mod, "atomic_write", rendezvous)
    _wrap(writer_mod, "atomic_write", lambda n: (None, "shard"))
    _wrap(group_mod, "atomic_write", lambda n: (None, "part"))
    _wrap(
        commit_mod,
        "atomic_write",
        lambda n: ("manifest-before", "manifest-after") if n == "manifest.json" else (None, None),
    )
    _wrap(group_mod, "_remove_unnamed", lambda n: ("cleanup-before", "cleanup-after"))
    _wrap(commit_mod, "append_manifest", lambda n: ("log-before", "log-after"))


def rank_main(cfg: dict[str, Any]) -> None:
    """One rank: wait for the driver's go for each step, publish once, report."""
    _install_probes(cfg["rank"])
    asyncio.run(_rank(cfg))


def foreign(step: int, rank: int, world: int) -> tuple[dict[str, Any], Any]:
    """Another job's weights: this job's names and shapes, other values."""
    sd, slices = portion(step, rank, world)
    return {k: v.flip(0) if v.dim() else v + 1 for k, v in sd.items()}, slices


def intruder_main(cfg: dict[str, Any]) -> None:
    """A rank of another job on the same root: publish other weights once, report, exit."""

    async def go() -> None:
        coord = FileRendezvous(cfg["root"], cfg["rank"], cfg["world"], timeout=cfg["timeout"],
                               poll_interval=0.005, job=OTHER_JOB)  # fmt: skip
        rec: dict[str, Any] = {}
        try:
            async with Publisher(cfg["root"], coordinator=coord, bucket_bytes=16 << 10) as pub:
                sd, slices = foreign(cfg["step"], cfg["rank"], cfg["world"])
                kw = {"step": cfg["step"]} if cfg["stepped"] else {}
                rec["version"] = (await pub.publish(sd, slices=slices, **kw)).version
        except PublishError as exc:
            rec["outcome"] = f"error: {exc}"
        Path(cfg["report"]).write_text(json.dumps(rec))

    asyncio.run(go())


async def _rank(cfg: dict[str, Any]) -> None:
    rank, world, ctl = cfg["rank"], cfg["world"], Path(cfg["ctl"])
    coord = FileRendezvous(cfg["root"], rank, world, timeout=cfg["timeout"], poll_interval=0.005,
                           job=JOB)  # fmt: skip
    PROBES.loop = asyncio.get_running_loop()
    hook = (lambda vdir: PROBES.hit("hook")) if rank == 0 else None
    async with Publisher(
        cfg["root"], coordinator=coord, bucket_bytes=16 << 10, keyframe_interval=4,
        pre_commit_hook=hook,
    ) as pub:  # fmt: skip
        step = cfg["start"]
        while True:
            go = ctl / f"go-{step}-r{rank}.json"
            while not go.exists():
                await asyncio.sleep(0.005)
            order = json.loads(go.read_text())
            if order.get("exit"):
                return
            PROBES.spec, PROBES.fired = order.get("fault"), False
            rec: dict[str, Any] = {"step": step}
            if order.get("skip"):  # this rank's step failed before it could publish
                rec.update(outcome="skipped", fired=True)
                _report(ctl, step, rank, rec)
                step += 1
                continue
            if order.get("fail"):
                arm_fail()  # this rank's encode stage fails once
            await asyncio.sleep(order.get("delay", 0.0))
            sd, slices = portion(step, rank, world)
            kw = {"step": step} if cfg["stepped"] else {}
            call = (
                pub.seed(sd, slices=slices, **kw)
                if step == 0
                else pub.publish(sd, slices=slices, **kw)
            )
            PROBES.task = task = asyncio.ensure_future(call)
            if order.get("cancel_after") is not None:
                asyncio.get_running_loop().call_later(order["cancel_after"], task.cancel)
            try:
                rec["version"] = (await task).version
            except asyncio.CancelledError:
                rec["outcome"] = "cancelled"
            except OutcomeUnknown:
                rec["outcome"] = "unknown"
            except PublishError as exc:
                rec["outcome"] = f"error: {exc}"
            PROBES.spec, rec["fired"] = None, PROBES.fired or task.cancelled() or "fail" in order
            _report(ctl, step, rank, rec)
            step += 1


def _report(ctl: Path, step: int, rank: int, rec: dict[str, Any]) -> None:
    tmp = ctl / f".done-{step}-r{rank}"
    tmp.write_text(json.dumps(rec))
    tmp.rename(ctl / f"done-{step}-r{rank}.json")


# --------------------------------------------------------------------------- the driver


class _Group:
    def __init__(self, work: Path, world: int, timeout: float, stepped: bool) -> None:
        self.root, self.ctl = work / "root", work / "ctl"
        self.ctl.mkdir(parents=True)
        self.world, self.timeout, self.stepped = world, timeout, stepped
        self.procs: dict[int, BaseProcess] = {}
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["tests.dist_worker", "tests.multirank_model"])
        self.ctx = ctx

    def start(self, rank: int, step: int) -> None:
        cfg = {"rank": rank, "world": self.world, "root": str(self.root), "ctl": str(self.ctl),
               "timeout": self.timeout, "start": step, "stepped": self.stepped}  # fmt: skip
        p = self.ctx.Process(target=rank_main, args=(cfg,), name=f"model-rank{rank}")
        p.start()
        self.procs[rank] = p

    def intrude(self, rank: int, step: int) -> tuple[BaseProcess, Path]:
        """Start a rank of another job on the root (see :func:`intruder_main`)."""
        report = self.ctl / f"intruder-{step}.json"
        cfg = {"rank": rank, "world": self.world, "root": str(self.root), "step": step,
               "timeout": self.timeout, "stepped": self.stepped, "report": str(report)}  # fmt: skip
        p = self.ctx.Process(target=intruder_main, args=(cfg,), name=f"intruder-rank{rank}")
        p.start()
        return p, report

    def order(self, step: int, rank: int, order: dict[str, Any]) -> None:
        path = self.ctl / f"go-{step}-r{rank}.json"
        tmp = path.with_name("." + path.name)
        tmp.write_text(json.dumps(order))
        tmp.rename(path)

    def wait_step(self, step: int, limit: float) -> dict[int, dict[str, Any] | None]:
        """Each rank's report of ``step`` (None: it died)."""
        deadline = time.monotonic() + limit
        out: dict[int, dict[str, Any] | None] = {}
        while len(out) < self.world:
            for r, p in self.procs.items():
                done = self.ctl / f"done-{step}-r{r}.json"
                if r in out:
                    continue
                if done.exists():
                    out[r] = json.loads(done.read_text())
                elif p.exitcode is not None:
                    out[r] = None
            if time.monotonic() > deadline:
                stuck = sorted(set(self.procs) - set(out))
                raise AssertionError(f"step {step}: ranks {stuck} are stuck")
            time.sleep(0.01)
        return out

    def stop(self, step: int) -> None:
        for r, p in self.procs.items():
            if p.exitcode is None:
                self.order(step, r, {"exit": True})
        for p in self.procs.values():
            p.join(60)
            if p.exitcode is None:
                p.kill()
                raise AssertionError("a rank did not exit")
        for r in self.procs:
            (self.ctl / f"go-{step}-r{r}.json").unlink(missing_ok=True)


def _faults(
    rng: random.Random, world: int, timeout: float, stepped: bool
) -> tuple[str, dict[int, dict[str, Any]]]:
    """What to do before a step: (kind, rank -> its order's fault fields). Kinds: "none",
    "restart-one", "restart-all", "late", "cancel-plan", "error", "skip", "intruder",
    "fault" (a point of :data:`POINTS`)."""
    x = rng.random()
    if x < 0.06:
        return "restart-all", {}
    if x < 0.12:
        return "restart-one", {rng.randrange(world): {}}
    if x < 0.28:
        return "none", {}
    rank = rng.randrange(world)
    if x < 0.38:  # past the timeout: the others give up on this round
        return "late", {rank: {"delay": 2.5 * timeout}}
    if x < 0.48:  # it calls first and is cancelled while it waits for the others in the plan
        others = {r: {"delay": 0.6 * timeout} for r in range(world) if r != rank}
        return "cancel-plan", {rank: {"cancel_after": 0.3 * timeout}, **others}
    if x < 0.58:
        if stepped and rng.random() < 0.5:
            return "skip", {rank: {"skip": True}}
        return "error", {rank: {"fail": True}}
    if x < 0.64 and world > 1:
        return "intruder", {}
    points = [p for p, on in POINTS.items() if on == "all" or (on == "0") == (rank == 0)]
    action = rng.choice(["cancel", "kill"])
    return "fault", {rank: {"action": action, "point": rng.choice(points)}}


def run_model(
    work: Path, *, seed: int, steps: int, world: int = 2, timeout: float = 1.0
) -> dict[str, Any]:
    """Run ``steps`` steps (see the module docstring); return a summary; AssertionError on a
    broken invariant."""
    from tests.test_multirank_faults import assert_finished, steps_of_version

    rng = random.Random(seed)
    stepped = seed % 2 == 1
    g = _Group(work, world, timeout, stepped)
    seen: dict[int, str] = {}  # version -> sha256 of its manifest
    tally: dict[str, int] = {"stepped": int(stepped)}
    idle = 0  # steps with no fault and every rank alive since the last commit
    for r in range(world):
        g.start(r, 0)
    try:
        for step in range(steps + 1):
            kind, faults = (
                _faults(rng, world, timeout, stepped) if 0 < step < steps else ("none", {})
            )
            intruder = None
            if kind == "restart-all":
                g.stop(step)
                for r in range(world):
                    g.start(r, step)
            elif kind == "restart-one":
                (r,) = faults
                g.procs[r].kill()
                g.procs[r].join()
                g.start(r, step)
            for r, p in g.procs.items():
                if p.exitcode is not None:  # killed at the last step: restarted alone
                    g.start(r, step)
            if kind == "intruder":  # rank 1 is down; another job's rank 1 takes its place
                g.procs[1].kill()
                g.procs[1].join()
                intruder = g.intrude(1, step)
            for r in range(world):
                if r in g.procs and g.procs[r].exitcode is None:
                    order = faults.get(r, {}) if kind != "fault" else {"fault": faults.get(r)}
                    g.order(step, r, order)
            before = set(seen)
            reports = g.wait_step(step, 60 + 10 * timeout)
            label = kind
            if kind == "fault":
                ((r, f),) = faults.items()
                landed = reports[r] is None or reports[r].get("fired")  # type: ignore[union-attr]
                label = f"{f['action']} at {f['point']}" + ("" if landed else " (not reached)")
            if intruder is not None:
                proc, report = intruder
                proc.join(60 + 10 * timeout)
                assert proc.exitcode == 0, f"step {step}: the intruder exited {proc.exitcode}"
                got = json.loads(report.read_text())
                assert "version" not in got, f"step {step}: another job's rank committed {got}"
            tally[label] = tally.get(label, 0) + 1
            versions = list_versions(g.root)
            new = [v for v in versions if v not in before]
            assert len(new) <= 1, f"step {step}: versions {new} committed by one round"
            for v in new:
                assert step in steps_of_version(g.root, v, world, range(step + 1)), (step, v)
                seen[v] = hashlib.sha256(manifest_path(g.root, v).read_bytes()).hexdigest()
            for v, digest in seen.items():
                data = manifest_path(g.root, v).read_bytes()
                assert hashlib.sha256(data).hexdigest() == digest, f"v{v} changed at {step}"
            for r, rep in reports.items():
                if rep is not None and "version" in rep:
                    assert rep["version"] in new, (step, r, rep, new)
            tally["committed"] = tally.get("committed", 0) + len(new)
            clean = kind in ("none", "restart-one", "restart-all")
            idle = 0 if new or not clean else idle + 1
            assert idle <= LIVENESS, (
                f"step {step}: {idle} steps with every rank alive and calling together, and "
                f"no commit (reports {reports})"
            )
        g.stop(steps + 1)
    finally:
        for p in g.procs.values():
            if p.exitcode is None:
                p.kill()
    assert_finished(g.root)
    _replay(g.root, world, steps_of_version(g.root, max(seen), world, range(steps + 1)))
    return {"seed": seed, "steps": steps, "world": world, **tally}


def _replay(root: Path, world: int, steps: set[int]) -> None:
    """A receiver that starts empty follows the root to its newest version, bit-exact."""
    from receiver import ReceiverAgent
    from receiver.engines.torch_module import TorchModule
    from tests.conftest import Holder, assert_holds
    from tests.dist_worker import full_state

    mod = Holder(full_state(0, world))

    async def go() -> None:
        async with ReceiverAgent(root, TorchModule(mod), "replay", use_inotify=False) as a:
            await a.sync_once()

    asyncio.run(go())
    assert_holds(mod.state_dict(), full_state(min(steps), world))
