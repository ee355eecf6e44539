"""A model-based test of the multi-rank publish: ranks as processes, faults at the commit path.

A seeded driver (:func:`run_model`) plays a trainer whose ranks publish in lockstep: at each
step every live rank publishes its portion of the step's model (``tests/dist_worker.py``) once,
whatever happened before, through FileRendezvous. Before a step the driver may arm one fault in
one rank: a cancellation of its publish or a SIGKILL at one of the awaits of the commit path
(:data:`POINTS`: messages sent, shards and part record written, the hook, before and after the
manifest rename, the result sent, the clean-up, the log line); or restart one rank or all of
them (all: a clean exit, leaving ``.rendezvous/`` behind). Killed ranks are restarted alone at
the next step. After every step it checks the invariant: at most one new version, which holds
exactly that step's whole model, and every manifest it has seen is unchanged. At the end one
clean step, then: every committed directory holds only what its manifest names, the log lists
every version once, and a receiver replays the root bit-exact.

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
from tests.dist_worker import portion

# (point, ranks it can happen on): the awaits of one publish, in order
POINTS = {
    "plan-sent": "others", "shard": "all", "part": "all", "commit-sent": "others",
    "hook": "0", "manifest-before": "0", "manifest-after": "0", "result-before": "0",
    "result-after": "0", "cleanup-before": "0", "cleanup-after": "0", "log-before": "0",
    "log-after": "0",
}  # fmt: skip

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


async def _rank(cfg: dict[str, Any]) -> None:
    rank, world, ctl = cfg["rank"], cfg["world"], Path(cfg["ctl"])
    coord = FileRendezvous(cfg["root"], rank, world, timeout=cfg["timeout"], poll_interval=0.005)
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
            sd, slices = portion(step, rank, world)
            call = pub.seed(sd, slices=slices) if step == 0 else pub.publish(sd, slices=slices)
            PROBES.task = task = asyncio.ensure_future(call)
            rec: dict[str, Any] = {"step": step}
            try:
                rec["version"] = (await task).version
            except asyncio.CancelledError:
                rec["outcome"] = "cancelled"
            except OutcomeUnknown:
                rec["outcome"] = "unknown"
            except PublishError as exc:
                rec["outcome"] = f"error: {exc}"
            PROBES.spec, rec["fired"] = None, PROBES.fired
            tmp = ctl / f".done-{step}-r{rank}"
            tmp.write_text(json.dumps(rec))
            tmp.rename(ctl / f"done-{step}-r{rank}.json")
            step += 1


# --------------------------------------------------------------------------- the driver


class _Group:
    def __init__(self, work: Path, world: int, timeout: float) -> None:
        self.root, self.ctl = work / "root", work / "ctl"
        self.ctl.mkdir(parents=True)
        self.world, self.timeout = world, timeout
        self.procs: dict[int, BaseProcess] = {}
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["tests.dist_worker", "tests.multirank_model"])
        self.ctx = ctx

    def start(self, rank: int, step: int) -> None:
        cfg = {"rank": rank, "world": self.world, "root": str(self.root), "ctl": str(self.ctl),
               "timeout": self.timeout, "start": step}  # fmt: skip
        p = self.ctx.Process(target=rank_main, args=(cfg,), name=f"model-rank{rank}")
        p.start()
        self.procs[rank] = p

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


def _faults(rng: random.Random, world: int) -> tuple[str, dict[int, dict[str, Any]]]:
    """What to do before a step: ("none" | "restart-one" | "restart-all", rank -> fault)."""
    x = rng.random()
    if x < 0.08:
        return "restart-all", {}
    if x < 0.15:
        return "restart-one", {rng.randrange(world): {}}
    if x < 0.35:
        return "none", {}
    rank = rng.randrange(world)
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
    g = _Group(work, world, timeout)
    seen: dict[int, str] = {}  # version -> sha256 of its manifest
    tally: dict[str, int] = {}
    for r in range(world):
        g.start(r, 0)
    try:
        for step in range(steps + 1):
            kind, faults = _faults(rng, world) if 0 < step < steps else ("none", {})
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
            for r in range(world):
                fault = faults.get(r) if kind == "fault" else None
                g.order(step, r, {"fault": fault})
            before = set(seen)
            reports = g.wait_step(step, 60 + 10 * timeout)
            label = kind
            if kind == "fault":
                ((r, f),) = faults.items()
                landed = reports[r] is None or reports[r].get("fired")  # type: ignore[union-attr]
                label = f"{f['action']} at {f['point']}" + ("" if landed else " (not reached)")
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
