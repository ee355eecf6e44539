"""The receiver's HTTP endpoints on 127.0.0.1: health, status, metrics, the token-guarded sync."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from asyncsync import ConfigError, IncompleteVersion, Publisher
from asyncsync.errors import shown
from asyncsync.format.acks import read_acks
from receiver import ReceiverAgent
from receiver.engines.checkpoint import LocalCheckpoint
from receiver.server import StatusServer
from tests.conftest import eventually, mixed_state, mutate
from tests.ports import free_port, has_ipv6_loopback, resolving_to

TOKEN = "s3cret-token-0123456789"


def _stop(proc: subprocess.Popen[Any]) -> None:
    """SIGTERM, then SIGKILL if it has not exited within 30 s; reaped either way."""
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


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
    with pytest.raises(ConfigError, match="16 characters"):
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


# --------------------------------------------------------------------------- issue 22, 8 and 9


async def test_a_non_utf8_authorization_header_is_401(tmp_path: Path) -> None:
    """Finding 9: aiohttp decodes header bytes as UTF-8 with surrogate escapes; encoding them
    back as strict UTF-8 raised, and POST /sync answered 500 with a traceback."""
    agent = ReceiverAgent(tmp_path / "root", LocalCheckpoint(tmp_path / "c"), "e1")
    async with StatusServer(agent, token=TOKEN) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(
            b"POST /sync HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\xc3\r\n"
            b"Content-Length: 0\r\nConnection: close\r\n\r\n"
        )
        await writer.drain()
        head = await asyncio.wait_for(reader.readline(), 10)
        writer.close()
    assert head.startswith(b"HTTP/1.1 401"), head


async def test_slow_and_excess_connections_are_closed(tmp_path: Path) -> None:
    """Finding 8, in one process: a connection that has not sent a complete request
    ``header_timeout`` after it opened is closed, and past ``max_connections`` open ones a new
    connection is closed as soon as it is accepted (its descriptor freed at once); requests
    are answered again once the others are gone."""
    agent = ReceiverAgent(tmp_path / "root", LocalCheckpoint(tmp_path / "c"), "e1")
    async with StatusServer(agent, max_connections=4, header_timeout=0.5) as server:
        slow = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(4)]
        for _, w in slow:
            w.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
            await w.drain()
        await eventually(lambda: server.open_connections == 4, "the 4 slow clients counted")
        r5, w5 = await asyncio.open_connection("127.0.0.1", server.port)
        assert await asyncio.wait_for(r5.read(), 10) == b""  # closed unanswered: full
        w5.close()
        for r, w in slow:  # each closed by the server, header_timeout after it opened
            assert await asyncio.wait_for(r.read(), 10) == b""
            w.close()
        await eventually(lambda: server.open_connections == 0, "the slow clients dropped")
        async with aiohttp.ClientSession() as http, http.get(f"{server.url}/healthz") as resp:
            assert resp.status == 200


async def test_clients_that_read_no_answer_are_closed(tmp_path: Path) -> None:
    """Found by attack (forty-third session): a client that pipelines requests and never reads
    the answers kept its connection for good (the idle timeout runs only between requests,
    and its answers waited unsent), so 64 of them shut the status port (a liveness probe
    then fails) with no effort. Now a connection whose answers cannot be sent for
    ``header_timeout`` is closed, and the port answers again."""
    agent = ReceiverAgent(tmp_path / "root", LocalCheckpoint(tmp_path / "c"), "e1")
    async with StatusServer(agent, max_connections=4, header_timeout=0.5) as server:
        readers = []
        for _ in range(4):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.setblocking(False)
            await asyncio.get_running_loop().sock_connect(s, ("127.0.0.1", server.port))
            with contextlib.suppress(BlockingIOError):
                s.send(b"GET /status HTTP/1.1\r\nHost: x\r\n\r\n" * 20000)
            readers.append(s)
        try:
            await eventually(lambda: server.open_connections == 4, "the 4 readers counted")
            await eventually(lambda: server.open_connections == 0, "the readers closed")
            async with aiohttp.ClientSession() as http, http.get(f"{server.url}/healthz") as r:
                assert r.status == 200
        finally:
            for s in readers:
                s.close()


async def test_a_flood_of_idle_connections_never_stops_a_receiver_process(tmp_path: Path) -> None:
    """Finding 8, on a real receiver process limited to 1,024 descriptors: 1,100 idle
    unauthenticated connections to its status port. On today's main it logged "Too many open
    files" and stopped applying versions; now the connections past the cap are closed at
    accept, the receiver applies and acks the next version, and answers once they are gone."""
    root = tmp_path / "root"
    sd = mixed_state(0)
    async with Publisher(root, keyframe_interval=0) as pub:
        await pub.seed(sd)
    port = free_port()
    log = tmp_path / "receiver.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "receiver.cli", "--root", str(root), "--engine-id", "e1",
             "--checkpoint", str(tmp_path / "c"), "--status-port", str(port),
             "--poll-interval", "0.2", "--force-polling"],
            stdout=out, stderr=subprocess.STDOUT,
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024)),
        )  # fmt: skip
    flood: list[socket.socket] = []
    try:
        await eventually(lambda: 0 in _acked(root), "the receiver's first ack", timeout=120)
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < 1300:
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
        for _ in range(1100):
            s = socket.socket()
            s.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                s.connect(("127.0.0.1", port))
            flood.append(s)
            if len(flood) % 100 == 0:
                await asyncio.sleep(0.01)  # let the connections land
        async with Publisher(root, keyframe_interval=0) as pub:
            await pub.seed(mutate(sd, 0.05, seed=1))
        await eventually(lambda: 1 in _acked(root), "v1 applied and acked", timeout=60)
        for s in flood:
            s.close()
        flood.clear()
        async with aiohttp.ClientSession() as http:

            async def healthy() -> bool:
                with contextlib.suppress(aiohttp.ClientError):
                    async with http.get(f"http://127.0.0.1:{port}/healthz") as resp:
                        return resp.status == 200
                return False

            await eventually_async(healthy, "the status port to answer again")
    finally:
        for s in flood:
            s.close()
        _stop(proc)
    text = log.read_text(errors="replace")
    assert "Too many open files" not in text, text[-3000:]
    assert "refusing more" in text  # the cap said so, once


def _acked(root: Path) -> set[int]:
    ack = read_acks(root).get("e1")
    return set() if ack is None else set(range(ack.version + 1))


async def eventually_async(cond: Any, what: str, timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await cond():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


async def test_an_ipv6_status_url_has_brackets(tmp_path: Path) -> None:
    """The URL the receiver prints and logs for ``--status-host ::1`` (it was http://::1:PORT,
    which no client parses); a client reaches /healthz through it."""
    if not has_ipv6_loopback():
        pytest.skip("no IPv6 loopback here")
    root = tmp_path / "root"
    async with Publisher(root, keyframe_interval=0) as pub:
        await pub.seed(mixed_state(0))
    agent = ReceiverAgent(root, LocalCheckpoint(tmp_path / "c"), "e", use_inotify=False)
    async with agent, StatusServer(agent, host="::1") as server, aiohttp.ClientSession() as http:
        assert server.url.startswith("http://[::1]:")
        async with http.get(f"{server.url}/healthz") as r:
            assert r.status in (200, 503)


@pytest.mark.parametrize("value", [float("nan"), -1, True, 10**400, 1e300, float("inf"), 0, "5"],
                         ids=shown)  # fmt: skip
def test_a_duration_no_wait_can_take_is_refused_at_once(tmp_path: Path, value: Any) -> None:
    """``ready_timeout`` reached ``asyncio.timeout`` on the first /readyz unchecked (10**400
    overflowed there, a bool waited a second) and ``header_timeout`` aiohttp's keep-alive
    timer; both are seconds > 0, with a limit (a probe must answer)."""
    agent = ReceiverAgent(tmp_path / "root", LocalCheckpoint(tmp_path / "c"), "e")
    for name in ("ready_timeout", "header_timeout"):
        with pytest.raises(ConfigError, match=f"StatusServer: {name}"):
            StatusServer(agent, **{name: value})


async def test_malformed_requests_log_one_line_a_minute_without_traceback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """(attack-42) Each malformed request (a bad Content-Length, an overlong header line, a
    port scanner's probe) logged an ERROR with an 11-line traceback through aiohttp's server
    logger: any client of the port could write ~1.4 MB of log a second into the receiver's
    log. The client's fault is one WARNING a minute now, with a count; still answered 400."""
    agent = ReceiverAgent(tmp_path / "root", LocalCheckpoint(tmp_path / "c"), "e1")
    bad = (
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 9000 + b"\r\n\r\n",
        b"GET /status\x00 HTTP/1.1\r\nHost: x\r\n\r\n",
    )
    caplog.set_level(logging.DEBUG)
    async with StatusServer(agent) as server:
        for i in range(30):
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(bad[i % len(bad)])
            await writer.drain()
            head = await asyncio.wait_for(reader.readline(), 10)
            writer.close()
            assert head.split()[1:2] == [b"400"], head
        async with aiohttp.ClientSession() as http, http.get(f"{server.url}/healthz") as resp:
            assert resp.status == 200
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(loud) == 1, [r.getMessage() for r in loud]
    assert loud[0].levelno == logging.WARNING and loud[0].exc_info is None
    assert "malformed" in loud[0].getMessage() and "\n" not in loud[0].getMessage()
    assert not any(r.exc_info for r in caplog.records if r.levelno > logging.DEBUG)


async def test_concurrent_readyz_requests_share_one_scan_of_the_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(attack-42) Each ``/readyz`` scanned the root in a thread of the loop's default
    executor, the pool the agent's own reads wait in: 40 clients asking without pause made
    the acks 12x slower (52 ms to 622 ms median at 8 MiB), and on a slow NFS root they would
    hold every worker. Requests that arrive while a scan runs now wait for that one."""
    import receiver.server as server_mod

    calls = 0
    real = server_mod.latest_version

    def slow_scan(root: Path, held: int | None) -> int | None:
        nonlocal calls
        calls += 1
        time.sleep(0.3)  # a root on a slow filesystem
        return real(root, held)

    monkeypatch.setattr(server_mod, "latest_version", slow_scan)
    root = tmp_path / "root"
    async with Publisher(root) as pub:
        await pub.seed(mixed_state(0))
    agent = ReceiverAgent(root, LocalCheckpoint(tmp_path / "c"), "e1", use_inotify=False)
    async with agent, StatusServer(agent) as server, aiohttp.ClientSession() as http:
        assert await agent.sync_once() == 0

        async def ready() -> int:
            async with http.get(f"{server.url}/readyz") as r:
                assert (await r.json())["latest"] == 0
                return r.status

        assert await asyncio.gather(*(ready() for _ in range(20))) == [200] * 20
    assert calls <= 3, calls


async def test_the_ipv6_any_address_serves_ipv4_clients_too(tmp_path: Path) -> None:
    """``--status-host ::`` ("every interface") listened on IPv6 only: asyncio binds each IPv6
    address with IPV6_V6ONLY, so a probe to 127.0.0.1 found nothing. It is bound dual-stack
    now: 127.0.0.1 and ::1 both reach /healthz on the one port."""
    if not has_ipv6_loopback():
        pytest.skip("no IPv6 loopback here")
    agent = ReceiverAgent(tmp_path / "root", LocalCheckpoint(tmp_path / "c"), "e")
    async with StatusServer(agent, host="::") as server, aiohttp.ClientSession() as http:
        assert server.url == f"http://127.0.0.1:{server.port}"  # (a URL a client can use)
        for host in ("127.0.0.1", "[::1]"):
            async with http.get(f"http://{host}:{server.port}/healthz") as r:
                assert r.status == 200, host


def test_the_check_before_the_engine_binds_the_ipv6_any_address_as_the_server_does(
    tmp_path: Path,
) -> None:
    """The receiver's check of ``--status-host :: --status-port P`` (before the engine is
    opened) bound IPv6 only, so a port an IPv4 server holds passed it. It binds as the server
    does, dual-stack: refused at once, naming the option."""
    if not has_ipv6_loopback():
        pytest.skip("no IPv6 loopback here")
    import argparse

    from receiver.cli_checks import check_status_options

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        args = argparse.Namespace(control_token_file=None, status_port=port, status_host="::")
        with pytest.raises(ConfigError, match=f"--status-port {port} on ::: Address already"):
            check_status_options(args)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"token": "short"}, "token: .* at least 16 characters .got 5."),
        ({"token": b"0123456789abcdef0"}, "token must be a str"),
        ({"token": "0123456789abcdef\nX-Evil: 1"}, "token must be one line of printable"),
        ({"token": " 0123456789abcdef"}, "token must be one line of printable"),
        ({"ready_max_lag": -1}, "ready_max_lag must be >= 0"),
        ({"ready_max_lag": 1.5}, "ready_max_lag must be an integer"),
    ],
    ids=["short", "bytes", "newline", "space", "negative-lag", "float-lag"],
)
def test_bad_control_options_are_config_errors(
    tmp_path: Path, kwargs: dict[str, Any], message: str
) -> None:
    """StatusServer's token and lag checks raised a plain ValueError, outside the error tree
    (a caller catching AsyncSyncError missed it); a bytes token was sent as "Bearer b'...'"
    and one with a newline or a surrounding space matched no header a client can send (every
    POST /sync answered 401)."""
    agent = ReceiverAgent(tmp_path / "root", LocalCheckpoint(tmp_path / "c"), "e")
    with pytest.raises(ConfigError, match=f"^StatusServer: {message}"):
        StatusServer(agent, **kwargs)


async def test_a_name_of_two_addresses_is_served_on_one_port(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A host name that resolves to IPv4 and IPv6 addresses (``localhost`` on most hosts:
    127.0.0.1 and ::1; this machine's /etc/hosts gives one, so the resolver is stood in for)
    was bound by asyncio on each address with port 0 separately: each got its own free port,
    the URL named the first, and a client whose resolver tried ::1 first found nothing there
    (or another server). Every address of the name is bound on the one port now."""
    if not has_ipv6_loopback():
        pytest.skip("no IPv6 loopback here")
    monkeypatch.setattr(socket, "getaddrinfo", resolving_to("dual.test", "::1", "127.0.0.1"))
    agent = ReceiverAgent(tmp_path / "root", LocalCheckpoint(tmp_path / "c"), "e")
    async with StatusServer(agent, host="dual.test") as server, aiohttp.ClientSession() as http:
        assert server.url == f"http://dual.test:{server.port}"
        for host in ("127.0.0.1", "[::1]"):
            async with http.get(f"http://{host}:{server.port}/healthz") as r:
                assert r.status == 200, host


async def test_port_0_on_two_addresses_takes_another_port_when_the_first_is_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Port 0 and a name of two addresses: the second address is bound on the free port the
    first took, which an IPv6-only socket may hold on the other family; that failed the start
    ("port 0 on dual.test: Address already in use"). It takes another free port now. The
    kernel's choice of port cannot be steered, so the first bind of port 0 is handed the port a
    listening ::1 socket holds (a stand-in socket class); the rest is real."""
    if not has_ipv6_loopback():
        pytest.skip("no IPv6 loopback here")
    real_socket = socket.socket
    with real_socket(socket.AF_INET6) as busy:
        busy.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        busy.bind(("::1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        handed: list[int] = []

        class FirstGetsTheTakenPort(real_socket):  # type: ignore[misc,valid-type]
            def bind(self, addr: Any) -> None:
                if addr[1] == 0 and not handed:
                    handed.append(taken)
                    addr = (addr[0], taken, *addr[2:])
                super().bind(addr)

        monkeypatch.setattr(socket, "getaddrinfo", resolving_to("dual.test", "127.0.0.1", "::1"))
        monkeypatch.setattr(socket, "socket", FirstGetsTheTakenPort)
        agent = ReceiverAgent(tmp_path / "root", LocalCheckpoint(tmp_path / "c"), "e")
        server = StatusServer(agent, host="dual.test")
        await server.start()
        monkeypatch.undo()
        try:
            assert handed == [taken] and server.port != taken
            async with aiohttp.ClientSession() as http:
                for host in ("127.0.0.1", "[::1]"):
                    async with http.get(f"http://{host}:{server.port}/healthz") as r:
                        assert r.status == 200, host
        finally:
            await server.stop()


@pytest.mark.parametrize(
    ("host", "hint"),
    [
        ("[::1]", "written without brackets: '::1'"),
        ("127.0.0.1:9500", "the port goes in --status-port"),
        ("localhost:0", "the port goes in --status-port"),
        ("http://0.0.0.0", "an address, not a URL"),
    ],
)
def test_a_status_host_written_as_in_a_url_says_how_to_write_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], host: str, hint: str
) -> None:
    """``--status-host [::1]`` (as the receiver prints it in its URL), ``127.0.0.1:9500`` or a
    URL failed as "Name or service not known", as a typo does: the line now says what to
    write instead. Refused before the engine is opened."""
    from receiver.cli import main as receiver_main

    root = tmp_path / "root"
    root.mkdir()
    argv = ["--root", str(root), "--engine-id", "e1", "--checkpoint", str(tmp_path / "c"),
            "--status-port", "0", "--status-host", host]  # fmt: skip
    assert receiver_main(argv) == 1
    err = capsys.readouterr().err
    assert f"--status-host {host!r}" in err and hint in err, err
    assert not (tmp_path / "c").exists()


def test_a_status_port_taken_after_the_check_names_the_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The port is free at the check before the engine is opened and taken by the time the
    server starts (another process was quicker): the line said "StatusServer: port N ...", a
    name the operator never wrote; it names --status-port now. The race is made on demand by
    taking the port right after the real check."""
    from receiver import cli

    root = tmp_path / "root"
    root.mkdir()
    port = free_port()
    real_check = cli.check_status_options
    busy = socket.socket()

    def check_then_taken(args: Any) -> Any:
        token = real_check(args)
        busy.bind(("127.0.0.1", port))
        busy.listen()
        return token

    monkeypatch.setattr(cli, "check_status_options", check_then_taken)
    argv = ["--root", str(root), "--engine-id", "e1", "--checkpoint", str(tmp_path / "c"),
            "--status-port", str(port), "--force-polling"]  # fmt: skip
    with busy:
        assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert f"--status-port {port} on 127.0.0.1: Address already in use" in err, err
    assert "StatusServer" not in err, err


async def test_resolving_the_status_host_does_not_stall_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """StatusServer.start resolved its host on the event loop: a name behind a slow resolver
    (DNS timeouts run 5 s per try) stalled everything on the loop, a Ray receiver actor's
    agent and status calls included. The name is resolved in a worker thread now (the
    resolver is stood in for: a slow DNS cannot be had on demand)."""
    import threading

    real = socket.getaddrinfo
    release = threading.Event()

    def slow(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        if host == "slow.test":
            release.wait(10)  # (a bound: the code before this fix blocked the loop here)
            host = "127.0.0.1"
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", slow)
    agent = ReceiverAgent(tmp_path / "root", LocalCheckpoint(tmp_path / "c"), "e")
    server = StatusServer(agent, host="slow.test")
    starting = asyncio.create_task(server.start())
    ticks = 0
    for _ in range(20):  # the loop runs while the name is resolved
        await asyncio.sleep(0.01)
        ticks += 1
    running_meanwhile = not starting.done()
    release.set()
    await starting
    try:
        assert running_meanwhile and ticks == 20
        assert server.url == f"http://slow.test:{server.port}"
    finally:
        await server.stop()


async def test_readyz_says_why_when_the_root_cannot_be_read(shared_tmp: Path) -> None:
    """Found by attack (forty-third session): a receiver process (as nobody) whose root became
    unreadable (its mode changed, on NFS a stale handle) answered each /readyz with aiohttp's
    500 "Server got itself in trouble" and logged a traceback per probe. Now 503 saying why,
    no traceback; ready again once the root reads."""
    tmp_path = shared_tmp
    root = tmp_path / "root"
    async with Publisher(root, keyframe_interval=0) as pub:
        await pub.seed(mixed_state(0))
    (tmp_path / "c").mkdir()
    for d in (root, root / "acks", root / "leases", tmp_path / "c"):
        d.mkdir(exist_ok=True)
        d.chmod(0o777)
    port = free_port()
    log = tmp_path / "receiver.log"
    url = f"http://127.0.0.1:{port}/readyz"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.as_user", "65534", "65534", "receiver.cli",
             "--root", str(root), "--engine-id", "e1", "--checkpoint", str(tmp_path / "c"),
             "--status-port", str(port), "--poll-interval", "0.2", "--force-polling"],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        async with aiohttp.ClientSession() as http:

            async def ready() -> tuple[int, Any]:
                async with http.get(url) as resp:
                    return resp.status, await resp.json()

            async def answers(status: int) -> bool:
                with contextlib.suppress(aiohttp.ClientError):
                    return (await ready())[0] == status
                return False

            await eventually_async(lambda: answers(200), "ready at v0", timeout=120)
            root.chmod(0o700)  # nobody can no longer read it
            status, body = await ready()
            assert status == 503, (status, body)  # was 500, text/plain
            assert body["ready"] is False and body["serving"] == 0, body
            assert body["why"].startswith(f"cannot read the root {root}: "), body
            assert "Permission denied" in body["why"], body
            root.chmod(0o777)
            await eventually_async(lambda: answers(200), "ready again")
    finally:
        root.chmod(0o777)
        _stop(proc)
    text = log.read_text(errors="replace")
    assert "Traceback" not in text and "Error handling request" not in text, text[-3000:]
