"""SGLang: keep an SGLang server (0.5.15 - 0.5.23) at the newest version over its HTTP API.

Example::

    engine = SGLang("http://127.0.0.1:30000", "/local/ckpt", api_key=key)
    async with ReceiverAgent("/shared/weights", engine, "node3-gpu0") as agent:
        await agent.run()

The receiver patches the host-local checkpoint first (the server keeps serving), then::

    POST /pause_generation         {"mode": "abort"}
    POST /update_weights_from_disk {"model_path": <checkpoint>, "weight_version": "N",
                                    "flush_cache": true, "abort_all_requests": false}
    POST /continue_generation      {}                      (always, even after a failure)
    GET  /model_info               -> weight_version must be "N"

A zero-diff version is ``POST /update_weight_version {"new_version": "N",
"abort_all_requests": false}`` (no reload; SGLang's default would abort every request).

Keys (0.5.23): with ``--admin-api-key`` the server wants it on the weight, pause, continue,
flush and version endpoints, and the ``--api-key`` on ``/model_info`` and ``/generate``; give
both (``api_key``, ``admin_api_key``). With ``--api-key`` alone that key opens everything.

What the real server does that shapes this (docs/ENGINES.md, "Behaviours of the real server"):

* ``/health`` runs a generation: while paused it blocks ~20 s and answers 503. The receiver
  never calls it; ``open`` waits on ``/model_info`` and then sends ``/continue_generation``
  (clears a pause left by a receiver killed mid-reload).
* A checkpoint SGLang cannot load kills its scheduler: the reload's connection drops. That is
  an error naming the cause, the server is marked lost, and the next attempt first waits for
  it to answer (``ReloadingEngine``); nothing is acknowledged.
* ``400 "Weights were updated, but the cache was not flushed"``: the weights changed but the
  label may not have. Not guessed either way: the receiver flushes the cache and sends the
  same reload again (idempotent: the plugin then loads nothing), then reads ``/model_info``.
* The reload's answer says whether the asyncsync plugin ran in the server (its message carries
  ``asyncsync:``); :meth:`SGLang.info` (the receiver's ``/status``) reports it.

Pause mode (see docs/ENGINES.md): ``abort`` is the default because it is the only mode after
which the scheduler is idle, so the KV-cache flush that must follow a weight change succeeds on
every version. On 0.5.15 a failed flush is an assertion that kills the scheduler; ``retract``
leaves the requests queued and ``in_place`` leaves them running, so both make the flush fail.
With those modes ``flush_cache`` is therefore False, and the prefix cache keeps KV entries
computed with the old weights: opt in only if that staleness is acceptable.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from typing import Any, ClassVar, Literal

import aiohttp

from asyncsync.errors import ConfigError
from asyncsync.format import Manifest
from receiver.engines.base import AuditReport
from receiver.engines.http_engine import EngineHTTPError, RetryPolicy, Timeouts
from receiver.engines.reloading import ReloadingEngine
from receiver.plugins.stage import STAGE_CAPABILITY

__all__ = ["PAUSE_MODES", "SGLang"]

logger = logging.getLogger(__name__)

#: in the message of a reload that went through receiver.plugins.sglang_loader
PLUGIN_MARKER = "asyncsync:"
#: SGLang 0.5.23's 400 when the reload succeeded but the KV-cache flush after it did not
CACHE_NOT_FLUSHED = "Weights were updated, but the cache was not flushed"

PauseMode = Literal["auto", "abort", "retract", "in_place"]
PAUSE_MODES: tuple[PauseMode, ...] = ("auto", "abort", "retract", "in_place")
#: the first SGLang release seen to flush the cache with retracted requests queued while paused
#: (0.5.23: ``flush_cache`` ignores the waiting queue during a pause); older ones are not known
#: to, and 0.5.15 kills its scheduler when a flush fails
RETRACT_FLUSHES_FROM = (0, 5, 23)
#: seconds between the receiver's readings of the plugin's audit records (docs/ENGINES.md)
AUDIT_INTERVAL = 5.0


class SGLang(ReloadingEngine):
    """An SGLang server that reloads a host-local checkpoint (see the module docstring).

    Args:
        url: the server, e.g. ``http://127.0.0.1:30000``.
        checkpoint_dir: the local checkpoint the receiver keeps (created if missing).
        api_key: the server's ``--api-key``; sent as a Bearer token.
        admin_api_key: the server's ``--admin-api-key``, for the endpoints that change it.
        model_path: the checkpoint directory as the server sees it (default: the same).
        pause_mode: ``auto`` (default: ``retract`` on a server of SGLang 0.5.23 or later, as its
            ``/server_info`` reports, else ``abort``; see docs/ENGINES.md), ``abort``,
            ``retract`` or ``in_place``.
        flush_cache: flush the KV cache with the reload; default True for ``abort`` and for
            ``auto``. With ``retract`` only on a server known to flush with retracted requests
            queued (0.5.23); never with ``in_place`` (the requests still run: the flush fails,
            fatally on 0.5.15).
        load_format: passed to ``update_weights_from_disk`` when set (default: the server's).
        in_engine: stage each delta for the asyncsync plugin to apply in place (default True;
            used once the server's answers show the plugin takes stages).
        audit_wait: seconds :meth:`audit` waits for the plugin's audit pass over the version
            held to finish (default 0: it reports what the ranks' records say now).
        timeouts, retry, failure_backoff: see :class:`ReloadingEngine`.
    """

    kind: ClassVar[str] = "sglang"
    #: not /health: it runs a generation, which blocks ~20 s and fails while paused
    ready_path: ClassVar[str] = "/model_info"

    def __init__(
        self,
        url: str,
        checkpoint_dir: str | os.PathLike[str],
        *,
        api_key: str | None = None,
        admin_api_key: str | None = None,
        model_path: str | None = None,
        pause_mode: PauseMode = "auto",
        flush_cache: bool | None = None,
        load_format: str | None = None,
        timeouts: Timeouts | None = None,
        retry: RetryPolicy | None = None,
        failure_backoff: tuple[float, float] = (2.0, 60.0),
        version_offset: int = 0,
        in_engine: bool = True,
        audit_wait: float = 0.0,
    ):
        if pause_mode not in PAUSE_MODES:
            raise ConfigError(f"pause_mode must be one of {PAUSE_MODES}, got {pause_mode!r}")
        if flush_cache is None:
            flush_cache = pause_mode in ("abort", "auto")
        if flush_cache and pause_mode == "in_place":
            raise ConfigError(
                "flush_cache=True cannot go with pause_mode='in_place': the paused requests "
                "still run, the flush fails, and SGLang 0.5.15 asserts on it"
            )
        super().__init__(
            url,
            checkpoint_dir,
            api_key=api_key,
            admin_api_key=admin_api_key,
            model_path=model_path,
            timeouts=timeouts,
            retry=retry,
            failure_backoff=failure_backoff,
            version_offset=version_offset,
            in_engine=in_engine,
        )
        self.pause_mode = pause_mode
        self.flush_cache = flush_cache
        #: the mode the pauses use: ``pause_mode`` resolved against the server (``auto``)
        self.mode: PauseMode = "abort" if pause_mode == "auto" else pause_mode
        self.server_version: str | None = None
        self.load_format = load_format
        self.last_reload: dict[str, Any] | None = None  # what the server said about the last one
        self.audit_wait = audit_wait
        self.audit_interval = AUDIT_INTERVAL  # the plugin's records: the receiver's one check

    def info(self) -> dict[str, Any]:
        """``/status``'s view of the server: whether the in-engine plugin ran, the last reload."""
        out = super().info()
        msg = None if self.last_reload is None else self.last_reload["message"]
        if msg is None:
            partial: dict[str, Any] = {"active": None, "why": "no reload seen yet"}
        elif PLUGIN_MARKER in msg:
            partial = {"active": True, "why": None}
        else:
            partial = {
                "active": False,
                "why": "the server's reload answer carries no asyncsync marker: the loader "
                "plugin is not installed in SGLang's environment, or found no reload method "
                "to hook (see the server's start-up log); every reload is SGLang's full one",
            }
        return {
            **out,
            "partial_reload": partial,
            "last_reload": self.last_reload,
            "pause_mode": self.mode,
            "server_version": self.server_version,
        }

    async def audit(self, manifest: Manifest) -> AuditReport | None:
        """What the asyncsync plugin's per-rank audit found the server serving, against
        ``manifest`` (receiver/engines/audit_view.py); None when no rank keeps a record (no
        plugin), the last reload did not go through the plugin, or every rank's audit is
        off. Reads records only: never changes the weights."""
        msg = None if self.last_reload is None else self.last_reload["message"]
        plugin = None if self.last_reload is None else PLUGIN_MARKER in str(msg)
        return await self.audit_watch.report(
            manifest, self.state, plugin=plugin, wait=self.audit_wait
        )

    async def _post(self, path: str, body: dict[str, Any], timeout: float, **kw: Any) -> Any:
        return await self.client.request(
            "POST", path, json_body=body, timeout=timeout, admin=True, **kw
        )

    async def _check_server(self) -> None:
        # a receiver killed between pause and continue leaves the server paused: clear it
        await self._resume()
        info = await self._drain()
        if self.pause_mode == "auto":
            self.mode = self._auto_mode(info)

    async def _drain(self) -> Any:
        """Wait until the server finished every weight update sent to it before (by a receiver
        killed while it waited for the answer, or by this one after its call timed out): ``GET
        /server_info`` is a round trip through SGLang's scheduler, which takes requests in
        order. SGLang 0.5.23 keeps one result slot for weight updates and takes no lock while
        paused: a second update sent while the first still runs is answered with the first
        one's result, and the second result kills the server's TokenizerManager. Waits as long
        as an update may take; the answer, or None when the server has no ``/server_info``."""
        try:
            return await self.client.request(
                "GET", "/server_info", timeout=self.timeouts.update, retries=False
            )
        except EngineHTTPError as exc:
            if exc.status is None:  # no answer: whatever it runs may still be running
                raise
            logger.warning("sglang at %s: no /server_info (%s): cannot wait for an update "
                           "still running in it", self.client.url, exc)  # fmt: skip
            return None

    def _auto_mode(self, info: Any) -> PauseMode:
        """``retract`` when the server's release flushes with retracted requests queued (seen
        on 0.5.23: nothing in flight is lost, and the requests are re-prefilled with the new
        weights), else ``abort``: the flush must succeed after every weight change. ``info``:
        the server's ``/server_info`` (None: it has none)."""
        if info is None:
            logger.warning("sglang at %s: no /server_info: pausing with abort", self.client.url)
            return "abort"
        version = info.get("version") if isinstance(info, dict) else None
        self.server_version = None if version is None else str(version)
        mode: PauseMode = "retract" if _release(version) >= RETRACT_FLUSHES_FROM else "abort"
        logger.info("sglang at %s is %s: pausing with %s", self.client.url, version, mode)
        return mode

    async def _pause(self) -> None:
        await self._post("/pause_generation", {"mode": self.mode}, self.timeouts.control)

    async def _load(self, version: int) -> None:
        answer = await self._load_from(self.model_path, version)
        _check_success(answer, "POST /update_weights_from_disk")

    async def _load_stage(self, version: int, stage: str) -> bool:
        try:
            answer = await self._load_from(stage, version)
        except EngineHTTPError as exc:
            if exc.status is None or PLUGIN_MARKER in (exc.server_message or ""):
                raise
            message = exc.server_message  # SGLang itself refused the stage's path
        else:
            message = answer.get("message") if isinstance(answer, dict) else None
            refused = isinstance(answer, dict) and answer.get("success") is False
            if not refused or PLUGIN_MARKER in str(message):
                _check_success(answer, "POST /update_weights_from_disk")
                return True
        # Not the asyncsync plugin answering (removed, or the server restarted without it):
        # SGLang tried to read the stage as a model and changed nothing.
        logger.warning(
            "sglang at %s cannot take stages (%s): reloading the checkpoint instead",
            self.client.url,
            message,
        )
        self.stages_supported = False
        return False

    async def _load_from(self, model_path: str, version: int) -> Any:
        """``POST /update_weights_from_disk`` of ``model_path``; the answer (the plugin's words
        recorded for ``/status``). Raises on HTTP errors, never on ``success: false``."""
        body: dict[str, Any] = {
            "model_path": model_path,
            "weight_version": str(version),
            "flush_cache": self.flush_cache,
            "abort_all_requests": False,
        }
        if self.load_format is not None:
            body["load_format"] = self.load_format
        endpoint = "POST /update_weights_from_disk"
        t0 = time.perf_counter()
        try:
            answer = await self._update(body)
        except EngineHTTPError as exc:
            cause = exc.__cause__
            if exc.status is None and not isinstance(
                cause, TimeoutError | aiohttp.ClientConnectorError
            ):
                raise EngineHTTPError(
                    f"sglang {endpoint}: the connection dropped during the reload of v{version}"
                    " (SGLang's scheduler dies on a checkpoint it cannot load: see the server's"
                    " log); not acknowledged, the server is waited for before the next attempt"
                    f": {exc}",
                    endpoint=endpoint,
                ) from exc
            if not (exc.server_message and CACHE_NOT_FLUSHED in exc.server_message):
                raise
            # The weights may or may not have changed and the label may lag: do not guess.
            # Flush (we are paused, so nothing runs now) and send the same reload again.
            logger.warning(
                "sglang: v%s: %s; flushing the cache and reloading again to reconcile",
                version,
                exc.server_message,
            )
            await self.client.request(
                "POST", "/flush_cache", timeout=self.timeouts.control, admin=True
            )
            answer = await self._update(body)
        message = answer.get("message") if isinstance(answer, dict) else None
        self.last_reload = {
            "version": version,
            "seconds": round(time.perf_counter() - t0, 4),
            "message": None if message is None else str(message)[:400],
        }
        if message is not None:
            self.stages_supported = STAGE_CAPABILITY.strip() in str(message)
        return answer

    async def _update(self, body: dict[str, Any]) -> Any:
        # Not retried here: a timed-out reload may still be running in the server, and after a
        # dropped connection the server is waited for first. The next sync retries it.
        return await self._post(
            "/update_weights_from_disk", body, self.timeouts.update, retries=False
        )

    async def _resume(self) -> None:
        await self._post("/continue_generation", {}, self.timeouts.control)

    async def _relabel(self, version: int) -> None:
        answer = await self._post(
            "/update_weight_version",
            {"new_version": str(version), "abort_all_requests": False},
            self.timeouts.control,
        )
        _check_success(answer, "POST /update_weight_version")

    async def served_version(self) -> str | None:
        info = await self.client.request("GET", "/model_info", timeout=self.timeouts.control)
        if not isinstance(info, dict):
            raise EngineHTTPError(
                f"sglang GET /model_info: expected a JSON object, got {type(info).__name__}",
                endpoint="GET /model_info",
                status=200,
            )
        v = info.get("weight_version")
        return None if v is None else str(v)


def _release(version: Any) -> tuple[int, ...]:
    """(0, 5, 23) of "0.5.23" or "0.5.23.post1"; () when it is not a release number."""
    parts = []
    for p in str(version or "").split(".")[:3]:
        digits = "".join(itertools.takewhile(str.isdigit, p))
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts) if len(parts) == 3 else ()


def _check_success(answer: Any, endpoint: str) -> None:
    """SGLang reports some failures as HTTP 200 with ``success: false``."""
    if isinstance(answer, dict) and answer.get("success") is False:
        msg = str(answer.get("message") or "(no message)")
        raise EngineHTTPError(
            f"sglang {endpoint}: the server refused: {msg}",
            endpoint=endpoint,
            status=200,
            server_message=msg,
        )
