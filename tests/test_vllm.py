"""VLLM engine against a fake vLLM dev-mode server on 127.0.0.1, for what the real server
(tests/test_vllm_real.py) cannot be made to do on demand or does not show: the exact call
order, 5xx retries, a wrong reported version, a server serving another model root, a reload
refused just once, a server without the worker extension. (The key is tested on the real
server.)"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from asyncsync import ApplyFailed, ConfigError
from asyncsync.format.acks import read_acks
from asyncsync.format.store import read_manifest
from receiver import ReceiverAgent
from receiver.engines import VLLM, EngineHTTPError, verify_checkpoint
from tests.fake_engines import FAST, FAST_RETRY, KEY, Chain, FakeVLLM

RELOAD = [
    "POST /pause",
    "POST /collective_rpc",
    "POST /update_weight_version",
    "POST /resume",
    "GET /weight_info",
]
OPEN = ["GET /health", "POST /resume", "GET /v1/models", "POST /collective_rpc", "GET /weight_info"]


@pytest.fixture
async def chain(tmp_path: Path) -> AsyncIterator[Chain]:
    c = Chain(tmp_path / "root")
    async with c.pub:
        yield c


def make_engine(srv: FakeVLLM, ckpt: Path, **kw: Any) -> VLLM:
    kw.setdefault("retry", FAST_RETRY)
    kw.setdefault("timeouts", FAST)
    kw.setdefault("failure_backoff", (0.0, 0.0))
    return VLLM(srv.url, ckpt, **kw)


def agent_for(chain: Chain, engine: VLLM) -> ReceiverAgent:
    return ReceiverAgent(chain.root, engine, "v1", use_inotify=False, verify_deadline=0.2)


async def test_call_sequence_and_zero_diff(chain: Chain, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    async with FakeVLLM(str(ckpt.absolute()), api_key=KEY) as srv:
        async with agent_for(chain, make_engine(srv, ckpt, api_key=KEY)) as agent:
            assert srv.endpoints() == OPEN
            for version, zero in ((0, False), (1, False), (2, True)):
                await chain.next(zero_diff=zero)
                srv.running = 2
                n = len(srv.calls)
                assert await agent.sync_once() == version
                if zero:
                    assert srv.endpoints()[n:] == [
                        "GET /weight_info",
                        "POST /update_weight_version",
                        "GET /weight_info",
                    ]
                else:
                    assert srv.endpoints()[n:] == RELOAD
                    assert srv.calls[n].query == {"mode": "abort"}
                    assert srv.calls[n + 1].body["method"] == "reload_weights"
                assert srv.weight_version == str(version) and srv.paused is None
                assert verify_checkpoint(ckpt, read_manifest(chain.root, version)) == []
                assert read_acks(chain.root)["v1"].version == version
        assert [ld.checkpoint_version for ld in srv.loads] == [0, 1]
        assert srv.aborted == 4 and {c.auth for c in srv.calls} == {"ok"}


async def test_failing_reload_resumes_and_is_retried_later(chain: Chain, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    async with (
        FakeVLLM(str(ckpt.absolute())) as srv,
        agent_for(chain, make_engine(srv, ckpt)) as agent,
    ):
        await chain.next()
        srv.inject("/collective_rpc", status=500, message="CUDA error", times=FAST_RETRY.attempts)
        n = len(srv.calls)
        with pytest.raises(EngineHTTPError, match="CUDA error") as ei:
            await agent.sync_once()
        assert ei.value.status == 500
        calls = srv.endpoints()[n:]
        assert calls.count("POST /collective_rpc") == FAST_RETRY.attempts  # 5xx: retried
        assert calls[-1] == "POST /resume" and srv.paused is None
        assert agent.engine.state.version is None
        assert await agent.sync_once() == 0


async def test_wrong_version_reported(chain: Chain, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    async with (
        FakeVLLM(str(ckpt.absolute())) as srv,
        agent_for(chain, make_engine(srv, ckpt)) as agent,
    ):
        await chain.next()
        srv.report_version = "17"
        with pytest.raises(ApplyFailed, match="reports weight version '17' after loading v0"):
            await agent.sync_once()
        assert "v1" not in read_acks(chain.root)


async def test_server_serving_another_model_is_refused(chain: Chain, tmp_path: Path) -> None:
    async with FakeVLLM("/models/base") as srv:
        engine = make_engine(srv, tmp_path / "ckpt")
        with pytest.raises(ApplyFailed, match="serves '/models/base', not the checkpoint"):
            await engine.open()
        await engine.close()
        unchecked = make_engine(srv, tmp_path / "ckpt2", check_model_root=False)
        await unchecked.open()
        await unchecked.close()


def test_bad_pause_mode(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="pause_mode"):
        VLLM("http://127.0.0.1:1", tmp_path, pause_mode="retract")  # type: ignore[arg-type]


async def test_a_refused_version_is_not_ready_and_a_keyframe_after_it_is_taken_instead(
    chain: Chain, tmp_path: Path
) -> None:
    """A reload the server answers with an error leaves vLLM's weights unknown (the real 0.32
    leaves layers on the meta device, tests/test_vllm_real.py): not ready until a reload
    succeeds. The server no longer serves v0 either, but the ack kept naming v0: as for a
    restarted server (docs/ENGINES.md), the ack is withdrawn, and written again once a reload
    is confirmed. Once a keyframe follows the refused version, the next attempt takes the
    keyframe instead of retrying the refused version first."""
    ckpt = tmp_path / "ckpt"
    async with (
        FakeVLLM(str(ckpt.absolute())) as srv,
        agent_for(chain, make_engine(srv, ckpt)) as agent,
    ):
        await chain.next()
        assert await agent.sync_once() == 0
        assert read_acks(chain.root)["v1"].version == 0
        await chain.next()  # v1: the server will refuse it
        for _ in range(2):
            srv.inject("/collective_rpc", status=500, message="no parameter named extra",
                       times=FAST_RETRY.attempts)  # fmt: skip
            with pytest.raises(EngineHTTPError, match="no parameter named extra"):
                await agent.sync_once()
            assert await agent.engine.serving_version() is None  # weights unknown: not ready
            assert "v1" in (agent.engine.info()["weights_unknown"] or "")
            assert "v1" not in read_acks(chain.root)  # was: v0, no longer served
            if len(chain.states) == 2:  # a keyframe after the refused version
                v = (await chain.pub.publish(chain.states[-1], keyframe=True)).version
                chain.states.append(chain.states[-1])
        n = len(srv.loads)
        assert await agent.sync_once() == v
        assert [ld.checkpoint_version for ld in srv.loads[n:]] == [v]  # v1 not tried again
        assert await agent.engine.serving_version() == v
        assert agent.engine.info()["weights_unknown"] is None
        assert read_acks(chain.root)["v1"].version == v


@pytest.mark.parametrize("fails", ["/pause", "/collective_rpc"])
async def test_a_failed_repair_withdraws_the_ack_and_the_next_sync_repairs(
    chain: Chain, tmp_path: Path, fails: str
) -> None:
    """A repair follows an audit that found the server serving other bytes than the version
    held. When it fails (the pause refused, or the load: vLLM's weights then unknown), the
    server still does not serve the version: the ack must go, and a sync with nothing newer
    must load it again in full. Before, ``_lost`` was not set: a failed pause kept the ack,
    a failed load lost it at the next idle sync, and neither was ever reloaded."""
    ckpt = tmp_path / "ckpt"
    async with (
        FakeVLLM(str(ckpt.absolute())) as srv,
        agent_for(chain, make_engine(srv, ckpt)) as agent,
    ):
        await chain.next()
        assert await agent.sync_once() == 0
        srv.inject(fails, status=500, message="refused", times=FAST_RETRY.attempts)
        with pytest.raises(EngineHTTPError, match="refused"):
            await agent.engine.repair()
        assert "v1" not in read_acks(chain.root)
        assert await agent.engine.serving_version() is None
        n = len(srv.loads)
        assert await agent.sync_once() == 0
        assert [ld.checkpoint_version for ld in srv.loads[n:]] == [0]  # repaired
        assert await agent.engine.serving_version() == 0
        assert read_acks(chain.root)["v1"].version == 0


async def test_a_server_without_the_worker_extension_cannot_audit(
    chain: Chain, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    async with (
        FakeVLLM(str(ckpt.absolute())) as srv,
        agent_for(chain, make_engine(srv, ckpt)) as agent,
    ):
        await chain.next()
        assert await agent.sync_once() == 0
        engine = agent.engine
        assert isinstance(engine, VLLM)
        assert await engine.audit(read_manifest(chain.root, 0)) is None
        assert "--worker-extension-cls" in (engine.info()["audit_unsupported"] or "")
