"""A model-based test of the whole protocol (hypothesis ``RuleBasedStateMachine``, issue 13).

A real publisher, two receivers (a LocalCheckpoint and a TorchModule persisting its version in
a state directory) and ``gc`` over one real root, driven by random interleavings of: publish
(random density, zero diff, keyframe on request, a change of tensor set), receiver restart,
``kill -9`` of a receiver child process at a random moment, of either engine kind (the
checkpoint: ``asyncsync-receiver --once``; the module: ``tests/module_child.py``, whose
module's bytes live in a shared file and so outlive it, as a module of an inference process
outlives a receiver thread), damage to a random file of a random version (flip, truncate,
delete), deletion of an ack, gc with random policies, and a publisher restart. After every
step:

* an engine's bytes equal the bytes of the committed version its state names;
* an ack never names a version its engine does not hold (same run, version, fingerprint);
* gc never deletes the newest keyframe (checked around each gc);
* with an intact keyframe at or after the newest damage (and an intact chain from it), every
  receiver reaches the newest version within a bounded number of syncs.

``make test`` runs a short, seeded form; ``ASYNCSYNC_LONG=1`` (``make stress``) a long one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from asyncsync import AsyncSyncError, Publisher
from asyncsync.format.acks import read_acks
from asyncsync.format.lease import read_lease
from asyncsync.format.store import list_versions, read_manifest
from asyncsync.publish.retention import RetentionPolicy, collect
from receiver import ReceiverAgent
from receiver.engines.checkpoint import LocalCheckpoint
from receiver.engines.torch_module import TorchModule
from tests.conftest import Holder, mixed_state, mutate, same_bytes
from tests.module_child import SharedHolder, layout_of

LONG = os.environ.get("ASYNCSYNC_LONG") == "1"
REPO = Path(__file__).resolve().parent.parent
SYNCS_TO_CONVERGE = 3
KILLS = 3 if LONG else 1  # kill_module_child per example


def _small_state(extra: int = 0) -> dict[str, torch.Tensor]:
    sd = {k: v for k, v in mixed_state(0).items() if not k.startswith("model.layers.1")}
    for i in range(extra):
        sd[f"model.extra.{i}"] = torch.arange(16, dtype=torch.float32) + i
    return sd


class ProtocolModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(os.environ["ASYNCSYNC_MODEL_TMP"]) / f"m{time.monotonic_ns()}"
        self.root = self.tmp / "root"
        self.loop = asyncio.new_event_loop()
        self.states: dict[int, dict[str, torch.Tensor]] = {}
        self.current = _small_state()
        self.extra = 0
        self.damaged: set[int] = set()
        self.kills = 0
        self.pub = self._publisher()
        self.run(self.pub.open())
        self.states[self.run(self.pub.seed(self.current)).version] = self.current
        self.module = Holder(self.current)
        self.agents: dict[str, ReceiverAgent | None] = {"ck": None, "mod": None}
        for name in self.agents:
            self._start(name)

    # -- plumbing --------------------------------------------------------------------------
    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def _publisher(self) -> Publisher:
        return Publisher(self.root, bucket_bytes=4096, keyframe_interval=0)

    def _start(self, name: str, *, keep_module: bool = False) -> None:
        if name == "ck":
            engine: Any = LocalCheckpoint(self.tmp / "ck")
        else:
            if not keep_module:
                self.module = Holder(self.current)  # a restarted process: an empty module
            engine = TorchModule(self.module, state_dir=self.tmp / "modstate")
        agent = ReceiverAgent(self.root, engine, name, use_inotify=False, verify_deadline=0.05)
        self.run(agent.open())
        self.agents[name] = agent

    def _stop(self, name: str) -> None:
        agent = self.agents[name]
        if agent is not None:
            self.run(agent.close())
        self.agents[name] = None

    def _sync(self, name: str) -> None:
        agent = self.agents[name]
        assert agent is not None
        with contextlib.suppress(AsyncSyncError):  # refused: the invariants say what still holds
            self.run(agent.sync_once())

    def _held(self, name: str) -> dict[str, torch.Tensor]:
        agent = self.agents[name]
        assert agent is not None
        if name == "ck":
            return agent.engine.load_state_dict()  # type: ignore[attr-defined,no-any-return]
        names = self.states[agent.version].keys() if agent.version is not None else []
        sd = self.module.state_dict()
        return {n: sd[n] for n in names if n in sd}

    def teardown(self) -> None:
        for name in self.agents:
            self._stop(name)
        self.run(self.pub.close())
        self.loop.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    # -- rules -----------------------------------------------------------------------------
    @rule(
        density=st.sampled_from([0.0, 0.01, 0.2, 0.9]),
        keyframe=st.booleans(),
        change_set=st.integers(0, 9),
        seed=st.integers(0, 2**16),
    )
    def publish(self, density: float, keyframe: bool, change_set: int, seed: int) -> None:
        if change_set == 0:  # a change of tensor set: the publisher sends a full version
            self.extra += 1
            sd = {**self.current, f"model.extra.{self.extra}": torch.full((8,), float(seed))}
        else:
            sd = mutate(self.current, density, seed=seed) if density else dict(self.current)
        r = self.run(self.pub.publish(sd, keyframe=keyframe))
        self.current = sd
        self.states[r.version] = sd

    @rule(name=st.sampled_from(["ck", "mod"]))
    def sync(self, name: str) -> None:
        self._sync(name)

    @rule(name=st.sampled_from(["ck", "mod"]))
    def restart_receiver(self, name: str) -> None:
        self._stop(name)
        self._start(name)

    @rule(delay=st.floats(0.0, 2.0))
    def kill_receiver_child(self, delay: float) -> None:
        """``kill -9`` of a real receiver process applying into the checkpoint."""
        self._stop("ck")
        argv = [sys.executable, "-m", "receiver.cli", "--root", str(self.root),
                "--engine-id", "ck", "--checkpoint", str(self.tmp / "ck"), "--once",
                "--apply-group-bytes", "2048"]  # fmt: skip
        self._run_and_kill(argv, delay)
        self._start("ck")

    @precondition(lambda self: self._held_version("mod") is not None and self.kills < KILLS)
    @rule(delay=st.floats(0.0, 0.6))
    def kill_module_child(self, delay: float) -> None:
        """``kill -9`` of a real receiver process applying into a TorchModule whose weights
        outlive it (a shared file holding the module's bytes) and whose version is in its
        state directory, ``delay`` seconds after it is ready to sync; the restarted receiver
        takes that module and state (at most ``KILLS`` per example: each child imports
        torch)."""
        self._stop("mod")
        self.kills += 1
        layout = layout_of(self.module.state_dict())
        mem = self.tmp / f"modmem{self.kills}"
        shared = SharedHolder(mem, layout)
        for k, t in self.module.state_dict().items():
            shared.state_dict()[k].copy_(t)
        argv = [sys.executable, "-m", "tests.module_child", str(self.root), "mod",
                str(self.tmp / "modstate"), str(mem), json.dumps(layout)]  # fmt: skip
        self._run_and_kill(argv, delay, ready=True)
        self.module = shared  # what the child left in the shared memory
        self._start("mod", keep_module=True)

    def _held_version(self, name: str) -> int | None:
        agent = self.agents[name]
        return agent.version if agent is not None else None

    def _run_and_kill(self, argv: list[str], delay: float, *, ready: bool = False) -> None:
        """Run ``argv``; SIGKILL it ``delay`` s after its start (``ready``: after it prints a
        line saying it is about to sync) unless it exits first."""
        out = subprocess.PIPE if ready else subprocess.DEVNULL
        with subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=subprocess.DEVNULL) as child:
            if ready and child.stdout is not None:
                child.stdout.readline()  # blocks until the child is ready, or exits
            try:
                child.wait(timeout=delay)
            except subprocess.TimeoutExpired:
                child.send_signal(signal.SIGKILL)
                child.wait()

    @rule(
        which=st.integers(0, 2**16),
        file=st.integers(0, 2**16),
        at=st.integers(0, 2**16),
        how=st.sampled_from(["flip", "truncate", "delete"]),
    )
    def damage(self, which: int, file: int, at: int, how: str) -> None:
        # indices, not draws from what is on disk: the strategy must not depend on the state
        versions = list_versions(self.root)
        v = versions[which % len(versions)]
        vdir = self.root / f"v{v:012d}"
        files = sorted(p for p in vdir.iterdir() if not p.name.startswith("."))
        if not files:
            return
        p = files[file % len(files)]
        raw = p.read_bytes()
        if how == "delete":
            p.unlink()
        elif how == "truncate":
            p.write_bytes(raw[: len(raw) // 2])
        elif raw:
            b = bytearray(raw)
            b[at % len(b)] ^= 0x01
            p.write_bytes(bytes(b))
        self.damaged.add(v)

    @rule(name=st.sampled_from(["ck", "mod"]))
    def delete_ack(self, name: str) -> None:
        (self.root / "acks" / f"{name}.json").unlink(missing_ok=True)

    def _newest_keyframe(self) -> int | None:
        for v in reversed(list_versions(self.root)):
            with contextlib.suppress(OSError, AsyncSyncError):
                if read_manifest(self.root, v).kind == "full":
                    return v
        return None

    @rule(keep=st.one_of(st.none(), st.integers(1, 4)), ttl=st.sampled_from([None, 1e-6, 600.0]))
    def gc(self, keep: int | None, ttl: float | None) -> None:
        kf = self._newest_keyframe()
        chain = [v for v in list_versions(self.root) if kf is not None and v >= kf]
        collect(self.root, RetentionPolicy(keep_versions=keep, ack_ttl=ttl))
        # gc never deletes the newest keyframe, nor anything after it
        assert [v for v in list_versions(self.root) if v in chain] == chain

    @rule()
    def restart_publisher(self) -> None:
        """A restarted trainer: no snapshot, so it seeds a full version of its state."""
        self.run(self.pub.close())
        self.pub = self._publisher()
        self.run(self.pub.open())
        self.states[self.run(self.pub.seed(self.current)).version] = self.current

    def _converges(self) -> bool:
        """An intact keyframe at or after the newest damage, and an intact chain from it."""
        versions = list_versions(self.root)
        newest_damage = max(self.damaged, default=-1)
        for v in reversed(versions):
            if v in self.damaged:
                return False
            try:
                if read_manifest(self.root, v).kind == "full" and v >= newest_damage:
                    return versions[-1] - v == len([x for x in versions if x >= v]) - 1
            except (OSError, AsyncSyncError):
                return False
        return False

    @precondition(lambda self: self._converges())
    @rule()
    def converge(self) -> None:
        latest = list_versions(self.root)[-1]
        if set(self.module.state_dict()) != set(self.states[latest]):
            # a live module cannot grow or lose tensors: a new tensor set is a redeploy
            self._stop("mod")
            self._start("mod")
        for name in self.agents:
            for _ in range(SYNCS_TO_CONVERGE):
                self._sync(name)
                agent = self.agents[name]
                if agent is not None and agent.version == latest:
                    break
            agent = self.agents[name]
            assert agent is not None and agent.version == latest, (name, agent, self.damaged)

    # -- invariants ------------------------------------------------------------------------
    @invariant()
    def engines_hold_a_committed_version_bit_for_bit(self) -> None:
        for name, agent in self.agents.items():
            if agent is None or agent.version is None:
                continue
            want = self.states[agent.version]
            got = self._held(name)
            assert set(got) == set(want), name
            for k, t in want.items():
                assert same_bytes(got[k], t), (name, agent.version, k)

    @invariant()
    def acks_never_name_more_than_the_engine_holds(self) -> None:
        acks = read_acks(self.root)
        for name, agent in self.agents.items():
            ack = acks.get(name)
            if agent is None or ack is None:
                continue
            st_ = agent.engine.state
            assert st_.version is not None and ack.version <= st_.version, (name, ack, st_)
            if ack.version == st_.version:
                assert (ack.fingerprint, ack.run_id) == (st_.fingerprint, st_.run_id)


SHORT = settings(
    max_examples=4,
    stateful_step_count=20,
    deadline=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)
LONG_SETTINGS = settings(
    max_examples=40, stateful_step_count=40, deadline=None, suppress_health_check=list(HealthCheck)
)


@pytest.mark.timeout(900 if LONG else 280)
def test_protocol_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCSYNC_MODEL_TMP", str(tmp_path))
    ProtocolModel.TestCase.settings = LONG_SETTINGS if LONG else SHORT
    ProtocolModel.TestCase().runTest()


def test_kill_of_a_module_receiver_mid_apply(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The model's ``kill_module_child`` 20 and 50 ms into dense deltas (the hypothesis run
    may draw it rarely): after each kill the restarted receiver takes the lease over, holds
    a committed version bit for bit or none, its ack names no more, and it then catches up."""
    monkeypatch.setenv("ASYNCSYNC_MODEL_TMP", str(tmp_path))
    m = ProtocolModel()
    held: list[int | None] = []  # the version each restarted receiver found
    try:
        m.sync("mod")
        for i, delay in enumerate([0.02, 0.05]):
            m.publish(0.9, False, 1, i)  # dense: many apply groups of 2 KiB
            m.kill_module_child(delay)
            agent = m.agents["mod"]
            assert agent is not None
            found = read_lease(m.root, "mod")
            assert found is not None and found[0].owner == agent._presence.lease.owner
            held.append(agent.version)
            m.engines_hold_a_committed_version_bit_for_bit()
            m.acks_never_name_more_than_the_engine_holds()
            m.sync("mod")
            assert m.agents["mod"] is not None and m.agents["mod"].version == max(m.states)
            m.acks_never_name_more_than_the_engine_holds()
    finally:
        m.teardown()
    print("versions held after each kill:", held, "published:", sorted(m.states))
