"""Operator options and inputs with a bound (helper-59): the status port and host, the status
URL, a Ray receiver's agent options, poll intervals, secrets from procfs-like files, the
auditor's read rate, ``ASYNCSYNC_PINNED_MB`` and ``/readyz`` while the receiver starts."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import re
import signal
import socket
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from asyncsync import AckTimeout, ConfigError
from asyncsync.errors import shown
from asyncsync.format.acks import wait_acked
from asyncsync.publish.rendezvous import FileRendezvous
from receiver import ReceiverAgent
from receiver.engines.checkpoint import LocalCheckpoint
from receiver.listen import _PORT_TRIES, bind_sockets, url_host
from receiver.options import AGENT_OPTIONS
from receiver.server import StatusServer
from tests.conftest import stopped_at_end
from tests.ports import has_ipv6_loopback, resolving_to


def test_port_0_taken_on_every_try_names_the_ports_tried(monkeypatch: pytest.MonkeyPatch) -> None:
    """Port 0 and a name of two addresses: each free port the first address takes may be held
    on the other by another family's socket; after the last try the error said "port 0 on
    dual.test: Address already in use; pick a free port (0: any free one)", though 0 was what
    was given and five ports were tried. It names the ports tried now. The kernel's choice
    cannot be steered: each first bind of port 0 is handed a port a listening ::1 socket
    holds (a stand-in socket class); the binds are real."""
    if not has_ipv6_loopback():
        pytest.skip("no IPv6 loopback here")
    real_socket = socket.socket
    busy = []
    try:
        for _ in range(_PORT_TRIES):
            s = real_socket(socket.AF_INET6)
            busy.append(s)
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            s.bind(("::1", 0))
            s.listen()
        taken = [s.getsockname()[1] for s in busy]
        handed: list[int] = []

        class FirstGetsATakenPort(real_socket):  # type: ignore[misc,valid-type]
            def bind(self, addr: Any) -> None:
                if addr[1] == 0:
                    handed.append(taken[len(handed)])
                    addr = (addr[0], handed[-1], *addr[2:])
                super().bind(addr)

        monkeypatch.setattr(socket, "getaddrinfo", resolving_to("dual.test", "127.0.0.1", "::1"))
        monkeypatch.setattr(socket, "socket", FirstGetsATakenPort)
        with pytest.raises(ConfigError) as caught:
            bind_sockets("dual.test", 0, port_option="--status-port")
        monkeypatch.undo()
    finally:
        for s in busy:
            s.close()
    msg = str(caught.value)
    assert handed == taken, handed
    assert msg.startswith(f"--status-port 0 on dual.test: tried {_PORT_TRIES} free ports"), msg
    for port in taken:
        assert f"{port} on ::1" in msg, msg
    assert "pick a free port (0: any free one)" not in msg, msg


@pytest.fixture
def no_ipv6(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel without IPv6 (booted with ``ipv6.disable=1``): an AF_INET6 socket cannot be
    made. That is a boot parameter, so it is stood in for; a network namespace with
    ``net.ipv6.conf.all.disable_ipv6=1`` (``unshare -rn``) still makes AF_INET6 sockets, and
    ``::`` bound there serves IPv4 clients (tried by hand: the receiver serves)."""
    real = socket.socket

    class NoInet6(real):  # type: ignore[misc,valid-type]
        def __init__(self, family: Any = socket.AF_INET, *args: Any, **kwargs: Any) -> None:
            if family == socket.AF_INET6:
                raise OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")
            super().__init__(family, *args, **kwargs)

    monkeypatch.setattr(socket, "socket", NoInet6)


async def test_the_ipv6_any_address_on_a_host_without_ipv6_serves_ipv4(
    tmp_path: Path, no_ipv6: None, caplog: pytest.LogCaptureFixture
) -> None:
    """``--status-host ::`` ("every interface, IPv4 and IPv6") on a host without IPv6 was
    refused: "--status-host '::': Address family not supported by protocol", and a receiver
    deployed with one manifest on every node failed on that one. It serves every IPv4
    interface there, with a warning saying so."""
    agent = ReceiverAgent(tmp_path / "root", LocalCheckpoint(tmp_path / "c"), "e")
    caplog.set_level(logging.WARNING, logger="receiver.listen")
    async with (
        StatusServer(agent, host="::") as server,
        aiohttp.ClientSession() as http,
        http.get(f"http://127.0.0.1:{server.port}/healthz") as r,
    ):
        assert r.status == 200
    assert "this host has no IPv6" in caplog.text and "0.0.0.0" in caplog.text, caplog.text


def test_another_ipv6_address_on_a_host_without_ipv6_says_to_give_ipv4(no_ipv6: None) -> None:
    """``--status-host ::1`` there: the error said only "Address family not supported by
    protocol"; it says what to give instead now."""
    with pytest.raises(ConfigError, match="this host has no IPv6: give an IPv4 address"):
        bind_sockets("::1", 0, host_option="--status-host")


async def test_the_ipv6_fallback_is_said_once_by_the_receiver_cli(
    tmp_path: Path, no_ipv6: None, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``asyncsync-receiver --status-host ::`` on a host without IPv6 said "this host has no
    IPv6 ... serving every IPv4 interface" twice: from its early check of the status port and
    from the server's bind. The check is quiet about it: the bind says it, once. The CLI's own
    two steps, in the order it runs them."""
    import argparse

    from receiver.cli_checks import TOKEN_ENV, check_status_options
    from receiver.cli_start import _serve_status

    monkeypatch.delenv(TOKEN_ENV, raising=False)
    args = argparse.Namespace(
        control_token_file=None, status_host="::", status_port=0, control_token=None,
        ready_max_lag=0, engine_id="e",
    )  # fmt: skip
    caplog.set_level(logging.WARNING, logger="receiver.listen")
    check_status_options(args)
    agent = ReceiverAgent(tmp_path / "root", LocalCheckpoint(tmp_path / "c"), "e")
    server = await _serve_status(args, agent)
    await server.stop()
    said = [r.getMessage() for r in caplog.records if "this host has no IPv6" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("--status-host '::': "), said


@pytest.mark.parametrize("host", ["::", "0.0.0.0"])
async def test_the_status_url_of_every_interface_is_one_a_client_can_use(
    tmp_path: Path, host: str
) -> None:
    """A receiver started with ``--status-host ::`` printed ``http://[::]:PORT`` (and
    ``0.0.0.0``, ``http://0.0.0.0:PORT``): "every interface" is no address to connect to. It
    prints the loopback it serves now, and says it is bound to every interface. A real
    receiver process; its URL is fetched as printed."""
    if host == "::" and not has_ipv6_loopback():
        pytest.skip("no IPv6 loopback here")
    (tmp_path / "root").mkdir()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "receiver.cli", "--root", str(tmp_path / "root"),
        "--engine-id", "e1", "--checkpoint", str(tmp_path / "c"), "--status-port", "0",
        "--status-host", host, "--force-polling", "--log-level", "WARNING",
        stderr=asyncio.subprocess.PIPE, env={**os.environ, "ASYNCSYNC_RECEIVER_TOKEN": ""},
    )  # fmt: skip
    assert proc.stderr is not None
    lines: list[str] = []
    async with stopped_at_end(proc), asyncio.timeout(60):
        while not (m := re.search(r"status on (\S+)(.*)", lines[-1] if lines else "")):
            line = (await proc.stderr.readline()).decode()
            assert line, "receiver exited early: " + "".join(lines)
            lines.append(line)
        url, rest = m.groups()
        assert url.startswith("http://127.0.0.1:"), url
        assert f"every interface, {host}" in rest, rest
        async with aiohttp.ClientSession() as http, http.get(f"{url}/healthz") as r:
            assert r.status == 200


def test_a_scoped_ipv6_address_in_a_url_escapes_its_percent() -> None:
    """RFC 6874: ``fe80::1%eth0`` is written ``[fe80::1%25eth0]`` in a URL."""
    with socket.socket() as s:
        assert url_host("fe80::1%eth0", s) == "[fe80::1%25eth0]"
        assert url_host("::1", s) == "[::1]" and url_host("localhost", s) == "localhost"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"verify_deadlin": 5}, "ReceiverAgent takes no option 'verify_deadlin'; did you mean "
                                "'verify_deadline'?"),
        ({"lease_ttl": -1}, "lease_ttl must be > 0, got -1"),
        ({"prefetch_bytes": float("nan")}, "prefetch_bytes must be an integer, got nan"),
        ({"prefetch": "no"}, "prefetch must be True or False, got 'no'"),
    ],
)  # fmt: skip
def test_a_ray_receiver_specs_agent_options_are_checked_when_it_is_made(
    tmp_path: Path, options: dict[str, Any], message: str
) -> None:
    """``ReceiverSpec.agent_options`` reached ReceiverAgent only inside the actor, on the
    engine's node after placement: a typo was a TypeError there, a bad value a remote
    ConfigError. Both are a ConfigError when the spec is made now, with the agent's own
    message (the agent checks its options with the same checks)."""
    from asyncsync.training.ray.base import ReceiverSpec

    with pytest.raises(ConfigError) as caught:
        ReceiverSpec("e0", str(tmp_path / "c"), agent_options=options)
    assert str(caught.value).startswith(f"e0: agent_options: {message}"), caught.value
    [name] = options
    if name in AGENT_OPTIONS:  # the agent's own error says the same
        with pytest.raises(ConfigError, match=f"^{re.escape(message)}"):
            ReceiverAgent(tmp_path / "root", LocalCheckpoint(tmp_path / "c"), "e0", **options)


def test_the_checked_options_are_the_agents_keywords() -> None:
    """The checks stay in step with ReceiverAgent's keyword-only parameters."""
    import inspect

    params = inspect.signature(ReceiverAgent).parameters.values()
    assert {p.name for p in params if p.kind is p.KEYWORD_ONLY} == set(AGENT_OPTIONS)


_POLLS = [0, -1, float("nan"), float("inf"), 1e-9, 0.0009]


@pytest.mark.parametrize("value", _POLLS, ids=shown)
@pytest.mark.parametrize("name", ["poll_interval", "max_poll_interval"])
async def test_an_ack_wait_polls_at_least_a_millisecond_apart(
    tmp_path: Path, name: str, value: float
) -> None:
    """``wait_acked(poll_interval=1e-9)`` (or ``max_poll_interval``) was taken: it read the
    acks directory without pause, a core spinning for the whole wait. A poll below 1 ms is
    refused (not 10 ms: the bench polls acks every 2 ms on purpose); 0, negative, NaN and inf
    were and are."""
    with pytest.raises(ConfigError, match=f"^wait_acked: {name} must be"):
        await wait_acked(tmp_path, 0, quorum=1, timeout=0.01, **{name: value})


async def test_the_benchs_ack_poll_is_taken(tmp_path: Path) -> None:
    with pytest.raises(AckTimeout):
        await wait_acked(tmp_path, 0, quorum=1, timeout=0.01, poll_interval=0.002,
                         max_poll_interval=0.002)  # fmt: skip
    FileRendezvous(tmp_path, 0, 1, poll_interval=0.001)


@pytest.mark.parametrize("value", [*_POLLS, 10.0, 1e9], ids=shown)
def test_a_rendezvous_polls_at_least_a_millisecond_apart_and_within_its_timeout(
    tmp_path: Path, value: float
) -> None:
    """``FileRendezvous(poll_interval=1e-9)`` spun a core in each wait; one at or above its
    timeout (10 s, the timeout 10 s) made its heartbeats (every poll at least) come after the
    other ranks had given it up. Both are refused."""
    with pytest.raises(ConfigError, match=r"^FileRendezvous poll_interval"):
        FileRendezvous(tmp_path, 0, 2, timeout=10.0, poll_interval=value)


def test_a_secret_in_a_procfs_file_is_read_whole(tmp_path: Path) -> None:
    """A secret read from a file whose ``st_size`` says 0 whatever it holds (procfs, sysfs, some
    FUSE secret stores) came back as its first byte: the read asked for ``st_size + 1``
    bytes. It is read to its end now, bounded as before. ``/proc/self/comm`` (this process's
    name, one line) stands for such a file: real procfs."""
    from receiver.cli_checks import read_secret

    comm = Path("/proc/self/comm")
    assert comm.stat().st_size == 0
    assert read_secret(str(comm), "UNSET_ENV", "--api-key-file") == comm.read_text().strip()


def test_a_procfs_file_past_the_limit_is_refused() -> None:
    """Read on to its end, a file that says 0 bytes is still refused past the limit (not read
    without end): ``/proc/self/status`` holds over a kilobyte."""
    from asyncsync import fsio

    assert len(fsio.read_bytes("/proc/self/status", limit=4096)) > 200
    with pytest.raises(ValueError, match="larger than 200 bytes"):
        fsio.read_bytes("/proc/self/status", limit=200)


@pytest.mark.parametrize("value", [1.0, 1e-300, 1e300, 10**400, -5.0, 0], ids=shown)
async def test_the_in_engine_auditors_read_pace_has_bounds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, value: Any
) -> None:
    """``Auditor(bytes_per_s=1e-300)`` (or 1 byte a second) was taken: each tensor then waited
    its share of an endless pace, a pass over a model took days and the audit never said a
    thing; ``1e300`` is no pace a disk has. A pace from 1 MiB/s to 1 PiB/s is taken now: a
    ConfigError in code, a warning and the default from ``$ASYNCSYNC_AUDIT_BYTES_PER_S`` (the
    engine's model load, which builds the auditor, must not fail on it)."""
    from receiver.plugins.audit import Auditor
    from tests.sglang_toy import Rig

    monkeypatch.setenv("ASYNCSYNC_AUDIT_BYTES_PER_S", str(value))
    async with Rig(tmp_path, tp=1) as rig:
        with pytest.raises(ConfigError, match=r"^Auditor: bytes_per_s must be"):
            Auditor(rig.loaders[0], bytes_per_s=value)
        caplog.set_level(logging.WARNING, logger="receiver.plugins.audit")
        assert Auditor(rig.loaders[0]).bytes_per_s == float(256 << 20)
        assert "$ASYNCSYNC_AUDIT_BYTES_PER_S" in caplog.text, caplog.text
        assert Auditor(rig.loaders[0], bytes_per_s=float(1 << 20)).bytes_per_s == 1 << 20


@pytest.mark.parametrize(
    ("env", "said"),
    [
        ("ASYNCSYNC_PINNED_MB", "ASYNCSYNC_PINNED_MB must be a number of MiB"),
        ("ASYNCSYNC_SCRATCH_MB", "ASYNCSYNC_SCRATCH_MB must be a number of MiB"),
        ("ASYNCSYNC_THREADS", "ASYNCSYNC_THREADS='lots' is not a whole number"),
    ],
)
def test_a_bad_setting_in_the_environment_is_said_at_start_up(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    env: str,
    said: str,
) -> None:
    """``ASYNCSYNC_PINNED_MB=lots`` was read when the pinned pool was made: at the first copy of
    a CUDA tensor, inside a publish (its version failed) or an audit, hours after start-up (and
    never on a host without a GPU). ``ASYNCSYNC_SCRATCH_MB=lots`` failed the import of
    ``asyncsync.codec.scratch``: a traceback out of ``import asyncsync``, before any command
    could say it in context. ``ASYNCSYNC_THREADS=lots`` was read at the first parallel map:
    the receiver had opened its engine (and a running one retried every version, each failing
    with it). The Publisher and the receiver refuse each as they are made now; the receiver's
    command line says it in one line before anything is opened."""
    from asyncsync import Publisher
    from receiver.cli import main as receiver_main

    monkeypatch.setenv(env, "lots")
    with pytest.raises(ConfigError, match=re.escape(said)):
        Publisher(tmp_path / "root")
    with pytest.raises(ConfigError, match=re.escape(said)):
        ReceiverAgent(tmp_path / "root", LocalCheckpoint(tmp_path / "c"), "e")
    (tmp_path / "root").mkdir()
    argv = ["--root", str(tmp_path / "root"), "--engine-id", "e1", "--checkpoint",
            str(tmp_path / "c"), "--once"]  # fmt: skip
    assert receiver_main(argv) == 1
    err = capsys.readouterr().err
    assert said in err, err
    assert not (tmp_path / "c").exists()
    # a new process: the setting is there as it imports the package
    import subprocess

    proc = subprocess.run(
        [sys.executable, "-m", "receiver.cli", *argv], capture_output=True, text=True
    )
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr and said in proc.stderr, proc.stderr
    assert not (tmp_path / "c").exists()


async def test_readyz_answers_503_saying_why_while_the_receiver_retries_its_start(
    tmp_path: Path,
) -> None:
    """While ``asyncsync-receiver`` retried a start that failed for now (the SGLang server
    answering 503), its status port was not open: ``/readyz`` refused the connection, so a
    probe could not tell a receiver waiting for its engine from one that is not there. It
    answers 503 now, saying why, from before the first attempt; ``/healthz`` (200: alive) and
    ``/status`` say it is starting. A real receiver process and a real (fake SGLang) HTTP server."""
    import subprocess

    from tests.fake_engines import KEY, Chain, FakeSGLang, ServerThread

    async def publish() -> None:
        c = Chain(tmp_path / "root")
        async with c.pub:
            await c.next()

    await publish()
    key = tmp_path / "key"
    key.write_text(KEY)
    with ServerThread(FakeSGLang(api_key=KEY)) as srv:
        srv.inject("/continue_generation", status=503, times=10**6)
        proc = subprocess.Popen(
            [sys.executable, "-m", "receiver.cli", "--root", str(tmp_path / "root"),
             "--force-polling", "--sglang-url", srv.url, "--api-key-file", str(key),
             "--engine-id", "w", "--checkpoint", str(tmp_path / "w"), "--status-port", "0"],
            stderr=subprocess.PIPE, text=True, env={**os.environ, "ASYNCSYNC_RECEIVER_TOKEN": ""},
        )  # fmt: skip
        try:
            assert proc.stderr is not None
            lines = [await asyncio.to_thread(proc.stderr.readline)]
            while "could not start" not in lines[-1]:
                assert lines[-1], "".join(lines)  # it exited
                lines.append(await asyncio.to_thread(proc.stderr.readline))
            urls = [m.group(1) for x in lines if (m := re.search(r"status on (\S+)", x))]
            assert urls, "".join(lines)  # printed before the first attempt
            async with aiohttp.ClientSession() as http:
                async with http.get(urls[0] + "/readyz") as r:
                    body = await r.json()
                    assert r.status == 503 and body["ready"] is False, body
                    assert body["why"].startswith("starting: could not start"), body
                async with http.get(urls[0] + "/healthz") as r:  # alive: no liveness restart
                    body = await r.json()
                    assert r.status == 200 and body["starting"].startswith("could not"), body
                async with http.get(urls[0] + "/status") as r:
                    status = await r.json()
                    assert status["starting"].startswith("could not start"), status
                    assert status["version"] is None
            proc.send_signal(signal.SIGTERM)
            _, rest = await asyncio.to_thread(proc.communicate, timeout=60)
        finally:
            if proc.returncode is None:
                proc.kill()
                proc.communicate()
        assert proc.returncode == 0, rest
        assert "stopped while starting" in rest, rest
