"""Publisher crash stress: SIGKILL a publishing trainer at random points, restart it, check.

Each trial starts a publisher child (:mod:`stress.children`) on the same root. The child opens
a Publisher (removing what the last kill left), the driver checks the root is clean, lets it go,
and kills it after a random delay drawn over about one re-seed plus three deltas, so kills land
in every part of a publish: shard writes, the manifest write, the log append, between
publishes, and in the re-seed. After each kill the driver records what the kill left on disk and
checks every invariant of :class:`stress.ondisk.RootChecker`. At the end a fresh publisher
opens the root once more (it must leave it clean) and an in-process receiver follows the whole
chain from scratch, one version at a time (every delta and every re-seed, in order), into a
LocalCheckpoint that must be bit-exact at each version and equal ``state(latest)`` at the end.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from asyncsync.errors import AsyncSyncError
from asyncsync.format import ROOT_INFO_NAME, version_dir
from asyncsync.format.store import list_versions, read_manifest
from asyncsync.publish.publisher import Publisher
from receiver.agent import ReceiverAgent
from receiver.engines.checkpoint import LocalCheckpoint, verify_checkpoint
from stress.ondisk import Leftovers, RootChecker, leftovers, state_diff
from stress.procs import Child, Launch
from stress.report import Ema, StressReport
from stress.states import VersionedState

__all__ = ["PublisherParams", "run_publisher_stress"]

_OPEN_TIMEOUT = 180.0  # seconds for a child to import torch and open the root (noisy machine)


@dataclass(frozen=True)
class PublisherParams:
    """Sizes of the publisher stress: ~277k elements (~0.6 MB) in 8 KiB buckets, so a seed or a
    delta publish writes ~70 shards, each with its own fsync."""

    trials: int = 50
    seed: int = 0
    elements: int = 300_000
    bucket_bytes: int = 8 << 10
    keyframe_interval: int = 5
    launch: Launch = "fork"
    max_failures: int = 5


def _category(lo: Leftovers) -> str:
    temps = [p.name for p in lo.temps]
    if any(".tmp.manifest.json" in t for t in temps):
        return "manifest temp file (kill inside the commit)"
    if temps:
        return "shard temp file (kill inside a shard write)"
    if any(lo.uncommitted.values()):
        return "shards without manifest"
    if lo.uncommitted:
        return "empty version dir"
    if lo.log_lag:
        return "committed, log line not yet appended"
    return "no trace (between publishes)"


def _phase(events: list[dict[str, Any]], t_kill: float, mean: dict[str, Ema]) -> str:
    """Where the kill landed by the child's event log."""
    if not events:
        return "before the re-seed"
    last = events[-1]
    if last["ev"] == "commit":
        return "between publishes"
    frac = (t_kill - last["t"]) / max(mean[last["kind"]].value, 1e-3)
    quarter = min(int(frac * 4), 4)
    label = ("0-25%", "25-50%", "50-75%", "75-100%", ">100%")[quarter]
    return f"{last['kind']} {label}"


def _events(ctl: Path, pid: int) -> list[dict[str, Any]]:
    try:
        lines = (ctl / "events.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("pid") == pid:
            out.append(rec)
    return out


def _wait_open(child: Child, path: Path, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return True
        if child.poll() is not None:
            return False
        time.sleep(0.005)
    return False


def run_publisher_stress(
    params: PublisherParams, work: Path | None = None, *, say: Callable[[str], None] = print
) -> StressReport:
    """Run the trials; return the report (``report.ok`` is False on any invariant failure).

    ``work`` (default: a new temp dir, removed when everything passed) holds the root, the
    control files and the children's logs.
    """
    t0 = time.monotonic()
    own = work is None
    work = Path(tempfile.mkdtemp(prefix="asyncsync-crash-pub-")) if work is None else work
    root, ctl, logs = work / "root", work / "ctl", work / "logs"
    for d in (root, ctl, logs):
        d.mkdir(parents=True, exist_ok=True)
    rep = StressReport("publisher", params=asdict(params))
    states = VersionedState(params.seed, params.elements)
    checker = RootChecker(root, states.state)
    rng = random.Random(params.seed)
    mean = {"seed": Ema(0.5), "delta": Ema(0.3), "keyframe": Ema(0.5)}
    shards_at_kill: list[int] = []
    argv = [
        "publisher", "--root", str(root), "--ctl", str(ctl), "--seed", str(params.seed),
        "--elements", str(params.elements), "--bucket-bytes", str(params.bucket_bytes),
        "--keyframe-interval", str(params.keyframe_interval),
    ]  # fmt: skip
    for trial in range(params.trials):
        if len(rep.failures) >= params.max_failures:
            say(f"stopping after {len(rep.failures)} failures")
            break
        child = Child(params.launch, "stress.children", argv, logs / f"publisher-{trial:03d}.log")
        if not _wait_open(child, ctl / f"open-{child.pid}.json", _OPEN_TIMEOUT):
            child.kill()
            rep.failures.append(f"trial {trial}: publisher never opened: {child.log_tail()}")
            continue
        lo = leftovers(root)
        if not lo.clean:
            rep.failures.append(
                f"trial {trial}: after Publisher.open the root still has leftovers: "
                f"uncommitted={sorted(lo.uncommitted)} temps={[str(p) for p in lo.temps]}"
            )
        horizon = mean["seed"].value + 3 * mean["delta"].value
        delay = rng.uniform(0.0, horizon)
        (ctl / f"go-{child.pid}").touch()
        deadline = time.monotonic() + delay
        while time.monotonic() < deadline and child.poll() is None:
            time.sleep(min(0.005, max(0.0, deadline - time.monotonic())))
        if child.poll() is not None:
            rep.failures.append(
                f"trial {trial}: the publisher died on its own (status {child.poll()}): "
                f"{child.log_tail()}"
            )
            continue
        t_kill = child.kill()
        rep.trials += 1
        rep.kills += 1
        events = _events(ctl, child.pid)
        rep.phases[_phase(events, t_kill, mean)] += 1
        starts: dict[int, float] = {}
        for ev in events:
            if ev["ev"] == "start":
                starts[ev["version"]] = ev["t"]
            elif ev["version"] in starts:
                mean[ev["kind"]].add(ev["t"] - starts[ev["version"]])
        lo = leftovers(root)
        rep.categories[_category(lo)] += 1
        if lo.mid_publish:
            rep.mid += 1
        shards_at_kill += [len(files) for files in lo.uncommitted.values()]
        bad = checker.check()
        rep.failures += [f"trial {trial} (after kill): {b}" for b in bad]
        say(
            f"trial {trial + 1}/{params.trials}: killed after {delay:.3f}s, "
            f"{_category(lo)}; committed {len(list_versions(root))}; "
            f"{'OK' if not bad else 'FAIL'}"
        )
    rep.failures += _final_checks(root, work, states, rep)
    rep.failures += [f"final: {b}" for b in checker.check()]
    rep.versions = len(list_versions(root))
    rep.extra["shards_in_uncommitted_dir_at_kill"] = sorted(shards_at_kill)
    rep.extra["mean_publish_seconds"] = {k: round(v.value, 4) for k, v in mean.items()}
    rep.extra["work"] = str(work)
    rep.seconds = time.monotonic() - t0
    if own and rep.ok:
        shutil.rmtree(work, ignore_errors=True)
    return rep


def _final_checks(root: Path, work: Path, states: VersionedState, rep: StressReport) -> list[str]:
    """A last restart must leave the root clean; a receiver must replay the chain bit-exact."""
    bad: list[str] = []

    async def reopen() -> None:
        async with Publisher(root):
            pass

    asyncio.run(reopen())
    lo = leftovers(root)
    if not lo.clean:
        bad.append(f"final: a fresh Publisher.open left {sorted(lo.uncommitted)} {lo.temps}")
    versions = list_versions(root)
    if not versions:
        return [*bad, "final: nothing was ever committed"]
    t = time.monotonic()
    try:
        bad += asyncio.run(_replay(root, work / "replay", versions, rep))
    except AsyncSyncError as exc:
        bad.append(f"final replay: the receiver refused the chain: {exc!r}")
    rep.extra["replay_seconds"] = round(time.monotonic() - t, 3)
    if not bad:
        got = LocalCheckpoint(work / "replay" / "ckpt").load_state_dict()
        want = states.state(versions[-1])
        bad += [f"final replay: {d} (want state({versions[-1]}))" for d in state_diff(got, want)]
    return bad


async def _replay(root: Path, work: Path, versions: list[int], rep: StressReport) -> list[str]:
    """Follow the chain version by version, as a receiver that ran next to the publisher would.

    Each committed version is copied into a replay root and synced on its own, so every delta
    and every re-seed is applied in order; after each the checkpoint must be bit-exact at that
    version (whose tensors the RootChecker already matched against ``state(v)``).
    """
    shutil.rmtree(work, ignore_errors=True)
    replay_root, ckpt = work / "root", work / "ckpt"
    replay_root.mkdir(parents=True)
    shutil.copy2(root / ROOT_INFO_NAME, replay_root / ROOT_INFO_NAME)
    agent = ReceiverAgent(
        replay_root,
        LocalCheckpoint(ckpt),
        "stress-replay",
        use_inotify=False,
        prefetch=False,
        verify_deadline=0,
    )
    full = 0
    async with agent:
        for v in versions:
            shutil.copytree(version_dir(root, v), version_dir(replay_root, v))
            held = await agent.sync_once()
            if held != v:
                return [f"final replay: after v{v} the receiver holds {held}"]
            m = read_manifest(replay_root, v)
            full += m.base_version is None
            mism = verify_checkpoint(ckpt, m)
            if mism:
                return [f"final replay: at v{v} the checkpoint differs in {mism[:5]}"]
    rep.extra["replayed_versions"] = len(versions)
    rep.extra["replayed_full_versions"] = full
    return []
