"""One HTTP engine under one ``asyncio.run`` after another.

An ``aiohttp.ClientSession`` belongs to the event loop it was made in; a ReceiverAgent (and so
its engine) serves successive ``asyncio.run`` calls. The client keeps one session per running
loop: reused within the loop (one connection for successive calls), closed when its loop ends
or at ``close()``, and no "Unclosed client session" / "Unclosed connector" is ever reported
(the suite turns warnings into errors; the asyncio log is checked as well).
"""

from __future__ import annotations

import asyncio
import gc
import logging
from pathlib import Path

import aiohttp
import pytest

from asyncsync import Publisher
from asyncsync.errors import ApplyFailed
from receiver import ReceiverAgent
from receiver.engines import SGLang
from receiver.engines.http_engine import EngineHTTPError, HttpClient
from receiver.engines.vllm import VLLM
from tests.conftest import mixed_state, mutate
from tests.fake_engines import FAST, FAST_RETRY, FakeSGLang, FakeVLLM, ServerThread

_LEAKS = ("Unclosed client session", "Unclosed connector", "never retrieved", "unclosed")


def _no_leak_reported(caplog: pytest.LogCaptureFixture) -> None:
    gc.collect()
    bad = [r.getMessage() for r in caplog.records if any(w in r.getMessage() for w in _LEAKS)]
    assert bad == []


def test_a_client_serves_one_asyncio_run_after_another(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    with ServerThread(FakeSGLang()) as srv:
        client = HttpClient(srv.url, retry=FAST_RETRY)

        async def twice() -> aiohttp.ClientSession:
            await client.request("GET", "/health", timeout=2)
            first = client._session
            await client.request("GET", "/health", timeout=2)
            assert first is not None and client._session is first  # reused within one loop
            return first

        first = asyncio.run(twice())
        assert first.closed  # closed as its loop ended, not left to the garbage collector
        second = asyncio.run(twice())
        assert second is not first and second.closed
        asyncio.run(client.close())
        assert client._session is None
        with pytest.raises(EngineHTTPError, match="closed"):
            asyncio.run(client.request("GET", "/health", timeout=2))
    _no_leak_reported(caplog)


def test_close_under_the_same_loop_closes_its_session(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    with ServerThread(FakeSGLang()) as srv:
        client = HttpClient(srv.url, retry=FAST_RETRY)
        asyncio.run(client.request("GET", "/health", timeout=2))

        async def use_and_close() -> None:
            await client.request("GET", "/health", timeout=2)
            session = client._session
            await client.close()
            assert session is not None and session.closed

        asyncio.run(use_and_close())
    _no_leak_reported(caplog)


def test_a_loop_that_runs_again_keeps_its_session(caplog: pytest.LogCaptureFixture) -> None:
    """A loop run again after another loop ran (an ``asyncio.Runner``) finds its own session
    still open; the other loop's was closed as that loop ended."""
    caplog.set_level(logging.DEBUG)
    with ServerThread(FakeSGLang()) as srv, asyncio.Runner() as runner:
        client = HttpClient(srv.url, retry=FAST_RETRY)

        async def call() -> aiohttp.ClientSession | None:
            await client.request("GET", "/health", timeout=2)
            return client._session

        first = runner.run(call())
        other = asyncio.run(call())
        assert other is not first and other is not None and other.closed
        assert runner.run(call()) is first and first is not None and not first.closed
        runner.run(client.close())
        assert first.closed and not client._sessions
    _no_leak_reported(caplog)


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_an_engine_serves_one_asyncio_run_after_another(
    kind: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    ckpt = tmp_path / "ckpt"
    fake = FakeSGLang() if kind == "sglang" else FakeVLLM(str(ckpt.absolute()))
    with ServerThread(fake) as srv:
        engine = (SGLang if kind == "sglang" else VLLM)(
            srv.url, ckpt, timeouts=FAST, retry=FAST_RETRY
        )
        asyncio.run(engine.served_version())
        asyncio.run(engine.served_version())
        asyncio.run(engine.close())
    _no_leak_reported(caplog)


def test_an_agent_with_an_sglang_engine_syncs_under_one_asyncio_run_after_another(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The agent serves successive ``asyncio.run`` calls (its locks are LoopLocks): so must its
    engine's HTTP client, for a version applied under each."""
    caplog.set_level(logging.DEBUG)
    root = tmp_path / "root"
    states = [mixed_state(0), mutate(mixed_state(0), 0.03, seed=1)]

    async def publish(i: int) -> None:
        async with Publisher(root, bucket_bytes=8192) as pub:
            await pub.seed(states[i])  # a full version: this publisher has no snapshot

    with ServerThread(FakeSGLang()) as srv:
        engine = SGLang(srv.url, tmp_path / "ckpt", timeouts=FAST, retry=FAST_RETRY)
        agent = ReceiverAgent(root, engine, "e", use_inotify=False)

        async def sync() -> int | None:
            await agent.open()
            return await agent.sync_once()

        for i in (0, 1):
            asyncio.run(publish(i))
            assert asyncio.run(sync()) == i and srv.weight_version == str(i)
        asyncio.run(agent.close())
    _no_leak_reported(caplog)


@pytest.mark.parametrize("first", ["asyncio.run", "a runner left open"])
def test_a_resume_cut_by_the_end_of_its_loop_is_made_under_the_next(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, first: str
) -> None:
    """(fix-47) A sync cancelled while its server is being resumed leaves the resume running in
    a task of the engine's (``_background``), bound to that event loop. When the loop ended
    (``asyncio.run`` cancels what is left), the resume was cancelled and the server stayed
    paused for good, serving nothing; with the loop left open (an ``asyncio.Runner``), a close
    under the next ``asyncio.run`` waited on the other loop's task, then failed with "got
    Future attached to a different loop". The next loop's close now forgets the other loop's
    task and resumes the server itself."""
    caplog.set_level(logging.DEBUG)
    root = tmp_path / "root"

    async def publish() -> None:
        async with Publisher(root) as pub:
            await pub.seed(mixed_state(0))

    asyncio.run(publish())
    thread = ServerThread(FakeSGLang())
    with thread as srv, asyncio.Runner() as runner:
        engine = SGLang(srv.url, tmp_path / "ckpt", timeouts=FAST, retry=FAST_RETRY)
        agent = ReceiverAgent(root, engine, "e", use_inotify=False)
        hold = asyncio.Event()  # (waited on by the server's loop)

        async def cut() -> None:
            await agent.open()
            srv.inject("/continue_generation", status=None, hold=hold)  # the resume hangs
            n = len(srv.calls)
            task = asyncio.create_task(agent.sync_once())
            while "POST /continue_generation" not in srv.endpoints()[n:]:
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        (asyncio.run if first == "asyncio.run" else runner.run)(cut())
        assert srv.paused == "abort"  # the resume did not get through
        asyncio.run(agent.close())
        assert srv.paused is None  # resumed under the second loop
        assert [c.path for c in srv.calls].count("/continue_generation") == 3
        thread._loop.call_soon_threadsafe(hold.set)


async def test_a_resume_that_failed_is_not_made_again_at_close(tmp_path: Path) -> None:
    """Only a resume cut by a cancellation is made again at close (above): one the server
    refused was reported when it failed ("the server may still be paused"), and making it
    again at close would hold a shutdown for another round of retries (4 x 30 s against a
    server that hangs, with the default deadlines)."""
    root = tmp_path / "root"
    async with Publisher(root) as pub:
        await pub.seed(mixed_state(0))
    with ServerThread(FakeSGLang()) as srv:
        engine = SGLang(srv.url, tmp_path / "ckpt", timeouts=FAST, retry=FAST_RETRY)
        agent = ReceiverAgent(root, engine, "e", use_inotify=False)
        await agent.open()
        srv.inject("/continue_generation", status=500, times=FAST_RETRY.attempts)
        with pytest.raises(ApplyFailed, match="resuming generation failed"):
            await agent.sync_once()
        n = [c.path for c in srv.calls].count("/continue_generation")
        await agent.close()
        assert [c.path for c in srv.calls].count("/continue_generation") == n
