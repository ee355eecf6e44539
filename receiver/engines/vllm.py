"""VLLM: keep a vLLM OpenAI server (dev mode) at the newest version over its HTTP API.

vLLM exposes its weight-update endpoints only with ``VLLM_SERVER_DEV_MODE=1``. vLLM's
``reload_weights`` re-reads the directory the server was started from, so start it with
``--model <checkpoint_dir>`` (the directory holds ``config.json`` and the tokenizer files too;
the receiver only manages the weight files and their index). ``open`` checks that the served
model's root is that directory. For each version::

    POST /pause?mode=abort
    POST /collective_rpc        {"method": "reload_weights"}
    POST /update_weight_version {"new_version": "N"}
    POST /resume                                          (always, even after a failure)
    GET  /weight_info           -> weight_version must be "N"

A zero-diff version is ``POST /update_weight_version`` alone. ``pause_mode="abort"`` (the
default) aborts in-flight requests and clears vLLM's prefix cache, so no KV computed with the
old weights survives; ``keep`` and ``wait`` are available for callers that accept otherwise.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar, Literal

from asyncsync.errors import ApplyFailed, ConfigError
from receiver.engines.http_engine import EngineHTTPError, RetryPolicy, Timeouts
from receiver.engines.reloading import ReloadingEngine

__all__ = ["VLLM"]

VLLMPauseMode = Literal["abort", "wait", "keep"]
_MODES: tuple[VLLMPauseMode, ...] = ("abort", "wait", "keep")


class VLLM(ReloadingEngine):
    """A vLLM server whose ``--model`` is the host-local checkpoint (see the module docstring).

    Args:
        url, checkpoint_dir, api_key, model_path, timeouts, retry, failure_backoff: as for
            :class:`~receiver.engines.sglang.SGLang`.
        pause_mode: ``abort`` (default), ``wait`` or ``keep`` (vLLM's ``/pause`` modes).
        check_model_root: at ``open``, refuse a server whose served model root is not
            ``model_path`` (its reload would load something else).
    """

    kind: ClassVar[str] = "vllm"
    ready_path: ClassVar[str] = "/health"

    def __init__(
        self,
        url: str,
        checkpoint_dir: str | os.PathLike[str],
        *,
        api_key: str | None = None,
        model_path: str | None = None,
        pause_mode: VLLMPauseMode = "abort",
        check_model_root: bool = True,
        timeouts: Timeouts | None = None,
        retry: RetryPolicy | None = None,
        failure_backoff: tuple[float, float] = (2.0, 60.0),
        version_offset: int = 0,
    ):
        if pause_mode not in _MODES:
            raise ConfigError(f"pause_mode must be one of {_MODES}, got {pause_mode!r}")
        super().__init__(
            url,
            checkpoint_dir,
            api_key=api_key,
            model_path=model_path,
            timeouts=timeouts,
            retry=retry,
            failure_backoff=failure_backoff,
            version_offset=version_offset,
        )
        self.pause_mode = pause_mode
        self.check_model_root = check_model_root

    async def _check_server(self) -> None:
        if not self.check_model_root:
            return
        models = await self.client.request("GET", "/v1/models", timeout=self.timeouts.control)
        data = models.get("data") if isinstance(models, dict) else None
        roots = [m.get("root") for m in data or [] if isinstance(m, dict) and m.get("root")]
        want = os.path.normpath(self.model_path)
        if roots and all(os.path.normpath(str(r)) != want for r in roots):
            raise ApplyFailed(
                f"vllm at {self.client.url} serves {roots[0]!r}, not the checkpoint {want!r}: "
                "its reload_weights would load that instead. Start vLLM with --model "
                f"{want} (or pass model_path as the server sees the checkpoint)"
            )

    async def _pause(self) -> None:
        await self.client.request(
            "POST", "/pause", params={"mode": self.pause_mode}, timeout=self.timeouts.control
        )

    async def _load(self, version: int) -> None:
        await self.client.request(
            "POST",
            "/collective_rpc",
            json_body={"method": "reload_weights", "timeout": self.timeouts.update},
            timeout=self.timeouts.update,
            retry_timeouts=False,
        )
        await self._relabel(version)

    async def _resume(self) -> None:
        await self.client.request("POST", "/resume", timeout=self.timeouts.control)

    async def _relabel(self, version: int) -> None:
        answer = await self.client.request(
            "POST",
            "/update_weight_version",
            json_body={"new_version": str(version)},
            timeout=self.timeouts.control,
        )
        if isinstance(answer, dict) and answer.get("success") is False:
            raise EngineHTTPError(
                f"vllm POST /update_weight_version refused: {answer}",
                endpoint="POST /update_weight_version",
                status=200,
            )

    async def served_version(self) -> str | None:
        info: Any = await self.client.request("GET", "/weight_info", timeout=self.timeouts.control)
        if not isinstance(info, dict):
            raise EngineHTTPError(
                "vllm GET /weight_info: expected a JSON object (is VLLM_SERVER_DEV_MODE=1 set?)",
                endpoint="GET /weight_info",
                status=200,
            )
        v = info.get("weight_version")
        return None if v is None else str(v)
