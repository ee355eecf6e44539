"""An open that is cancelled or fails midway (a ``LocalCheckpoint.open()`` whose thread still
runs: a startup deadline, a Ray actor's task cancelled; a ``ReceiverAgent.open()`` failing after
its engine's), then closed: the checkpoint's lock (``flock`` on ``.asyncsync/lock``: one receiver
per checkpoint) as another process sees it."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncsync import Publisher, fsio
from asyncsync.errors import ConfigError
from receiver import ReceiverAgent
from receiver.engines import TorchModule
from receiver.engines.checkpoint import CheckpointFiles, LocalCheckpoint
from tests.conftest import eventually, mixed_state, mutate, sync_to

REPO = Path(__file__).resolve().parent.parent

_TAKER = """
import asyncio, sys, torch
from asyncsync.errors import LockHeld
from receiver.engines import TorchModule
from receiver.engines.checkpoint import LocalCheckpoint
async def main():
    if sys.argv[2] == "module":
        ck = TorchModule(torch.nn.Linear(2, 2), state_dir=sys.argv[1])
    else:
        ck = LocalCheckpoint(sys.argv[1])
    try:
        await ck.open()
    except LockHeld:
        print("refused")
        return
    await ck.close()
    print("took")
asyncio.run(main())
"""


def _opened_by_another_process(ckpt: Path, kind: str = "checkpoint") -> str:
    """``took`` (then closed) or ``refused`` (the checkpoint's lock, or a ``TorchModule``'s
    state directory's with ``kind="module"``, is held), as a receiver in a process of its own
    finds it."""
    proc = subprocess.run([sys.executable, "-c", _TAKER, str(ckpt), kind], capture_output=True,
                          text=True, cwd=REPO, timeout=120)  # fmt: skip
    return proc.stdout.strip() or proc.stderr


async def _checkpoint_at_v0(tmp_path: Path) -> Path:
    root, ckpt = tmp_path / "root", tmp_path / "ckpt"
    async with Publisher(root) as pub:
        await pub.seed(mixed_state(0))
    async with ReceiverAgent(root, LocalCheckpoint(ckpt), "e1", use_inotify=False) as agent:
        assert await agent.sync_once() == 0
    return ckpt


def _gated(real: Callable[..., Any], inside: threading.Event, go: threading.Event) -> Any:
    """``real``, its first call held at a gate (``inside`` set, then ``go`` waited for)."""

    def held(*args: Any, **kw: Any) -> Any:
        if not inside.is_set():
            inside.set()
            assert go.wait(120)
        return real(*args, **kw)

    return held


@pytest.mark.parametrize("kind", ["checkpoint", "module"])
@pytest.mark.parametrize("gate", ["before the lock", "under the lock"])
async def test_an_open_cancelled_midway_then_closed_leaves_the_checkpoint_to_one_receiver(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gate: str, kind: str
) -> None:
    """(attack-85) ``close()`` released the lock at once while the cancelled open's thread
    still ran: held before it took the lock, the thread took it after ``close()`` returned, and
    this process held the checkpoint for good, closed (a replacement receiver refused, as with
    the server lock in attack-80); held after (an interrupted delta undone, files re-checked),
    the thread went on patching the files with the lock let go, another receiver free to open
    them beside it. ``close()`` now waits for that thread and releases the lock after it. A
    ``TorchModule``'s state directory (its lock, its open checking the module's bytes) the same.
    """
    ckpt = await _checkpoint_at_v0(tmp_path) if kind == "checkpoint" else tmp_path / "state"
    inside, go = threading.Event(), threading.Event()
    if gate == "before the lock":  # the state store's parent made durable, its lock not taken
        monkeypatch.setattr(fsio, "fsync_dir", _gated(fsio.fsync_dir, inside, go))
    else:  # the state store's temp files cleared, the lock taken
        monkeypatch.setattr(fsio, "remove_temp_files", _gated(fsio.remove_temp_files, inside, go))
    engine: LocalCheckpoint | TorchModule = (
        LocalCheckpoint(ckpt) if kind == "checkpoint"
        else TorchModule(torch.nn.Linear(2, 2), state_dir=ckpt)
    )  # fmt: skip
    try:
        await _cancel_open_then_close(engine, ckpt, inside, go, gate, kind)
    finally:
        go.set()  # (a failed assert: the thread let go)


async def _cancel_open_then_close(
    engine: LocalCheckpoint | TorchModule,
    ckpt: Path,
    inside: threading.Event,
    go: threading.Event,
    gate: str,
    kind: str,
) -> None:
    opening = asyncio.create_task(engine.open())
    assert await asyncio.to_thread(inside.wait, 120)
    opening.cancel()
    with pytest.raises(asyncio.CancelledError):
        await opening
    closing = asyncio.create_task(engine.close())
    for _ in range(3):
        await asyncio.sleep(0)
    if gate == "under the lock":  # the open's thread works on the files: nobody else may
        assert await asyncio.to_thread(_opened_by_another_process, ckpt, kind) == "refused"
    go.set()
    await asyncio.wait_for(closing, 120)
    await asyncio.to_thread(lambda: engine._mutex.acquire(timeout=120) and engine._mutex.release())
    assert await asyncio.to_thread(_opened_by_another_process, ckpt, kind) == "took"


async def test_an_agent_whose_open_fails_after_the_engines_lets_the_checkpoint_go(
    tmp_path: Path,
) -> None:
    """(attack-85) ``ReceiverAgent.open()`` opened the engine, then failed (here: its ack names
    v0, the new checkpoint holds nothing, and the ack cannot be removed, ``chattr +i``; a
    cancel there, an unreadable root the same): the engine stayed open, its lock held, and the
    agent, never opened, closed nothing, so no receiver could take the checkpoint until this
    process ended (a Ray actor retrying with a new agent: refused for good). The engine is
    closed where the agent's open fails."""
    if shutil.which("chattr") is None:
        pytest.skip("needs chattr (e2fsprogs)")
    await _checkpoint_at_v0(tmp_path)  # acked v0 as e1
    root, ckpt = tmp_path / "root", tmp_path / "other-ckpt"
    ack = root / "acks" / "e1.json"
    subprocess.run(["chattr", "+i", str(ack)], check=True)
    try:
        agent = ReceiverAgent(root, LocalCheckpoint(ckpt), "e1", use_inotify=False)
        with pytest.raises(ConfigError, match="immutable"):  # (the ack removed at open: EPERM)
            await agent.open()
    finally:
        subprocess.run(["chattr", "-i", str(ack)], check=True)
    assert await asyncio.to_thread(_opened_by_another_process, ckpt) == "took"


async def test_a_close_cancelled_while_the_flush_runs_lets_the_checkpoint_go_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(attack-85) ``ReceiverAgent.close()`` cancelled while the checkpoint's close waited for
    the last delta's flush (a shutdown deadline): the checkpoint's lock was released on
    close's last line only, so it stayed held by a process that had closed the agent (which
    will not close it again). It is released on every path now, once the flush (which writes
    ``state.json``) is done: never under it."""
    root, ckpt = tmp_path / "root", tmp_path / "ckpt"
    inside, go = threading.Event(), threading.Event()
    sd = mixed_state(0)
    async with Publisher(root, keyframe_interval=0) as pub:
        await pub.seed(sd)
        await pub.publish(mutate(sd, 0.05, seed=1))
    engine = LocalCheckpoint(ckpt)
    agent = ReceiverAgent(root, engine, "e1", use_inotify=False)
    await agent.open()
    await sync_to(agent, root, 0)
    real = CheckpointFiles.fsync_data_files
    monkeypatch.setattr(CheckpointFiles, "fsync_data_files", _gated(real, inside, go))
    try:
        assert await agent.sync_once() == 1  # v1's flush started after its ack, held
        assert await asyncio.to_thread(inside.wait, 120)
        closing = asyncio.create_task(agent.close())
        for _ in range(3):
            await asyncio.sleep(0)
        closing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closing
        # the flush still runs: nobody else may open the files
        assert await asyncio.to_thread(_opened_by_another_process, ckpt) == "refused"
    finally:
        go.set()
    # the flush done, the lock is let go (in the background: close() was cancelled)
    await eventually(lambda: not engine._store.locked, "the lock released", timeout=60)
    assert await asyncio.to_thread(_opened_by_another_process, ckpt) == "took"
