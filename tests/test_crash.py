"""Crash safety under SIGKILL: the quick versions of ``stress/crash.py`` (issue 5, section 1).

Publisher: a trainer process is killed at random points of publish; after each kill every
committed version is complete and exactly the deterministic state of its number, the restarted
publisher removes the leftovers, and a receiver replays the whole chain bit-exact. Receiver:
``receiver.cli`` is killed at random points of apply into a LocalCheckpoint; after each kill the
engine reports only versions it fully holds, acks never run ahead of it, a reopen recovers, and
a clean run ends bit-exact at the trainer's final state.

Default (``make test``): 6 trials per side, children forked from a preloaded forkserver (same
code, no interpreter start-up), well under a minute together. With ``ASYNCSYNC_LONG=1`` the
full runs: 50 trials per side, every child a fresh interpreter (``python -m receiver.cli`` for
the receiver), as ``make stress`` runs them (several minutes)::

    ASYNCSYNC_LONG=1 .venv/bin/pytest tests/test_crash.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncsync import Publisher
from asyncsync.format.acks import read_acks
from receiver import ReceiverAgent
from receiver.engines.checkpoint import LocalCheckpoint
from receiver.state import STATE_DIR_NAME, StateStore
from stress.procs import REPO, Launch
from stress.receiver_stress import ReceiverParams, run_receiver_stress
from tests.conftest import mixed_state, mutate

LONG = os.environ.get("ASYNCSYNC_LONG") == "1"
TRIALS = 50 if LONG else 6
LAUNCH: Launch = "exec" if LONG else "fork"

LONG_TIMEOUT = pytest.mark.timeout(1800 if LONG else 300)


@pytest.mark.slow
@LONG_TIMEOUT
def test_publisher_killed_mid_publish_never_commits_a_partial_version(tmp_path: Path) -> None:
    """Runs the script itself (its command line, summary line, JSON and exit status)."""
    out = tmp_path / "report.json"
    cmd = [sys.executable, "stress/crash.py", "publisher", "--trials", str(TRIALS)]
    cmd += ["--launch", LAUNCH, "--json", str(out), "--workdir", str(tmp_path / "w"), "-q"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1700)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rep = json.loads(out.read_text())
    assert rep["failures"] == []
    assert rep["trials"] == rep["kills"] == TRIALS
    assert f"publisher crash stress: {TRIALS} trials, {rep['kills_mid']} kills" in proc.stdout
    assert rep["kills_mid"] >= 1  # the kills do land inside publishes
    assert rep["versions"] > TRIALS  # the publisher made progress between kills


@pytest.mark.slow
@LONG_TIMEOUT
def test_receiver_killed_mid_apply_recovers_bit_exact(tmp_path: Path) -> None:
    rep = run_receiver_stress(
        ReceiverParams(trials=TRIALS, launch=LAUNCH, seed=1), tmp_path, say=lambda _m: None
    )
    assert rep.failures == []
    assert rep.trials == TRIALS
    assert rep.kills >= 1 and rep.mid >= 1  # at least one kill landed inside an apply


async def test_ack_never_outlives_a_full_apply_killed_while_moving_files_in(tmp_path: Path) -> None:
    """Found by the receiver stress: a kill while a full version is moved into place makes the
    next open drop the mixed files (the engine holds nothing), so the ack of the version held
    before must go too; the agent then re-initialises from a keyframe and acks again."""
    root, ckpt = tmp_path / "root", tmp_path / "ckpt"
    sd = mixed_state(0)
    async with Publisher(root, keyframe_interval=0) as pub:
        await pub.seed(sd)
        await pub.publish(mutate(sd, 0.05, seed=1))
    async with ReceiverAgent(root, LocalCheckpoint(ckpt), "e", use_inotify=False) as agent:
        assert await agent.sync_once() == 1
    assert read_acks(root)["e"].version == 1
    async with Publisher(root) as pub:  # a restarted trainer re-seeds: v2 is a full apply
        await pub.seed(mutate(sd, 0.05, seed=2))
    # What SIGKILL leaves in the middle of LocalCheckpoint's full commit: state "applying" v2,
    # old and new files mixed (here: one data file already replaced by garbage).
    store = StateStore(ckpt / STATE_DIR_NAME)
    ps = store.open()
    assert ps is not None
    store.save(ps.begin(2, "full"))
    store.close()
    next(ckpt.glob("model-*.safetensors")).write_bytes(b"half-moved")

    agent = ReceiverAgent(root, LocalCheckpoint(ckpt), "e", use_inotify=False)
    await agent.open()
    try:
        assert agent.version is None  # the mixed files were dropped
        assert "e" not in read_acks(root)  # so no ack claims v1 any more
        assert await agent.sync_once() == 2
        assert read_acks(root)["e"].version == 2
    finally:
        await agent.close()


async def test_a_delta_interrupted_on_a_file_cut_behind_its_back_is_wiped_not_refused(
    tmp_path: Path,
) -> None:
    """Found by attack (``truncate`` on the data file of a running receiver, versions every 50
    ms): the delta kernel's writes through the mapping past the cut ended the receiver with
    SIGBUS, and every restart then refused the checkpoint ("tensor ... does not fit its shape
    or the file; the checkpoint is damaged, remove it to reinit") for good. No undo can mend a
    cut file: the open wipes it, as it does a lost journal, and the agent re-initialises."""
    root, ckpt = tmp_path / "root", tmp_path / "ckpt"
    sd = mixed_state(0)
    async with Publisher(root, keyframe_interval=0) as pub:
        await pub.seed(sd)
        async with ReceiverAgent(root, LocalCheckpoint(ckpt), "e", use_inotify=False) as agent:
            assert await agent.sync_once() == 0
        await pub.publish(mutate(sd, 0.05, seed=1))
    # What the SIGBUS leaves: state "applying" v1 (a delta), one data file cut short.
    store = StateStore(ckpt / STATE_DIR_NAME)
    ps = store.open()
    assert ps is not None and ps.version == 0
    store.save(ps.begin(1, "delta"))
    store.close()
    data = next(ckpt.glob("model-*.safetensors"))
    os.truncate(data, data.stat().st_size // 2)

    agent = ReceiverAgent(root, LocalCheckpoint(ckpt), "e", use_inotify=False)
    await agent.open()
    try:
        assert agent.version is None  # the cut files were dropped
        assert "e" not in read_acks(root)  # so no ack claims v0 any more
        assert await agent.sync_once() == 1
        assert read_acks(root)["e"].version == 1
    finally:
        await agent.close()
