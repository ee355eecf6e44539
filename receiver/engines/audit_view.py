"""The SGLang engine's audit: the in-engine auditors' records turned into an AuditReport.

The engine plugin's auditors (:mod:`receiver.plugins.audit`) compare, on every rank, what the
engine serves with the trainer's bytes, and write one record per rank under
``<checkpoint>/.asyncsync/audit/``. :class:`AuditWatch` reads them for the SGLang engine
(:meth:`receiver.engines.sglang.SGLang.audit`): :meth:`AuditWatch.report` is the
:class:`~receiver.engines.base.AuditReport` of the version held (per tensor: compared on every
rank, found differing on one, or skipped and why), which the receiver's
:class:`~receiver.audit.Auditor` decides on (``/readyz`` 503, a repair by a full reload, its
``/status`` and metrics). A rank that found a mismatch, or that reports holding another version
than the one the receiver made it hold (after the last load), makes the report fail.
:meth:`AuditWatch.check` is the same reading as one reason, for the engine's own staging
decision (never stage onto bytes the audit disowned). :meth:`AuditWatch.summary` (``/status``
``engine.audit``) shows each rank's record. Engine-agnostic; never changes the weights.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path
from typing import Any

from asyncsync.format import Manifest
from receiver.engines.base import AuditReport, EngineState
from receiver.plugins.audit import AuditRecord, read_records, record_path

__all__ = ["AuditWatch"]

logger = logging.getLogger(__name__)

#: a rank's record may lag the load that changed it by this long before it counts as behind
GRACE_SECONDS = 15.0
#: seconds between readings of the records while :meth:`AuditWatch.report` waits for a pass
POLL = 0.2
HOW = "the asyncsync plugin's in-engine audit (per-rank records)"


class AuditWatch:
    """Reads the audit records of one checkpoint (see the module docstring)."""

    def __init__(self, checkpoint_dir: str | os.PathLike[str]):
        self.directory = Path(checkpoint_dir)
        self.records: list[AuditRecord] = []
        self.problem: str | None = None  # why the engine is not serving the trainer's bytes
        self.mismatches_seen = 0
        self.repairs = 0
        self.loaded_at = 0.0  # when the receiver last changed the engine's weights
        self._seen: set[tuple[int, str, str, float]] = set()

    def __repr__(self) -> str:
        return f"<AuditWatch {self.directory} ranks={len(self.records)} problem={self.problem!r}>"

    async def check(self, held: EngineState) -> str | None:
        """Read the records; returns (and keeps in :attr:`problem`) why the engine does not
        serve the bytes of ``held`` (what the receiver made it hold), or None."""
        version = held.version
        self.records = await asyncio.to_thread(read_records, self.directory)
        problem = None
        now = time.time()
        for r in self.records:
            where = f"rank {r.rank} ({r.role})"
            if r.status == "mismatch":
                for m in r.mismatches:
                    key = (r.rank, r.role, str(m.get("name")), float(m.get("at") or 0))
                    if key not in self._seen:
                        self._seen.add(key)
                        self.mismatches_seen += 1
                first = r.mismatches[0] if r.mismatches else {}
                problem = problem or (
                    f"the audit on {where} found the engine serving other bytes than the "
                    f"trainer's for {first.get('name')} at v{first.get('version')} "
                    f"({first.get('detail')})"
                )
            elif (
                version is not None
                and r.role == "target"
                and r.updated_at >= self.loaded_at > 0
                and now - self.loaded_at > GRACE_SECONDS
                and not _same(r.held, held)
            ):
                problem = problem or (
                    f"{where} reports holding v{r.held_version}, the receiver loaded v{version}"
                )
        if problem != self.problem and problem is not None:
            logger.error("in-engine audit: %s", problem)
        self.problem = problem
        return problem

    def loaded(self) -> None:
        """The receiver just changed the engine's weights (records written before are old)."""
        self.loaded_at = time.time()

    async def repaired(self, started: float) -> None:
        """A repairing full reload that began at ``started`` succeeded: drop mismatch records
        it did not rewrite (a rank of a server that no longer runs)."""
        self.repairs += 1
        self.problem = None

        def drop() -> None:
            for r in read_records(self.directory):
                if r.status == "mismatch" and r.updated_at < started:
                    path = record_path(self.directory, r.rank, r.role)
                    try:
                        path.unlink()
                    except OSError as exc:
                        logger.warning("cannot remove the stale audit record %s: %s", path, exc)

        await asyncio.to_thread(drop)

    def summary(self) -> dict[str, Any]:
        """Each rank's record (``/status`` ``engine.audit``; the verdict is the Auditor's)."""
        return {
            "ranks": [
                {
                    "rank": r.rank,
                    "role": r.role,
                    "status": r.status,
                    "held_version": r.held_version,
                    "last_ok_version": r.last_ok_version,
                    "passes": r.passes,
                    "checked": r.checked,
                    "total": r.total,
                    "skipped": r.skipped,
                    "not_auditable": len(r.not_auditable),
                    "mismatches": r.mismatches[:5],
                    "in_place_applies": r.loader.get("in_place"),
                    "updated_at": r.updated_at,
                }
                for r in self.records
            ],
        }

    def metrics(self) -> dict[str, tuple[str, float | None]]:
        passes = sum(r.passes for r in self.records) if self.records else None
        return {
            "audit_passes": ("Complete in-engine audit passes of every rank (this server's "
                             "life).", passes),
        }  # fmt: skip

    async def report(
        self, manifest: Manifest, held: EngineState, *, plugin: bool | None, wait: float = 0.0
    ) -> AuditReport | None:
        """The :class:`AuditReport` of ``manifest`` (the version ``held``) from the records.
        ``plugin``: whether the server's last reload went through the plugin (None: no reload
        seen). None (it cannot tell) when it did not, when every rank's audit is off, or when
        no rank keeps a record and no reload was seen. A rank whose pass over what it holds has
        not finished yet leaves what it has not vouched for skipped; ``wait`` > 0: wait up to
        that many seconds for the passes to finish first."""
        if plugin is False:
            return None  # records left by an earlier server process vouch for nothing now
        deadline = time.monotonic() + wait
        while True:
            await self.check(held)
            report, settled = _report(self.records, manifest, held, self.loaded_at, plugin)
            if settled or time.monotonic() >= deadline:
                return report
            await asyncio.sleep(min(POLL, max(0.0, deadline - time.monotonic())))


def _report(
    records: list[AuditRecord],
    manifest: Manifest,
    held: EngineState,
    loaded_at: float,
    plugin: bool | None,
) -> tuple[AuditReport | None, bool]:
    """(the report, whether every rank's pass over what it holds is over)."""
    names = [t.name for t in manifest.tensors]
    live = [r for r in records if r.status != "off"]
    if records and not live:
        return None, True  # ASYNCSYNC_AUDIT=0 in the server
    if not live:
        if plugin is None:
            return None, True
        why = "no rank of the plugin has written an audit record since the last load"
        return AuditReport(manifest.version, 0, (), dict.fromkeys(names, why), HOW), False
    now = time.time()
    skipped: dict[str, str] = {}
    bad: set[str] = set()
    settled = True
    targets = [r for r in records if r.role == "target"]
    ranks = max((r.tp_size for r in targets), default=0)
    for rank in sorted(set(range(ranks)) - {r.rank for r in targets}):  # damaged or not written
        settled = False
        for n in names:
            skipped.setdefault(n, f"rank {rank} (target) has no readable audit record")
    for r in live:
        where = f"rank {r.rank} ({r.role})"
        same = _same(r.held, held)
        if r.status == "mismatch":
            bad.update(str(m.get("name")) for m in r.mismatches)
            continue
        if not same:
            if r.role != "target":
                continue  # a draft model's record: not the version the receiver loads
            # written after the receiver's last load (or it has loaded nothing: as it is), and
            # the load is not that recent: a rank left behind, serving other bytes
            fresh = loaded_at == 0 or r.updated_at >= loaded_at
            if fresh and now - loaded_at > GRACE_SECONDS:
                bad.add(f"<{where} holds v{r.held_version}, not v{held.version}>")
                continue
            settled = False
            why = f"{where} has not reported holding v{held.version} yet"
        elif r.status == "ok":
            for n, reason in r.not_auditable.items():
                skipped.setdefault(n, f"{where}: not auditable: {reason}")
            for n in r.skipped_names:
                skipped.setdefault(n, f"{where}: the checkpoint had moved on to the next "
                                      "version when its pass reached it")  # fmt: skip
            continue
        else:  # pending, running, idle: its pass over what it holds is not over
            settled = False
            why = {
                "pending": f"{where}: its audit pass over v{held.version} has not started yet",
                "running": f"{where}: its audit pass over v{held.version} is running "
                f"({r.checked} of {r.total} compared)",
            }.get(r.status, f"{where}: its audit is {r.status}")
        for n in names:
            skipped.setdefault(n, why)
    mismatched = tuple(sorted(bad))
    for n in mismatched:
        skipped.pop(n, None)
    checked = len(names) - len(skipped)
    return AuditReport(manifest.version, checked, mismatched, skipped, HOW), settled or bool(bad)


def _same(record_held: dict[str, Any] | None, held: EngineState) -> bool:
    """A rank's held version is the receiver's: same content (a zero-diff version keeps its
    base's fingerprint and is only relabelled), else the same number."""
    if not record_held:
        return False
    fp = record_held.get("fingerprint")
    if fp is not None and held.fingerprint is not None:
        return bool(fp == held.fingerprint and record_held.get("run_id") == held.run_id)
    return bool(record_held.get("version") == held.version)
