"""SGLang engine behaviours the real server shows but cannot be made to show on demand, against
the fake server (tests/fake_engines.py): the two keys, a connection dropped mid-reload (the
scheduler died), the 400 "Weights were updated, but the cache was not flushed" race, /readyz
and the reconciliation of a restarted server, and what /status says about the plugin. The
same paths against the real server: tests/test_sglang_real*.py (docs/ENGINES.md)."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from asyncsync import ApplyFailed
from asyncsync.format.acks import read_acks
from receiver import ReceiverAgent
from receiver.engines import SGLang
from receiver.engines.http_engine import EngineHTTPError
from receiver.engines.sglang import CACHE_NOT_FLUSHED
from receiver.server import StatusServer
from tests.fake_engines import FAST, FAST_RETRY, Chain, FakeSGLang, ServerThread, publish_chain

ADMIN = "admin-key-0123456789"
USER = "user-key-0123456789"


@pytest.fixture
async def chain(tmp_path: Path) -> AsyncIterator[Chain]:
    c = Chain(tmp_path / "root")
    async with c.pub:
        yield c


def engine_for(srv: FakeSGLang, ckpt: Path, **kw: Any) -> SGLang:
    kw.setdefault("retry", FAST_RETRY)
    kw.setdefault("timeouts", FAST)
    kw.setdefault("failure_backoff", (0.0, 0.0))
    return SGLang(srv.url, ckpt, **kw)


def agent_for(chain: Chain, engine: SGLang) -> ReceiverAgent:
    return ReceiverAgent(chain.root, engine, "e1", use_inotify=False, verify_deadline=0.2)


def acked(chain: Chain) -> int | None:
    rec = read_acks(chain.root).get("e1")
    return None if rec is None else rec.version


async def test_admin_key_on_the_admin_endpoints_user_key_on_the_others(
    chain: Chain, tmp_path: Path
) -> None:
    async with FakeSGLang(api_key=USER, admin_api_key=ADMIN) as srv:
        engine = engine_for(srv, tmp_path / "ckpt", api_key=USER, admin_api_key=ADMIN)
        async with agent_for(chain, engine) as agent:
            await chain.next()
            await chain.next()
            assert await agent.sync_once() == 1
        assert {c.auth for c in srv.calls} == {"ok"}
        assert {c.path for c in srv.calls} >= {"/model_info", "/update_weights_from_disk"}
        assert "admin_auth=yes" in repr(engine.client) and ADMIN not in repr(engine.client)


@pytest.mark.parametrize("admin", [None, "wrong-admin-key-0123"])
async def test_a_refused_admin_key_names_the_admin_key_file(
    chain: Chain, tmp_path: Path, admin: str | None
) -> None:
    """A 401 on an admin endpoint says which key to fix: --admin-api-key-file, not only the
    API key (it said "give the key it was started with (--api-key-file ...)" whichever)."""
    await chain.next()
    async with FakeSGLang(api_key=USER, admin_api_key=ADMIN) as srv:
        engine = engine_for(srv, tmp_path / "ckpt", api_key=USER, admin_api_key=admin)
        agent = agent_for(chain, engine)
        with pytest.raises(EngineHTTPError) as ei:
            await agent.open()
        err = str(ei.value)
        assert ei.value.status == 401 and "/continue_generation" in err, err
        assert "--admin-api-key-file or ASYNCSYNC_ADMIN_API_KEY" in err, err
        assert ("admin API key" in err) == (admin is not None), err
        assert USER not in err and (admin is None or admin not in err)
        await agent.close()
        # the API key refused on a user endpoint still names the API key file alone
        engine = engine_for(srv, tmp_path / "ckpt", api_key="wrong-user-key-0123")
        agent = agent_for(chain, engine)
        with pytest.raises(EngineHTTPError, match=r"GET /model_info: HTTP 401") as ei:
            await agent.open()
        assert "(--api-key-file or ASYNCSYNC_API_KEY)" in str(ei.value)
        assert "admin" not in str(ei.value)
        await agent.close()


async def test_a_dropped_connection_mid_reload_is_an_error_then_a_wait(
    chain: Chain, tmp_path: Path
) -> None:
    async with FakeSGLang() as srv:
        agent = agent_for(chain, engine_for(srv, tmp_path / "ckpt"))
        async with agent:
            await chain.next()
            assert await agent.sync_once() == 0
            await chain.next()
            srv.inject("/update_weights_from_disk", drop=True)
            with pytest.raises(ApplyFailed, match="connection dropped during the reload of v1"):
                await agent.sync_once()
            assert acked(chain) == 0
            # the scheduler died: the server comes back with its initial weights
            await srv.stop()
            n = len(srv.calls)
            sync = asyncio.create_task(agent.sync_once())
            await asyncio.sleep(0.3)  # waiting for the server (no reload sent to nothing)
            assert not sync.done()
            srv.reset()
            await srv.start()
            assert await sync == 1
            assert acked(chain) == 1 and srv.weight_version == "1"
            assert srv.endpoints()[n] == "GET /model_info"  # the wait, before any pause


async def test_cache_not_flushed_is_reconciled_not_guessed(chain: Chain, tmp_path: Path) -> None:
    async with FakeSGLang() as srv:
        agent = agent_for(chain, engine_for(srv, tmp_path / "ckpt"))
        async with agent:
            await chain.next()
            assert await agent.sync_once() == 0
            await chain.next()
            n = len(srv.calls)
            srv.inject(
                "/update_weights_from_disk",
                status=400,
                message=f"{CACHE_NOT_FLUSHED} because requests are still running or queued.",
            )
            assert await agent.sync_once() == 1
            assert srv.endpoints()[n:] == [
                "POST /pause_generation",
                "POST /update_weights_from_disk",  # 400: weights maybe updated, label maybe not
                "POST /flush_cache",
                "POST /update_weights_from_disk",  # the same reload again (idempotent)
                "POST /continue_generation",
                "GET /model_info",  # only what the server reports is acknowledged
            ]
            assert acked(chain) == 1


async def test_readyz_follows_what_the_server_serves(chain: Chain, tmp_path: Path) -> None:
    async with FakeSGLang() as srv:
        agent = ReceiverAgent(
            chain.root, engine_for(srv, tmp_path / "ckpt"), "e1", poll_interval=0.05
        )
        async with agent, StatusServer(agent, ready_max_lag=1) as status:
            http = aiohttp.ClientSession()

            async def readyz() -> tuple[int, Any]:
                async with http.get(status.url + "/readyz") as r:
                    return r.status, await r.json()

            run = asyncio.create_task(agent.run())
            try:
                assert (await readyz())[0] == 503  # nothing committed
                await chain.next()
                await wait(lambda: agent.version == 0)
                assert await readyz() == (200, {"serving": 0, "latest": 0, "ready": True})
                await srv.restart()  # SGLang restarted: serves its initial weights as "default"
                code, body = await readyz()
                assert code == 503 and body["serving"] is None
                await wait(lambda: srv.weight_version == "0")  # reconciled, no new version
                assert (await readyz())[0] == 200
                assert srv.loads[-1].checkpoint_version == 0

                await srv.stop()  # down: not ready; versions pile up
                await chain.next()
                await chain.next()
                assert (await readyz())[0] == 503
                srv.reset()
                await srv.start()
                await wait(lambda: agent.version == 2)
                assert (await readyz())[1]["ready"] is True
                srv.report_version = "1"  # one behind: within --ready-max-lag 1
                assert (await readyz())[0] == 503  # not the version the receiver holds
            finally:
                run.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await run
                await http.close()


async def test_status_says_whether_the_plugin_ran(chain: Chain, tmp_path: Path) -> None:
    async with FakeSGLang() as srv:
        engine = engine_for(srv, tmp_path / "ckpt")
        async with agent_for(chain, engine) as agent:
            assert agent.status().engine["partial_reload"]["active"] is None  # type: ignore[index]
            await chain.next()
            await agent.sync_once()
            info = agent.status().engine
            assert info is not None and info["partial_reload"]["active"] is False
            assert "not installed" in info["partial_reload"]["why"]
            assert info["last_reload"]["version"] == 0


async def wait(cond: Any, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.02)


@pytest.mark.parametrize("via", ["file", "env"])
async def test_a_ray_receiver_sends_the_admin_key_from_its_node(
    chain: Chain, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, via: str
) -> None:
    """ReceiverSpec.admin_api_key_file (else the node's ASYNCSYNC_ADMIN_API_KEY) reaches an
    SGLang started with --admin-api-key, as the CLI's --admin-api-key-file does (the actor's
    body, without Ray; tests/test_ray_cluster.py runs the actors on a real two-raylet cluster)."""
    from asyncsync.training.ray import ReceiverSpec
    from asyncsync.training.ray.receivers import ReceiverActor

    (tmp_path / "key").write_text(USER)
    (tmp_path / "admin").write_text(ADMIN)
    if via == "env":
        monkeypatch.setenv("ASYNCSYNC_ADMIN_API_KEY", ADMIN)
    async with FakeSGLang(api_key=USER, admin_api_key=ADMIN) as srv:
        spec = ReceiverSpec(
            "e1",
            str(tmp_path / "ckpt"),
            engine="sglang",
            url=srv.url,
            api_key_file=str(tmp_path / "key"),
            admin_api_key_file=str(tmp_path / "admin") if via == "file" else None,
            poll_interval=0.05,
        )
        actor = ReceiverActor(str(chain.root), spec)
        await chain.next()
        await actor.start()
        try:
            await actor.wait_ready()
            await chain.next()
            assert await actor.sync_now() == 1
        finally:
            await actor.stop()
        assert "/update_weights_from_disk" in {c.path for c in srv.calls}
        assert {c.auth for c in srv.calls} == {"ok"}
        assert acked(chain) == 1


def test_the_admin_key_file_is_an_sglang_option(tmp_path: Path) -> None:
    from asyncsync import ConfigError
    from asyncsync.training.ray import ReceiverSpec

    for engine, url in (("vllm", "http://127.0.0.1:1"), ("checkpoint", None)):
        with pytest.raises(ConfigError, match="admin_api_key_file is an SGLang option"):
            ReceiverSpec("e1", "/c", engine=engine, url=url, admin_api_key_file="/k")  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def _at_v0_with_v1_published(
    chain: Chain, tmp_path: Path
) -> AsyncIterator[tuple[FakeSGLang, SGLang, ReceiverAgent]]:
    """A fake server, an engine on it and its agent, at v0, with v1 published."""
    async with FakeSGLang() as srv:
        engine = engine_for(srv, tmp_path / "ckpt")
        async with agent_for(chain, engine) as agent:
            await chain.next()
            assert await agent.sync_once() == 0
            await chain.next()
            yield srv, engine, agent


@pytest.mark.parametrize("how", ["raised", "cancelled"])
async def test_an_abort_after_a_failed_begin_leaves_the_next_version_free(
    chain: Chain, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """A begin that fails inside the checkpoint's begin, then the abort the agent and the
    stream send after it. Cancelled while the checkpoint's begin ran in its thread (a stream
    stopped, the receiver stopping), that begin still opened the checkpoint's transaction,
    and the engine's abort, which knew of none, left it open: every later version was refused
    ("begin v1 while v1 is in progress") until the receiver was restarted."""
    import threading

    from asyncsync.format.store import read_manifest
    from receiver.engines.checkpoint import LocalCheckpoint

    async with _at_v0_with_v1_published(chain, tmp_path) as (srv, engine, agent):
        real_begin, entered, go = LocalCheckpoint._begin, threading.Event(), threading.Event()

        def begin(ck: LocalCheckpoint, *args: Any) -> bool:
            if how == "raised":
                raise OSError(28, "injected: No space left on device")
            entered.set()
            go.wait(30)
            return real_begin(ck, *args)

        monkeypatch.setattr(LocalCheckpoint, "_begin", begin)
        task = asyncio.create_task(engine.begin(read_manifest(chain.root, 1), "delta"))
        if how == "cancelled":
            await asyncio.to_thread(entered.wait, 30)
            task.cancel()
            go.set()
        with pytest.raises((asyncio.CancelledError, ApplyFailed)):
            await task
        await engine.abort()
        monkeypatch.undo()
        assert engine.checkpoint.state.version == 0
        assert await agent.sync_once() == 1  # was: "begin v1 while v1 is in progress"
        assert acked(chain) == 1 and srv.weight_version == "1"


async def test_the_checkpoints_failed_rollback_is_done_again_when_nothing_newer_comes(
    chain: Chain, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's reconcile (a sync with nothing newer) reconciled the server only: its
    checkpoint's rollback that failed (or flush) waited for the next version's begin, with
    state.json saying ``applying`` meanwhile. It is done again now."""
    import json

    from tests.test_full_disk import failing_patch, rollback_state_refused

    async with _at_v0_with_v1_published(chain, tmp_path) as (_, engine, agent):
        failing_patch(monkeypatch)
        rollback_state_refused(monkeypatch)
        with pytest.raises(ApplyFailed, match="injected after the patch"):
            await agent.sync_once()
        monkeypatch.undo()
        path = tmp_path / "ckpt" / ".asyncsync" / "state.json"
        assert json.loads(path.read_text())["status"] == "applying"
        await engine.reconcile()
        assert json.loads(path.read_text())["status"] == "clean"  # was: "applying"
        assert engine.checkpoint.state.version == 0 == engine.state.version


@pytest.mark.parametrize("then", ["nothing_newer", "delta", "zero_diff"])
async def test_a_version_the_checkpoint_lost_is_no_longer_acked_and_is_loaded_again(
    chain: Chain, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, then: str
) -> None:
    """v1's flush fails and its bytes are then lost (a page dropped): the checkpoint's recovery
    wipes it, in the engine's reconcile (a sync with nothing newer) or at the next version's
    begin or bump. The engine still said v1 (the server serves it from memory), so the ack
    stayed though no restart could restore v1, and every later delta was refused for good
    ("the engine holds vNone": the agent goes on from a keyframe only once the engine holds
    nothing). It holds nothing now, as a reopen finds: the ack goes at once and the same sync
    goes on from the keyframe; the next version then applies as a delta."""
    from receiver.engines.checkpoint import LocalCheckpoint
    from receiver.engines.st_layout import FileMaps
    from tests.test_flush import _damage, _enospc

    async with _at_v0_with_v1_published(chain, tmp_path) as (srv, engine, agent):
        with monkeypatch.context() as m:
            m.setattr(FileMaps, "sync", _enospc)
            assert await agent.sync_once() == 1
            await engine.checkpoint.flushed()  # failed, after the ack
        _damage(engine.checkpoint)
        acks_at_full, begin = [], LocalCheckpoint.begin

        async def watched(ck: LocalCheckpoint, m: Any, mode: str) -> None:
            if mode == "full":
                acks_at_full.append((acked(chain), agent.status().version))
            await begin(ck, m, mode)

        monkeypatch.setattr(LocalCheckpoint, "begin", watched)
        v = 1 if then == "nothing_newer" else await chain.next(zero_diff=then == "zero_diff")
        assert await agent.sync_once() == v  # was: OutOfOrder (a delta or zero diff)
        assert acks_at_full == [(None, None)]  # was: [] (the checkpoint left empty, acked v1)
        assert engine.checkpoint.state.version == v == acked(chain)
        assert srv.weight_version == str(v)
        await chain.next()
        assert await agent.sync_once() == v + 1  # was: OutOfOrder, at every sync
        assert acked(chain) == v + 1 and srv.weight_version == str(v + 1)


async def test_a_full_version_whose_move_into_place_fails_withdraws_the_ack(
    chain: Chain, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full version whose move into place fails midway (its index refused: a full disk)
    wipes the checkpoint (its files mixed). The engine still said v0, served from memory only,
    and the ack stayed until the version's next attempt. As for a checkpoint the recovery
    wiped, the engine holds nothing at once: the ack goes with the failed sync, and the next
    sync applies the version."""
    import torch

    from receiver.engines.checkpoint.files import CheckpointFiles
    from tests.test_flush import _enospc

    async with FakeSGLang() as srv:
        engine = engine_for(srv, tmp_path / "ckpt")
        async with agent_for(chain, engine) as agent:
            await chain.next()
            assert await agent.sync_once() == 0
            sd = {**chain.states[-1], "model.extra.weight": torch.ones(4, 4)}
            v = (await chain.pub.publish(sd)).version  # a new tensor set: a full version
            with monkeypatch.context() as m:
                m.setattr(CheckpointFiles, "write_index", _enospc)
                with pytest.raises(ApplyFailed, match="moving v1 into place failed"):
                    await agent.sync_once()
            assert engine.checkpoint.state.version is None
            assert acked(chain) is None and engine.state.version is None  # was: 0, 0
            assert await agent.sync_once() == v
            assert acked(chain) == v and srv.weight_version == str(v)


async def test_an_answer_that_never_ends_is_refused_at_the_cap_not_held_to_the_deadline(
    chain: Chain, tmp_path: Path
) -> None:
    """Found by attack (forty-third session): a server answering a body that never ends (the
    URL of something else, a proxy's stream) was read into memory until the call's deadline
    (6 GB in the 30 s of a control call on a loopback), then called "no answer". Now the
    answer is refused once it passes MAX_ANSWER_BYTES, saying so; the version is not acked,
    and the next sync, answered as a server does, applies it."""
    async with FakeSGLang() as srv:
        agent = agent_for(chain, engine_for(srv, tmp_path / "ckpt"))
        async with agent:
            await chain.next()
            assert await agent.sync_once() == 0
            await chain.next()
            srv.inject("/update_weights_from_disk", status=200, flood=True)
            with pytest.raises(ApplyFailed, match=r"the answer passed 67,108,864 bytes") as err:
                await agent.sync_once()
            assert "server's own URL" in str(err.value)
            assert acked(chain) == 0 and srv.weight_version == "0"
            assert not srv.paused  # resumed after the refused reload
            assert await agent.sync_once() == 1
            assert acked(chain) == 1 and srv.weight_version == "1"


def test_a_receiver_whose_server_answers_without_end_stops_with_one_line(tmp_path: Path) -> None:
    """The same on a real receiver process at start: its ready path answered without end is a
    clear, final error (exit 1, one line), not a process growing until the deadline."""
    publish_chain(tmp_path / "root", 1)
    with ServerThread(FakeSGLang()) as srv:
        srv.inject("/model_info", status=200, flood=True, times=100)
        proc = subprocess.run(
            [sys.executable, "-m", "receiver.cli", "--root", str(tmp_path / "root"),
             "--engine-id", "e1", "--checkpoint", str(tmp_path / "c"), "--once",
             "--sglang-url", srv.url],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "GET /model_info: HTTP 200: the answer passed 67,108,864 bytes" in last, last
    assert srv.url in last


async def test_the_wait_for_a_server_that_never_answers_ends_at_its_deadline() -> None:
    """Found by attack (forty-third session): ``--engine-startup-timeout 3`` against a server
    that takes connections and answers nothing ended after 34 s ("did not come up within 3s"):
    each call of the wait ran its own 30 s. A call of the wait now ends at the deadline."""
    from receiver.engines.http_engine import EngineNotUp, HttpClient

    async with FakeSGLang() as srv:
        srv.inject("/model_info", status=None, hold=asyncio.Event())  # never answered
        client = HttpClient(srv.url, retry=FAST_RETRY, name="sglang")
        try:
            t0 = asyncio.get_running_loop().time()
            with pytest.raises(EngineNotUp, match=r"did not come up within 0\.5s"):
                await client.wait_until_up("/model_info", deadline=0.5, call_timeout=30)
            assert asyncio.get_running_loop().time() - t0 < 5  # was 30
        finally:
            await client.close()


@pytest.mark.parametrize("status", [200, 500])
async def test_an_answer_nested_past_the_parsers_depth_is_an_engine_error(
    status: int, tmp_path: Path
) -> None:
    """Found by attack (forty-third session): a server answering ``[[[[...`` (200,000 deep)
    ended the receiver with "RecursionError: maximum recursion depth exceeded while decoding a
    JSON array", no endpoint nor server named. Now such an answer is text: an error of the
    engine that names the call (a 2xx: not the object expected; a 5xx: its start quoted)."""
    from aiohttp import web

    async def deep(_request: web.Request) -> web.Response:
        return web.Response(status=status, body=b"[" * 200_000, content_type="application/json")

    app = web.Application()
    app.router.add_get("/model_info", deep)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    engine = SGLang(f"http://127.0.0.1:{port}", tmp_path / "c", retry=FAST_RETRY, timeouts=FAST)
    try:
        with pytest.raises(EngineHTTPError, match=r"sglang GET /model_info: ") as err:
            await engine.served_version()
        assert "RecursionError" not in str(err.value)
        assert ("expected a JSON object, got str" if status == 200 else "HTTP 500: [[[") in str(
            err.value
        )
    finally:
        await engine.client.close()
        await runner.cleanup()
