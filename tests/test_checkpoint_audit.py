"""The served-bytes audit of a plain LocalCheckpoint (no server: what it serves is its files).

``asyncsync-receiver --audit-interval S`` without ``--sglang-url``/``--vllm-url`` did nothing:
LocalCheckpoint had no ``audit``, so the auditor found it "not supported" and said so only in
``/status``. A byte changed in a data file without changing its stamp (bit rot, an edit that
restored the mtime) was acknowledged for good. Now the audit re-hashes every tensor of the
files against the manifest of the version held; a mismatch makes ``/readyz`` 503, the files
are removed (``repair``) and the receiver re-initialises them from the newest keyframe."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from asyncsync import Publisher
from asyncsync.errors import EngineStateError
from asyncsync.format.acks import read_acks
from asyncsync.format.store import read_manifest
from asyncsync.ops.cli import main as asyncsync_main
from receiver import ReceiverAgent
from receiver.audit import Auditor
from receiver.engines.checkpoint import LocalCheckpoint
from receiver.stream import StreamApplier
from tests.conftest import (
    eventually,
    flip_tensor_byte,
    mixed_state,
    mutate,
    running,
    same_bytes,
    stopped_at_end,
)

REPO = Path(__file__).resolve().parent.parent


async def _status(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(f"{url}/status") as r:
        return await r.json()  # type: ignore[no-any-return]


@contextlib.asynccontextmanager
async def _receiver_cli(tmp_path: Path) -> AsyncIterator[tuple[str, list[str]]]:
    """``mixed_state(0)`` published on ``tmp_path/root`` (v0, then v1 a delta) and the
    ``receiver`` CLI as a process syncing it into ``tmp_path/c``, auditing it every 0.2 s:
    (status URL, its log lines so far); stopped by SIGTERM (exit 0) at the end."""
    root, ckpt, sd = tmp_path / "root", tmp_path / "c", mixed_state(0)
    async with Publisher(root, keyframe_interval=0) as pub:
        await pub.seed(sd)
        await pub.publish(mutate(sd, 0.1, seed=1))  # v1, a delta
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "receiver.cli", "--root", str(root), "--engine-id", "a1",
        "--checkpoint", str(ckpt), "--status-port", "0", "--audit-interval", "0.2",
        "--poll-interval", "0.2", "--force-polling", cwd=REPO, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stderr is not None
    lines: list[str] = []

    async def read_log() -> None:
        assert proc.stderr is not None
        while line := (await proc.stderr.readline()).decode():
            lines.append(line)

    logging = asyncio.create_task(read_log())
    try:
        async with stopped_at_end(proc):
            async with asyncio.timeout(120):
                while not (m := re.search(r"status on (http://127\.0\.0\.1:\d+)", "".join(lines))):
                    assert proc.returncode is None, "".join(lines)
                    await asyncio.sleep(0.05)  # another process's log
            yield m.group(1), lines
    finally:
        await logging


async def test_the_receiver_cli_audits_a_plain_checkpoint_and_reseeds_one_that_rotted(
    tmp_path: Path,
) -> None:
    root, ckpt, sd = tmp_path / "root", tmp_path / "c", mixed_state(0)
    async with (
        _receiver_cli(tmp_path) as (url, lines),
        asyncio.timeout(120),
        aiohttp.ClientSession() as http,
    ):
        while (s := await _status(http, url)).get("audit", {}).get("last") is None:
            assert s.get("audit", {}).get("supported") is not False, s["audit"]
            await asyncio.sleep(0.05)  # polling another process's HTTP state (the audit
            # shows once the engine is open)
        assert s["audit"]["last"]["ok"] and s["audit"]["last"]["version"] == 1, s["audit"]
        assert s["audit"]["last"]["checked"] == len(sd)

        name = "model.layers.2.weight"
        flip_tensor_byte(ckpt, name, keep_mtime=True)
        while (s := await _status(http, url))["audit"]["repairs"] == 0:
            await asyncio.sleep(0.05)
        assert s["audit"]["mismatches"] >= 1, s["audit"]
        # re-initialised from the keyframe, the delta applied again, then audited clean
        while not ((s := await _status(http, url))["version"] == 1 and s["audit"]["healthy"]):
            await asyncio.sleep(0.05)
        async with http.get(f"{url}/readyz") as r:
            assert r.status == 200
    log = "".join(lines)
    assert f"the engine serves other bytes than the manifest for 1 of {len(sd)}" in log, log
    assert f"({name})" in log and "re-initialises from a keyframe" in log, log
    assert asyncsync_main(["verify", str(root), "--checkpoint", str(ckpt)]) == 0
    assert read_acks(root)["a1"].version == 1


def _durable(ckpt: Path, version: int) -> bool:
    """Whether the checkpoint's state.json holds ``version`` flushed (no ``synced: false``)."""
    state = json.loads((ckpt / ".asyncsync" / "state.json").read_text())
    return state["version"] == version and state.get("synced", True) is True


async def test_a_fifo_in_place_of_a_data_file_is_not_ready_nor_acked_and_never_opened(
    tmp_path: Path,
) -> None:
    """(attack-80) A FIFO put in place of a data file of a plain checkpoint: the audit could
    not run (logged at each interval, the auditor healthy), each sync failed ("the checkpoint
    is damaged"), and yet ``/readyz`` answered 200 and the ack still named v1, which the files
    no longer held. The FIFO is refused, never opened (a hostile one must not hang the
    receiver) nor removed: the ack is withdrawn and ``/readyz`` is 503 with the reason until
    it is gone; then the receiver re-initialises the files from a keyframe."""
    root, ckpt = tmp_path / "root", tmp_path / "c"
    async with (
        _receiver_cli(tmp_path) as (url, _),
        asyncio.timeout(120),
        aiohttp.ClientSession() as http,
    ):
        while "a1" not in read_acks(root) or (await _status(http, url))["version"] != 1:
            await asyncio.sleep(0.05)  # another process's ack
        while not _durable(ckpt, 1):  # v1's flush done: the FIFO meets the sync's check, not
            await asyncio.sleep(0.05)  # the flush (which fails on it, and its recovery wipes)
        weight_map = json.loads((ckpt / "model.safetensors.index.json").read_text())
        data = ckpt / weight_map["weight_map"]["model.layers.2.weight"]
        data.unlink()
        os.mkfifo(data)
        while "a1" in read_acks(root):
            await asyncio.sleep(0.05)  # the ack withdrawn
        async with http.get(f"{url}/readyz") as r:
            body = await r.json()
            assert r.status == 503, body
        assert body["serving"] is None and "FIFO" in body.get("error", ""), body
        async with http.get(f"{url}/status") as r:  # the receiver not hung on it
            assert "FIFO" in (await r.json())["last_error"]
        data.unlink()  # the operator's fix: the files re-initialised from the keyframe
        while not ((await _status(http, url))["version"] == 1 and "a1" in read_acks(root)):
            await asyncio.sleep(0.05)
        async with http.get(f"{url}/readyz") as r:
            assert r.status == 200, await r.text()
    assert asyncsync_main(["verify", str(root), "--checkpoint", str(ckpt)]) == 0
    assert read_acks(root)["a1"].version == 1


async def test_the_audit_merges_redo_records_first_and_a_mismatch_is_wiped(
    tmp_path: Path,
) -> None:
    """With a redo log the files are older than the version held: the records are merged into
    them before the audit (as before any read of the bytes), else every audit failed."""
    sd = mixed_state(0)
    async with Publisher(tmp_path / "root", keyframe_interval=0) as pub:
        await pub.seed(sd)
        engine = LocalCheckpoint(tmp_path / "c", redo_log=8, compact_idle=3600)
        async with ReceiverAgent(tmp_path / "root", engine, "r1", use_inotify=False) as agent:
            await agent.sync_once()
            await pub.publish(mutate(sd, 0.1, seed=1))
            assert await agent.sync_once() == 1
            assert engine.redo_held == 1
            auditor = Auditor(agent, interval=None, after_apply=False)
            report = await auditor.audit_once()
            assert report is not None and report.ok and report.checked == len(sd)
            assert engine.redo_held == 0

            flip_tensor_byte(tmp_path / "c", "model.layers.5.weight", keep_mtime=True)
            report = await auditor.audit_once()
            assert report is not None and report.mismatched == ("model.layers.5.weight",)
            assert not auditor.healthy and engine.state.version is None  # removed
            assert "r1" not in read_acks(tmp_path / "root")  # the ack withdrawn at once
            assert await agent.sync_once() == 1  # re-initialised from the keyframe
            report = await auditor.audit_once()
            assert report is not None and report.ok and auditor.healthy


async def test_an_audit_of_another_version_than_the_one_held_is_an_error(tmp_path: Path) -> None:
    """(the auditor reads the manifest of the version held, under the agent's lock: a caller
    of its own may pass another) refused, not reported as a mismatch of every tensor."""
    sd = mixed_state(0)
    async with Publisher(tmp_path / "root") as pub:
        await pub.seed(sd)
        await pub.publish(mutate(sd, 0.1, seed=1))
    engine = LocalCheckpoint(tmp_path / "c")
    async with ReceiverAgent(tmp_path / "root", engine, "r1", use_inotify=False) as agent:
        assert await agent.sync_once() == 1
        v0 = read_manifest(tmp_path / "root", 0)
        with pytest.raises(EngineStateError, match="holds v1, not v0"):
            await engine.audit(v0)
        assert engine.state.version == 1


@pytest.mark.parametrize("redo_log", [0, 8])
async def test_an_audit_while_a_delta_streams_into_the_files_finds_no_mismatch(
    tmp_path: Path, redo_log: int
) -> None:
    """(attack-80) The auditor holds the agent's sync lock, but a streamed delta (format 3,
    receiver/stream.py) is applied into the files outside it, before its manifest: an audit
    of the version held then hashed files half patched to the next one, called every patched
    tensor a mismatch, and the repair removed the checkpoint under the open transaction (the
    ack withdrawn, the model shipped again from a keyframe). Now the tensors patched so far
    are not compared (named in the report), the others are compared with the version held.
    With a redo log (the delta streamed into a record, the files untouched) the audit merges
    the records held into the files first, and that compaction cleared the redo directory,
    the streamed delta's record being written included: its commit failed (FileNotFoundError
    renaming the record), and the version was read and applied a second time."""
    root = tmp_path / "root"
    sd = mixed_state(0, scale=4)
    engine = LocalCheckpoint(tmp_path / "c", redo_log=redo_log, compact_idle=3600)
    agent = ReceiverAgent(root, engine, "e1", use_inotify=False, poll_interval=0.02)
    auditor = Auditor(agent, interval=None, after_apply=False)
    seen: dict[str, Any] = {}
    async with Publisher(root, bucket_bytes=2048, delta_shard_bytes=2048,
                         keyframe_interval=0) as pub:  # fmt: skip
        await pub.seed(sd)
        await pub.publish(mutate(sd, 0.05, seed=1))
        async with running(agent, 1):

            async def hook(vdir: Path) -> None:  # v2's shards durable, its manifest not yet
                n = len(list(vdir.glob("delta-*.safetensors")))
                await eventually(
                    lambda: (
                        isinstance(reader := agent._early.reader, StreamApplier)
                        and len(reader.applied) == n
                    ),
                    "every shard of v2 applied before its manifest",
                    timeout=120,
                )
                seen["report"] = await auditor.audit_once()
                seen["held"] = engine.state.version

            pub.pre_commit_hook = hook
            sd2 = mutate(sd, 0.05, seed=2)
            await pub.publish(sd2)
            await eventually(lambda: agent.version == 2, "the agent at v2", timeout=120)
            status = agent.status()
    report = seen["report"]
    assert report is not None and report.ok, report
    assert status.streamed_shards > 1  # v2 was streamed in, not shipped again after a repair
    assert status.failures == 0 and status.last_error is None, status
    assert report.version == 1 and seen["held"] == 1
    assert report.checked + len(report.skipped) == len(sd)
    assert bool(report.skipped) == (redo_log == 0)  # (a record leaves the files as they were)
    assert auditor.healthy and auditor.stats.repairs == 0
    got = engine.load_state_dict()
    assert set(got) == set(sd2) and all(same_bytes(got[k], t) for k, t in sd2.items())
    assert read_acks(root)["e1"].version == 2
