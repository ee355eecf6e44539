"""Start and stop real vLLM 0.32 servers for the tests (127.0.0.1 only).

Runs in the project's venv; the server runs in the cached vLLM environment (``build.py``).
The process plumbing (:class:`~tests.sglang_env.server.Process`, :func:`http`, the receiver)
is the SGLang tests' own.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.sglang_env.server import Process, free_port, http
from tests.vllm_env import build

#: the recipe that serves on a CPU-only host (docs/ENGINES.md, "The real vLLM in the tests")
CPU_FLAGS = (
    "--dtype", "float32",
    "--max-model-len", "512",
    "--enforce-eager",
    "--max-num-seqs", "8",
)  # fmt: skip
#: the worker extension the receiver's in-engine calls and the served-bytes audit need
WORKER_EXTENSION = "receiver.plugins.vllm_worker.AsyncSyncWorkerExtension"

START_TIMEOUT = 600.0  # ~1 min on an idle 2-core host; several while other jobs run


class VLLMServer(Process):
    """``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1 (dev mode).

    ``model`` is the directory vLLM loads at start and reloads from (``--model``);
    ``extension=True`` puts this checkout's installed copy (``build/vllm-plugin``) on the
    server's PYTHONPATH and loads the asyncsync worker extension."""

    def __init__(
        self,
        env_dir: Path,
        model: Path,
        log: Path,
        *,
        api_key: str | None = None,
        extension: bool = True,
        extra_env: dict[str, str] | None = None,
        extra_args: Sequence[str] = (),
        port: int | None = None,
        threads: int | None = 1,
    ):
        self.port = port or free_port()
        self.model = model
        self.api_key = api_key
        path = [build.PLUGIN_DIR] if extension else []
        env = build.server_env(env_dir, path)
        env.update(VLLM_HOST_IP="127.0.0.1", VLLM_LOOPBACK_IP="127.0.0.1")
        if threads is not None:  # the tiny model needs no more; several servers share 2 cores
            env.update(VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS=str(threads))
        env.update(extra_env or {})
        cmd = [
            str(build.python_of(env_dir)), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model), "--host", "127.0.0.1", "--port", str(self.port),
            *CPU_FLAGS, *extra_args,
        ]  # fmt: skip
        if extension:
            cmd += ["--worker-extension-cls", WORKER_EXTENSION]
        if api_key is not None:
            cmd += ["--api-key", api_key]
        super().__init__(cmd, log, env)
        self.movable_port = port is None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = START_TIMEOUT) -> None:
        self.start_healthy(lambda: self.wait_healthy(timeout))

    def wait_healthy(self, timeout: float = START_TIMEOUT) -> None:
        self.wait_ok(self.url + "/health", "vLLM", timeout)

    def call(self, method: str, path: str, body: Any = None, **kw: Any) -> tuple[int, Any]:
        return http(self.url + path, method, body, key=self.api_key, **kw)

    def weight_version(self) -> str | None:
        status, info = self.call("GET", "/weight_info")
        assert status == 200, info
        v = info["weight_version"]
        return None if v is None else str(v)

    def complete(self, prompt: list[int], n: int = 8) -> list[int]:
        """Greedy completion of ``n`` tokens of the token-id prompt: the generated ids."""
        status, out = self.call(
            "POST",
            "/v1/completions",
            {
                "model": str(self.model),
                "prompt": prompt,
                "max_tokens": n,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            },
        )
        assert status == 200, out
        return [int(t) for t in out["choices"][0]["token_ids"]]

    def checksums(self) -> dict[str, str]:
        """vLLM's own ``/weight_checker`` SHA-256 of each served (fused) parameter."""
        status, out = self.call("POST", "/weight_checker", {"action": "checksum"})
        assert status == 200, out
        return dict(out["checksums"])

    def rpc(self, method: str, *args: Any, timeout: float = 120.0) -> list[Any]:
        """``/collective_rpc``: one result per worker."""
        status, out = self.call(
            "POST", "/collective_rpc", {"method": method, "args": list(args)}, timeout=timeout
        )
        assert status == 200, out
        return list(out["results"])

    def count(self, needle: str) -> int:
        """How often ``needle`` occurs in the server's log (e.g. an access-log line)."""
        return self.text().count(needle)


__all__ = ["START_TIMEOUT", "VLLMServer", "free_port"]
