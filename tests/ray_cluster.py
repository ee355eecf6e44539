"""A real local Ray cluster of two raylets on this host, for tests that kill a node.

``ray start --head`` and a second ``ray start --address`` with its own ``--temp-dir``, each in
its own session, on free ports; token authentication with the host's shared token
(``~/.ray/auth_token``, made by ``ray get-auth-token --generate`` if missing), as a local
``ray.init()`` of Ray 2.60 uses: with ``RAY_AUTH_MODE=disabled`` instead, the driver process
keeps that mode cached and the next local ``ray.init()`` in it (another test module) fails to
talk to its own GCS. Health checks every second, so that the GCS marks a killed node dead
within about 10 s (not faster: a loaded 2-core machine must not lose a node that is only slow).
:meth:`TwoNodes.kill_node` SIGKILLs every process of the second node's session (its raylet,
its workers, its agents): a node lost, as when its machine dies. :meth:`TwoNodes.stop`
ends both sessions; it never runs ``ray stop``, which would end every Ray on the host.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from tests.ports import free_ports

NODE_B = "asyncsync_node_b"  # a custom resource only the second node offers
ENGINE = "asyncsync_engine"  # one unit on each node: receivers placed by resource


def _session_pids(sid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
        if int(fields[3]) == sid:  # state ppid pgrp session ...
            out.append(int(d))
    return out


class TwoNodes:
    """Two raylets on this host (see the module docstring)."""

    DRIVER_ENV: ClassVar[dict[str, str]] = {"RAY_AUTH_MODE": "token"}
    ENV: ClassVar[dict[str, str]] = {
        **DRIVER_ENV,
        "RAY_health_check_period_ms": "1000",
        "RAY_health_check_timeout_ms": "5000",
        "RAY_health_check_failure_threshold": "5",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_agent_register_timeout_ms": "180000",  # a loaded machine starts agents slowly
    }

    def __init__(self, node_b_ip: str | None = None) -> None:
        self.node_b_ip = node_b_ip  # the second node's address (another loopback: 127.0.0.2)
        self._env = {k: os.environ.get(k) for k in self.DRIVER_ENV}
        self.tmp = Path(tempfile.mkdtemp(prefix="ray2n-", dir="/tmp"))  # short: unix sockets
        self.ray = str(Path(sys.executable).with_name("ray"))
        self.sessions: dict[str, int] = {}
        self.address = ""
        self.head_node = self.node_b = ""

    def _start(self, name: str, args: list[str]) -> None:
        """``ray start`` one node; on a loaded machine its agents can start too slowly for the
        raylet, which then gives up: that node is started again (3 tries)."""
        for tries in range(3):
            ports = free_ports(3)  # the others are Ray's random ones
            cmd = [
                self.ray, "start", f"--temp-dir={self.tmp / f'{name}{tries}'}", "--num-cpus=2",
                "--object-store-memory=200000000", "--disable-usage-stats",
                f"--node-manager-port={ports[0]}", f"--object-manager-port={ports[1]}",
                f"--dashboard-agent-listen-port={ports[2]}", *args,
            ]  # fmt: skip
            env = {**os.environ, **self.ENV}
            p = subprocess.Popen(
                cmd, env=env, start_new_session=True, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
            out, _ = p.communicate(timeout=240)
            self.sessions[name] = p.pid
            if p.returncode == 0:
                return
            self._kill(name)
            log = "".join(
                f.read_text(errors="replace")[-1500:]
                for f in (self.tmp / f"{name}{tries}").glob("session_2*/logs/raylet.out")
            )
            if tries == 2:
                raise RuntimeError(
                    f"ray start ({name}) failed:\n{out.decode()[-2000:]}\nraylet: {log}"
                )

    def _kill(self, name: str) -> None:
        for pid in _session_pids(self.sessions[name]):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def start(self) -> TwoNodes:
        subprocess.run(
            [self.ray, "get-auth-token", "--generate"], env={**os.environ, **self.DRIVER_ENV},
            check=True, capture_output=True, timeout=120,
        )  # fmt: skip
        port, dash = free_ports(2)
        self.address = f"127.0.0.1:{port}"
        self._start(
            "head",
            ["--head", f"--port={port}", "--include-dashboard=false", f"--dashboard-port={dash}",
             f"--resources={{\"{ENGINE}\": 1}}"],
        )  # fmt: skip
        ip = [f"--node-ip-address={self.node_b_ip}"] if self.node_b_ip else []
        self._start(
            "b",
            [f"--address={self.address}", f'--resources={{"{ENGINE}": 1, "{NODE_B}": 1}}', *ip],
        )
        return self

    def connect(self) -> Any:
        """``ray.init`` this process to the cluster (on the head's raylet); the two node ids."""
        os.environ.update(self.DRIVER_ENV)
        import ray
        from ray._raylet import Config

        # Ray reads RAY_AUTH_MODE when it is first imported (a test module may have imported
        # it before) and a ray.init(address=...) never re-reads it: re-read it, as Ray's own
        # _enable_token_auth does (running this module's tests alone failed without it)
        Config.initialize("")
        ray.init(address=self.address, log_to_driver=False, configure_logging=False)
        deadline = time.monotonic() + 120
        while True:
            alive = [n for n in ray.nodes() if n["Alive"]]
            if len(alive) == 2:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the second raylet never joined: {ray.nodes()}")
            time.sleep(0.5)
        self.node_b = next(n["NodeID"] for n in alive if n["Resources"].get(NODE_B))
        self.head_node = next(n["NodeID"] for n in alive if n["NodeID"] != self.node_b)
        here = ray.get_runtime_context().get_node_id()
        assert here == self.head_node, "the driver attached to the second raylet"
        return ray

    def kill_node(self, name: str = "b", *, wait_dead: bool = True) -> None:
        """SIGKILL every process of a node's session; wait until the GCS marks it dead."""
        self._kill(name)
        if not wait_dead:
            return
        import ray

        deadline = time.monotonic() + 60
        while any(n["Alive"] for n in ray.nodes() if n["NodeID"] == self.node_b):
            if time.monotonic() > deadline:
                raise RuntimeError("the killed node is still alive for the GCS")
            time.sleep(0.2)

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            import ray

            ray.shutdown()
        for name in ("b", "head"):
            if name in self.sessions:
                self._kill(name)
        for k, v in self._env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(self.tmp, ignore_errors=True)


def running(node_b_ip: str | None = None) -> Iterator[TwoNodes]:
    """A module fixture's body: the cluster started and connected, stopped after its tests."""
    pytest.importorskip("ray")
    cluster = TwoNodes(node_b_ip)
    try:
        cluster.start()
        cluster.connect()
        yield cluster
    finally:
        cluster.stop()
