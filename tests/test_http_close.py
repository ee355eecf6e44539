"""Closing the HTTP engines: nothing they started outlives ``close()`` (issue 13, failure 5).

A sync cancelled while the final resume call is still being retried, then ``close()``: the
resume task must be cancelled or awaited, the client must refuse to open a new session, and no
"Unclosed client session" / "Unclosed connector" / "Task exception was never retrieved" may
be reported (the suite turns warnings into errors; the asyncio log is checked as well).
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from receiver import ReceiverAgent
from receiver.engines import SGLang
from receiver.engines.http_engine import EngineHTTPError, HttpClient, Timeouts
from receiver.engines.reloading import ReloadingEngine
from receiver.engines.vllm import VLLM
from tests.fake_engines import FAST_RETRY, Chain, FakeServer, FakeSGLang, FakeVLLM

SHORT = Timeouts(control=0.3, update=2.0, connect=0.2, startup=3.0)


@pytest.fixture
async def chain(tmp_path: Path) -> AsyncIterator[Chain]:
    c = Chain(tmp_path / "root")
    async with c.pub:
        yield c


def _no_leak_reported(caplog: pytest.LogCaptureFixture) -> None:
    gc.collect()
    words = ("Unclosed client session", "Unclosed connector", "never retrieved")
    bad = [r.getMessage() for r in caplog.records if any(w in r.getMessage() for w in words)]
    assert bad == []


async def _cancel_during_resume(
    chain: Chain, srv: FakeServer, engine: ReloadingEngine, resume: str
) -> None:
    agent = ReceiverAgent(chain.root, engine, "e1", use_inotify=False, verify_deadline=0.2)
    await agent.open()
    await chain.next()
    assert await agent.sync_once() == 0
    await chain.next()
    # every resume attempt hangs past its deadline and is retried: the task outlives the sync
    srv.inject(resume, status=500, delay=5.0, times=50)
    n = len(srv.calls)
    task = asyncio.create_task(agent.sync_once())
    while f"POST {resume}" not in srv.endpoints()[n:]:
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert engine._background  # the resume call is still being retried
    await agent.close()
    assert not engine._background  # cancelled and awaited by close()
    assert engine.client.closed and engine.client._session is None
    with pytest.raises(EngineHTTPError, match="closed"):
        await engine.client.request("GET", "/health", timeout=1)
    assert engine.client._session is None  # no new session behind the caller's back


async def test_sglang_close_cancels_the_resume_task(
    chain: Chain, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    async with FakeSGLang() as srv:
        engine = SGLang(srv.url, tmp_path / "ckpt", timeouts=SHORT, retry=FAST_RETRY,
                        failure_backoff=(0.0, 0.0))  # fmt: skip
        await _cancel_during_resume(chain, srv, engine, "/continue_generation")
    _no_leak_reported(caplog)


async def test_vllm_close_cancels_the_resume_task(
    chain: Chain, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    ckpt = tmp_path / "ckpt"
    async with FakeVLLM(str(ckpt.absolute())) as srv:
        engine = VLLM(srv.url, ckpt, timeouts=SHORT, retry=FAST_RETRY, failure_backoff=(0.0, 0.0))
        await _cancel_during_resume(chain, srv, engine, "/resume")
    _no_leak_reported(caplog)


async def test_a_closed_client_refuses_requests(caplog: pytest.LogCaptureFixture) -> None:
    async with FakeSGLang() as srv:
        client = HttpClient(srv.url, retry=FAST_RETRY)
        await client.request("GET", "/health", timeout=2)
        await client.close()
        calls: list[Any] = list(srv.calls)
        with pytest.raises(EngineHTTPError, match="closed"):
            await client.request("GET", "/health", timeout=2)
        assert srv.calls == calls and client._session is None
    _no_leak_reported(caplog)
