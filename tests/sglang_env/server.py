"""Start and stop real SGLang servers and asyncsync receivers for the tests (127.0.0.1 only).

Used by ``tests/test_sglang_real*.py`` and ``bench_reload.py``; runs in the project's venv,
while the servers run in the cached SGLang environment (``build.py``). Blocking helpers (plain
``urllib``): the tests call them between their own awaits.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from tests.ports import free_port
from tests.sglang_env import build

#: what the recipe found to work on a CPU-only host with the sgl_kernel stub
CPU_FLAGS: tuple[str, ...] = (
    "--device", "cpu",
    "--attention-backend", "torch_native",
    "--disable-cuda-graph",
    "--skip-server-warmup",
    "--max-total-tokens", "4096",
    # SGLang refuses to start when the free memory it measured before loading the weights
    # falls by more than this fraction before it sizes the KV cache (other processes
    # allocating meanwhile: 29% of it seen on this shared host); the pool stays
    # --max-total-tokens whatever the fraction (tests/test_sglang_real_start.py)
    "--mem-fraction-static", "0.9",
    "--dtype", "float32",
    "--log-level", "info",
    # an idle 0.5.23 scheduler polls its sockets without sleeping: one whole core per server
    # (measured: 1.02 CPU-s per s idle, 0.03 with the flag; 1-token latency unchanged)
    "--sleep-on-idle",
)  # fmt: skip

START_TIMEOUT = 600.0  # ~15 s on an idle 2-core host; minutes while other jobs run
START_MARK = "===== start "  # the line Process.start writes into the log before each start
_ERROR_LINE = re.compile(r"\bERROR\b|[Aa]ddress already in use|Traceback|\w(Error|Exception): ")


def http(
    url: str,
    method: str = "GET",
    body: Any = None,
    *,
    key: str | None = None,
    timeout: float = 60.0,
) -> tuple[int, Any]:
    """One call; returns (status, decoded JSON or text). Connection errors propagate."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if key is not None:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    text = raw.decode(errors="replace")
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


class Process:
    """A child process in its own session, its output in ``log``; stopped by SIGTERM to the
    whole group (SGLang's scheduler and detokenizer are children of the launcher)."""

    port: int  # a server's --port (start_healthy moves it when it was taken)

    def __init__(self, cmd: Sequence[str], log: Path, env: dict[str, str]):
        self.cmd, self.log, self.env = list(cmd), log, env
        self.proc: subprocess.Popen[bytes] | None = None
        self.movable_port = False  # a server's own --port, until it first served (start_healthy)

    def start(self) -> None:
        with open(self.log, "ab") as out:
            out.write(f"\n{START_MARK}{time.strftime('%H:%M:%S')}: {' '.join(self.cmd)}\n".encode())
            # run beside its log, never in the checkout: `python -m` puts the working directory
            # first on sys.path, and a checkout's asyncsync.egg-info (pip install -e) would
            # register the asyncsync plugins in a server started without them
            self.proc = subprocess.Popen(
                self.cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                start_new_session=True, cwd=self.log.resolve().parent,
            )  # fmt: skip

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 30.0, sig: int = signal.SIGTERM) -> int | None:
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            rc = None
        with contextlib.suppress(ProcessLookupError):  # any child left behind
            os.killpg(proc.pid, signal.SIGKILL)
        if rc is None:
            rc = proc.wait(10)
        return rc

    def wait_ok(self, url: str, name: str, timeout: float, probe_timeout: float = 30.0) -> None:
        """Until ``GET url`` answers 200 (RuntimeError with the log's errors and tail if the
        process exits first, or after ``timeout`` seconds); each probe waits ``probe_timeout``."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if not self.alive:
                raise RuntimeError(f"{name} exited during start; {self.diagnosis()}")
            with contextlib.suppress(OSError):
                if http(url, timeout=probe_timeout)[0] == 200:
                    return
            time.sleep(0.5)
        raise RuntimeError(f"{name} not healthy within {timeout:g}s; {self.diagnosis()}")

    def start_healthy(self, wait_healthy: Callable[[], None]) -> None:
        """:meth:`start`, then ``wait_healthy()``. A failed start is stopped, never left
        behind; one whose ``--port`` was bound by another process first (the log says "address
        already in use") is retried once on a new port, if the test did not choose the port
        and the server never served on it (a restarted server keeps its address)."""
        for attempt in (0, 1):
            Process.start(self)  # the process alone (a subclass's start() waits, via here)
            try:
                wait_healthy()
            except BaseException:
                self.stop()
                if attempt or not (self.movable_port and self.bind_failed()):
                    raise
                at = self.cmd.index("--port") + 1
                self.cmd[at] = str(free_port())
                self.port = int(self.cmd[at])
                continue
            self.movable_port = False
            return

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.text().splitlines()[-n:])

    def this_start(self) -> str:
        """The log since the last :meth:`start` (the log file is appended to)."""
        return self.text().rsplit(START_MARK, 1)[-1]

    def bind_failed(self) -> bool:
        """Whether the last start could not bind its port (its log says so)."""
        return "address already in use" in self.this_start().lower()

    def diagnosis(self) -> str:
        """The error lines of the last start (a long traceback can push the cause out of the
        tail), then the log's tail."""
        errors = [ln for ln in self.this_start().splitlines() if _ERROR_LINE.search(ln)]
        head = "its error lines:\n" + "\n".join(errors[:20]) + "\n" if errors else ""
        return f"{head}its log ends:\n{self.tail()}"


class SGLangServer(Process):
    """``python -m sglang.launch_server`` on 127.0.0.1 with a tiny local model.

    ``plugin=True`` puts this checkout's installed copy (``build/sglang-plugin``) on the
    server's PYTHONPATH, so SGLang loads the asyncsync plugin from its entry point."""

    def __init__(
        self,
        env_dir: Path,
        model: Path,
        log: Path,
        *,
        api_key: str | None = None,
        admin_api_key: str | None = None,
        plugin: bool = True,
        extra_env: dict[str, str] | None = None,
        extra_path: Sequence[Path] = (),
        port: int | None = None,
    ):
        self.port = port or free_port()
        self.model = model
        self.api_key, self.admin_api_key = api_key, admin_api_key
        path = [*extra_path, *([build.PLUGIN_DIR] if plugin else [])]
        env = {**build.server_env(env_dir, list(path)), **(extra_env or {})}
        cmd = [
            str(build.python_of(env_dir)), "-m", "sglang.launch_server",
            "--model-path", str(model), "--host", "127.0.0.1", "--port", str(self.port),
            *CPU_FLAGS,
        ]  # fmt: skip
        if api_key is not None:
            cmd += ["--api-key", api_key]
        if admin_api_key is not None:
            cmd += ["--admin-api-key", admin_api_key]
        super().__init__(cmd, log, env)
        self.movable_port = port is None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = START_TIMEOUT) -> None:
        self.start_healthy(lambda: self.wait_healthy(timeout))

    def wait_healthy(self, timeout: float = START_TIMEOUT) -> None:
        """Until ``GET /health`` (a 1-token generation) answers 200; never call it paused."""
        self.wait_ok(self.url + "/health", "SGLang", timeout)

    # -- calls, with the right key -------------------------------------------------------------
    def user(self, method: str, path: str, body: Any = None, **kw: Any) -> tuple[int, Any]:
        return http(self.url + path, method, body, key=self.api_key, **kw)

    def admin(self, method: str, path: str, body: Any = None, **kw: Any) -> tuple[int, Any]:
        return http(self.url + path, method, body, key=self.admin_api_key or self.api_key, **kw)

    def model_info_version(self) -> str:
        status, info = self.user("GET", "/model_info")
        assert status == 200, info
        return str(info["weight_version"])

    def generate(self, input_ids: list[int], n: int = 8) -> dict[str, Any]:
        """Greedy generation of ``n`` tokens; the answer has output_ids and meta_info."""
        status, out = self.user(
            "POST",
            "/generate",
            {
                "input_ids": input_ids,
                "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True},
            },
        )
        assert status == 200, out
        return dict(out)

    def weights(self, name: str, rows: int = 1 << 20) -> Any:
        """``/get_weights_by_name`` (Llama implements it): nested lists of the served values."""
        status, out = self.admin(
            "POST", "/get_weights_by_name", {"name": name, "truncate_size": rows}
        )
        assert status == 200, out
        return out

    def update(self, model_path: Path | str, version: str, **kw: Any) -> tuple[int, Any]:
        body = {
            "model_path": str(model_path),
            "weight_version": version,
            "flush_cache": True,
            "abort_all_requests": False,
            **kw,
        }
        return self.admin("POST", "/update_weights_from_disk", body, timeout=300)

    def plugin_lines(self) -> list[str]:
        """The asyncsync plugin's lines about each load in the server log, in order (a stage
        that went through the checkpoint logs two: why, then what was loaded)."""
        return re.findall(
            r"asyncsync: (?:in-engine apply|stage not applied|partial reload|full reload|refused)"
            r"[^\n\]]*",
            self.text(),
        )

    def audit_lines(self) -> list[str]:
        """The plugin's audit lines (one per complete pass, one per mismatch)."""
        return re.findall(r"asyncsync audit \(rank \d+\)[^\n]*", self.text())


class Receiver(Process):
    """The real ``asyncsync-receiver`` CLI of this checkout's venv, with a status port."""

    def __init__(self, log: Path, args: Sequence[str], env: dict[str, str] | None = None):
        self.status_port = free_port()
        exe = Path(sys.executable).with_name("asyncsync-receiver")
        cmd = [str(exe), *args, "--status-port", str(self.status_port), "--poll-interval", "0.2"]
        super().__init__(cmd, log, {**os.environ, **(env or {})})

    @property
    def status_url(self) -> str:
        return f"http://127.0.0.1:{self.status_port}"

    def get(self, path: str) -> tuple[int, Any]:
        return http(self.status_url + path, timeout=30)

    def status(self) -> dict[str, Any]:
        code, body = self.get("/status")
        assert code == 200, body
        return dict(body)


def wait_for(what: str, fn: Any, timeout: float = 120.0, interval: float = 0.2) -> Any:
    """Poll ``fn()`` until it returns something truthy (exceptions count as not yet)."""
    end = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < end:
        try:
            got = fn()
        except (OSError, AssertionError, KeyError) as exc:
            got, last = None, exc
        if got:
            return got
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what} (last: {last!r})")


def run_env_python(
    env_dir: Path, *args: str, timeout: float = 300.0, environ: dict[str, str] | None = None
) -> str:
    """Run a script with the SGLang environment's python (transformers lives there); another
    environment's (the vLLM one) with its own ``environ``."""
    out = subprocess.run(
        [str(build.python_of(env_dir)), *args],
        env=build.server_env(env_dir) if environ is None else environ,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{args[0]} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return out.stdout


def iter_lines(text: str, needle: str) -> Iterator[str]:
    return (line for line in text.splitlines() if needle in line)
