"""The receiver's view of the in-engine audit: is every rank serving the trainer's bytes?

The engine plugin's auditors (:mod:`receiver.plugins.audit`) write one record per rank under
``<checkpoint>/.asyncsync/audit/``. :class:`AuditWatch` reads them and answers what the
receiver needs: a rank that found a mismatch, or that reports holding another version than
the one the receiver made it hold (after the last load), means the engine must not count as
ready (``/readyz`` 503) and is repaired by a full reload. Its :meth:`AuditWatch.summary` is
``/status``'s ``engine.audit``, and :meth:`AuditWatch.metrics` feeds ``/metrics``.
Engine-agnostic.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path
from typing import Any

from receiver.engines.base import EngineState
from receiver.plugins.audit import AuditRecord, read_records, record_path

__all__ = ["AuditWatch"]

logger = logging.getLogger(__name__)

#: a rank's record may lag the load that changed it by this long before it counts as behind
GRACE_SECONDS = 15.0


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
            logger.error("in-engine audit: %s: not ready until repaired", problem)
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
        return {
            "problem": self.problem,
            "mismatches_seen": self.mismatches_seen,
            "repairs": self.repairs,
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
        ok = None if not self.records else float(self.problem is None)
        passes = sum(r.passes for r in self.records) if self.records else None
        return {
            "audit_ok": (
                "1 while every rank's audit agrees with the trainer's bytes, 0 on a "
                "mismatch (NaN: no audit record)",
                ok,
            ),
            "audit_mismatches": ("Mismatches the in-engine audit found.", self.mismatches_seen),
            "audit_repairs": ("Full reloads that repaired an audit mismatch.", self.repairs),
            "audit_passes": ("Complete audit passes of every rank (this server's life).", passes),
        }


def _same(record_held: dict[str, Any] | None, held: EngineState) -> bool:
    """A rank's held version is the receiver's: same content (a zero-diff version keeps its
    base's fingerprint and is only relabelled), else the same number."""
    if not record_held:
        return False
    fp = record_held.get("fingerprint")
    if fp is not None and held.fingerprint is not None:
        return bool(fp == held.fingerprint and record_held.get("run_id") == held.run_id)
    return bool(record_held.get("version") == held.version)
