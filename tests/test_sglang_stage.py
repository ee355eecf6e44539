"""The SGLang engine's in-engine path against a fake SGLang server (what the real one cannot
be made to do on demand): stages are sent only to a server whose answers carry the plugin's
capability; a server that lost the plugin (answers 400 to a stage) gets the checkpoint in the
same pause; a stage the plugin refuses is not acknowledged and retried as a reload; a version
is never staged onto bytes an audit record disowned (the audit's readiness and repair through
the receiver's Auditor: tests/test_sglang_audit.py); the engine and the checkpoint reconcile
after a crash with the engine ahead or behind. The real server: tests/test_sglang_real*.py."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from receiver import ReceiverAgent
from receiver.engines import SGLang
from receiver.plugins.audit import AuditRecord, record_path
from receiver.plugins.stage import STAGE_CAPABILITY, is_stage, read_stage
from tests.fake_engines import BODY, FAST, FAST_RETRY, Chain, FakeSGLang, Load, _json


class FakePluginSGLang(FakeSGLang):
    """SGLang with the asyncsync plugin as far as the receiver can tell: a stage is read and
    verified and its version taken; a checkpoint is loaded; every answer ends with the
    plugin's capability. ``plugin = False`` turns it into a server without the plugin, and
    ``refuse_stages`` makes the plugin refuse them."""

    def __init__(self, **kw: Any):
        super().__init__(**kw)
        self.plugin = True
        self.refuse_stages = False

    async def _update_from_disk(self, request: web.Request) -> web.Response:
        body = request[BODY]
        path = body.get("model_path") if isinstance(body, dict) else None
        if self.plugin and isinstance(path, str) and is_stage(path):
            if self.refuse_stages:
                return _json({"success": False, "message": "asyncsync: refused to load: test"
                              + STAGE_CAPABILITY, "num_paused_requests": 0}, 400)  # fmt: skip
            stage = read_stage(path)
            self.loads.append(Load(path, body.get("weight_version"), stage.target.version))
            if body.get("weight_version") is not None:
                self.weight_version = body["weight_version"]
            msg = f"asyncsync: in-engine apply: v{stage.base.version} -> v{stage.target.version}"
            return _json({"success": True, "message": msg + STAGE_CAPABILITY,
                          "num_paused_requests": 0})  # fmt: skip
        resp = await super()._update_from_disk(request)
        if not self.plugin:
            return resp
        assert isinstance(resp, web.Response) and resp.body is not None
        answer = json.loads(bytes(resp.body))  # type: ignore[arg-type]
        answer["message"] = "asyncsync: partial reload: ..." + STAGE_CAPABILITY
        return _json(answer, resp.status)


@pytest.fixture
async def chain(tmp_path: Path) -> AsyncIterator[Chain]:
    c = Chain(tmp_path / "root")
    async with c.pub:
        yield c


@pytest.fixture
async def srv() -> AsyncIterator[FakePluginSGLang]:
    async with FakePluginSGLang() as s:
        yield s


def engine_for(srv: FakeSGLang, ckpt: Path, **kw: Any) -> SGLang:
    return SGLang(srv.url, ckpt, retry=FAST_RETRY, timeouts=FAST, failure_backoff=(0.0, 0.0), **kw)


def agent_for(chain: Chain, engine: SGLang) -> ReceiverAgent:
    return ReceiverAgent(chain.root, engine, "e1", use_inotify=False, verify_deadline=0.2)


def since(srv: FakeSGLang, n: int) -> list[str]:
    return srv.endpoints()[n:]


def loaded(srv: FakeSGLang) -> list[str]:
    """What each load was: "stage" or "checkpoint"."""
    return ["stage" if "engine-stage" in ld.path else "checkpoint" for ld in srv.loads]


async def test_stages_follow_the_servers_capability(
    chain: Chain, srv: FakePluginSGLang, tmp_path: Path
) -> None:
    engine = engine_for(srv, tmp_path / "ckpt")
    async with agent_for(chain, engine) as agent:
        await chain.next()
        await agent.sync_once()  # the first load tells whether the plugin takes stages
        assert loaded(srv) == ["checkpoint"] and engine.stages_supported is True
        for _ in range(2):
            await chain.next()
            n = len(srv.endpoints())
            await agent.sync_once()
            assert since(srv, n) == [
                "POST /pause_generation",
                "POST /update_weights_from_disk",
                "POST /continue_generation",
                "GET /model_info",
            ]
        assert loaded(srv) == ["checkpoint", "stage", "stage"]
        assert srv.loads[-1].path.endswith(f"/.asyncsync/engine-stage/v{2:012d}")
        assert engine.in_place_applies == 2 and engine.last_pause_seconds is not None
        assert not any((tmp_path / "ckpt/.asyncsync/engine-stage").iterdir())  # removed after
        await chain.next(zero_diff=True)
        await agent.sync_once()  # relabelled, nothing loaded
        assert len(srv.loads) == 3
        await chain.next()
        await agent.sync_once()
        assert loaded(srv)[-1] == "stage"
        info = engine.info()
        assert info["in_engine"] == {"enabled": True, "stages_supported": True,
                                     "in_place_applies": 3,
                                     "last_pause_seconds": engine.last_pause_seconds}  # fmt: skip


async def test_in_engine_off_never_stages(
    chain: Chain, srv: FakePluginSGLang, tmp_path: Path
) -> None:
    async with agent_for(chain, engine_for(srv, tmp_path / "ckpt", in_engine=False)) as agent:
        for _ in range(3):
            await chain.next()
            await agent.sync_once()
    assert loaded(srv) == ["checkpoint"] * 3


async def test_a_server_without_the_plugin_gets_the_checkpoint_in_the_same_pause(
    chain: Chain, srv: FakePluginSGLang, tmp_path: Path
) -> None:
    engine = engine_for(srv, tmp_path / "ckpt")
    async with agent_for(chain, engine) as agent:
        await chain.next()
        await agent.sync_once()
        srv.plugin = False  # restarted without the plugin
        v = await chain.next()
        n = len(srv.endpoints())
        assert await agent.sync_once() == v
        assert since(srv, n) == [
            "POST /pause_generation",
            "POST /update_weights_from_disk",  # the stage: 400, SGLang found no checkpoint
            "POST /update_weights_from_disk",  # the checkpoint, still paused
            "POST /continue_generation",
            "GET /model_info",
        ]
        assert engine.stages_supported is False
        await chain.next()
        await agent.sync_once()
        assert loaded(srv) == ["checkpoint", "checkpoint", "checkpoint"]


async def test_a_stage_the_plugin_refuses_is_not_acked_and_retried_as_a_reload(
    chain: Chain, srv: FakePluginSGLang, tmp_path: Path
) -> None:
    engine = engine_for(srv, tmp_path / "ckpt")
    async with agent_for(chain, engine) as agent:
        v0 = await chain.next()
        await agent.sync_once()
        srv.refuse_stages = True
        v = await chain.next()
        with pytest.raises(Exception, match="refused to load"):
            await agent.sync_once()
        assert engine.state.version == v0 and srv.paused is None  # continued after the failure
        srv.refuse_stages = False
        assert await agent.sync_once() == v  # the checkpoint holds v: only the reload again
        assert loaded(srv) == ["checkpoint", "checkpoint"]


async def test_a_begin_cancelled_while_its_stage_is_made_leaves_no_stage(
    chain: Chain, srv: FakePluginSGLang, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The begin is cancelled (a stream stopped, the receiver stopping) while its thread
    makes the version's stage: that thread ran on and made the stage's directory (and an open
    data file), which neither the abort after it nor any later version removed; it stayed
    until the receiver was restarted (``clear_stages`` at open). The abort removes it now."""
    import asyncio
    import threading

    from asyncsync.format.store import read_manifest
    from receiver.engines import stage_builder

    ckpt = tmp_path / "ckpt"
    engine = engine_for(srv, ckpt)
    async with agent_for(chain, engine) as agent:
        await chain.next()
        await agent.sync_once()
        assert engine.stages_supported is True
        v = await chain.next()
        real, entered, go, made = stage_builder.StageBuilder, *(threading.Event() for _ in "123")

        def held(*args: Any) -> stage_builder.StageBuilder:
            entered.set()
            go.wait(30)
            try:
                return real(*args)
            finally:
                made.set()

        monkeypatch.setattr(stage_builder, "StageBuilder", held)
        task = asyncio.create_task(engine.begin(read_manifest(chain.root, v), "delta"))
        await asyncio.to_thread(entered.wait, 30)
        task.cancel()
        go.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.to_thread(made.wait, 30)  # the stage's directory is made
        await engine.abort()
        monkeypatch.undo()
        assert list((ckpt / ".asyncsync/engine-stage").iterdir()) == []  # was: its stage
        assert await agent.sync_once() == v
        assert loaded(srv)[-1] == "stage"


def _mismatch_record(ckpt: Path, version: int, at: float) -> None:
    rec = AuditRecord(0, 1, "target", 4242, "mismatch", {"version": version})
    rec.mismatches = [{"name": "w", "detail": "1 element(s) differ", "version": version,
                       "at": at}]  # fmt: skip
    rec.updated_at = at
    path = record_path(ckpt, 0)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rec.__dict__))


async def test_a_mismatch_found_before_a_version_is_repaired_by_its_reload(
    chain: Chain, srv: FakePluginSGLang, tmp_path: Path
) -> None:
    """Never stage onto bytes the audit disowned: that version goes as a checkpoint reload."""
    ckpt = tmp_path / "ckpt"
    engine = engine_for(srv, ckpt)
    async with agent_for(chain, engine) as agent:
        v = await chain.next()
        await agent.sync_once()
        _mismatch_record(ckpt, v, time.time())
        await chain.next()
        await agent.sync_once()
        assert loaded(srv) == ["checkpoint", "checkpoint"]
        assert engine.audit_watch.repairs == 1 and engine.audit_watch.problem is None


async def test_engine_behind_after_a_crash_is_reloaded_then_staged(
    chain: Chain, srv: FakePluginSGLang, tmp_path: Path
) -> None:
    """The receiver died after the checkpoint committed v but before the server took it: at
    the next start the engine is behind (its label, the record), the checkpoint is reloaded
    into it once, and the next versions are staged again."""
    ckpt = tmp_path / "ckpt"
    async with agent_for(chain, engine_for(srv, ckpt)) as agent:
        await chain.next()
        await agent.sync_once()
    v1 = await chain.next()
    srv.inject("/update_weights_from_disk", status=500, times=10)
    async with agent_for(chain, engine_for(srv, ckpt)) as agent:
        with pytest.raises(Exception):  # noqa: B017 - the server refuses every reload
            await agent.sync_once()
    srv._faults.clear()
    engine = engine_for(srv, ckpt)
    async with agent_for(chain, engine) as agent:  # open: the server is behind the checkpoint
        assert engine.state.version == v1 and loaded(srv)[-1] == "checkpoint"
        await chain.next()
        await agent.sync_once()
        assert loaded(srv)[-1] == "stage"


async def test_engine_ahead_of_the_checkpoint_is_brought_back_by_it(
    chain: Chain, srv: FakePluginSGLang, tmp_path: Path
) -> None:
    """The checkpoint lost its last version (restored from a copy, or a machine crash before
    it was durable) while the server serves it: the checkpoint is the source of truth, it is
    reloaded into the server, and the lost version is applied again (staged: the base is
    what the server now holds)."""
    ckpt = tmp_path / "ckpt"
    async with agent_for(chain, engine_for(srv, ckpt)) as agent:
        await chain.next()
        await agent.sync_once()
        await chain.next()
        await agent.sync_once()
        copy = tmp_path / "ckpt-v1"
        shutil.copytree(ckpt, copy, ignore=shutil.ignore_patterns("lock", ".tmp.*"))
        v2 = await chain.next()
        await agent.sync_once()
    assert srv.weight_version == str(v2)
    shutil.rmtree(ckpt)
    copy.rename(ckpt)
    engine = engine_for(srv, ckpt)
    async with agent_for(chain, engine) as agent:
        assert srv.weight_version == str(v2 - 1)  # open reloaded the checkpoint's v1
        assert await agent.sync_once() == v2
        assert loaded(srv)[-2:] == ["checkpoint", "stage"]


class FakeReleasedSGLang(FakePluginSGLang):
    """Answers ``/server_info`` with a release number (the real one has it; the other fakes
    do not, and the engine then pauses with abort)."""

    def __init__(self, release: str, **kw: Any):
        self.release = release
        super().__init__(**kw)

    def routes(self, app: web.Application) -> None:
        super().routes(app)
        app.router.add_get("/server_info", self._server_info)

    async def _server_info(self, request: web.Request) -> web.Response:
        return _json({"version": self.release, "tp_size": 1})


@pytest.mark.parametrize(
    ("release", "mode"),
    [("0.5.23", "retract"), ("0.5.24.post1", "retract"), ("0.6.0", "retract"),
     ("0.5.15", "abort"), ("unknown", "abort")],
)  # fmt: skip
async def test_the_default_pause_mode_follows_the_release(
    chain: Chain, tmp_path: Path, release: str, mode: str
) -> None:
    """retract (nothing in flight is lost, the requests are re-prefilled with the new weights,
    the cache flushed) where the release is known to flush with retracted requests queued;
    abort elsewhere. Both flush the cache with the weight change."""
    async with FakeReleasedSGLang(release) as srv:
        engine = engine_for(srv, tmp_path / "ckpt")
        async with agent_for(chain, engine) as agent:
            await chain.next()
            await agent.sync_once()
            srv.running = 1  # a request in flight when the next version comes
            await chain.next()
            await agent.sync_once()
        assert engine.info()["pause_mode"] == mode
        assert engine.info()["server_version"] == release
        assert srv.bodies("/pause_generation")[-1] == {"mode": mode}
        assert srv.bodies("/update_weights_from_disk")[-1]["flush_cache"] is True
        assert srv.aborted == (1 if mode == "abort" else 0)
