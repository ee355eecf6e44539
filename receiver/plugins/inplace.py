"""One model inside an engine, kept at the receiver's version: in place from a stage, or from
the receiver's checkpoint.

:class:`InEngineLoader` is what an engine plugin (``sglang_loader``; a vLLM one the same way)
calls with the directory the receiver named:

* **a stage** (:mod:`receiver.plugins.stage`): :meth:`InEngineLoader.apply_stage`. The stage is
  read and verified; its base must be exactly what the model holds (:class:`~receiver.plugins.
  held.Held`: version, run, fingerprint, checkpoint); each changed tensor's dense XOR is routed
  through the model's own ``load_weights`` with every parameter write recorded
  (:mod:`receiver.plugins.routing`) and then executed as an in-place XOR of integer views. A
  tensor whose loader is not a pure copy (probed once per name, before anything is written) is
  read whole from the checkpoint, verified, and loaded as the engine always did. Anything that
  cannot be proven safe falls back to the checkpoint path, in the same call:
  another base, a stage that does not verify, tensors that write the same parameter bytes, a
  route that differs from its probe (the XORs done so far are undone first: XOR is its own
  inverse), in-place applies disabled.
* **the checkpoint** (a clean asyncsync ``LocalCheckpoint``): :meth:`InEngineLoader.
  reload_checkpoint`. The tensors whose checksum differs from what the model holds are read,
  verified and loaded whole; a full reload through the engine's own code when the base is
  unknown (the first load, another directory, another tensor set).
* **refused** (nothing loaded, the engine keeps its weights): bytes that fail verification, a
  checkpoint that is not clean or does not hold the stage's version.

Every change bumps :attr:`InEngineLoader.epoch` under :attr:`InEngineLoader.lock` and calls
the ``on_change`` listener (the auditor, :mod:`receiver.plugins.audit`). Engine-agnostic: it
needs ``model.load_weights`` and, from the engine, a full reload callable.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import safetensors
import torch

from asyncsync.console.args import env_size
from asyncsync.errors import FormatError, check_bytes
from asyncsync.pipeline import run_all
from receiver.plugins.held import (
    INDEX_NAME,
    CheckpointSnapshot,
    Held,
    Refused,
    Unverified,
    checkpoint_snapshot,
    read_snapshot,
    read_verified,
    read_weight_map,
    tensor_specs,
)
from receiver.plugins.routing import Guard, ModelParams, Route, apply_xor, route
from receiver.plugins.scatter import Probe, apply_plan, conflicts, independent, make_plan
from receiver.plugins.stage import (
    STAGE_DIR,
    Stage,
    StagedTensor,
    VersionRef,
    read_stage,
    stage_record,
)

__all__ = ["ENV_IN_PLACE", "InEngineLoader", "LoadResult", "Probe", "checkpoint_of_stage"]

logger = logging.getLogger(__name__)

LoadResult = tuple[bool, str]
ENV_IN_PLACE = "ASYNCSYNC_IN_PLACE"
ENV_BATCH_BYTES = "ASYNCSYNC_SGLANG_BATCH_BYTES"


class SupportsLoadWeights(Protocol):
    def load_weights(self, weights: Any) -> Any: ...


class _Fallback(Exception):
    """The stage cannot be applied in place: go through the checkpoint (nothing written)."""


class _Broken(Exception):
    """A write failed midway through one tensor: what the model holds is not known."""


@dataclass
class Stats:
    in_place: int = 0
    xor_bytes: int = 0
    whole: int = 0
    fallbacks: int = 0
    partial: int = 0
    full: int = 0
    refused: int = 0
    last: dict[str, Any] = field(default_factory=dict)


def checkpoint_of_stage(stage_dir: Path) -> Path | None:
    """The checkpoint a stage belongs to (``<checkpoint>/.asyncsync/engine-stage/<stage>``)."""
    if stage_dir.parent.name != STAGE_DIR or stage_dir.parent.parent.name != ".asyncsync":
        return None
    return stage_dir.parent.parent.parent


class InEngineLoader:
    """Keeps one model at the receiver's version (see the module docstring).

    Args:
        model: has ``load_weights(iterable of (HF name, tensor))``.
        guard: the engine's veto on parameters whose loaded bytes are transformed after
            loading (packing, quantization): writes into them are not XORed.
        batch_bytes: whole tensors are handed to ``load_weights`` in batches of about this size
            (default ``$ASYNCSYNC_SGLANG_BATCH_BYTES`` or 1 GiB).
        volatile: (parameter, module) -> True for parameters whose place may move between
            loads without a reload (MoE experts under EPLB): their tensors are routed at every
            apply instead of through a cached plan.
        in_place: apply stages in place (default: unless ``$ASYNCSYNC_IN_PLACE`` is ``0``).
        partial: load only changed tensors from a checkpoint (else every reload is full).
    """

    def __init__(
        self,
        model: Any,
        *,
        guard: Guard | None = None,
        batch_bytes: int | None = None,
        in_place: bool | None = None,
        partial: bool = True,
        volatile: Callable[[str, Any], bool] | None = None,
    ):
        if batch_bytes is None:
            batch_bytes = env_size(ENV_BATCH_BYTES, 1 << 30)
        check_bytes("InEngineLoader: batch_bytes", batch_bytes)
        if in_place is None:
            in_place = os.environ.get(ENV_IN_PLACE, "1").strip() != "0"
        self.model = model
        self.guard = guard
        self.volatile = volatile
        self.batch_bytes = batch_bytes
        self.in_place = in_place
        self.partial = partial
        self.held: Held | None = None
        self.forgotten: str | None = None  # why the held weights were forgotten, if they were
        self.lock = threading.RLock()
        self.epoch = 0
        self.stats = Stats()
        #: names whose loader takes no XOR (probe or audit found why), with the reason
        self.not_xor: dict[str, str] = {}
        #: names whose served bytes came through an XOR since the engine's loader last loaded them
        self.xored: set[str] = set()
        self.on_change: Callable[[InEngineLoader, list[str] | None], None] | None = None
        self._params: ModelParams | None = None
        self._probes: dict[str, Probe] = {}
        self._transient: set[str] = set()  # probes that failed by an exception: not kept
        self._conflicts: dict[str, str] = {}
        self._ahead: Stage | None = None  # a stage read and verified ahead (offer)
        self._ahead_lock = threading.Lock()
        #: held while a stage is read (ahead, or by the apply): one reader per stage
        self.reading = threading.Lock()
        self.last_stage: Path | None = None  # the stage the last apply read

    def __repr__(self) -> str:
        v = None if self.held is None else self.held.version.version
        return f"<InEngineLoader held={v} epoch={self.epoch} in_place={self.in_place}>"

    # -- bookkeeping ----------------------------------------------------------------------
    def forget(self, why: str) -> None:
        """The model's weights are no longer known (the next load is full)."""
        with self.lock:
            if self.held is not None:
                logger.warning("asyncsync: the model's base is no longer known: %s", why)
            self.held = None
            self.forgotten = why
            self.epoch += 1

    def _changed(self, held: Held | None, names: list[str] | None) -> None:
        self.held = held
        self.forgotten = None if held is not None else self.forgotten
        self.epoch += 1
        if self.on_change is not None:
            try:
                self.on_change(self, names)
            except Exception:  # the listener's bug must not fail a load
                logger.exception("asyncsync: on_change listener failed")

    def device(self) -> torch.device:
        for p in getattr(self.model, "parameters", lambda: iter(()))():
            if isinstance(p, torch.Tensor) and p.device.type != "meta":
                return p.device
        return torch.device("cpu")

    def params(self) -> ModelParams:
        if self._params is None or not self._params.unchanged():
            self._params = ModelParams(self.model)
            self._probes.clear()
            self._conflicts.clear()
        return self._params

    # -- the checkpoint path --------------------------------------------------------------
    def why_full(self, snap: CheckpointSnapshot) -> str | None:
        """Why ``snap`` needs a full reload (None: the partial path may run)."""
        held = self.held
        if held is None and self.forgotten is not None:
            return f"the weights the server holds are not known: {self.forgotten}"
        if held is None:
            return "first reload: the weights the server holds are not known"
        if held.directory != snap.directory:
            return f"another directory than the last reload ({held.directory})"
        if held.algorithm != snap.algorithm:
            return "the checksum algorithm changed"
        if held.checksums.keys() != snap.checksums.keys():
            return "the set of tensors changed"
        return None

    def reload_checkpoint(
        self,
        directory: str | os.PathLike[str],
        full_reload: Callable[[], LoadResult],
        *,
        prefix: str = "",
    ) -> LoadResult:
        """Bring the model to the checkpoint in ``directory``; ``full_reload`` is the engine's
        own full reload of it."""
        with self.lock:
            try:
                snap = checkpoint_snapshot(directory)
            except Unverified as exc:
                return self._refuse(prefix, str(exc))
            if snap is None:
                return self._full(directory, full_reload, "not an asyncsync checkpoint", prefix)
            why = self.why_full(snap) if self.partial else "partial reloads are off"
            if why is not None:
                return self._full(directory, full_reload, why, prefix)
            held = self.held
            assert held is not None
            names = [n for n in snap.weight_map if held.checksums[n] != snap.checksums[n]]
            try:
                batches = self._verified_batches(
                    snap.directory, snap.weight_map, names, snap.checksums, snap.algorithm,
                    snap.parts,
                )  # fmt: skip
            except (Refused, OSError, ValueError, safetensors.SafetensorError) as exc:
                return self._refuse(prefix, str(exc))  # nothing loaded
            try:
                for batch in batches:
                    self.model.load_weights(batch)
            except Exception as exc:  # the model may be half-updated: reload all of it
                logger.warning("asyncsync: partial reload of v%s failed midway (%s)",
                               snap.version, exc)  # fmt: skip
                return self._full(
                    directory, full_reload, f"partial reload failed midway: {exc}", prefix,
                    adopt=not isinstance(exc, Refused),
                )  # fmt: skip
            self.stats.partial += 1
            self.xored.difference_update(names)
            self._changed(Held.of(snap), names)
            msg = (
                f"{prefix}asyncsync: partial reload: loaded {len(names)} of "
                f"{len(snap.checksums)} tensors (checkpoint v{snap.version}): {_shown(names)}"
            )
            logger.info("%s", msg)
            return True, msg

    def _refuse(self, prefix: str, why: str) -> LoadResult:
        self.stats.refused += 1
        msg = (
            f"{prefix}asyncsync: refused to load: {why}; nothing was loaded, the server keeps "
            "its weights (only verified bytes are handed to the engine)"
        )
        logger.error("%s", msg)
        return False, msg

    def _full(
        self,
        directory: str | os.PathLike[str],
        full_reload: Callable[[], LoadResult],
        why: str,
        prefix: str = "",
        *,
        adopt: bool = True,
    ) -> LoadResult:
        self.held = None
        before = read_snapshot(directory)
        ok, msg = full_reload()
        held = None
        # the receiver does not touch the checkpoint during the call; if it did, forget it
        if adopt and ok and before is not None and read_snapshot(directory) == before:
            held = Held.of(before)
        self.stats.full += 1
        self.xored.clear()
        self._changed(held, None)
        logger.info("%sasyncsync: full reload (%s): %s", prefix, why, msg)
        return ok, f"{prefix}{msg} [asyncsync: full reload ({why})]"

    def _verified_batches(
        self,
        directory: Path,
        weight_map: dict[str, str],
        names: list[str],
        checksums: dict[str, str],
        algorithm: str,
        parts: dict[str, list[tuple[int, int]]],
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Every tensor is read and verified before the first is loaded. When they fit in one
        batch they are kept; else they are read again per batch (page cache) and verified
        again: a mismatch then is an error midway."""

        def read() -> Iterator[tuple[str, torch.Tensor]]:
            return read_verified(directory, weight_map, names, checksums, algorithm, parts)

        first: list[tuple[str, torch.Tensor]] = []
        size, kept = 0, True
        for n, t in read():  # raises before anything is loaded
            size += t.numel() * t.element_size()
            if kept and size <= self.batch_bytes:
                first.append((n, t))
            else:
                kept, first = False, []
        if kept:
            return iter([first] if first else [])
        return _batches(read(), self.batch_bytes)

    # -- the stage path ----------------------------------------------------------------------
    def apply_stage(
        self, stage_dir: str | os.PathLike[str], full_reload_of: Callable[[str], LoadResult]
    ) -> LoadResult:
        """Apply the stage in ``stage_dir`` in place, or bring the model to its version through
        the checkpoint (``full_reload_of(path)``: the engine's own full reload of ``path``)."""
        t0 = time.perf_counter()
        sdir = Path(stage_dir).resolve()
        ckpt = checkpoint_of_stage(sdir)
        if ckpt is None:
            return self._refuse("", f"{sdir} is not a stage of an asyncsync checkpoint")
        try:
            stage, ahead = self._read_stage(sdir)
        except FormatError as exc:
            return self._via_checkpoint(ckpt, full_reload_of, f"the stage does not verify: {exc}")
        t_read = time.perf_counter()
        with self.lock:
            why = self._why_not_in_place(stage, ckpt)
            if why is not None:
                return self._via_checkpoint(ckpt, full_reload_of, why, stage.target)
            try:
                xor, whole = self._plan(stage, ckpt)
            except _Fallback as exc:
                return self._via_checkpoint(ckpt, full_reload_of, str(exc), stage.target)
            finally:
                for n in self._transient:
                    self._probes.pop(n, None)
                self._transient.clear()
            held = self.held
            assert held is not None
            try:  # every whole tensor verified before anything is written
                batches = self._verified_batches(
                    ckpt, _weight_map(ckpt, held), list(whole), stage.checksums,
                    stage.algorithm, stage.parts,
                )  # fmt: skip
            except (Refused, OSError, ValueError, safetensors.SafetensorError) as exc:
                return self._refuse("", f"stage v{stage.target.version}: {exc}")
            done: list[StagedTensor] = []
            nbytes = 0
            try:
                nbytes += self._xor_parallel(xor, done)
                parallel = {id(t) for t in done}
                for t in xor:
                    if id(t) not in parallel:
                        nbytes += self._xor(t)
                        done.append(t)
            except _Fallback as exc:
                if not self._undo(done):
                    why = f"undoing a stopped in-place apply failed: {exc}"
                    return self._full(ckpt, lambda: full_reload_of(str(ckpt)), why)
                return self._via_checkpoint(ckpt, full_reload_of, str(exc), stage.target)
            except _Broken as exc:
                return self._full(ckpt, lambda: full_reload_of(str(ckpt)), str(exc))
            try:
                for batch in batches:
                    self.model.load_weights(batch)
            except Exception as exc:  # half-updated: only a full reload is safe
                return self._full(ckpt, lambda: full_reload_of(str(ckpt)),
                                  f"loading whole tensors failed midway: {exc}")  # fmt: skip
            self.stats.in_place += 1
            self.stats.xor_bytes += nbytes
            self.stats.whole += len(whole)
            self.xored.update(t.name for t in xor)
            self.xored.difference_update(whole)
            self._changed(held.advanced(stage), [t.name for t in stage.tensors])
        ms = (time.perf_counter() - t0) * 1000
        read_ms = (t_read - t0) * 1000
        reasons = "; ".join(f"{n}: {w}" for n, w in list(whole.items())[:3])
        msg = (
            f"asyncsync: in-engine apply: v{stage.base.version} -> v{stage.target.version}: "
            f"{len(xor)} of {len(stage.checksums)} tensors XORed in place "
            f"({nbytes / 2**20:.1f} MiB), {len(whole)} loaded whole"
            + (f" ({reasons})" if whole else "")
            + f" in {ms:.1f} ms (stage read and verified "
            + ("before the pause)" if ahead else f"in {read_ms:.1f} ms)")
        )
        self.stats.last = {"version": stage.target.version, "ms": round(ms, 2),
                           "xor": len(xor), "whole": len(whole)}  # fmt: skip
        logger.info("%s", msg)
        return True, msg

    def offer(self, stage: Stage) -> None:
        """A stage read and verified ahead of its apply (:mod:`receiver.plugins.prefetch`)."""
        with self._ahead_lock:
            self._ahead = stage

    def _read_stage(self, sdir: Path) -> tuple[Stage, bool]:
        """The stage in ``sdir``: the copy read ahead when its record on disk is unchanged
        (the record names the data's checksum the copy was verified against), else read and
        verified now. True when it was read ahead."""
        with self.reading:  # a read ahead of this stage in progress is waited for, not repeated
            self.last_stage = sdir
            with self._ahead_lock:
                ahead = self._ahead
                if ahead is not None and ahead.directory.resolve() == sdir:
                    self._ahead = None
                else:
                    ahead = None
            if ahead is not None and ahead.record:
                with contextlib.suppress(FormatError):
                    if stage_record(sdir) == ahead.record:
                        return ahead, True
            return read_stage(sdir), False

    def _why_not_in_place(self, stage: Stage, ckpt: Path) -> str | None:
        if not self.in_place:
            return f"in-place applies are off ({ENV_IN_PLACE}=0)"
        if self.held is None:
            why = self.forgotten or "first load"
            return f"the weights the model holds are not known ({why})"
        return self.held.why_not_base_of(stage, ckpt)

    def _via_checkpoint(
        self,
        ckpt: Path,
        full_reload_of: Callable[[str], LoadResult],
        why: str,
        target: VersionRef | None = None,
    ) -> LoadResult:
        """The stage's version through the checkpoint (which must hold exactly it)."""
        self.stats.fallbacks += 1
        prefix = f"asyncsync: stage not applied in place ({why}); "
        logger.warning("%s", prefix.rstrip("; "))
        snap = read_snapshot(ckpt)
        if target is not None and (
            snap is None or VersionRef(snap.version, snap.run_id, snap.fingerprint) != target
        ):
            held = "nothing clean" if snap is None else f"v{snap.version}"
            return self._refuse(prefix, f"the checkpoint {ckpt} holds {held}, the stage makes "
                                f"{target}")  # fmt: skip
        return self.reload_checkpoint(ckpt, lambda: full_reload_of(str(ckpt)), prefix=prefix)

    def probe(self, ckpt: Path, held: Held) -> dict[str, Probe]:
        """Probe every tensor of the checkpoint not probed yet (zero tensors: nothing written).
        Raises _Fallback when probing changed the model (then the base is forgotten)."""
        params = self.params()
        missing = {n: f for n, f in held.weight_map.items() if n not in self._probes}
        if not missing:
            return self._probes
        specs = tensor_specs(ckpt, missing)
        dev = self.device()
        for n, (dtype, shape) in specs.items():
            # uninitialised: never read, never faulted in unless the loader copies it
            routed = torch.empty(shape, dtype=dtype, device=dev)
            r = route(self.model.load_weights, n, routed, params, guard=self.guard)
            if r.altered:
                self.forget(f"probing {n} changed the model: {r.problem}")
                raise _Fallback(f"probing {n} changed the model ({r.problem})")
            plan = None if not r.ok or self._is_volatile(r, params) else make_plan(r, routed)
            del routed
            self._probes[n] = Probe(dtype, shape, r.footprint() if r.ok else (), r.problem, plan)
            if r.raised:  # not a property of the loader: loaded whole now, probed again later
                self._transient.add(n)
            elif r.problem:
                logger.info("asyncsync: %s takes no in-place XOR: %s", n, r.problem)
        self._conflicts = conflicts(self._probes)
        return self._probes

    def _plan(self, stage: Stage, ckpt: Path) -> tuple[list[StagedTensor], dict[str, str]]:
        held = self.held
        assert held is not None
        probes = self.probe(ckpt, held)
        xor: list[StagedTensor] = []
        whole: dict[str, str] = {}
        for t in stage.tensors:
            p = probes.get(t.name)
            if p is None or (p.dtype, p.shape) != (t.dtype, t.shape):
                raise _Fallback(f"tensor {t.name!r} is not in the model's checkpoint as staged")
            if t.name in self._conflicts:
                raise _Fallback(self._conflicts[t.name])
            why = p.problem or self.not_xor.get(t.name)
            if why is not None:
                whole[t.name] = why
            elif p.footprint:
                xor.append(t)
            # else: the loader writes nothing for it (skipped, e.g. a tied lm_head)
        return xor, whole

    def _is_volatile(self, r: Route, params: ModelParams) -> bool:
        if self.volatile is None:
            return False
        for w in r.writes:
            owner = params.owner(w.dst)
            if owner is not None and self.volatile(*owner):
                return True
        return False

    def _xor(self, t: StagedTensor) -> int:
        """XOR one staged tensor into the model: through its plan (sparse), else by routing
        its dense XOR (checked against its probe). Returns the bytes changed or XORed."""
        plan = self._probes[t.name].plan
        if plan is not None and t.positions is not None:
            dev = self.device()
            try:
                n = apply_plan(plan, t.positions.to(dev), t.values.to(dev))
            except Exception as exc:  # a device error midway: this tensor is half-written
                raise _Broken(f"tensor {t.name}: the sparse apply failed: {exc}") from exc
            return n * t.values.element_size()
        dense = t.dense(self.device())
        r = route(self.model.load_weights, t.name, dense, self.params(), guard=self.guard)
        if r.altered:
            self.forget(f"routing {t.name} changed the model")
            raise _Fallback(f"routing {t.name} changed the model ({r.problem})")
        if not r.ok or r.footprint() != self._probes[t.name].footprint:
            why = r.problem or "it routes differently than its probe"
            if not r.raised:
                self.not_xor[t.name] = why
            raise _Fallback(f"tensor {t.name}: {why}")
        try:
            return apply_xor(r)
        except Exception as exc:
            raise _Broken(f"tensor {t.name}: the XOR failed: {exc}") from exc

    def _xor_parallel(self, xor: list[StagedTensor], done: list[StagedTensor]) -> int:
        """XOR the tensors whose plans are independent (XOR steps only, on CPU: disjoint
        bytes, no order between them) on the process's pool; appends them to ``done`` once
        every one has finished. Returns their bytes; the rest go one by one, in order."""
        if self.device().type != "cpu":
            return 0
        todo = [t for t in xor if t.positions is not None and independent(self._probes[t.name])]
        if len(todo) < 2:
            return 0
        results = run_all(self._xor, todo)
        broken = [r for r in results if isinstance(r, BaseException)]
        if broken:  # every call has finished: some tensors may be half-written
            raise broken[0]
        done.extend(todo)
        return sum(r for r in results if isinstance(r, int))

    def _undo(self, done: list[StagedTensor]) -> bool:
        """XOR the applied tensors again (back to the base); False when that failed."""
        try:
            for t in reversed(done):
                self._xor(t)
        except Exception as exc:
            logger.error("asyncsync: undoing an in-place apply failed: %s", exc)
            self.forget("an in-place apply could not be undone")
            return False
        return True


def _weight_map(ckpt: Path, held: Held) -> dict[str, str]:
    try:
        return read_weight_map(ckpt / INDEX_NAME)
    except (OSError, ValueError):
        return held.weight_map


def _batches(
    tensors: Iterator[tuple[str, torch.Tensor]], limit: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    batch: list[tuple[str, torch.Tensor]] = []
    size = 0
    for n, t in tensors:
        batch.append((n, t))
        size += t.numel() * t.element_size()
        if size >= limit:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _shown(names: list[str]) -> str:
    shown = ", ".join(names[:8]) + (f", ... ({len(names) - 8} more)" if len(names) > 8 else "")
    return shown or "-"
