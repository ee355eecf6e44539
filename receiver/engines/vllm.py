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

**In-engine apply** (``in_engine=True``, the default; docs/ENGINES.md): with the asyncsync
worker extension loaded (below), ``open`` asks every worker what it can do
(``asyncsync_capabilities``). A server whose workers hold plain weights (on the CPU build:
started with ``ASYNCSYNC_VLLM_INPLACE=1``; on GPU always) gets each delta staged before the
pause (``receiver.plugins.stage``), and the pause holds one call::

    POST /collective_rpc {"method": "asyncsync_apply_stage", "args": [<stage dir>]}

which every worker (tensor-parallel rank) answers after XORing the changed elements into its
parameters in place through the model's own ``load_weights``, or, when that cannot be proven
safe, after loading the version from the checkpoint (``receiver.plugins.vllm_loader``; the
answer and the server's log say which and why). Checkpoint loads (keyframes, a reconcile, a
repair) go through ``asyncsync_load`` (only the tensors that changed; vLLM's
``reload_weights`` when the base is unknown). A server whose weights are packed (the CPU
build without the opt-in) or quantized gets no stages: every version is ``reload_weights``
(``info()["in_engine"]["why_not"]`` says why). Without the extension: ``reload_weights``
through ``/collective_rpc``, as above.

The served-bytes audit (:meth:`VLLM.audit`, ``receiver.audit``) needs the worker extension:
start vLLM with ``--worker-extension-cls receiver.plugins.vllm_worker.AsyncSyncWorkerExtension``
(asyncsync installed in vLLM's environment); it is called as ``POST /collective_rpc
{"method": "asyncsync_served_checksums"}`` and answers the checksum of the bytes each HF
tensor is served from (``receiver.plugins.vllm_worker`` says how, and why vLLM's own
``/weight_checker`` cannot tell on its CPU build).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
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

logger = logging.getLogger(__name__)

VLLMPauseMode = Literal["abort", "wait", "keep"]
_MODES: tuple[VLLMPauseMode, ...] = ("abort", "wait", "keep")
AUDIT_METHOD = "asyncsync_served_checksums"
CAPS_METHOD = "asyncsync_capabilities"
STAGE_METHOD = "asyncsync_apply_stage"
LOAD_METHOD = "asyncsync_load"


class VLLM(ReloadingEngine):
    """A vLLM server whose ``--model`` is the host-local checkpoint (see the module docstring).

    Args:
        url, checkpoint_dir, api_key, model_path, timeouts, retry, failure_backoff: as for
            :class:`~receiver.engines.sglang.SGLang`.
        pause_mode: ``abort`` (default), ``wait`` or ``keep`` (vLLM's ``/pause`` modes).
        check_model_root: at ``open``, refuse a server whose served model root is not
            ``model_path`` (its reload would load something else).
        in_engine: stage each delta for the worker extension to apply in place, on a server
            whose workers say they can (see the module docstring).
        partial_loads: checkpoint loads through the extension load only the tensors that
            changed; False: every one is vLLM's ``reload_weights`` (still through the
            extension, which then knows what its model holds).
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
        in_engine: bool = True,
        partial_loads: bool = True,
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
            in_engine=in_engine,
        )
        self.pause_mode = pause_mode
        self.check_model_root = check_model_root
        self.partial_loads = partial_loads
        self.audit_unsupported: str | None = None  # why the server cannot be audited
        #: the workers' answers to asyncsync_capabilities (None: no extension, or not asked)
        self.workers: list[dict[str, Any]] | None = None
        self.in_place_why_not: str | None = "not asked yet"
        self.last_reload: dict[str, Any] | None = None  # what the workers said about the last

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
        await self._ask_capabilities()

    async def _rpc(self, method: str, *args: Any) -> list[dict[str, Any]]:
        """``/collective_rpc`` of an extension method: one answer per worker. Not retried (a
        call that changes weights is retried by the next sync). Raises EngineHTTPError."""
        endpoint = "POST /collective_rpc"
        answer = await self.client.request(
            "POST",
            "/collective_rpc",
            json_body={"method": method, "args": list(args), "timeout": self.timeouts.update},
            timeout=self.timeouts.update,
            retry_timeouts=False,
            retries=False,
        )
        results = answer.get("results") if isinstance(answer, dict) else None
        if (
            not isinstance(results, list)
            or not results
            or not all(isinstance(r, dict) for r in results)
        ):
            raise EngineHTTPError(
                f"vllm {endpoint} {method}: unexpected answer {str(answer)[:300]}",
                endpoint=endpoint,
                status=200,
            )
        return results

    @staticmethod
    def _missing(exc: EngineHTTPError, method: str) -> bool:
        """The server answered, and has no such extension method."""
        return exc.status is not None and method in (exc.server_message or "")

    async def _ask_capabilities(self) -> None:
        """What the workers can do (at open and whenever the server was lost): stages are
        written only for a server whose every worker applies them in place."""
        try:
            self.workers = await self._rpc(CAPS_METHOD)
        except EngineHTTPError as exc:
            if not self._missing(exc, CAPS_METHOD):
                raise
            self.workers = None
            self.stages_supported = False
            self.in_place_why_not = (
                "the server has no asyncsync worker extension (start vLLM with "
                "--worker-extension-cls receiver.plugins.vllm_worker.AsyncSyncWorkerExtension): "
                "every version is vLLM's reload_weights"
            )
            logger.warning("vllm at %s: %s", self.client.url, self.in_place_why_not)
            return
        whys = sorted({str(w.get("why_not")) for w in self.workers if not w.get("in_place")})
        self.stages_supported = not whys
        self.in_place_why_not = "; ".join(whys) or None
        if whys:
            logger.warning(
                "vllm at %s: versions are not applied in place (every one is vLLM's "
                "reload_weights): %s",
                self.client.url,
                self.in_place_why_not,
            )
        else:
            logger.info("vllm at %s: %d worker(s) apply versions in place", self.client.url,
                        len(self.workers))  # fmt: skip

    async def _pause(self) -> None:
        await self.client.request(
            "POST", "/pause", params={"mode": self.pause_mode}, timeout=self.timeouts.control
        )

    async def _load(self, version: int) -> None:
        if self.workers is None:
            await self.client.request(
                "POST",
                "/collective_rpc",
                json_body={"method": "reload_weights", "timeout": self.timeouts.update},
                timeout=self.timeouts.update,
                retry_timeouts=False,
            )
        else:
            mode = "partial" if self.partial_loads else "full"
            await self._worker_call(version, LOAD_METHOD, self.model_path, mode)
        await self._relabel(version)

    async def _load_full(self, version: int) -> None:
        if self.workers is None:
            await self._load(version)
            return
        await self._worker_call(version, LOAD_METHOD, self.model_path, "full")
        await self._relabel(version)

    async def _load_stage(self, version: int, stage: str) -> bool:
        try:
            await self._worker_call(version, STAGE_METHOD, stage)
        except EngineHTTPError as exc:
            if not self._missing(exc, STAGE_METHOD):
                raise
            # restarted without the extension: nothing was changed; reload in the same pause
            logger.warning("vllm at %s cannot take stages (%s): reloading the checkpoint",
                           self.client.url, exc.server_message)  # fmt: skip
            self.workers, self.stages_supported = None, False
            return False
        await self._relabel(version)
        return True

    async def _worker_call(self, version: int, method: str, *args: Any) -> None:
        """One extension call that changes the weights; every worker must say ok."""
        t0 = time.perf_counter()
        answers = await self._rpc(method, *args)
        messages = [str(a.get("message"))[:400] for a in answers]
        self.last_reload = {
            "version": version,
            "method": method,
            "seconds": round(time.perf_counter() - t0, 4),
            "messages": messages,
        }
        failed = [m for a, m in zip(answers, messages, strict=True) if a.get("ok") is not True]
        if failed:
            raise EngineHTTPError(
                f"vllm {method} of v{version}: {len(failed)} of {len(answers)} worker(s) "
                f"refused: {failed[0]}",
                endpoint="POST /collective_rpc",
                status=200,
                server_message=failed[0],
            )

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
        out = super().info()
        out["in_engine"] = {**out.get("in_engine", {}), "why_not": self.in_place_why_not}
        return {
            **out,
            "audit_unsupported": self.audit_unsupported,
            "workers": self.workers,
            "last_reload": self.last_reload,
        }
