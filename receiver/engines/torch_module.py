"""TorchModule: apply versions into a live ``torch.nn.Module`` in place (CPU or CUDA).

The engine for a receiver that runs inside the inference process (or next to a model it can
reach): parameters AND buffers, named by ``module.state_dict(keep_vars=True)``, are patched
in place, so the module serves the new weights without a reload and without a second copy.

* delta: each patch is applied to the int view of the tensor's storage (a contiguous copy is
  patched and copied back when the tensor is not contiguous). Full: ``copy_`` of the new bytes
  (through int views: torch copies a bool's elements as 0/1, not the bytes shipped).
* Tied weights (one storage under two names) are applied once and verified under both names,
  also when the version changed only one of them (a trainer that untied them).
* Names that view parts of one buffer (FSDP-1's flat parameters with views of them, a fused
  QKV with its blocks) each carry the version's change of the bytes they share: each byte is
  patched once per version (:mod:`receiver.engines.overlap`) and verified under every name.
  An expanded tensor (stride 0: its elements one memory location) takes no write: a version
  that names one is refused at ``begin`` (ConfigError, saying what to register instead).
* Before each write the old values are kept in an in-memory undo journal (positions and old
  values for a sparse patch, the whole old tensor, on the CPU, for a dense patch or a full
  copy). ``abort`` and a failed checksum in ``commit`` restore them, so the module is back at
  the old version bit for bit.
* The version is kept in memory. With ``state_dir`` it is also persisted there (with the lock
  of :mod:`receiver.state`), for a module whose weights outlive the receiver; a state found
  ``applying`` or whose checksums do not match the module at ``open`` is dropped (no version),
  so the receiver re-initialises the module from a keyframe instead of trusting it.
* A tensor of the held version replaced or resized in the module since (a loader that rebinds
  a parameter, ``module.weight = ...``, ``resize_``: its identity changed) is hashed before the
  next delta or zero diff: where it no longer holds the version's bytes, the version is dropped
  (OutOfOrder) and the receiver re-initialises the module from a keyframe; before, the next
  version was acknowledged over bytes no version had. An edit in place is the audit's to find.

Work runs in ``asyncio.to_thread``; CUDA kernels are queued on the current stream and
``commit`` synchronises through the checksum's device-to-host copy.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal, TypeVar

import torch

from asyncsync.codec import Patch, apply_patch, int_view, patch_and_checksum, raw_view
from asyncsync.errors import (
    ApplyFailed,
    AsyncSyncError,
    ChecksumMismatch,
    ConfigError,
    LockHeld,
    OutOfOrder,
)
from asyncsync.format import Manifest, TensorEntry
from asyncsync.format.checksum import checksum_tensor, entry_checksum
from asyncsync.pipeline import parallel_map
from receiver.engines.base import AuditReport, Engine, EngineState, TensorUpdate
from receiver.engines.overlap import Covered, apart, span, touched
from receiver.rules import bumped, check_base, check_patch, check_tensor_set, layouts_of
from receiver.state import PersistedState, StateStore

__all__ = ["TorchModule"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_AliasKey = tuple[Any, ...]

# the open TorchModule that applies versions to each module: one agent per engine (a
# checkpoint's lock says the same); two over one module undid each other's XOR deltas. Weak
# both ways: a module or an engine dropped unclosed holds nothing once collected
_DRIVEN: weakref.WeakKeyDictionary[torch.nn.Module, weakref.ref[TorchModule]] = (
    weakref.WeakKeyDictionary()
)
_DRIVEN_LOCK = threading.Lock()


def _alias_key(name: str, t: torch.Tensor) -> _AliasKey:
    """Equal for two names that view the very same elements (tied weights); an empty tensor's
    is its own, with its form (no bytes to compare: a resize keeps no version's tensor)."""
    if t.numel() == 0:
        return ("empty", name, t.dtype, tuple(t.shape))
    return (
        t.device,
        t.untyped_storage().data_ptr(),
        t.storage_offset(),
        t.dtype,
        tuple(t.shape),
        t.stride(),
    )


def _same_form(a: _AliasKey | None, b: _AliasKey | None) -> bool:
    """Whether two non-empty tensors' alias keys give one dtype and shape (a copy, a ``.to()``:
    its bytes then tell whether it still holds the version)."""
    return a is not None and b is not None and len(a) == len(b) == 6 and a[3:5] == b[3:5]


def _ids(tensors: dict[str, torch.Tensor]) -> dict[str, _AliasKey]:
    return {n: _alias_key(n, t) for n, t in tensors.items()}


def _shared(tensors: dict[str, torch.Tensor], ids: dict[str, _AliasKey]) -> set[_AliasKey]:
    """The tensors (by alias key: a tied twin is one) whose memory another one's overlaps."""
    one = {k: n for n, k in ids.items()}
    spans = {n: span(tensors[n]) for n in one.values()}
    alone = apart(spans)
    return {k for k, n in one.items() if n not in alone}


def _check_writable(name: str, t: torch.Tensor) -> None:
    """ConfigError for a tensor that no write can land in: one expanded (stride 0), whose
    elements along that dim are one memory location (torch refuses every ``copy_`` and patch)."""
    for dim, (n, st) in enumerate(zip(t.shape, t.stride(), strict=True)):
        if st == 0 and n > 1:
            raise ConfigError(
                f"tensor {name!r} of the module is expanded (stride 0 along dim {dim} of "
                f"{list(t.shape)}): its {n} elements there are one memory location, which no "
                "version can be written into; register the tensor before .expand() (and expand "
                "it where it is used) or a .contiguous() copy, or leave it out of the published "
                "state dict"
            )


def _write_int(t: torch.Tensor, fn: Callable[[torch.Tensor], None]) -> None:
    """Run ``fn`` on the flat int view of ``t``'s bytes and make the change land in ``t``
    (copied through :func:`raw_view`: a bool's copy would write 0/1 over its other bytes)."""
    if t.is_contiguous():
        fn(int_view(t))
    else:
        work = raw_view(t).contiguous()
        fn(work.reshape(-1))
        raw_view(t).copy_(work)


def _group_bytes(ws: list[tuple[str, torch.Tensor, Patch]]) -> int:
    """The bytes one storage's patch task passes over (each tensor is hashed whole)."""
    return sum(t.nbytes for _, t, _ in ws)


def _restore(positions: torch.Tensor | None, old: torch.Tensor, flat: torch.Tensor) -> None:
    """Write journaled old values back (idempotent)."""
    if positions is None:
        flat.copy_(old)
    elif positions.numel():
        flat.index_copy_(0, positions, old.to(flat.device))


@dataclass
class _Txn:
    manifest: Manifest
    mode: Literal["delta", "full"]
    entries: dict[str, TensorEntry]
    tensors: dict[str, torch.Tensor]
    ids: dict[str, _AliasKey]
    seen: set[str] = field(default_factory=set)
    applied: set[_AliasKey] = field(default_factory=set)
    # (name, positions or None for the whole tensor, old int values)
    undo: list[tuple[str, torch.Tensor | None, torch.Tensor]] = field(default_factory=list)
    # checksums of new bytes taken in the pass that patched them (CPU, sparse patches), and
    # the memory each patched tensor spans: a digest stands only for a tensor whose bytes no
    # other patch of the version could have written after it (views of one buffer, or
    # storages over overlapping memory)
    sums: dict[str, str] = field(default_factory=dict)
    spans: dict[str, tuple[Any, int, int]] = field(default_factory=dict)
    # (delta) the tensors whose memory another name of the module views in part (a flat
    # buffer and views of it), and per device the bytes the version's patches wrote there
    shared: set[_AliasKey] = field(default_factory=set)
    covered: dict[str, Covered] = field(default_factory=dict)


class TorchModule(Engine):
    """An engine over a live module's parameters and buffers (see the module docstring)."""

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        state_dir: str | os.PathLike[str] | None = None,
        verify_on_open: bool = True,
    ):
        self.module = module
        self.verify_on_open = verify_on_open
        self._store = StateStore(state_dir) if state_dir is not None else None
        self._ps = PersistedState()
        self._txn: _Txn | None = None
        self._ids: dict[str, _AliasKey] = {}  # the held version's tensors, as they were then
        self._mutex = threading.Lock()
        self.state = EngineState()

    def __repr__(self) -> str:
        return f"<TorchModule {type(self.module).__name__} version={self.state.version}>"

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer by state-dict name (detached views of the live storage);
        not a layer's extra state (``get_extra_state``: no tensor, which no version carries)."""
        sd = self.module.state_dict(keep_vars=True)
        return {k: v.detach() for k, v in sd.items() if isinstance(v, torch.Tensor)}

    # -- public coroutines ----------------------------------------------------------------
    async def open(self) -> EngineState:
        return await self._run(self._open)

    async def close(self) -> None:
        try:
            if self._txn is not None:
                await self.abort()
        finally:  # after a thread still at work (a cancelled open's): the lock, the module
            await self._run(self._let_go)

    def _let_go(self) -> None:
        try:
            if self._store is not None:
                self._store.close()
        finally:
            with _DRIVEN_LOCK:
                if (ref := _DRIVEN.get(self.module)) is not None and ref() is self:
                    del _DRIVEN[self.module]

    async def begin(self, manifest: Manifest, mode: Literal["delta", "full"]) -> None:
        await self._run(self._begin, manifest, mode)

    async def apply(self, updates: list[TensorUpdate]) -> None:
        await self._run(self._apply, updates)

    async def commit(self) -> str:
        return await self._run(self._commit)

    async def abort(self) -> None:
        await self._run(self._abort)

    async def bump(self, manifest: Manifest) -> None:
        await self._run(self._bump, manifest)

    async def audit(self, manifest: Manifest) -> AuditReport:
        """The module's live bytes against ``manifest``'s checksums (``receiver.audit``)."""
        return await self._run(self._audit, manifest)

    def _audit(self, manifest: Manifest) -> AuditReport:
        tensors = self.tensors()
        bad, skipped = [], {}
        for e in manifest.tensors:
            t = tensors.get(e.name)
            if t is None:
                skipped[e.name] = "the module has no such tensor"
            elif entry_checksum(e, t, manifest.checksum_algorithm) != e.checksum:
                bad.append(e.name)
        checked = len(manifest.tensors) - len(skipped)
        return AuditReport(manifest.version, checked, tuple(bad), skipped, "the module's bytes")

    # -- plumbing -----------------------------------------------------------------------------
    async def _run(self, fn: Callable[..., _T], *args: Any) -> _T:
        def locked() -> _T:
            with self._mutex, torch.no_grad():
                return fn(*args)

        try:
            return await asyncio.to_thread(locked)
        except AsyncSyncError:
            raise
        except (OSError, RuntimeError, ValueError) as exc:
            raise ApplyFailed(f"{self!r}: {type(exc).__name__}: {exc}") from exc

    def _set(self, ps: PersistedState) -> None:
        self._ps = self._store.save(ps) if self._store is not None else ps
        self.state = EngineState(ps.version, ps.run_id, ps.fingerprint)

    def _need_txn(self) -> _Txn:
        if self._txn is None:
            raise ApplyFailed(f"{self!r}: apply/commit without begin")
        return self._txn

    # -- open -----------------------------------------------------------------------------------
    def _open(self) -> EngineState:
        with _DRIVEN_LOCK:
            other = (ref := _DRIVEN.get(self.module)) and ref()
            if other is None:
                _DRIVEN[self.module] = weakref.ref(self)
        if other is not None and other is not self:
            raise LockHeld(
                f"{self!r}: the module is applied to by {other!r}, open in another receiver "
                "agent of this process: one agent per engine; close that one (one dropped "
                "unclosed holds it until the garbage collector frees it), or give this one a "
                "module of its own"
            )
        if self._store is None or self._store.locked:
            return self.state
        try:  # (a failed open leaves the module free too: another engine may open over it)
            ps = self._store.open()
            if ps is None:
                ps = PersistedState()
            elif ps.applying:
                logger.warning(
                    "%s: a previous process died applying v%s; the module's bytes are unknown, "
                    "starting with no version",
                    self._store.directory,
                    ps.target_version,
                )
                ps = PersistedState()
            elif ps.version is not None and self.verify_on_open and ps.checksum_algorithm:
                bad = self._mismatches(ps)
                if bad:
                    logger.warning(
                        "%s: the module does not hold v%s (%d tensors differ, e.g. %r); "
                        "starting with no version",
                        self._store.directory,
                        ps.version,
                        len(bad),
                        bad[0],
                    )
                    ps = PersistedState()
            self._set(ps)
            self._ids = _ids(self.tensors())
        except BaseException:
            self._let_go()
            raise
        return self.state

    def _held(self) -> dict[str, tuple[torch.dtype | None, tuple[int, ...]]]:
        """dtype and shape of each tensor of the held version (as the module has them)."""
        tensors = self.tensors()
        return {
            n: (tensors[n].dtype, tuple(tensors[n].shape)) if n in tensors else (None, ())
            for n in self._ps.checksums
        }

    def _mismatches(self, ps: PersistedState, names: list[str] | None = None) -> list[str]:
        tensors = self.tensors()
        algo = ps.checksum_algorithm or "xxh3-128"
        names = list(ps.checksums) if names is None else names
        bad = sorted(set(names) - set(tensors))
        for name in names:
            want = ps.checksums[name]
            if name not in tensors:
                continue
            t, layout = tensors[name], ps.parts.get(name)
            if checksum_tensor(t, algo, layout) != want:
                bad.append(name)
        return bad

    def _check_rebound(self, ids: dict[str, _AliasKey], manifest: Manifest) -> None:
        """Drop the held version (OutOfOrder: the receiver goes on from a keyframe) where a
        tensor of it was replaced or resized in the module since it was last known to hold it
        (``ids``: the tensors now) and no longer has its bytes; a copy of the same bytes (a
        ``module.to()``) is taken."""
        was = self._ids
        if self._ps.version is None or ids == was:  # (one C comparison: the usual case)
            return
        moved = [n for n in self._ps.checksums if ids.get(n) != was.get(n)]
        if not moved:
            return
        same = [n for n in moved if _same_form(ids.get(n), was.get(n))]
        bad = sorted(set(moved) - set(same)) + self._mismatches(self._ps, same)
        if not bad:
            self._ids = ids
            return
        held = self._ps.version
        logger.warning(
            "%r: %d tensors of v%s (e.g. %r) were replaced or resized in the module since and "
            "no longer hold its bytes; dropping v%s: the receiver re-initialises from a keyframe",
            self, len(bad), held, bad[0], held,
        )  # fmt: skip
        self._set(PersistedState())
        raise OutOfOrder(
            f"{self!r}: v{manifest.version} applies on v{manifest.base_version}, which the "
            f"module no longer holds (tensor {bad[0]!r} was replaced or resized in it): the "
            "receiver re-initialises from a keyframe"
        )

    # -- begin / apply --------------------------------------------------------------------------
    def _begin(self, manifest: Manifest, mode: Literal["delta", "full"]) -> None:
        if self._store is not None and not self._store.locked:
            raise ApplyFailed(f"{self!r}: begin before open")
        if self._txn is not None:
            raise ApplyFailed(
                f"{self!r}: begin v{manifest.version} while v{self._txn.manifest.version} "
                "is in progress; commit or abort it first"
            )
        if mode not in ("delta", "full"):
            raise ApplyFailed(f"unknown apply mode {mode!r}")
        tensors = self.tensors()
        ids = _ids(tensors)
        if mode == "delta":
            self._check_rebound(ids, manifest)
            check_base(self.state.version, self.state.run_id, manifest, repr(self))
            if self._ps.checksums:
                check_tensor_set(self._held(), manifest, repr(self))
        entries = manifest.tensor_map()
        for name, e in entries.items():
            t = tensors.get(name)
            if t is None:
                raise ApplyFailed(f"tensor {name!r} of v{manifest.version} is not in the module")
            if t.dtype != e.torch_dtype or tuple(t.shape) != e.shape:
                raise ApplyFailed(
                    f"tensor {name!r}: v{manifest.version} has {e.dtype}{list(e.shape)}, the "
                    f"module has {t.dtype}{list(t.shape)}"
                )
            _check_writable(name, t)
        if mode == "full":
            covered = {_alias_key(n, tensors[n]) for n in entries}
            extra = [n for n, t in tensors.items() if _alias_key(n, t) not in covered]
            if extra:
                logger.warning(
                    "%r: module tensors not in v%s are left as they are: %s",
                    self,
                    manifest.version,
                    extra,
                )
        if self._store is not None:
            self._set(self._ps.begin(manifest.version, mode))
        self._txn = _Txn(manifest, mode, entries, tensors, ids)
        if mode == "delta":
            self._txn.shared = _shared(tensors, ids)

    def _apply(self, updates: list[TensorUpdate]) -> None:
        txn = self._need_txn()
        patches: list[tuple[str, torch.Tensor, Patch]] = []
        try:
            self._take(txn, updates, patches)
        finally:  # the patches taken so far still run: the undo journal covers them
            # on the pool, one task per storage (a tied twin is taken once; names that view
            # parts of one storage are patched one after another, in order; so are, per device,
            # the names over memory that other names view in part, each byte once: Covered);
            # each journals its old values itself, and every task ends before the first error
            by_storage: dict[tuple[Any, int], list[tuple[str, torch.Tensor, Patch]]] = {}
            for w in patches:
                key = (w[1].device, w[1].untyped_storage().data_ptr())
                if _alias_key(w[0], w[1]) in txn.shared:
                    key = (w[1].device, -1)
                    txn.covered.setdefault(str(w[1].device), Covered())
                by_storage.setdefault(key, []).append(w)
                txn.spans[w[0]] = span(w[1])

            def run(ws: list[tuple[str, torch.Tensor, Patch]]) -> None:
                for name, t, patch in ws:
                    _write_int(t, functools.partial(self._patch, txn, name, patch, t))

            # (tasks of small tensors run on this thread: a pool task each cost more than
            # their patches, at a MoE model's tens of thousands of experts)
            parallel_map(run, by_storage.values(), cost=_group_bytes)

    def _take(
        self, txn: _Txn, updates: list[TensorUpdate], patches: list[tuple[str, torch.Tensor, Patch]]
    ) -> None:
        """Check ``updates`` in order; a full one is copied now, a delta's patch is queued."""
        for u in updates:
            name = u.entry.name
            entry = txn.entries.get(name)
            if entry is None:
                raise ApplyFailed(f"tensor {name!r} is not in v{txn.manifest.version}")
            if name in txn.seen:
                raise ApplyFailed(f"tensor {name!r} updated twice in v{txn.manifest.version}")
            txn.seen.add(name)
            t = txn.tensors[name]
            key = _alias_key(name, t)
            if key in txn.applied:  # a tied twin already took this data; commit verifies both
                continue
            if txn.mode == "delta":
                if u.patch is None:
                    raise ApplyFailed(f"tensor {name!r}: a delta needs a patch, not full data")
                txn.applied.add(key)
                patches.append((name, t, u.patch))
            else:
                new = u.full
                if new is None:
                    raise ApplyFailed(f"tensor {name!r}: full mode needs full data, not a patch")
                if new.dtype != t.dtype or tuple(new.shape) != tuple(t.shape):
                    raise ApplyFailed(
                        f"tensor {name!r}: got {new.dtype}{list(new.shape)}, the module has "
                        f"{t.dtype}{list(t.shape)}"
                    )
                txn.applied.add(key)
                txn.undo.append((name, None, int_view(t).to("cpu", copy=True)))
                raw_view(t).copy_(raw_view(new))  # the bytes shipped: a bool's are not all 0/1

    @staticmethod
    def _patch(txn: _Txn, name: str, patch: Patch, t: torch.Tensor, flat: torch.Tensor) -> None:
        """Validate, journal the old values, then patch ``flat`` (``t``'s int view) in place
        (on the CPU, and checksum its new bytes, in one pass: the C kernel saves, patches and
        hashes block by block; ``_commit`` uses that digest instead of reading the tensor
        again). Memory that other names view in part: only the bytes no patch of the version
        wrote yet (:class:`~receiver.engines.overlap.Covered`)."""
        patch = check_patch(patch, flat, name)
        covered = txn.covered.get(str(t.device)) if _alias_key(name, t) in txn.shared else None
        if covered is not None:
            patch = covered.drop_written(t, patch)
        if patch.positions is None:
            txn.undo.append((name, None, flat.to("cpu", copy=True)))
            apply_patch(flat, patch)
        else:
            old = torch.empty(patch.positions.numel(), dtype=flat.dtype, device=flat.device)
            if flat.device.type == "cpu":
                algo, layout = txn.manifest.checksum_algorithm, txn.entries[name].layout
                txn.sums[name] = patch_and_checksum(flat, patch, algo, layout, old_out=old)
            else:
                apply_patch(flat, patch, old_out=old)  # one pass: save the old values, patch
            txn.undo.append((name, patch.positions, old))
        if covered is not None:
            covered.add(t, patch)

    # -- commit / abort / bump ------------------------------------------------------------------
    def _commit(self) -> str:
        txn = self._need_txn()
        m = txn.manifest
        algo = m.checksum_algorithm
        same_algo = self._ps.checksum_algorithm == algo
        try:
            if txn.mode == "full":
                missing = [n for n in txn.entries if n not in txn.seen]
                if missing:
                    raise ApplyFailed(f"v{m.version}: tensors never arrived: {missing[:5]}")
            # taken in the patch's pass, for memory no other patch of this version wrote
            alone = apart(txn.spans)
            sums = {n: d for n, d in txn.sums.items() if n in alone}
            # a tensor without a change of its own whose memory a patch wrote (a tied twin)
            quiet = {n: span(txn.tensors[n]) for n in txn.entries if n not in txn.spans}
            written = touched(txn.spans.values(), quiet) if txn.spans else set()
            hashed = [
                name
                for name, e in txn.entries.items()
                if name not in sums
                and (name in txn.seen or e.changed > 0 or txn.mode == "full" or name in written)
            ]  # hashed on the pool (xxhash and the C kernels release the GIL)
            sums.update(zip(hashed, parallel_map(
                lambda n: entry_checksum(txn.entries[n], txn.tensors[n], algo), hashed
            ), strict=True))  # fmt: skip
            for name, e in txn.entries.items():
                if name in sums:
                    got = sums[name]
                elif same_algo:
                    got = self._ps.checksums.get(name, e.checksum)
                else:
                    continue
                if got != e.checksum:
                    raise ChecksumMismatch(
                        f"tensor {name!r} of v{m.version}: checksum {got} != {e.checksum}; "
                        f"rolled back to v{self.state.version}",
                        tensor=name,
                    )
            self._set(
                replace(
                    self._ps.clean(),
                    version=m.version,
                    run_id=m.run_id,
                    fingerprint=m.fingerprint,
                    checksum_algorithm=algo,
                    checksums={e.name: e.checksum for e in m.tensors},
                    parts=layouts_of(m),
                )
            )
        except BaseException:
            self._rollback(txn)
            raise
        self._txn = None
        self._ids = txn.ids
        logger.info("%r: committed %s v%s", self, txn.mode, m.version)
        return m.fingerprint

    def _rollback(self, txn: _Txn) -> None:
        self._txn = None
        for name, pos, old in reversed(txn.undo):
            _write_int(txn.tensors[name], functools.partial(_restore, pos, old))
        txn.undo.clear()
        if self._store is not None and self._ps.applying:
            self._set(self._ps.clean())

    def _abort(self) -> None:
        if self._txn is not None:
            logger.info("%r: aborting v%s", self, self._txn.manifest.version)
            self._rollback(self._txn)

    def _bump(self, manifest: Manifest) -> None:
        if self._txn is not None:
            raise ApplyFailed(f"{self!r}: bump while v{self._txn.manifest.version} is open")
        self._check_rebound(_ids(self.tensors()), manifest)
        check_base(self.state.version, self.state.run_id, manifest, repr(self))
        if self._ps.checksums:
            check_tensor_set(self._held(), manifest, repr(self))
        self._set(bumped(self._ps, manifest))
