"""SGLang engine against a fake SGLang server on 127.0.0.1: call sequences per server version,
zero diff, auth, a 400 and a timeout on update, a restart mid-sync, a wrong reported version,
backoff, cancellation, reconciliation at open, and the receiver CLI."""

from __future__ import annotations

import asyncio
import logging
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from asyncsync import ApplyFailed, ConfigError
from asyncsync.format.acks import read_acks
from asyncsync.format.store import read_manifest
from receiver import ReceiverAgent
from receiver.cli import main as receiver_main
from receiver.engines import (
    EngineHTTPError,
    HttpClient,
    RetryPolicy,
    SGLang,
    Timeouts,
    reloading,
    verify_checkpoint,
)
from tests.conftest import eventually
from tests.fake_engines import (
    FAST,
    FAST_RETRY,
    KEY,
    Chain,
    FakeSGLang,
    ServerThread,
    publish_chain,
)

RELOAD = [
    "POST /pause_generation",
    "POST /update_weights_from_disk",
    "POST /continue_generation",
    "GET /model_info",
]
# wait on /model_info (never /health: it runs a generation, which blocks while paused), clear a
# pause a killed receiver may have left, ask the release (the pause mode: the fake has no
# /server_info, so abort), read the version
OPEN = ["GET /model_info", "POST /continue_generation", "GET /server_info", "GET /model_info"]
REPO = Path(__file__).resolve().parent.parent


def make_engine(srv: FakeSGLang, ckpt: Path, **kw: Any) -> SGLang:
    kw.setdefault("retry", FAST_RETRY)
    kw.setdefault("timeouts", FAST)
    kw.setdefault("failure_backoff", (0.0, 0.0))
    return SGLang(srv.url, ckpt, **kw)


@pytest.fixture
async def chain(tmp_path: Path) -> AsyncIterator[Chain]:
    c = Chain(tmp_path / "root")
    async with c.pub:
        yield c


@pytest.fixture
async def srv() -> AsyncIterator[FakeSGLang]:
    async with FakeSGLang() as s:
        yield s


def agent_for(chain: Chain, engine: SGLang, engine_id: str = "e1") -> ReceiverAgent:
    return ReceiverAgent(chain.root, engine, engine_id, use_inotify=False, verify_deadline=0.2)


def since(srv: FakeSGLang, n: int) -> list[str]:
    return srv.endpoints()[n:]


# --------------------------------------------------------------------------- the happy path


@pytest.mark.parametrize("version", ["0.5.15", "0.5.23"])
async def test_call_sequence_per_version(chain: Chain, tmp_path: Path, version: str) -> None:
    ckpt = tmp_path / "ckpt"
    async with FakeSGLang(version=version) as srv:
        agent = agent_for(chain, make_engine(srv, ckpt))
        async with agent:
            assert srv.endpoints() == OPEN
            for expect_version, zero in ((0, False), (1, False), (2, True)):
                assert await chain.next(zero_diff=zero) == expect_version
                srv.running = 3  # requests in flight: the default pause must leave it idle
                n = len(srv.calls)
                assert await agent.sync_once() == expect_version
                if zero:
                    assert since(srv, n) == [
                        "GET /model_info",
                        "POST /update_weight_version",
                        "GET /model_info",
                    ]
                    assert srv.bodies("/update_weight_version")[-1] == {
                        "new_version": "2",
                        "abort_all_requests": False,
                    }
                else:
                    assert since(srv, n) == RELOAD
                    assert srv.bodies("/pause_generation")[-1] == {"mode": "abort"}
                    assert srv.bodies("/update_weights_from_disk")[-1] == {
                        "model_path": str(ckpt.absolute()),
                        "weight_version": str(expect_version),
                        "flush_cache": True,
                        "abort_all_requests": False,
                    }
                assert not srv.crashed and srv.paused is None
                assert srv.weight_version == str(expect_version)
                m = read_manifest(chain.root, expect_version)
                assert verify_checkpoint(ckpt, m) == []
                assert read_acks(chain.root)["e1"].version == expect_version
            # the server loaded the checkpoint at v0 then v1 (v2 needed no reload)
            assert [(ld.version, ld.checkpoint_version) for ld in srv.loads] == [("0", 0), ("1", 1)]
            assert agent.engine.state.version == 2
            assert "version=2" in repr(agent.engine)
            assert "/get_weight_version" not in {c.path for c in srv.calls}


async def test_version_offset_labels_the_server_and_acks_root_versions(
    chain: Chain, srv: FakeSGLang, tmp_path: Path
) -> None:
    """``version_offset`` (slime's start version): the server is told v + 5, a restarted
    receiver reads the label back as v (no needless reload), and the ack names v."""
    engine = make_engine(srv, tmp_path / "ckpt", version_offset=5)
    async with agent_for(chain, engine) as agent:
        for expect, zero in ((0, False), (1, False), (2, True)):
            assert await chain.next(zero_diff=zero) == expect
            assert await agent.sync_once() == expect
            assert srv.weight_version == str(expect + 5)
            assert read_acks(chain.root)["e1"].version == expect
    n = len(srv.calls)
    async with agent_for(chain, make_engine(srv, tmp_path / "ckpt", version_offset=5)) as agent:
        assert await agent.sync_once() == 2
    assert "POST /update_weights_from_disk" not in since(srv, n)  # label 7 read as v2: held
    with pytest.raises(ConfigError, match="version_offset must be an int"):
        make_engine(srv, tmp_path / "ckpt", version_offset="5")


def test_cli_version_offset_needs_a_server(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--root", "/tmp", "--engine-id", "e", "--checkpoint", "/tmp/c", "--version-offset", "3"]
    assert receiver_main(argv) == 2
    assert "--version-offset need --sglang-url" in capsys.readouterr().err


async def test_zero_diff_after_a_restart_reloads_in_full(
    chain: Chain, srv: FakeSGLang, tmp_path: Path
) -> None:
    async with agent_for(chain, make_engine(srv, tmp_path / "ckpt")) as agent:
        await chain.next()
        await chain.next()
        assert await agent.sync_once() == 1
        await srv.restart()  # the server now serves its launch weights as "default"
        await chain.next(zero_diff=True)
        n = len(srv.calls)
        assert await agent.sync_once() == 2
        assert since(srv, n) == ["GET /model_info", *RELOAD]
        assert srv.weight_version == "2" and srv.loads[-1].checkpoint_version == 2


async def test_a_restarted_server_has_its_ack_withdrawn_until_it_serves_the_version_again(
    chain: Chain, srv: FakeSGLang, tmp_path: Path
) -> None:
    """The ack says the engine holds the version (FORMAT.md 7). A server found serving another
    version (restarted with its launch weights) no longer holds it: the ack is removed before
    the reload, and written again once the server confirmed the version. Before, the ack named
    the version throughout, the server serving its launch weights. The reload is held (a fault
    of the fake) to look at the ack while it runs."""
    async with agent_for(chain, make_engine(srv, tmp_path / "ckpt")) as agent:
        await chain.next()
        await chain.next()
        assert await agent.sync_once() == 1
        assert read_acks(chain.root)["e1"].version == 1
        await srv.restart()  # the server now serves its launch weights as "default"
        assert await agent.engine.serving_version() is None  # the idle check (or /readyz)
        hold = asyncio.Event()
        srv.inject("/update_weights_from_disk", status=None, hold=hold)
        n = len(srv.calls)
        sync = asyncio.create_task(agent.sync_once())
        try:
            await eventually(
                lambda: "POST /update_weights_from_disk" in since(srv, n), "the reload"
            )
            assert "e1" not in read_acks(chain.root)
        finally:
            hold.set()
        assert await sync == 1
        assert srv.weight_version == "1" and read_acks(chain.root)["e1"].version == 1


async def test_a_label_read_during_a_commits_reload_is_not_taken_for_a_restart(
    chain: Chain, srv: FakeSGLang, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``/readyz`` (or the idle check) reads the server's label while a commit's reload runs:
    the server already reports v2, the engine still holds v1 until its record is written.
    That read marked the server lost (one more wait and label read on the next sync, and now
    that a mismatch withdraws the ack, the ack withdrawn for nothing): a read across a change
    in flight is not judged. The record's write is held (at the file boundary) to read there."""
    async with agent_for(chain, make_engine(srv, tmp_path / "ckpt")) as agent:
        await chain.next()
        await chain.next()
        assert await agent.sync_once() == 1
        await chain.next()
        writing, release = threading.Event(), threading.Event()
        real = reloading.write_record

        def held_write(path: Path, record: dict[str, Any]) -> None:
            if record["version"] == 2:
                writing.set()
                release.wait(30)
            real(path, record)

        monkeypatch.setattr(reloading, "write_record", held_write)
        sync = asyncio.create_task(agent.sync_once())
        try:
            await asyncio.to_thread(writing.wait, 30)
            assert srv.weight_version == "2" and agent.engine.state.version == 1
            assert await agent.engine.serving_version() == 2  # what the server serves
        finally:
            release.set()
        assert await sync == 2
        assert agent.engine.info()["server_lost"] is False
        n = len(srv.calls)
        assert await agent.sync_once() == 2
        assert since(srv, n) == []  # nothing to reconcile: no wait, no label read
        assert read_acks(chain.root)["e1"].version == 2


async def test_open_reconciles_only_when_needed(
    chain: Chain, srv: FakeSGLang, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    await chain.next()
    async with agent_for(chain, make_engine(srv, ckpt)) as agent:
        assert await agent.sync_once() == 0
    n = len(srv.calls)
    async with agent_for(chain, make_engine(srv, ckpt)) as agent:  # same server: nothing to do
        assert agent.engine.state.version == 0
    assert since(srv, n) == OPEN
    await srv.restart()
    n = len(srv.calls)
    async with agent_for(chain, make_engine(srv, ckpt)) as agent:  # restarted: reload once
        assert agent.engine.state.version == 0
    assert since(srv, n) == [*OPEN, *RELOAD]
    assert srv.weight_version == "0"


# --------------------------------------------------------------------------- auth


async def test_bearer_token_on_every_call(chain: Chain, tmp_path: Path) -> None:
    async with FakeSGLang(api_key=KEY) as srv:
        await chain.next()
        async with agent_for(chain, make_engine(srv, tmp_path / "ckpt", api_key=KEY)) as agent:
            assert await agent.sync_once() == 0
        assert {c.auth for c in srv.calls} == {"ok"}
        assert srv.weight_version == "0"


async def test_wrong_key_fails_at_once_and_is_never_shown(
    chain: Chain, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    await chain.next()
    async with FakeSGLang(api_key=KEY) as srv:
        engine = make_engine(srv, tmp_path / "ckpt", api_key="wrong-key-123")
        agent = agent_for(chain, engine)
        with pytest.raises(EngineHTTPError) as ei:
            await agent.open()
        assert ei.value.status == 401 and "API key" in str(ei.value)
        assert srv.endpoints(authorized_only=False) == OPEN[:1]  # a 4xx is never retried
        assert "wrong-key-123" not in str(ei.value) + repr(engine) + repr(engine.client)
        assert "wrong-key-123" not in caplog.text
        await agent.close()


# --------------------------------------------------------------------------- failures


async def seeded(chain: Chain, srv: FakeSGLang, tmp_path: Path, **kw: Any) -> ReceiverAgent:
    agent = agent_for(chain, make_engine(srv, tmp_path / "ckpt", **kw))
    await agent.open()
    await chain.next()
    assert await agent.sync_once() == 0
    await chain.next()
    return agent


async def test_400_on_update_surfaces_and_the_next_sync_retries(
    chain: Chain, srv: FakeSGLang, tmp_path: Path
) -> None:
    agent = await seeded(chain, srv, tmp_path)
    srv.inject("/update_weights_from_disk", status=400, message="Failed to load weights: bad shard")
    n = len(srv.calls)
    with pytest.raises(EngineHTTPError, match="bad shard") as ei:
        await agent.sync_once()
    assert ei.value.status == 400 and ei.value.server_message == "Failed to load weights: bad shard"
    assert since(srv, n) == RELOAD[:3]  # one update, no retry; continue all the same
    assert srv.paused is None
    assert agent.engine.state.version == 0 and read_acks(chain.root)["e1"].version == 0
    assert agent.engine.checkpoint.state.version == 1  # type: ignore[attr-defined]
    assert "bad shard" in (agent.status().last_error or "")
    n = len(srv.calls)
    assert await agent.sync_once() == 1  # no OutOfOrder: the checkpoint is reused as is
    assert since(srv, n) == RELOAD
    assert read_acks(chain.root)["e1"].version == 1
    await agent.close()


async def test_success_false_with_http_200_is_a_failure(
    chain: Chain, srv: FakeSGLang, tmp_path: Path
) -> None:
    agent = await seeded(chain, srv, tmp_path)
    srv.inject("/update_weights_from_disk", status=200, message="out of memory")
    with pytest.raises(EngineHTTPError, match="out of memory"):
        await agent.sync_once()
    assert agent.engine.state.version == 0
    assert await agent.sync_once() == 1
    await agent.close()


async def test_5xx_is_retried_then_succeeds(chain: Chain, srv: FakeSGLang, tmp_path: Path) -> None:
    agent = await seeded(chain, srv, tmp_path)
    srv.inject("/pause_generation", status=503, message="busy", times=2)
    n = len(srv.calls)
    assert await agent.sync_once() == 1
    assert since(srv, n) == ["POST /pause_generation"] * 3 + RELOAD[1:]
    await agent.close()


async def test_timeout_on_update(chain: Chain, srv: FakeSGLang, tmp_path: Path) -> None:
    timeouts = Timeouts(control=2.0, update=0.3, connect=1.0, startup=3.0)
    agent = await seeded(chain, srv, tmp_path, timeouts=timeouts)
    stalled = asyncio.Event()  # the server answers the reload only once the client gave up
    srv.inject("/update_weights_from_disk", status=None, hold=stalled)
    n, loads = len(srv.calls), len(srv.loads)
    with pytest.raises(EngineHTTPError, match=r"no answer within 0\.3s") as ei:
        await agent.sync_once()
    assert ei.value.status is None
    assert since(srv, n) == RELOAD[:3]  # a timed-out reload is not retried at once
    assert agent.engine.state.version == 0 and read_acks(chain.root)["e1"].version == 0
    stalled.set()  # the server finishes the stalled reload meanwhile
    await eventually(lambda: len(srv.loads) > loads, "the server to finish the stalled reload")
    assert await agent.sync_once() == 1
    assert srv.paused is None and srv.weight_version == "1"
    await agent.close()


async def test_server_restart_in_the_middle_of_a_sync(
    chain: Chain, srv: FakeSGLang, tmp_path: Path
) -> None:
    agent = await seeded(chain, srv, tmp_path)
    srv.inject("/update_weights_from_disk", status=None, delay=30.0)
    n = len(srv.calls)
    task = asyncio.create_task(agent.sync_once())
    while "POST /update_weights_from_disk" not in since(srv, n):
        await asyncio.sleep(0.01)
    await srv.restart(down_for=0.3)  # cuts the update in flight; refuses connections a while
    # a clear error, no ack; the next sync waits for the server (not retried into a dying one)
    with pytest.raises(ApplyFailed, match="connection dropped during the reload"):
        await asyncio.wait_for(task, 10)
    assert read_acks(chain.root)["e1"].version == 0
    assert await asyncio.wait_for(agent.sync_once(), 10) == 1
    assert srv.starts == 2
    assert srv.weight_version == "1" and srv.loads[-1].checkpoint_version == 1
    assert srv.endpoints()[-3:] == RELOAD[1:]  # the retried update, continue, check
    assert read_acks(chain.root)["e1"].version == 1
    await agent.close()


async def test_wrong_weight_version_after_update_is_not_acked(
    chain: Chain, srv: FakeSGLang, tmp_path: Path
) -> None:
    agent = await seeded(chain, srv, tmp_path)
    srv.report_version = "v-other"
    with pytest.raises(ApplyFailed, match="reports weight version 'v-other' after loading v1"):
        await agent.sync_once()
    assert agent.engine.state.version == 0 and read_acks(chain.root)["e1"].version == 0
    srv.report_version = None
    assert await agent.sync_once() == 1
    await agent.close()


async def test_failed_updates_back_off(chain: Chain, srv: FakeSGLang, tmp_path: Path) -> None:
    agent = await seeded(chain, srv, tmp_path, failure_backoff=(30.0, 60.0))
    srv.inject("/update_weights_from_disk", status=400, message="nope")
    with pytest.raises(EngineHTTPError):
        await agent.sync_once()
    n = len(srv.calls)
    with pytest.raises(ApplyFailed, match=r"not trying v1 yet \(1 consecutive failure"):
        await agent.sync_once()
    assert since(srv, n) == []  # the server is not paused once per poll
    await agent.close()


async def test_cancelled_sync_still_continues_generation(
    chain: Chain, srv: FakeSGLang, tmp_path: Path
) -> None:
    agent = await seeded(chain, srv, tmp_path)
    srv.inject("/update_weights_from_disk", status=None, delay=0.5)
    n = len(srv.calls)
    task = asyncio.create_task(agent.sync_once())
    while "POST /update_weights_from_disk" not in since(srv, n):
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await agent.close()  # waits for the resume call still in flight
    assert srv.endpoints()[-1] == "POST /continue_generation"
    assert srv.paused is None


async def test_server_down_at_open(chain: Chain, srv: FakeSGLang, tmp_path: Path) -> None:
    url = srv.url
    await srv.stop()
    timeouts = Timeouts(control=1.0, update=1.0, connect=0.5, startup=0.3)
    engine = SGLang(url, tmp_path / "ckpt", timeouts=timeouts, retry=FAST_RETRY)
    with pytest.raises(EngineHTTPError, match=r"did not come up within 0\.3s"):
        await engine.open()
    await engine.close()


# --------------------------------------------------------------------------- pause modes, config


async def test_retract_mode_does_not_flush(chain: Chain, tmp_path: Path) -> None:
    async with FakeSGLang(version="0.5.15") as srv:
        await chain.next()
        engine = make_engine(srv, tmp_path / "ckpt", pause_mode="retract")
        async with agent_for(chain, engine) as agent:
            srv.running = 2
            assert await agent.sync_once() == 0
        assert srv.bodies("/pause_generation")[-1] == {"mode": "retract"}
        assert srv.bodies("/update_weights_from_disk")[-1]["flush_cache"] is False
        assert not srv.crashed and srv.aborted == 0


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"pause_mode": "in_place", "flush_cache": True}, "cannot go with pause_mode='in_place'"),
        ({"pause_mode": "sleep"}, "pause_mode must be one of"),
        ({"api_key": "two words"}, "no whitespace"),
    ],
)
def test_bad_options(kw: dict[str, Any], needle: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=needle):
        SGLang("http://127.0.0.1:1", tmp_path, **kw)


@pytest.mark.parametrize(
    "url", ["ftp://h:1", "http://user:pw@h:1", "http://h:1/?x=1", "not a url", "http://"]
)
def test_bad_urls(url: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        SGLang(url, tmp_path)


async def test_client_messages_redirects_and_retry_policy(srv: FakeSGLang) -> None:
    client = HttpClient(srv.url, retry=FAST_RETRY, name="sglang")
    srv.running = 1
    with pytest.raises(EngineHTTPError, match="HTTP 400: Cache not flushed: requests are running"):
        await client.request("GET", "/flush_cache", timeout=2)
    srv.inject("/model_info", status=302, message="moved")
    with pytest.raises(EngineHTTPError, match="redirects are not followed") as ei:
        await client.request("GET", "/model_info", timeout=2)
    assert ei.value.status == 302 and srv.endpoints().count("GET /model_info") == 1
    assert "auth=no" in repr(client)
    await client.close()
    policy = RetryPolicy(attempts=5, initial=1.0, multiplier=2.0, maximum=3.0, jitter=0.0)
    assert [policy.delay(k) for k in (1, 2, 3, 4)] == [1.0, 2.0, 3.0, 3.0]
    with pytest.raises(ConfigError):
        RetryPolicy(attempts=0)
    with pytest.raises(ConfigError):
        Timeouts(update=0)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: Timeouts(control="30"), "Timeouts.control must be a number"),
        (lambda: Timeouts(update=float("nan")), "Timeouts.update must be finite"),
        (lambda: RetryPolicy(attempts=2.5), "RetryPolicy.attempts must be an integer"),
        (lambda: RetryPolicy(jitter=float("nan")), "RetryPolicy.jitter must be finite"),
        (lambda: SGLang("http://127.0.0.1:1", "ck", timeouts="x"), "must be a Timeouts"),
        (lambda: SGLang("http://127.0.0.1:1", "ck", retry=3), "must be a RetryPolicy"),
        (lambda: SGLang("http://127.0.0.1:1", "ck", failure_backoff=(1,)), "(first, max)"),
        (lambda: SGLang("http://127.0.0.1:1", "ck", failure_backoff=(0, "9")), "a number"),
    ],
)
def test_engine_options_of_a_wrong_type_are_config_errors(make: Any, match: str) -> None:
    """SGLang(timeouts="x") was an AttributeError at the first call; NaN timeouts were taken."""
    with pytest.raises(ConfigError, match=re.escape(match)):
        make()


# --------------------------------------------------------------------------- CLI


def test_cli_once_with_key_file_and_env(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "root"
    publish_chain(root, 2)
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    with ServerThread(FakeSGLang(api_key=KEY)) as srv:
        base = ["--root", str(root), "--once", "--force-polling", "--log-level", "ERROR",
                "--sglang-url", srv.url]  # fmt: skip
        argv = [*base, "--engine-id", "a", "--checkpoint", str(tmp_path / "a"),
                "--api-key-file", str(key_file)]  # fmt: skip
        assert receiver_main(argv) == 0
        assert capsys.readouterr().out.strip() == "a: holds version 1"
        assert srv.weight_version == "1" and {c.auth for c in srv.calls} == {"ok"}

        monkeypatch.setenv("ASYNCSYNC_API_KEY", KEY)
        argv = [*base, "--engine-id", "b", "--checkpoint", str(tmp_path / "b")]
        assert receiver_main(argv) == 0
        assert read_acks(root)["b"].version == 1

        monkeypatch.delenv("ASYNCSYNC_API_KEY")
        argv = [*base, "--engine-id", "c", "--checkpoint", str(tmp_path / "c")]
        assert receiver_main(argv) == 1
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "HTTP 401" in err, err
        assert "c" not in read_acks(root)


def test_cli_stops_promptly_while_waiting_for_the_server(tmp_path: Path) -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "receiver.cli", "--root", str(tmp_path / "root"),
         "--engine-id", "w", "--checkpoint", str(tmp_path / "c"),
         "--sglang-url", f"http://127.0.0.1:{port}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
    )  # fmt: skip
    try:
        assert proc.stderr is not None
        lines = [proc.stderr.readline()]
        while "not up yet" not in lines[-1]:  # it is waiting for a server that never comes
            assert lines[-1], "".join(lines)
            lines.append(proc.stderr.readline())
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert time.monotonic() - t0 < 10
    assert "stopped while starting" in err and "Traceback" not in err


def test_cli_option_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "root").mkdir()  # a checkpoint inside the root is refused first
    base = [
        "--root",
        str(tmp_path / "root"),
        "--engine-id",
        "x",
        "--checkpoint",
        str(tmp_path / "c"),
    ]
    both = ["--sglang-url", "http://127.0.0.1:1", "--vllm-url", "http://127.0.0.1:2"]
    assert receiver_main([*base, *both]) == 2
    assert receiver_main([*base, "--api-key-file", "k"]) == 2
    assert "need --sglang-url or --vllm-url" in capsys.readouterr().err
    missing = [*base, "--once", "--sglang-url", "http://127.0.0.1:1", "--api-key-file", "nope"]
    assert receiver_main(missing) == 1
    assert "cannot read --api-key-file nope" in capsys.readouterr().err


def test_cli_retries_a_start_that_failed_for_now_and_not_a_refused_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The start-up calls to the server failing with 5xx past the client's own retries ended
    the receiver with status 1 (a supervisor had to restart it). It retries now, acking
    nothing until it is up; a refused key still ends it at once with its one line."""
    root = tmp_path / "root"
    publish_chain(root, 1)
    with ServerThread(FakeSGLang(api_key=KEY)) as srv:
        argv = ["--root", str(root), "--force-polling", "--sglang-url", srv.url,
                "--engine-id", "w", "--checkpoint", str(tmp_path / "w")]  # fmt: skip
        capsys.readouterr()  # (what publishing logged)
        assert receiver_main([*argv, "--log-level", "ERROR"]) == 1  # no key: a 401
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "HTTP 401" in err, err

        srv.inject("/continue_generation", status=503, times=2 * RetryPolicy().attempts)
        key = tmp_path / "key"
        key.write_text(KEY)
        proc = subprocess.Popen(
            [sys.executable, "-m", "receiver.cli", *argv, "--api-key-file", str(key)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        )  # fmt: skip
        try:
            assert proc.stderr is not None
            lines = [proc.stderr.readline()]
            while "holding version" not in lines[-1]:
                assert lines[-1], "".join(lines)  # it exited
                if "could not start" in lines[-1]:
                    assert "w" not in read_acks(root)
                lines.append(proc.stderr.readline())
            assert sum("could not start" in line for line in lines) == 2, lines
            while "w" not in read_acks(root):  # bounded by the test's timeout
                time.sleep(0.05)  # polling another process's files
            assert read_acks(root)["w"].version == 0  # the one version published
            proc.send_signal(signal.SIGTERM)
            _, rest = proc.communicate(timeout=60)
        finally:
            if proc.returncode is None:
                proc.kill()
                proc.communicate()
        assert proc.returncode == 0, rest
