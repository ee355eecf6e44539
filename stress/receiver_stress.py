"""Receiver crash stress: SIGKILL ``python -m receiver.cli`` at random points of an apply.

The driver keeps a trainer in-process (a :class:`~asyncsync.ops.workload.Workload` of 4M elements,
bf16 Adam steps, published in 256 KiB buckets; a delta packs into one or two shards, which
the receiver applies in 48 KiB groups, ~30 journaled ``apply`` calls; a zero-diff version every
7th, a keyframe every 10th, and a trainer restart every 8th, whose re-seed is a full version
the engine must apply whole). Each trial tops the root up to ``ahead`` versions past what the
engine holds, starts ``receiver.cli --once`` on a LocalCheckpoint, waits until it holds the
engine lock, picks one of the pending versions and kills the receiver inside it (see
:class:`_Aim`): at a random fraction of its apply, or, for full versions, also the instant
staging begins or the files start moving in.

After every kill, before the next start:

* the engine's ``state.json`` (read without the lock): if it says clean at ``v``, the files are
  bit-exact at ``v`` — an engine never reports a version it does not fully hold;
* the ack of the engine never names a version past the one the state holds, and its
  fingerprint is that version's;
* recovery: a copy of the directory is opened in-process by a ReceiverAgent (the engine's
  ``open`` rolls an interrupted delta back from its journal or drops a mixed full apply; the
  agent then makes its ack name no more than the engine holds) and must verify bit-exact at
  the version it reports, the version the state held (none after a dropped full apply), with
  an ack that does not exceed it. The original is left for the next child to recover, so
  kills also land inside recovery.

After the last trial a clean run must exit 0 holding the newest version, bit-exact against
its manifest (``asyncsync verify``) and equal to the trainer's final state dict.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from asyncsync.errors import AsyncSyncError
from asyncsync.format import ACKS_DIR, ROOT_INFO_NAME
from asyncsync.format.acks import read_acks
from asyncsync.format.store import list_versions, read_manifest
from asyncsync.ops.cli.verify import verify_checkpoint_dir
from asyncsync.ops.workload import Workload
from asyncsync.publish.publisher import Publisher
from receiver.agent import ReceiverAgent
from receiver.engines.checkpoint import LocalCheckpoint, verify_checkpoint
from receiver.shard_reader import apply_groups
from receiver.state import JOURNAL_DIR, LOCK_NAME, STAGING_DIR, STATE_DIR_NAME, StateStore
from stress.ondisk import state_diff
from stress.procs import Child, Launch
from stress.report import Ema, StressReport

__all__ = ["ReceiverParams", "run_receiver_stress"]

APPLY_GROUP_BYTES = 48 << 10  # small apply groups: a delta is many journaled apply calls

ENGINE_ID = "stress-engine"
Trigger = Literal["time", "staging", "swap"]
_OPEN_TIMEOUT = 180.0
_FINAL_TIMEOUT = 600.0


@dataclass(frozen=True)
class ReceiverParams:
    """Sizes of the receiver stress (defaults: 4M elements, ~30 apply groups per delta)."""

    trials: int = 50
    seed: int = 0
    elements: int = 4_000_000
    bucket_bytes: int = 256 << 10
    ahead: int = 4
    keyframe_interval: int = 10
    zero_diff_every: int = 7
    reseed_every: int = 8  # a trainer restart: a full version without base, a full apply
    launch: Launch = "exec"
    max_failures: int = 5


class _Trainer:
    """The in-process trainer: a workload and a publisher open on the root."""

    def __init__(self, root: Path, p: ReceiverParams, runner: asyncio.Runner) -> None:
        self.runner = runner
        self.p = p
        self.wl = Workload.for_elements(p.elements, seed=p.seed, extras=True)
        self.pub = Publisher(
            root, bucket_bytes=p.bucket_bytes, keyframe_interval=p.keyframe_interval
        )
        runner.run(self.pub.open())
        self.sd = self.wl.state_dict()
        runner.run(self.pub.seed(self.sd))
        self.published = 1
        self.reseeds = 0
        self.seconds = 0.0

    @property
    def latest(self) -> int:
        v = self.pub.version
        assert v is not None
        return v

    def publish_until(self, version: int) -> None:
        t = time.monotonic()
        while self.latest < version:
            nxt = self.latest + 1
            if self.p.zero_diff_every <= 0 or nxt % self.p.zero_diff_every:
                self.wl.step()
                self.sd = self.wl.state_dict()
            if self.p.reseed_every > 0 and nxt % self.p.reseed_every == 0:
                self._restart()
                self.runner.run(self.pub.seed(self.sd))
                self.reseeds += 1
            else:
                self.runner.run(self.pub.publish(self.sd))
            self.published += 1
        self.seconds += time.monotonic() - t

    def _restart(self) -> None:
        """The trainer process restarts: a new publisher, no snapshot, so it re-seeds."""
        self.runner.run(self.pub.close())
        self.pub = Publisher(
            self.pub.root,
            bucket_bytes=self.p.bucket_bytes,
            keyframe_interval=self.p.keyframe_interval,
        )
        self.runner.run(self.pub.open())

    def close(self) -> None:
        self.runner.run(self.pub.close())


def _held(ckpt: Path) -> int | None:
    st = StateStore(ckpt / STATE_DIR_NAME).load() if (ckpt / STATE_DIR_NAME).is_dir() else None
    return None if st is None else st.version


def _wait_locked(child: Child, lock: Path, timeout: float) -> bool:
    """Until the child holds the engine lock (the file names its pid) or has ended."""
    want = f"{child.pid} "
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if lock.read_text().startswith(want):
                return True
        except OSError:
            pass
        if child.poll() is not None:
            return False
        time.sleep(0.002)
    return False


class _Aim:
    """Where a kill lands: a version picked by the driver, at a random fraction of its apply.

    The driver polls the engine's ``state.json`` (read-only) while the child runs: once the
    engine holds the version before the target, the target is being applied (or recovered
    into, or prepared), and the kill comes after ``fraction`` of the mean duration of versions
    of that kind, learnt from the same polls. So every kind of version (delta, full, zero-diff)
    is hit, from the first instant of its apply to its commit.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.mean = {"delta": Ema(0.2), "full": Ema(0.5), "zero-diff": Ema(0.02)}
        self._kinds: dict[int, str] = {}

    def kind(self, version: int) -> str:
        if version not in self._kinds:
            m = read_manifest(self.root, version)
            if m.base_version is None:
                k = "full"
            elif any(s.role == "delta" for s in m.shards):
                k = "delta"
            else:
                k = "zero-diff"
            self._kinds[version] = k
        return self._kinds[version]

    def follow(
        self,
        child: Child,
        ckpt: Path,
        held: int | None,
        target: int,
        fraction: float,
        trigger: Trigger = "time",
    ) -> int | None:
        """Poll until it is time to kill (None) or the child has ended (its exit status).

        ``trigger`` "time" kills at ``fraction`` of the target's mean duration; "staging" as
        soon as a full apply has staged a file; "swap" as soon as the state says a full
        version is being moved into place (a window of a few renames).
        """
        since = time.monotonic()
        kill_at: float | None = None
        sdir = ckpt / STATE_DIR_NAME
        while (status := child.poll()) is None:
            now = time.monotonic()
            st = StateStore(sdir).load() if sdir.is_dir() else None
            cur = None if st is None else st.version
            if cur != held:
                if cur is not None and held is not None and cur == held + 1:
                    self.mean[self.kind(cur)].add(now - since)
                held, since = cur, now
            if (held if held is not None else -1) >= target - 1:
                if trigger == "swap" and st is not None and st.applying and st.mode == "full":
                    return None
                if trigger == "staging" and _files(sdir / STAGING_DIR):
                    return None
                if trigger == "time" and kill_at is None:
                    kill_at = now + fraction * self.mean[self.kind(target)].value
            if kill_at is not None and now >= kill_at:
                return None
            time.sleep(0.001 if trigger != "time" else 0.002)
        return status


def _files(d: Path) -> list[str]:
    try:
        return sorted(p.name for p in d.iterdir())
    except FileNotFoundError:
        return []


def _classify(root: Path, ckpt: Path) -> tuple[str, str | None, bool]:
    """(category, phase, mid-apply) of what a kill left in the checkpoint."""
    sdir = ckpt / STATE_DIR_NAME
    st = StateStore(sdir).load() if sdir.is_dir() else None
    journal, staging = _files(sdir / JOURNAL_DIR), _files(sdir / STAGING_DIR)
    if st is not None and st.applying and st.mode == "delta":
        assert st.target_version is not None
        m = read_manifest(root, st.target_version)
        groups = [
            apply_groups(m, "delta", i, APPLY_GROUP_BYTES)
            for i, s in enumerate(m.shards)
            if s.role == "delta"
        ]
        n = max(1, sum(len(g) for g in groups))  # one journal file per apply group
        return "state applying a delta", _quarter("delta", len(journal) / n), True
    if st is not None and st.applying:
        return "state applying a full version (moving files in)", "full swap", True
    if staging:
        return "staging a full version", f"full: {len(staging)} parts staged", True
    if journal:
        return "delta committed, journal not yet cleared", "delta commit", True
    if st is None or st.version is None:
        return "no version yet (opening)", None, False
    if not st.synced:
        return "delta committed and acked, flush to disk in progress", "delta flush", False
    return "clean between versions", None, False


def _quarter(kind: str, frac: float) -> str:
    labels = ("0-25%", "25-50%", "50-75%", "75-100%", "100% (in commit)")
    return f"{kind} shards applied {labels[min(int(frac * 4), 4)]}"


def _check_after_kill(root: Path, ckpt: Path, scratch: Path) -> list[str]:
    """The invariants a killed receiver must leave (see the module docstring)."""
    bad: list[str] = []
    sdir = ckpt / STATE_DIR_NAME
    st = StateStore(sdir).load() if sdir.is_dir() else None
    held = None if st is None else st.version
    if st is not None and not st.applying and held is not None:
        mism = verify_checkpoint(ckpt, read_manifest(root, held))
        if mism:
            bad.append(f"state says clean at v{held} but the files differ in {mism[:5]}")
    ack = read_acks(root).get(ENGINE_ID)
    if ack is not None:
        if held is None or ack.version > held:
            bad.append(f"ack names v{ack.version} but the engine's state holds v{held}")
        elif ack.fingerprint != read_manifest(root, ack.version).fingerprint:
            bad.append(f"ack of v{ack.version} has a fingerprint that is not v{ack.version}'s")
    # Recovery, on copies: the original is left to the next child (kills can hit recovery
    # too). A ReceiverAgent opens a copy of the checkpoint against a scratch root holding a copy
    # of the acks, which is exactly what the restarted receiver does first.
    shutil.rmtree(scratch, ignore_errors=True)
    if not ckpt.exists():
        return bad
    s_ckpt, s_root = scratch / "ckpt", scratch / "root"
    shutil.copytree(ckpt, s_ckpt, ignore=shutil.ignore_patterns(LOCK_NAME))
    s_root.mkdir()
    shutil.copy2(root / ROOT_INFO_NAME, s_root / ROOT_INFO_NAME)
    if (root / ACKS_DIR).is_dir():
        shutil.copytree(root / ACKS_DIR, s_root / ACKS_DIR)

    async def reopen() -> int | None:
        agent = ReceiverAgent(s_root, LocalCheckpoint(s_ckpt), ENGINE_ID, use_inotify=False)
        await agent.open()
        try:
            return agent.version
        finally:
            await agent.close()

    try:
        got = asyncio.run(reopen())
    except AsyncSyncError as exc:
        return [*bad, f"reopening after the kill failed: {exc!r}"]
    if st is not None and st.applying and st.mode == "full":
        if got is not None:
            bad.append(f"an interrupted full apply reopened at v{got}, want no version")
    elif got != held:
        bad.append(f"reopened at v{got}, but the state held v{held}")
    if got is not None:
        mism = verify_checkpoint(s_ckpt, read_manifest(root, got))
        if mism:
            bad.append(f"after recovery the engine reports v{got} but differs in {mism[:5]}")
    ack = read_acks(s_root).get(ENGINE_ID)
    if ack is not None and (got is None or ack.version > got):
        bad.append(f"after reopening the engine holds v{got} but its ack names v{ack.version}")
    shutil.rmtree(scratch, ignore_errors=True)
    return bad


def run_receiver_stress(
    params: ReceiverParams, work: Path | None = None, *, say: Callable[[str], None] = print
) -> StressReport:
    """Run the trials; return the report (``report.ok`` is False on any invariant failure)."""
    t0 = time.monotonic()
    own = work is None
    work = Path(tempfile.mkdtemp(prefix="asyncsync-crash-recv-")) if work is None else work
    root, ckpt, logs, scratch = work / "root", work / "ckpt", work / "logs", work / "scratch"
    for d in (root, logs):
        d.mkdir(parents=True, exist_ok=True)
    rep = StressReport("receiver", params=asdict(params))
    rng = random.Random(params.seed)
    aim = _Aim(root)
    rep.extra["aimed"] = Counter[str]()
    argv = [
        "--root", str(root), "--engine-id", ENGINE_ID, "--checkpoint", str(ckpt), "--once",
        "--apply-group-bytes", str(APPLY_GROUP_BYTES),
        "--force-polling", "--log-level", "WARNING",
    ]  # fmt: skip
    lock = ckpt / STATE_DIR_NAME / LOCK_NAME
    with asyncio.Runner() as runner:
        trainer = _Trainer(root, params, runner)
        try:
            for trial in range(params.trials):
                if len(rep.failures) >= params.max_failures:
                    say(f"stopping after {len(rep.failures)} failures")
                    break
                before = _held(ckpt)
                trainer.publish_until((before if before is not None else 0) + params.ahead)
                child = Child(params.launch, "receiver.cli", argv, logs / f"recv-{trial:03d}.log")
                if not _wait_locked(child, lock, _OPEN_TIMEOUT):
                    status = child.poll()
                    child.kill()
                    rep.failures.append(
                        f"trial {trial}: the receiver never took the engine lock "
                        f"(status {status}): {child.log_tail()}"
                    )
                    continue
                rep.trials += 1
                first = 0 if before is None else before + 1
                target = rng.randint(first, trainer.latest)
                kind = aim.kind(target)
                trigger: Trigger = "time"
                if kind == "full":
                    trigger = rng.choice(["time", "staging", "swap"])
                t_open = time.monotonic()
                status = aim.follow(child, ckpt, before, target, rng.random(), trigger)
                if status is None:
                    child.kill()
                    rep.kills += 1
                    rep.extra["aimed"][f"{kind} ({trigger})"] += 1
                    category, phase, mid = _classify(root, ckpt)
                else:
                    category, phase, mid = f"exited on its own (status {status})", None, False
                    if status != 0:
                        rep.failures.append(f"trial {trial}: receiver failed: {child.log_tail()}")
                rep.categories[category] += 1
                rep.phases[phase or category] += 1
                rep.mid += mid
                after = _held(ckpt)
                bad = _check_after_kill(root, ckpt, scratch)
                rep.failures += [f"trial {trial} (after kill): {b}" for b in bad]
                say(
                    f"trial {trial + 1}/{params.trials}: aimed at v{target} ({kind}, {trigger}), "
                    f"killed after {time.monotonic() - t_open:.3f}s ({category}); engine "
                    f"v{before} -> v{after} of {trainer.latest}; {'OK' if not bad else 'FAIL'}"
                )
            rep.failures += _final_run(params, root, ckpt, logs, argv, trainer, rep)
        finally:
            trainer.close()
    rep.versions = len(list_versions(root))
    rep.extra["mean_apply_seconds"] = {k: round(e.value, 4) for k, e in aim.mean.items()}
    rep.extra["published"] = trainer.published
    rep.extra["reseeds"] = trainer.reseeds
    rep.extra["publish_seconds"] = round(trainer.seconds, 3)
    rep.extra["work"] = str(work)
    rep.seconds = time.monotonic() - t0
    if own and rep.ok:
        shutil.rmtree(work, ignore_errors=True)
    return rep


def _final_run(
    params: ReceiverParams,
    root: Path,
    ckpt: Path,
    logs: Path,
    argv: list[str],
    trainer: _Trainer,
    rep: StressReport,
) -> list[str]:
    """A clean run to the newest version: exit 0, bit-exact, the trainer's state, acked."""
    t = time.monotonic()
    child = Child(params.launch, "receiver.cli", argv, logs / "recv-final.log")
    try:
        status = child.wait(_FINAL_TIMEOUT)
    except TimeoutError:
        return [f"final: the clean run did not finish in {_FINAL_TIMEOUT}s"]
    rep.extra["final_run_seconds"] = round(time.monotonic() - t, 3)
    if status != 0:
        return [f"final: the clean run exited {status}: {child.log_tail()}"]
    latest = trainer.latest
    bad = []
    report = verify_checkpoint_dir(root, ckpt)
    if report.version != latest or not report.ok:
        bad.append(f"final: {report.describe()} (newest is v{latest})")
    got = LocalCheckpoint(ckpt).load_state_dict()
    want = {k: v.contiguous() for k, v in trainer.sd.items()}
    bad += [f"final: {d} (vs the trainer's state)" for d in state_diff(got, want)]
    ack = read_acks(root).get(ENGINE_ID)
    m = read_manifest(root, latest)
    if ack is None or ack.version != latest or ack.fingerprint != m.fingerprint:
        bad.append(f"final: ack {ack} is not v{latest} with fingerprint {m.fingerprint}")
    return bad
