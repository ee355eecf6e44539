"""Multi-rank keyframes of a trainer that keeps stepping while it publishes (helper-68).

A single publisher's keyframe saves its full shard from the snapshot its diff advanced: the
bytes its delta ships, whatever the trainer writes meanwhile. A rank of a group keeps its
snapshot apart until the outcome, and saved the full shard from the live tensors, a second
read: when they changed between the diff and the encode the two halves of the keyframe
differed, and every such keyframe failed ("changed while it was published"), retry after retry,
for as long as the trainer stepped. Each rank now reads a keyframe's tensors once, into its own
copy: the version is the tensors as the diff read them, on every receiver, bit-exact.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import time
from pathlib import Path
from typing import Any

from asyncsync.format.store import list_versions
from receiver import ReceiverAgent
from receiver.engines.checkpoint import LocalCheckpoint
from receiver.engines.torch_module import TorchModule
from tests import stepping_rank
from tests.conftest import Holder, assert_holds, sync_to
from tests.stepping_rank import state

WORLD, STEPS = 2, 3


def _model(step: int) -> dict[str, Any]:
    return {k: v for r in range(WORLD) for k, v in state(step, r).items()}


async def _run(tmp_path: Path) -> tuple[Path, dict[int, list[dict[str, Any]]]]:
    root, out = tmp_path / "root", tmp_path / "out"
    out.mkdir()
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.stepping_rank"])
    cfg = {"world": WORLD, "root": str(root), "out": str(out), "steps": STEPS, "retries": 2}
    procs = [ctx.Process(target=stepping_rank.main, args=({**cfg, "rank": r},)) for r in
             range(WORLD)]  # fmt: skip
    for p in procs:
        p.start()
    deadline = time.monotonic() + 180
    while any(p.is_alive() for p in procs):
        assert time.monotonic() < deadline, "the ranks did not finish"
        await asyncio.sleep(0.05)
    assert [p.exitcode for p in procs] == [0] * WORLD
    return root, {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)}


async def test_keyframes_of_ranks_whose_tensors_change_while_published(tmp_path: Path) -> None:
    root, logs = await _run(tmp_path)
    for r in range(WORLD):  # every step published at the first try, nothing stale
        assert [(x["step"], x.get("version"), x.get("stale")) for x in logs[r]] == [
            (s, s, []) for s in range(1, STEPS + 1)
        ], logs[r]
    assert list_versions(root) == list(range(STEPS + 1))
    # a receiver following the chain applies each keyframe's delta; one that starts at the
    # last takes its full data: both hold each step's tensors as the diff read them
    follower = ReceiverAgent(root, TorchModule(Holder(_model(0))), "f", use_inotify=False)
    fresh = ReceiverAgent(root, LocalCheckpoint(tmp_path / "ckpt"), "c", use_inotify=False)
    async with follower, fresh:
        for step in range(STEPS + 1):
            await sync_to(follower, root, step)
            assert_holds(follower.engine.module.state_dict(), _model(step))  # type: ignore[attr-defined]
        assert await fresh.sync_once() == STEPS
        assert_holds(fresh.engine.load_state_dict(), _model(STEPS))  # type: ignore[attr-defined]
