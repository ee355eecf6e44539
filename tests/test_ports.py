"""The test harness's ports and server starts (tests/ports.py, tests/sglang_env/server.py).

CI once lost a whole module of real-SGLang tests because the port chosen for the server was
taken before the server bound it; these run the harness against a real small HTTP server
process (no SGLang) so the recovery is checked on every run."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

from tests import ports
from tests.sglang_env.server import START_MARK, Process

#: a real HTTP server that answers GET /health with 200 on --port (the SGLang launcher's flag)
SERVE = """
import http.server, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a): pass
try:
    srv = http.server.HTTPServer(("127.0.0.1", port), H)
except OSError as exc:
    print(f"ERROR:    {exc}", flush=True)  # uvicorn's way: "[Errno 98] ... address already in use"
    sys.exit(3)
print("serving", port, flush=True)
srv.serve_forever()
"""


class Toy(Process):
    def __init__(self, log: Path, port: int | None = None):
        self.port = port or ports.free_port()
        cmd = [sys.executable, "-c", SERVE, "--port", str(self.port)]
        super().__init__(cmd, log, {})
        self.movable_port = port is None

    def start(self, timeout: float = 30.0) -> None:
        self.start_healthy(
            # a short probe: a squatter that listens holds each probe for its whole timeout
            lambda: self.wait_ok(f"http://127.0.0.1:{self.port}/health", "toy", timeout, 1.0)
        )


def _ephemeral() -> tuple[int, int]:
    low, high = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    return low, high


def test_ports_are_free_distinct_and_outside_the_ephemeral_range() -> None:
    got = ports.free_ports(50)
    low, high = _ephemeral()
    assert len(set(got)) == 50
    assert all(20000 <= p < low or p > high for p in got)  # not Ray's worker ports either
    for p in got:  # each one bindable now
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
    assert not set(got) & set(ports.free_ports(50))  # never handed out twice


def test_a_port_taken_before_the_server_binds_is_moved_once(tmp_path: Path) -> None:
    srv = Toy(tmp_path / "toy.log")
    first = srv.port
    with socket.socket() as squatter:  # what CI met: another process listened there first
        squatter.bind(("127.0.0.1", first))
        squatter.listen()
        srv.start()
        try:
            assert srv.alive and srv.port != first
            assert srv.cmd[srv.cmd.index("--port") + 1] == str(srv.port)
            assert srv.text().count(START_MARK) == 2
            assert "address already in use" in srv.text().lower()
        finally:
            srv.stop()
    # once served, the address is the server's: a restart never moves it
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past the TIME_WAITs
        squatter.bind(("127.0.0.1", srv.port))
        squatter.listen()
        try:
            with pytest.raises(
                RuntimeError, match=r"exited during start; its error lines:\n.*in use"
            ):
                srv.start()
        finally:
            srv.stop()


def test_a_port_the_test_chose_is_never_moved(tmp_path: Path) -> None:
    port = ports.free_port()
    srv = Toy(tmp_path / "toy.log", port=port)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        with pytest.raises(RuntimeError, match="in use"):
            srv.start()
    assert srv.port == port and not srv.alive and srv.text().count(START_MARK) == 1


def test_a_start_failing_otherwise_is_not_retried(tmp_path: Path) -> None:
    srv = Toy(tmp_path / "toy.log")
    srv.cmd = [sys.executable, "-c", "raise SystemExit('boom: no model')", "--port", "1"]
    with pytest.raises(RuntimeError, match="exited during start"):
        srv.start()
    assert srv.text().count(START_MARK) == 1 and "boom: no model" in srv.text()
