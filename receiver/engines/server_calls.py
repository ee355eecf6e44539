"""The calls a reloading engine makes of its inference server, and the reload cycle built on
them: pause -> load (a stage in place, else the checkpoint) -> resume (always, even on failure
or cancellation) -> confirm the label. :class:`ServerCalls` is a part of
:class:`~receiver.engines.reloading.ReloadingEngine` (which sets every attribute declared
below); the subclasses (:mod:`~receiver.engines.sglang`, :mod:`~receiver.engines.vllm`)
implement the calls."""

from __future__ import annotations

import abc
import asyncio
import logging
import time
from pathlib import Path
from typing import Any, ClassVar

from asyncsync.errors import ApplyFailed
from asyncsync.pipeline import LoopTasks
from receiver.engines.audit_view import AuditWatch
from receiver.engines.backoff import FailureBackoff
from receiver.engines.http_engine import EngineHTTPError, HttpClient, Timeouts
from receiver.engines.standing import ServerStanding
from receiver.state import STATE_DIR_NAME

__all__ = ["ServerCalls"]

logger = logging.getLogger(__name__)


class ServerCalls(abc.ABC):
    """The server's calls (abstract) and the reload cycle (a mixin of ReloadingEngine)."""

    kind: ClassVar[str] = "engine"
    #: a reload the server answered with an error may have left its weights half-loaded (vLLM's
    #: layerwise reload leaves layers on the meta device): not ready until a reload succeeds
    failed_load_leaves_weights_unknown: ClassVar[bool] = False
    #: a GET endpoint that answers once the server is up (``open`` waits for it)
    ready_path: ClassVar[str] = "/health"

    client: HttpClient
    timeouts: Timeouts
    standing: ServerStanding
    audit_watch: AuditWatch
    version_offset: int
    model_path: str
    in_place_applies: int
    last_pause_seconds: float | None
    last_pause_window: tuple[float, float] | None
    _backoff: FailureBackoff
    _background: LoopTasks
    _paused: bool

    # -- what a server must provide ----------------------------------------------------------
    @abc.abstractmethod
    async def _pause(self) -> None:
        """Stop serving so the weights can change."""

    @abc.abstractmethod
    async def _load(self, version: int) -> None:
        """Reload the weights from ``model_path`` and label them ``str(version)``."""

    async def _load_full(self, version: int) -> None:
        """Like :meth:`_load`, but every tensor (a repair): servers whose reload may load
        only some tensors override it."""
        await self._load(version)

    async def _load_stage(self, version: int, stage: str) -> bool:
        """Have the server apply the stage in ``stage`` (its path as the server sees it) and
        label the weights ``str(version)``; False when the server cannot take stages (then
        the caller reloads the checkpoint, in the same pause). Default: never."""
        return False

    @abc.abstractmethod
    async def _resume(self) -> None:
        """Serve again (idempotent: also called when ``_pause`` or ``_load`` failed)."""

    @abc.abstractmethod
    async def _relabel(self, version: int) -> None:
        """Set the server's weight version label without touching the weights (zero diff)."""

    @abc.abstractmethod
    async def served_version(self) -> str | None:
        """The weight version label the server reports now."""

    async def _served(self) -> str | None:
        """The root version the server's label names (its label less ``version_offset``)."""
        label = await self.served_version()
        if not self.version_offset or label is None:
            return label
        try:
            return str(int(label) - self.version_offset)
        except ValueError:
            return label  # "default" and other labels that no version of ours has

    async def _check_server(self) -> None:  # noqa: B027 - optional hook
        """Checks at ``open`` once the server answers (e.g. that it serves our checkpoint)."""

    async def _wait_for_server(self) -> None:
        logger.info("%s at %s: waiting for the server to answer", self.kind, self.client.url)
        await self.client.wait_until_up(
            self.ready_path, deadline=self.timeouts.startup, call_timeout=self.timeouts.control
        )
        await self._check_server()

    # -- the server protocol -----------------------------------------------------------------
    async def _reload_server(
        self, version: int, *, full: bool = False, stage: str | None = None
    ) -> None:
        """pause -> load (the stage in place, else the checkpoint; ``full``: every tensor) ->
        resume (always, even on failure or cancellation) -> confirm. ``stage``: the stage
        directory's name."""
        with self.standing.changing(version):
            await self._reload(version, full, stage)

    async def _reload(self, version: int, full: bool, stage: str | None) -> None:
        t0 = time.perf_counter()
        if self.standing.lost:
            await self._wait_for_server()
        loading = False
        repairs, started = self.audit_watch.problem, time.time()
        try:
            failed = True
            paused, paused_at = time.perf_counter(), time.monotonic()
            try:
                await self._guard(self._pause())
                label = version + self.version_offset
                seen = None
                if stage is not None:
                    seen = str(Path(self.model_path) / STATE_DIR_NAME / "engine-stage" / stage)
                loading = True
                if seen is not None and await self._guard(self._load_stage(label, seen)):
                    self.in_place_applies += 1
                else:
                    await self._guard((self._load_full if full else self._load)(label))
                failed = False
            finally:
                await self._resume_always(failed)
                self.last_pause_seconds = round(time.perf_counter() - paused, 4)
                self.last_pause_window = (paused_at, time.monotonic())
            self.audit_watch.loaded()
            await self._confirm(version)
        except ApplyFailed as exc:
            if isinstance(exc, EngineHTTPError) and exc.status is None:
                self.standing.lost = True  # no answer: the server may have died (or restarts)
            if loading and failed and self.failed_load_leaves_weights_unknown:
                self.standing.weights_unknown = f"the reload of v{version} failed: {exc}"[:300]
                logger.error("%s at %s: the reload of v%s failed; what the server serves is "
                             "unknown (not ready) until a reload succeeds", self.kind,
                             self.client.url, version)  # fmt: skip
            self._backoff.failed()
            raise
        self.standing.confirmed()
        self._backoff.reset()
        if repairs is not None:
            await self.audit_watch.repaired(started)
        logger.info("%s at %s loaded v%s in %.2fs", self.kind, self.client.url, version,
                    time.perf_counter() - t0)  # fmt: skip

    async def _resume_always(self, failed: bool) -> None:
        """Resume in a task of its own, so a cancelled sync still unpauses the server."""
        self._paused = True
        task = self._background.start(self._resumed(), name=f"{self.kind} resume")
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            raise  # the task keeps running; close() waits for it
        except Exception as exc:
            msg = f"{self.kind}: resuming generation failed, the server may still be paused: {exc}"
            if failed:
                logger.error("%s", msg)  # the update's own error is the one raised
            else:
                raise ApplyFailed(msg) from exc

    async def _resumed(self) -> None:
        try:
            await self._resume()
        finally:  # made, or failed (and said so); one cut by a cancellation is still owed
            self._paused = self._paused and asyncio.current_task().cancelling() > 0  # type: ignore[union-attr]

    async def _confirm(self, version: int) -> None:
        label = await self._guard(self._served())
        if label != str(version):
            raise ApplyFailed(
                f"{self.kind} at {self.client.url} reports weight version {label!r} after "
                f"loading v{version}; not acknowledging v{version} (another client may have "
                "changed the weights, or the server restarted): it is retried on the next sync"
            )

    async def _guard(self, coro: Any) -> Any:
        """Await ``coro``, translating anything but our errors into ApplyFailed."""
        try:
            return await coro
        except ApplyFailed:
            raise
        except (ValueError, TypeError, KeyError) as exc:
            raise ApplyFailed(f"{self.kind}: unexpected answer: {exc}") from exc
