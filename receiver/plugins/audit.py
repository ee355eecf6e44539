"""The audit of what an engine serves: its parameters compared, byte for byte, with the
trainer's bytes, in the background, and the record the receiver reads.

An in-place XOR applied twice, or onto another base, serves wrong bytes silently; the base
check before an apply (:class:`~receiver.plugins.held.Held`) prevents the known ways, the audit
proves it after the fact. :class:`Auditor` runs one thread per model (per tensor-parallel rank):

* after every change (a full or partial load, an in-place apply) it starts a pass over every
  tensor of the version held, the changed ones first, then every ``interval`` seconds again;
* per tensor: the tensor's bytes are read from the receiver's checkpoint and verified against
  the checksum the model's version records (the trainer's); then, under the loader's lock and
  only if no change came meanwhile, routed through ``load_weights`` with every parameter write
  turned into an exact comparison (:func:`receiver.plugins.routing.compare`): each rank checks
  its own slices. A checkpoint that has already moved to the next version (the receiver patches
  it while the engine serves) cannot vouch for that tensor now: it is *skipped* and checked on
  a later pass (an error an XOR leaves persists through later XORs, so it is found then);
* a mismatch: the loader forgets its base (the next load is a full reload) and the record says
  ``mismatch``; the receiver's ``/readyz`` then answers 503 and the receiver repairs with a full
  reload. A tensor loaded by the engine's own loader (not XORed) that differs again right after
  the repairing full load is one the engine transforms after loading: it is taken off the XOR
  path and the audit, and said so (no repair loop);
* reads are paced to ``bytes_per_s`` so the audit does not starve serving.

The record, ``<checkpoint>/.asyncsync/audit/rank<R>-<role>.json`` (format ``asyncsync-audit``
1), is written at each pass's start and end, on a mismatch and at most once a second between;
:func:`read_records` reads them (receiver side). Engine-agnostic.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from asyncsync import fsio
from asyncsync.errors import MAX_BYTES, ConfigError, check_number, check_seconds, shown
from receiver.plugins.held import INDEX_NAME, Held, read_verified, read_weight_map
from receiver.plugins.inplace import InEngineLoader
from receiver.plugins.routing import compare, route

__all__ = [
    "AUDIT_DIR",
    "ENV_AUDIT",
    "AuditRecord",
    "Auditor",
    "read_records",
    "record_path",
]

logger = logging.getLogger(__name__)

AUDIT_DIR = "audit"
RECORD_FORMAT = "asyncsync-audit"
ENV_AUDIT = "ASYNCSYNC_AUDIT"  # 0: off
ENV_RATE = "ASYNCSYNC_AUDIT_BYTES_PER_S"
ENV_INTERVAL = "ASYNCSYNC_AUDIT_INTERVAL"
ENV_DELAY = "ASYNCSYNC_AUDIT_DELAY"
_WRITE_EVERY = 1.0
MAX_RANKS = 1 << 16  # a record naming a larger tensor-parallel size is damaged


@dataclass
class AuditRecord:
    """One rank's audit state (the JSON record; see the module docstring)."""

    rank: int
    tp_size: int
    role: str
    pid: int
    status: str  # off | pending | running | ok | mismatch | idle (nothing held)
    held: dict[str, Any] | None  # the version the model holds (None: not known)
    passes: int = 0  # complete passes since the process started
    checked: int = 0  # tensors compared in the current (or last) pass
    total: int = 0
    skipped: int = 0  # the checkpoint had moved on: not checked now
    skipped_names: list[str] = field(default_factory=list)  # those tensors (this pass)
    not_auditable: dict[str, str] = field(default_factory=dict)
    mismatches: list[dict[str, Any]] = field(default_factory=list)
    pass_started: float | None = None
    pass_finished: float | None = None
    last_ok_version: int | None = None  # the version of the last pass that found no mismatch
    loader: dict[str, Any] = field(default_factory=dict)
    updated_at: float = 0.0
    format: str = RECORD_FORMAT
    format_version: int = 1

    @classmethod
    def from_dict(cls, d: Any) -> AuditRecord:
        if not isinstance(d, dict) or d.get("format") != RECORD_FORMAT:
            raise ValueError("not an asyncsync audit record")
        known = {f for f in cls.__dataclass_fields__}
        try:
            rec = cls(**{k: v for k, v in d.items() if k in known})
        except TypeError as exc:  # a field missing
            raise ValueError(str(exc)) from exc
        if not isinstance(rec.rank, int) or not isinstance(rec.status, str):
            raise ValueError("bad rank or status")
        if not (
            isinstance(rec.tp_size, int)
            and 0 <= rec.rank < rec.tp_size <= MAX_RANKS
            and (rec.held is None or isinstance(rec.held, dict))
            and isinstance(rec.not_auditable, dict)
            and isinstance(rec.mismatches, list)
            and all(isinstance(m, dict) for m in rec.mismatches)
            and isinstance(rec.skipped_names, list)
            and all(isinstance(n, str) for n in rec.skipped_names)
            and isinstance(rec.updated_at, int | float)
        ):
            raise ValueError("a field of the wrong type")
        return rec

    @property
    def held_version(self) -> int | None:
        v = (self.held or {}).get("version")
        return v if isinstance(v, int) else None


def record_path(checkpoint: Path, rank: int, role: str = "target") -> Path:
    return checkpoint / ".asyncsync" / AUDIT_DIR / f"rank{rank}-{role}.json"


def read_records(checkpoint: str | os.PathLike[str]) -> list[AuditRecord]:
    """Every rank's record under ``checkpoint`` (unreadable ones skipped, with a warning)."""
    d = Path(checkpoint) / ".asyncsync" / AUDIT_DIR
    out = []
    with contextlib.suppress(FileNotFoundError):
        for p in sorted(d.glob("rank*.json")):
            try:
                out.append(AuditRecord.from_dict(json.loads(fsio.read_bytes(p, limit=4 << 20))))
            except (OSError, ValueError) as exc:
                logger.warning("unreadable audit record %s: %s", p, exc)
    return out


#: the slowest and fastest read pace the auditor takes (bytes a second): below 1 MiB/s a pass
#: over a 14 GB model takes four hours and more, each tensor waiting its share; above 1 PiB/s
#: is no pace at all (and 1e300 is no rate a disk has)
MIN_RATE, MAX_RATE = float(1 << 20), float(MAX_BYTES)


def check_rate(name: str, value: Any) -> None:
    """ConfigError unless ``value`` is a read pace from :data:`MIN_RATE` to :data:`MAX_RATE`."""
    check_number(name, value)
    if not MIN_RATE <= value <= MAX_RATE:
        raise ConfigError(
            f"{name} must be from 1 MiB/s ({MIN_RATE:.0f}) to 1 PiB/s ({MAX_RATE:.0f}) bytes "
            f"a second, got {shown(value)}"
        )


def _env_number(name: str, default: float, *, zero: bool = False, rate: bool = False) -> float:
    """``$name`` as a number of seconds (or bytes a second) > 0 (``>= 0`` with ``zero``), else
    ``default``. A value that is not one is a WARNING naming it, and the default: the engine's
    model loading, which builds the auditor, must not fail on an audit setting (``1e400`` ended
    the audit's thread with an OverflowError; ``abc`` failed the load with a ValueError)."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
        check_rate(name, value) if rate else check_seconds(name, value, above=not zero)
    except ValueError as exc:  # (ConfigError is one)
        logger.warning("$%s=%r is not a usable number (%s); using %g", name, text, exc, default)
        return default
    return value


class Auditor:
    """Audits one model in a background thread (see the module docstring).

    Args:
        loader: the model's :class:`~receiver.plugins.inplace.InEngineLoader`; the auditor
            subscribes to its changes.
        rank, tp_size, role: where the record goes and what it says.
        bytes_per_s: pace of the checkpoint reads, 1 MiB/s to 1 PiB/s (default
            ``$ASYNCSYNC_AUDIT_BYTES_PER_S`` or 256 MiB/s); ``interval``: seconds between
            passes when nothing changes (default ``$ASYNCSYNC_AUDIT_INTERVAL`` or 300);
            ``delay``: seconds after a change before its pass starts
            (``$ASYNCSYNC_AUDIT_DELAY`` or 2: serving recovers from the pause first);
            ``enabled``: default unless ``$ASYNCSYNC_AUDIT`` is ``0`` (then the record only
            reports the version held).
    """

    def __init__(
        self,
        loader: InEngineLoader,
        *,
        rank: int = 0,
        tp_size: int = 1,
        role: str = "target",
        bytes_per_s: float | None = None,
        interval: float | None = None,
        enabled: bool | None = None,
        delay: float | None = None,
    ):
        self.loader = loader
        self.rank, self.tp_size, self.role = rank, tp_size, role
        if bytes_per_s is not None:
            check_rate("Auditor: bytes_per_s", bytes_per_s)
        check_seconds("Auditor: interval", interval, above=True, optional=True)
        check_seconds("Auditor: delay", delay, optional=True)
        self.bytes_per_s = bytes_per_s or _env_number(ENV_RATE, float(256 << 20), rate=True)
        self.interval = interval or _env_number(ENV_INTERVAL, 300.0)
        self.delay = _env_number(ENV_DELAY, 2.0, zero=True) if delay is None else delay
        if enabled is None:
            enabled = os.environ.get(ENV_AUDIT, "1").strip() != "0"
        self.enabled = enabled
        self.record = AuditRecord(rank, tp_size, role, os.getpid(), "idle", None)
        self._first: list[str] = []
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._dir: Path | None = None
        self._after_full: set[str] = set()  # mismatched while loaded by the engine's loader
        self._written = 0.0
        self._thread: threading.Thread | None = None
        loader.on_change = self.changed

    def __repr__(self) -> str:
        return f"<Auditor rank={self.rank} status={self.record.status} passes={self.record.passes}>"

    def start(self) -> None:
        if self._thread is None and self.enabled:
            self._thread = threading.Thread(
                target=self._run, name=f"asyncsync-audit-rank{self.rank}", daemon=True
            )
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread; wait at most ``timeout`` seconds for it (inf: without a limit)."""
        check_seconds("Auditor.stop: timeout", timeout, forever=True)
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(None if timeout == float("inf") else timeout)
            self._thread = None

    # -- the loader's listener (called under its lock, in the engine's thread) ---------------
    def changed(self, loader: InEngineLoader, names: list[str] | None) -> None:
        held = loader.held
        if held is not None:
            self._dir = held.directory
        self.record.held = None if held is None else held.version.to_dict()
        self.record.loader = {**asdict(loader.stats)}
        if held is None:
            return  # nothing known to audit; a mismatch record stays as it is
        self.record.mismatches = []
        self.record.status = "pending" if self.enabled else "off"
        self._first = list(names or [])
        self._write(force=True)
        self._wake.set()

    # -- the thread ------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            woken = self._wake.wait(self.interval)
            self._wake.clear()
            if woken and self.delay > 0:  # let serving recover from the change first
                self._stop.wait(self.delay)
            if self._stop.is_set():
                return
            try:
                self.run_pass()
            except Exception:  # never let the audit thread die silently
                logger.exception("asyncsync audit (rank %d): pass failed", self.rank)

    def run_pass(self) -> str:
        """One pass over the version held (also called directly by tests); returns the status."""
        loader = self.loader
        with loader.lock:
            held, epoch = loader.held, loader.epoch
            first = [n for n in self._first if held is not None and n in held.checksums]
            self._first = []
        if held is None:
            return self.record.status
        names = list(dict.fromkeys([*first, *held.weight_map]))
        rec = self.record
        rec.status, rec.checked, rec.skipped, rec.total = "running", 0, 0, len(names)
        rec.skipped_names = []
        rec.pass_started, rec.pass_finished = time.time(), None
        self._write(force=True)
        weight_map = _weight_map(held)
        for name in names:
            if self._stop.is_set():
                return rec.status
            if loader.epoch != epoch:  # a change came: the next pass starts from it
                self._wake.set()
                return rec.status
            if name in rec.not_auditable:
                continue
            t0 = time.perf_counter()
            outcome, size = self._check(held, epoch, weight_map, name)
            if outcome == "changed":
                self._wake.set()
                return rec.status
            if outcome == "mismatch":
                return rec.status
            wait = size / self.bytes_per_s - (time.perf_counter() - t0)
            if wait > 0:
                self._stop.wait(min(wait, 5.0))
            self._write()
        rec.passes += 1
        rec.pass_finished = time.time()
        rec.status = "ok"
        rec.last_ok_version = held.version.version
        self._write(force=True)
        logger.info("asyncsync audit (rank %d): v%s: %d of %d tensors match the trainer's bytes "
                    "(%d skipped, %d not auditable)", self.rank, held.version.version,
                    rec.checked, rec.total, rec.skipped, len(rec.not_auditable))  # fmt: skip
        return rec.status

    def _check(
        self, held: Held, epoch: int, weight_map: dict[str, str], name: str
    ) -> tuple[str, int]:
        """("ok" | "skipped" | "changed" | "mismatch", bytes read) for one tensor."""
        loader, rec = self.loader, self.record
        try:
            [(_, tensor)] = list(
                read_verified(held.directory, weight_map, [name], held.checksums,
                              held.algorithm, held.parts)
            )  # fmt: skip
        except Exception as exc:  # Refused, OSError, safetensors errors and the like
            rec.skipped += 1  # the checkpoint moved on (or is damaged): it cannot vouch now
            rec.skipped_names.append(name)
            logger.debug("asyncsync audit: %s skipped: %s", name, exc)
            return "skipped", 0
        size = tensor.numel() * tensor.element_size()
        with loader.lock:
            if loader.epoch != epoch:
                return "changed", size
            r = route(loader.model.load_weights, name, tensor, loader.params(), guard=loader.guard)
            if r.altered:
                loader.forget(f"the audit's routing of {name} changed the model")
                return "changed", size
            if not r.ok:
                rec.not_auditable[name] = str(r.problem)
                return "ok", size
            diff = compare(r)
            rec.checked += 1
            if diff is None or not self._mismatch(held, name, diff):
                return "ok", size
            return "mismatch", size

    def _mismatch(self, held: Held, name: str, diff: str) -> bool:
        """Record a mismatch (True), or take off a tensor the engine transforms (False)."""
        loader, rec = self.loader, self.record
        if name not in loader.xored and name in self._after_full:
            why = ("differs from the trainer's bytes right after the engine's own loader loaded "
                   "it, twice: the engine transforms it after loading")  # fmt: skip
            rec.not_auditable[name] = why
            loader.not_xor[name] = why
            logger.warning("asyncsync audit (rank %d): %s %s; no longer XORed nor audited",
                           self.rank, name, why)  # fmt: skip
            return False
        if name not in loader.xored:
            self._after_full.add(name)
        rec.mismatches.append(
            {"name": name, "detail": diff, "version": held.version.version, "at": time.time()}
        )
        rec.status = "mismatch"
        logger.error(
            "asyncsync audit (rank %d): v%s: the engine serves other bytes than the trainer's "
            "for %s (%s); its base is forgotten: the next load is a full reload",
            self.rank, held.version.version, name, diff,
        )  # fmt: skip
        loader.forget(f"audit mismatch on {name}")
        self._write(force=True)
        return True

    def _write(self, *, force: bool = False) -> None:
        now = time.time()
        if self._dir is None or (not force and now - self._written < _WRITE_EVERY):
            return
        self._written = now
        self.record.updated_at = now
        self.record.loader = {**asdict(self.loader.stats)}
        path = record_path(self._dir, self.rank, self.role)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fsio.atomic_write(path, json.dumps(asdict(self.record)).encode(), fsync=False,
                              sync_dir=False)  # fmt: skip
        except OSError as exc:
            logger.warning("asyncsync audit: cannot write %s: %s", path, exc)


def _weight_map(held: Held) -> dict[str, str]:
    try:
        return read_weight_map(held.directory / INDEX_NAME)
    except (OSError, ValueError):
        return held.weight_map
