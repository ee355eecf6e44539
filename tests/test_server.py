"""The receiver's HTTP endpoints on 127.0.0.1: health, status, metrics, the token-guarded sync."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from asyncsync import IncompleteVersion, Publisher
from asyncsync.format.acks import read_acks
from receiver import ReceiverAgent
from receiver.engines.checkpoint import LocalCheckpoint
from receiver.server import StatusServer
from tests.conftest import mixed_state, mutate

TOKEN = "s3cret-token-0123456789"


async def test_status_health_metrics_and_guarded_sync(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "root"
    sd = mixed_state(0)
    async with Publisher(root, keyframe_interval=0) as pub:
        await pub.seed(sd)
        agent = ReceiverAgent(root, LocalCheckpoint(tmp_path / "c"), "gpu0", poll_interval=30,
                              use_inotify=False)  # fmt: skip
        stop = asyncio.Event()
        async with StatusServer(agent, token=TOKEN) as server, aiohttp.ClientSession() as http:
            assert server.url.startswith("http://127.0.0.1:")
            run = asyncio.create_task(agent.run(stop=stop))
            await pub.wait_acked(0, engines=["gpu0"], timeout=10)

            async with http.get(f"{server.url}/status") as r:
                st = await r.json()
            assert r.status == 200 and st["engine_id"] == "gpu0" and st["version"] == 0
            assert st["lag"] == 0 and st["root"] == str(root)
            async with http.get(f"{server.url}/healthz") as r:
                assert r.status == 200 and (await r.json())["ok"] is True

            # a new version; the agent polls only every 30 s, so ask it to sync now
            await pub.publish(mutate(sd, 0.05, seed=1))
            async with http.post(f"{server.url}/sync") as r:
                assert r.status == 401
            async with http.post(
                f"{server.url}/sync", headers={"Authorization": "Bearer wrong-token-xxxxxxxx"}
            ) as r:
                assert r.status == 401
            async with http.post(
                f"{server.url}/sync", headers={"Authorization": f"Bearer {TOKEN}"}
            ) as r:
                assert r.status == 202
            await pub.wait_acked(1, engines=["gpu0"], timeout=10)

            async with http.get(f"{server.url}/metrics") as r:
                text = await r.text()
            assert r.status == 200 and r.content_type == "text/plain"
            assert 'asyncsync_receiver_version{engine_id="gpu0"} 1.0' in text
            assert 'asyncsync_receiver_applied_total{engine_id="gpu0"} 2.0' in text
            stop.set()
            agent.request_sync()
            await run
        await agent.close()
    assert TOKEN not in caplog.text


async def test_unhealthy_after_a_failed_sync_and_control_disabled_without_token(
    tmp_path: Path,
) -> None:
    root = tmp_path / "root"
    async with Publisher(root, keyframe_interval=0) as pub:
        await pub.seed(mixed_state(0))
    (root / "v000000000000" / "full-00000.safetensors").write_bytes(b"corrupt")
    agent = ReceiverAgent(root, LocalCheckpoint(tmp_path / "c"), "e", verify_deadline=0.05,
                          use_inotify=False)  # fmt: skip
    async with agent, StatusServer(agent) as server, aiohttp.ClientSession() as http:
        with pytest.raises(IncompleteVersion):
            await agent.sync_once()
        async with http.get(f"{server.url}/healthz") as r:
            body = await r.json()
        assert r.status == 503 and body["ok"] is False and "IncompleteVersion" in body["error"]
        async with http.post(f"{server.url}/sync", headers={"Authorization": "Bearer x"}) as r:
            assert r.status == 403
    with pytest.raises(ValueError, match="16 characters"):
        StatusServer(agent, token="short")


async def test_receiver_cli_serves_status_with_json_logs(tmp_path: Path) -> None:
    import json
    import os
    import re
    import signal
    import sys

    root = tmp_path / "root"
    async with Publisher(root) as pub:
        await pub.seed(mixed_state(0))
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "receiver.cli", "--root", str(root), "--engine-id", "cli0",
        "--checkpoint", str(tmp_path / "c"), "--status-port", "0",
        "--control-token-file", str(token_file), "--log-format", "json", "--poll-interval", "0.2",
        stderr=asyncio.subprocess.PIPE, env={**os.environ, "ASYNCSYNC_RECEIVER_TOKEN": ""},
    )  # fmt: skip
    assert proc.stderr is not None
    url = None
    lines: list[str] = []
    try:
        async with asyncio.timeout(60):
            while url is None:
                line = (await proc.stderr.readline()).decode()
                assert line, "receiver exited early: " + "".join(lines)
                lines.append(line)
                if m := re.search(r"status on (http://127\.0\.0\.1:\d+)", line):
                    url = m.group(1)
            async with aiohttp.ClientSession() as http:
                version = None
                while version != 0:  # bounded by the timeout above: fails if it never syncs
                    async with http.get(f"{url}/status") as r:
                        version = (await r.json())["version"]
                    if version != 0:
                        await asyncio.sleep(0.05)  # polling another process's HTTP state
                async with http.post(
                    f"{url}/sync", headers={"Authorization": f"Bearer {TOKEN}"}
                ) as r:
                    assert r.status == 202
        proc.send_signal(signal.SIGTERM)
        rest = (await asyncio.wait_for(proc.stderr.read(), 60)).decode()
        assert await proc.wait() == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert read_acks(root)["cli0"].version == 0  # it did sync, and said so in the root
    logs = [json.loads(x) for x in (lines + rest.splitlines()) if x.startswith("{")]
    assert any(r["logger"] == "receiver.agent" for r in logs)
    assert TOKEN not in "".join(lines) + rest
