"""Operator options and inputs with a bound (helper-59): the status port and host, the status
URL, a Ray receiver's agent options, poll intervals, secrets from procfs-like files, the
auditor's read rate, ``ASYNCSYNC_PINNED_MB`` and ``/readyz`` while the receiver starts."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from asyncsync import ConfigError
from receiver.listen import _PORT_TRIES, bind_sockets
from tests.ports import has_ipv6_loopback


def test_port_0_taken_on_every_try_names_the_ports_tried(monkeypatch: pytest.MonkeyPatch) -> None:
    """Port 0 and a name of two addresses: each free port the first address takes may be held
    on the other by another family's socket; after the last try the error said "port 0 on
    dual.test: Address already in use; pick a free port (0: any free one)", though 0 was what
    was given and five ports were tried. It names the ports tried now. The kernel's choice
    cannot be steered: each first bind of port 0 is handed a port a listening ::1 socket
    holds (a stand-in socket class); the binds are real."""
    if not has_ipv6_loopback():
        pytest.skip("no IPv6 loopback here")
    real_info, real_socket = socket.getaddrinfo, socket.socket

    def two(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        if host != "dual.test":
            return real_info(host, port, *args, **kwargs)
        return [*real_info("127.0.0.1", port, *args, **kwargs),
                *real_info("::1", port, *args, **kwargs)]  # fmt: skip

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

        monkeypatch.setattr(socket, "getaddrinfo", two)
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
