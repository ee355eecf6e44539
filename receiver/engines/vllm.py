"""VLLM: keep a vLLM OpenAI server (dev mode) at the newest version over its HTTP API.

vLLM exposes its weight-update endpoints only with ``VLLM_SERVER_DEV_MODE=1``. vLLM's
``reload_weights`` re-reads the directory the server was started from, so start it with
``--model <checkpoint_dir>`` (the directory holds ``config.json`` and the tokenizer files too;
the receiver only manages the weight files and their index). ``open`` checks that the served
model's root is that directory, and resumes generation (a receiver killed between pause and
resume leaves the server paused, with a label that may already be right). For each
version::

    POST /pause?mode=abort
    POST /collective_rpc        {"method": "reload_weights"}
    POST /update_weight_version {"new_version": "N"}
    POST /resume                                          (always, even after a failure)
    GET  /weight_info           -> weight_version must be "N"

A zero-diff version is ``POST /update_weight_version`` alone. ``pause_mode="abort"`` (the
default) aborts in-flight requests and clears vLLM's prefix cache, so no KV computed with the
old weights survives; ``keep`` and ``wait`` are available for callers that accept otherwise.
A reload the server answers with an error leaves its weights unknown (0.32 leaves layers on
the meta device under the old label): not ready until a reload succeeds.

The served-bytes audit (:meth:`VLLM.audit`, ``receiver.audit``) needs the worker extension:
start vLLM with ``--worker-extension-cls receiver.plugins.vllm_worker.AsyncSyncWorkerExtension``
(asyncsync installed in vLLM's environment); it is called as ``POST /collective_rpc
{"method": "asyncsync_served_checksums"}`` and answers the checksum of the bytes each HF
tensor is served from (``receiver.plugins.vllm_worker`` says how, and why vLLM's own
``/weight_checker`` cannot tell on its CPU build).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, ClassVar, Literal

import safetensors

from asyncsync.errors import ApplyFailed, ConfigError
from asyncsync.format import Manifest
from asyncsync.format.checksum import entry_checksum
from receiver.engines.base import AuditReport
from receiver.engines.http_engine import EngineHTTPError, RetryPolicy, Timeouts
from receiver.engines.reloading import ReloadingEngine
from receiver.plugins.vllm_worker import audit_spec, canonical_zeros

__all__ = ["VLLM"]

VLLMPauseMode = Literal["abort", "wait", "keep"]
_MODES: tuple[VLLMPauseMode, ...] = ("abort", "wait", "keep")
AUDIT_METHOD = "asyncsync_served_checksums"


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
    #: seen on 0.32: a refused reload_weights leaves layers on the meta device
    failed_load_leaves_weights_unknown: ClassVar[bool] = True
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
        self.audit_unsupported: str | None = None  # why the server cannot be audited

    async def _check_server(self) -> None:
        # a receiver killed between pause and resume leaves vLLM paused: clear it
        await self._resume()
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

    async def audit(self, manifest: Manifest) -> AuditReport | None:
        """The served bytes of every tensor against ``manifest`` (the worker extension's
        read-back; None when the server has no worker extension)."""
        spec = audit_spec(manifest.tensor_map(), manifest.checksum_algorithm)
        try:
            answer = await self.client.request(
                "POST",
                "/collective_rpc",
                json_body={"method": AUDIT_METHOD, "args": [spec], "timeout": self.timeouts.update},
                timeout=self.timeouts.update,
                retry_timeouts=False,
            )
        except EngineHTTPError as exc:
            if exc.status is not None and AUDIT_METHOD in (exc.server_message or ""):
                self.audit_unsupported = (
                    "the server has no asyncsync worker extension: start vLLM with "
                    "--worker-extension-cls receiver.plugins.vllm_worker.AsyncSyncWorkerExtension"
                )
                return None
            raise
        results = answer.get("results") if isinstance(answer, dict) else None
        if not isinstance(results, list) or not results or not isinstance(results[0], dict):
            raise ApplyFailed(f"vllm /collective_rpc {AUDIT_METHOD}: unexpected answer {answer!r}")
        got = results[0]
        if "unsupported" in got:
            self.audit_unsupported = str(got["unsupported"])
            return None
        sums: dict[str, str] = got["checksums"]
        canonical = set(got.get("zero_sign_canonical") or ())
        skipped = {str(k): str(v) for k, v in (got.get("unmapped") or {}).items()}
        entries = manifest.tensor_map()
        expected = {n: entries[n].checksum for n in sums}
        if canonical:  # read back through a kernel: compare with the checkpoint's bytes so read
            expected.update(
                await asyncio.to_thread(
                    self._canonical_checksums, entries, canonical, manifest.checksum_algorithm
                )
            )
        bad = tuple(sorted(n for n, c in sums.items() if c != expected[n]))
        how = "vllm worker extension read-back"
        if canonical:
            how += f" ({len(canonical)} packed CPU linear weights through their kernel)"
        return AuditReport(manifest.version, len(sums), bad, skipped, how)

    def _canonical_checksums(
        self, entries: dict[str, Any], names: set[str], algorithm: str
    ) -> dict[str, str]:
        """The checksums of the checkpoint's tensors with ``-0.0`` made ``+0.0``, for the
        tensors whose served bytes were read back that way; a checkpoint tensor that does not
        match its manifest checksum gets ``"checkpoint differs"`` (so it reads as mismatched)."""
        weight_map = self.checkpoint.files.read_index()[1]
        out: dict[str, str] = {}
        by_file: dict[str, list[str]] = {}
        for n in names:
            by_file.setdefault(weight_map[n], []).append(n)
        for file, group in by_file.items():
            with safetensors.safe_open(self.checkpoint.directory / file, "pt") as f:
                for n in group:
                    t = f.get_tensor(n)
                    if entry_checksum(entries[n], t, algorithm) != entries[n].checksum:
                        out[n] = "checkpoint differs"
                    else:
                        out[n] = entry_checksum(entries[n], canonical_zeros(t), algorithm)
        return out

    def info(self) -> dict[str, Any]:
        return {**super().info(), "audit_unsupported": self.audit_unsupported}
