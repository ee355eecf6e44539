"""The served-bytes audit: is what the engine serves the version the receiver acknowledged?

Engines have reported success while serving old weights (vLLM's ``reload_weights`` serving
cached weights, vllm#32718; SGLang's ``update_weights_from_disk`` discarding them,
sglang#33588). The ack says what the receiver *applied*; the audit checks what the engine
*serves*, through the engine's own read-back (:meth:`~receiver.engines.base.Engine.audit`):
per tensor, the checksum of the served bytes against the manifest of the version held.

Example::

    auditor = Auditor(agent, interval=600, after_apply=True)
    async with asyncio.TaskGroup() as tg:
        tg.create_task(agent.run(stop=stop))
        tg.create_task(auditor.run(stop=stop))

When it runs: after each newly applied version (``after_apply``) and every ``interval``
seconds (None: never on a schedule), never during an apply (it holds the agent's sync lock,
so the engine does not change under it). On a mismatch the auditor marks itself failing
(:attr:`Auditor.healthy` is False: the receiver's ``/readyz`` answers 503), asks the engine to
:meth:`~receiver.engines.base.Engine.repair` (a full reload of the held version from the
verified checkpoint), audits again, and is healthy again only once that audit passes. A
failed audit call (the server unreachable) is recorded, not a mismatch: readiness already
follows the server's own answers. Results: :meth:`Auditor.status` (``/status``'s ``audit``)
and the ``asyncsync_receiver_audit_*`` metrics.

:func:`receiver_auditor` is the auditor a receiver runs (the CLI, the Ray actor): the one asked
for, else the engine's default (SGLang: every few seconds, its plugin's audit records), else
none.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import asdict, dataclass
from typing import Any

from asyncsync.errors import AsyncSyncError, ConfigError
from asyncsync.format.store import read_manifest
from receiver.agent import ReceiverAgent
from receiver.engines.base import AuditReport

__all__ = ["Auditor", "AuditStats", "receiver_auditor"]

logger = logging.getLogger(__name__)

#: seconds between audits while a mismatch is not repaired (whatever the interval)
RETRY = 10.0


@dataclass
class AuditStats:
    """Counters since the auditor started (``/metrics``)."""

    audits: int = 0  # audits that compared something
    mismatches: int = 0  # audits that found served bytes differing from the manifest
    repairs: int = 0  # full reloads after a mismatch
    errors: int = 0  # audits that could not run (server unreachable, manifest gone, ...)


def receiver_auditor(
    agent: ReceiverAgent,
    *,
    interval: float | None = None,
    after_apply: bool = False,
    enabled: bool = True,
) -> Auditor | None:
    """The auditor a receiver runs for ``agent``: every ``interval`` seconds (default: the
    engine's :attr:`~receiver.engines.base.Engine.audit_interval`) and/or after each apply;
    None when ``enabled`` is False or nothing asks for one."""
    if not enabled:
        return None
    if interval is None:
        interval = agent.engine.audit_interval
    if interval is None and not after_apply:
        return None
    return Auditor(agent, interval=interval, after_apply=after_apply)


class Auditor:
    """Audits ``agent``'s engine (see the module docstring).

    Args:
        agent: the receiver agent whose engine is audited.
        interval: seconds between scheduled audits; None: only after applies.
        after_apply: audit each version once it is applied (default True).
        repair: on a mismatch, reload in full and audit again (default True).
    """

    def __init__(
        self,
        agent: ReceiverAgent,
        *,
        interval: float | None = None,
        after_apply: bool = True,
        repair: bool = True,
    ):
        if interval is not None and not interval > 0:
            raise ConfigError(f"the audit interval must be > 0 seconds, got {interval}")
        self.agent = agent
        self.interval = interval
        self.after_apply = after_apply
        self.repair = repair
        self.stats = AuditStats()
        self.last: AuditReport | None = None
        self.last_at: float | None = None  # time.time() of the last audit that compared
        self.last_seconds: float | None = None
        self.last_error: str | None = None
        self.supported: bool | None = None  # None: not tried yet
        self._failing: AuditReport | None = None  # the mismatch not yet repaired
        self.last_ok_version: int | None = None  # (a passing audit of it again logs at debug)
        self._audited_version: int | None = None
        self._empty_version: int | None = None  # the last version an audit compared nothing of

    @property
    def healthy(self) -> bool:
        """False from a mismatch until an audit of the engine passes again."""
        return self._failing is None

    def status(self) -> dict[str, Any]:
        last = None if self.last is None else {**asdict(self.last), "ok": self.last.ok}
        return {
            "supported": self.supported,
            "healthy": self.healthy,
            "interval": self.interval,
            "after_apply": self.after_apply,
            "last": last,
            "last_at": self.last_at,
            "last_seconds": self.last_seconds,
            "last_error": self.last_error,
            "failing": None if self._failing is None else list(self._failing.mismatched[:20]),
            **asdict(self.stats),
        }

    async def audit_once(self) -> AuditReport | None:
        """Audit the engine now (waiting for an apply in progress to end); repair a mismatch.

        Returns the report (after a repair: the report of the audit that followed it), or
        None when there is nothing to audit or the engine cannot audit."""
        async with self.agent.exclusive():
            engine = self.agent.engine
            version = engine.state.version
            if version is None:
                return None
            t0 = time.perf_counter()
            try:
                manifest = await asyncio.to_thread(read_manifest, self.agent.root, version)
                report = await engine.audit(manifest)
                if report is not None and not report.ok:
                    report = await self._mismatch(report, manifest)
            except (AsyncSyncError, OSError) as exc:
                self.stats.errors += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
                logger.warning("audit of v%s could not run: %s", version, self.last_error)
                return None
            self._audited_version = version
            self.supported = report is not None
            if report is None:
                return None
            self.last, self.last_at = report, time.time()
            self.last_seconds = round(time.perf_counter() - t0, 4)
            self.last_error = None
            self.stats.audits += 1
            if report.checked == 0:  # passes, but proves nothing: say so (once a version)
                why = next(iter(report.skipped.values()), "the engine named no tensor")
                again = self._empty_version == version
                (logger.debug if again else logger.warning)(
                    "audit of v%s compared no tensor (%s)", version, why
                )
                self._empty_version = version
            if report.ok:
                quiet = self._failing is None and self.last_ok_version == version
                self._failing, self.last_ok_version = None, version
                (logger.debug if quiet else logger.info)(
                    "audit of v%s: %d tensors served as published (%s%s)",
                    version,
                    report.checked,
                    report.how,
                    f"; {len(report.skipped)} not comparable" if report.skipped else "",
                )
            return report

    async def _mismatch(self, report: AuditReport, manifest: Any) -> AuditReport:
        self.stats.mismatches += 1
        self._failing = report
        self.last, self.last_at = report, time.time()
        shown = ", ".join(report.mismatched[:5]) + (" ..." if len(report.mismatched) > 5 else "")
        logger.error(
            "audit of v%s: the engine serves other bytes than the manifest for %d of %d "
            "tensors (%s); not ready%s",
            report.version,
            len(report.mismatched),
            report.checked,
            shown,
            ", reloading in full" if self.repair else "",
        )
        if not self.repair:
            return report
        self.stats.repairs += 1
        await self.agent.engine.repair()
        again = await self.agent.engine.audit(manifest)
        if again is None:
            return report
        if again.ok:
            logger.warning("audit of v%s: repaired by a full reload", report.version)
        else:
            self.stats.mismatches += 1
            self._failing = again
        return again

    def _due(self, next_at: float) -> bool:
        version = self.agent.engine.state.version
        if self.after_apply and version is not None and version != self._audited_version:
            return not self.agent.status().applying
        timed = self.interval is not None or not self.healthy
        return timed and time.monotonic() >= next_at

    async def run(self, *, stop: asyncio.Event | None = None, tick: float = 0.5) -> None:
        """Audit when due (see the module docstring) until ``stop`` is set."""
        stop = stop or asyncio.Event()
        next_at = time.monotonic() + (self.interval or 0)
        while not stop.is_set():
            if self._due(next_at):
                try:
                    await self.audit_once()
                except Exception:  # an engine's own bug must not stop the auditing for good
                    self.stats.errors += 1
                    logger.exception("audit failed unexpectedly")
                wait = self.interval if self.healthy else min(self.interval or RETRY, RETRY)
                next_at = time.monotonic() + (wait or 0)
                self._audited_version = self.agent.engine.state.version
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), tick)
