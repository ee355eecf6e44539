"""In-engine SGLang plugin: a reload that loads only the tensors that changed.

Without the plugin, every ``POST /update_weights_from_disk`` makes SGLang read and load every
shard of the checkpoint. With it, SGLang's reload method is wrapped (an AROUND hook of SGLang's
plugin registry, entry-point group ``sglang.srt.plugins``). The method is found by probing at
registration, newest first (:data:`HOOK_TARGETS`): SGLang 0.5.23 has it on
``WeightUpdater`` (``model_runner_components/weight_updater.py``, reached as
``ModelRunner.weight_updater``), older releases on ``ModelRunner``. When none exists the plugin
says so loudly at start and hooks nothing; the receiver's ``/status`` then reports the partial
path off (reload answers carry no ``asyncsync:`` marker).

When the directory is an asyncsync :class:`~receiver.engines.checkpoint.LocalCheckpoint`, the
hook compares the per-tensor checksums the checkpoint records for its version (``.asyncsync/
state.json``) with those of the version this model last loaded, reads only the tensors whose
checksum differs, verifies each against its recorded checksum (all of them before the first is
loaded), and passes them to the model's own ``load_weights``. That is where SGLang maps HF
names onto its parameters: fused ``qkv_proj``/``gate_up_proj`` (``stacked_params_mapping``
with shard ids), the slice of each tensor-parallel rank, tied embeddings, so none of that is
re-implemented here. Unchanged tensors are not read. Each reload logs one line (``asyncsync:
partial reload: loaded K of N tensors (checkpoint vV): names`` or ``asyncsync: full reload
(why)``) in the server's log, and the same words are in the reload's HTTP answer.

Where the new values come from: the host-local checkpoint the receiver already patched and
verified, not the delta shards. Inside the engine the HF-named, unfused old tensor a delta
applies to no longer exists (it was fused and sliced at load), so a delta path would need a
host copy of every managed HF tensor per TP rank (the full model in host RAM, per rank) or
old bytes that the receiver has just overwritten. Reading new bytes from the verified
checkpoint needs neither, re-uses the one decoder and verifier (the receiver's), and is
correct however many versions passed since the model last loaded (it diffs checksums against
what the model holds, not against the previous version).

A full reload through SGLang's own code where the partial path cannot be proven safe: the first
reload after start (it does not know what the model holds), another directory, a changed set of
tensors, quantized models (their ``process_weights_after_loading`` needs every weight), a
``load_format`` other than the default/safetensors, or an error midway through
``load_weights`` (the model may be half-updated). Calls with a ``weight_name_filter`` (EPLB)
pass through untouched.

Refused, neither partial nor full (``(False, message)``: SGLang keeps its weights and stays up):
an asyncsync checkpoint that is not clean (a version being applied, an unreadable state), and a
changed tensor whose bytes do not match their checksum. SGLang 0.5.23 cannot survive a
checkpoint it fails to load (its rollback re-reads the new path and the scheduler dies), so only
verified bytes may reach it.

Environment: ``ASYNCSYNC_SGLANG_PARTIAL=0`` disables the partial path;
``ASYNCSYNC_SGLANG_HOOK_TARGET`` names the function to hook (instead of probing);
``ASYNCSYNC_SGLANG_BATCH_BYTES`` bounds the bytes handed to ``load_weights`` at once (1 GiB).

This module imports without SGLang; only :func:`register` (called by SGLang) touches it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pkgutil
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import safetensors
import torch

from asyncsync.errors import AsyncSyncError
from asyncsync.format.checksum import layout_checksum, tensor_bytes
from asyncsync.fsio import read_bytes
from receiver.state import STATE_DIR_NAME, STATE_NAME, PersistedState

__all__ = [
    "HOOK_TARGET",
    "HOOK_TARGETS",
    "CheckpointSnapshot",
    "PartialReloader",
    "find_target",
    "read_snapshot",
    "register",
    "update_weights_from_disk_hook",
]

logger = logging.getLogger(__name__)

#: the reload methods hooked, probed in this order (the first that exists is hooked)
HOOK_TARGETS = (
    # SGLang 0.5.23
    "sglang.srt.model_executor.model_runner_components.weight_updater.WeightUpdater"
    ".update_weights_from_disk",
    # older SGLang
    "sglang.srt.model_executor.model_runner.ModelRunner.update_weights_from_disk",
)
HOOK_TARGET = HOOK_TARGETS[0]
ENV_TARGET = "ASYNCSYNC_SGLANG_HOOK_TARGET"
ENV_PARTIAL = "ASYNCSYNC_SGLANG_PARTIAL"
ENV_BATCH_BYTES = "ASYNCSYNC_SGLANG_BATCH_BYTES"
INDEX_NAME = "model.safetensors.index.json"
_PARTIAL_FORMATS = (None, "auto", "safetensors")

LoadResult = tuple[bool, str]


class SupportsLoadWeights(Protocol):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Any: ...


@dataclass(frozen=True)
class CheckpointSnapshot:
    """What a clean asyncsync checkpoint holds: its version and every tensor's checksum."""

    directory: Path
    version: int
    run_id: str | None
    algorithm: str
    checksums: dict[str, str]
    weight_map: dict[str, str]  # tensor name -> file name
    parts: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # tensors in parts


class Unverified(AsyncSyncError):
    """An asyncsync checkpoint that must not be handed to SGLang (mid-apply, unreadable)."""


def read_snapshot(directory: str | os.PathLike[str]) -> CheckpointSnapshot | None:
    """The snapshot of ``directory``, or None when it is not a clean asyncsync checkpoint."""
    try:
        return checkpoint_snapshot(directory)
    except Unverified:
        return None


def checkpoint_snapshot(directory: str | os.PathLike[str]) -> CheckpointSnapshot | None:
    """The snapshot of a clean asyncsync checkpoint; None when ``directory`` is not an asyncsync
    checkpoint at all (no ``.asyncsync/state.json``). Raises Unverified for one that is not
    clean."""
    d = Path(directory).resolve()
    if not (d / STATE_DIR_NAME / STATE_NAME).is_file():
        return None
    try:
        state = PersistedState.from_json(
            read_bytes(d / STATE_DIR_NAME / STATE_NAME, limit=256 << 20), where=str(d)
        )
        index = _read_weight_map(d / INDEX_NAME)
    except (OSError, ValueError, AsyncSyncError) as exc:
        raise Unverified(f"{d} is an asyncsync checkpoint that cannot be read: {exc}") from exc
    if state.applying:
        raise Unverified(f"{d}: a version is being applied (not verified yet)")
    if state.version is None or state.checksum_algorithm is None:
        raise Unverified(f"{d}: no verified version yet")
    if set(state.checksums) != set(index):
        raise Unverified(f"{d}: the index and state.json name different tensors")
    return CheckpointSnapshot(
        d,
        state.version,
        state.run_id,
        state.checksum_algorithm,
        dict(state.checksums),
        index,
        dict(state.parts),
    )


def _read_weight_map(path: Path) -> dict[str, str]:
    """The ``weight_map`` of an HF safetensors index (tensor names -> plain file names)."""
    index = json.loads(read_bytes(path, limit=256 << 20))
    wm = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wm, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and "/" not in v and v.endswith(".safetensors")
        for k, v in wm.items()
    ):
        raise ValueError(f"{path}: weight_map is missing or invalid")
    return dict(wm)


class _Refused(AsyncSyncError):
    """The partial path read bytes that fail verification: nothing was loaded."""


class PartialReloader:
    """Keeps one model at the checkpoint's version, loading only changed tensors.

    Args:
        batch_bytes: tensors are handed to ``load_weights`` in batches of about this size
            (bounds the host memory of one reload; default ``$ASYNCSYNC_SGLANG_BATCH_BYTES``
            or 1 GiB).
    """

    def __init__(self, *, batch_bytes: int | None = None):
        if batch_bytes is None:
            batch_bytes = int(os.environ.get(ENV_BATCH_BYTES, "") or 1 << 30)
        if batch_bytes < 1:
            raise ValueError(f"batch_bytes must be >= 1, got {batch_bytes}")
        self.batch_bytes = batch_bytes
        self.loaded: CheckpointSnapshot | None = None  # what the model holds, when known

    def __repr__(self) -> str:
        v = None if self.loaded is None else self.loaded.version
        return f"<PartialReloader loaded_version={v}>"

    def why_full(self, snap: CheckpointSnapshot) -> str | None:
        """Why ``snap`` needs a full reload (None: the partial path may run)."""
        held = self.loaded
        if held is None:
            return "first reload: the weights the server holds are not known"
        if held.directory != snap.directory:
            return f"another directory than the last reload ({held.directory})"
        if held.algorithm != snap.algorithm:
            return "the checksum algorithm changed"
        if held.checksums.keys() != snap.checksums.keys():
            return "the set of tensors changed"
        return None

    def changed(self, snap: CheckpointSnapshot) -> list[str] | None:
        """Names whose checksum differs from what the model holds; None: a full reload is due."""
        if self.why_full(snap) is not None:
            return None
        held = self.loaded
        assert held is not None
        return [n for n in snap.weight_map if held.checksums[n] != snap.checksums[n]]

    def reload(
        self,
        model: SupportsLoadWeights,
        directory: str | os.PathLike[str],
        full_reload: Callable[[], LoadResult],
    ) -> LoadResult:
        """Bring ``model`` to the checkpoint in ``directory``; ``full_reload`` is SGLang's own."""
        try:
            snap = checkpoint_snapshot(directory)
        except Unverified as exc:
            return self._refuse(str(exc))
        if snap is None:
            return self._full(directory, full_reload, "not an asyncsync checkpoint")
        why = self.why_full(snap)
        if why is not None:
            return self._full(directory, full_reload, why)
        names = self.changed(snap)
        assert names is not None
        try:
            batches = self._verified_batches(snap, names)
        except (_Refused, OSError, ValueError, safetensors.SafetensorError) as exc:
            return self._refuse(str(exc))  # nothing loaded: the model still holds self.loaded
        try:
            for batch in batches:
                model.load_weights(batch)
        except Exception as exc:  # the model may be half-updated: reload all of it
            logger.warning("asyncsync: partial reload of v%s failed midway (%s)", snap.version, exc)
            adopt = not isinstance(exc, _Refused)
            return self._full(
                directory, full_reload, f"partial reload failed midway: {exc}", adopt=adopt
            )
        self.loaded = snap
        shown = ", ".join(names[:8]) + (f", ... ({len(names) - 8} more)" if len(names) > 8 else "")
        msg = (
            f"asyncsync: partial reload: loaded {len(names)} of {len(snap.checksums)} tensors "
            f"(checkpoint v{snap.version}): {shown or '-'}"
        )
        logger.info("%s", msg)
        return True, msg

    def _refuse(self, why: str) -> LoadResult:
        msg = (
            f"asyncsync: refused to load: {why}; nothing was loaded, the server keeps its "
            "weights (only verified checkpoints are handed to SGLang)"
        )
        logger.error("%s", msg)
        return False, msg

    def _full(
        self,
        directory: str | os.PathLike[str],
        full_reload: Callable[[], LoadResult],
        why: str,
        *,
        adopt: bool = True,
    ) -> LoadResult:
        self.loaded = None
        before = read_snapshot(directory)
        ok, msg = full_reload()
        # the receiver does not touch the checkpoint during the call; if it did, forget it
        if adopt and ok and before is not None and read_snapshot(directory) == before:
            self.loaded = before
        logger.info("asyncsync: full reload (%s): %s", why, msg)
        return ok, f"{msg} [asyncsync: full reload ({why})]"

    def _read(
        self, snap: CheckpointSnapshot, names: list[str]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors ``names``, each verified against ``snap``; raises _Refused."""
        by_file: dict[str, list[str]] = {}
        for n in names:
            by_file.setdefault(snap.weight_map[n], []).append(n)
        for file, file_names in by_file.items():
            with safetensors.safe_open(str(snap.directory / file), framework="pt") as f:
                for n in file_names:
                    t = f.get_tensor(n)
                    got = layout_checksum(
                        tensor_bytes(t), t.element_size(), snap.parts.get(n), snap.algorithm
                    )
                    if got != snap.checksums[n]:
                        raise _Refused(
                            f"{snap.directory / file}: tensor {n!r} has checksum {got}, "
                            f"state.json says {snap.checksums[n]} (changed or damaged on disk)"
                        )
                    yield n, t

    def _verified_batches(
        self, snap: CheckpointSnapshot, names: list[str]
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Every changed tensor is read and verified before the first is loaded. When they fit
        in one batch they are kept; else they are read again per batch (page cache), and
        verified again: a mismatch then is an error midway."""
        first: list[tuple[str, torch.Tensor]] = []
        size = 0
        kept = True
        for n, t in self._read(snap, names):  # raises before anything is loaded
            size += t.numel() * t.element_size()
            if kept and size <= self.batch_bytes:
                first.append((n, t))
            else:
                kept, first = False, []
        if kept:
            return iter([first] if first else [])
        return self._batches(snap, names)

    def _batches(
        self, snap: CheckpointSnapshot, names: list[str]
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        batch: list[tuple[str, torch.Tensor]] = []
        size = 0
        for n, t in self._read(snap, names):
            batch.append((n, t))
            size += t.numel() * t.element_size()
            if size >= self.batch_bytes:
                yield batch
                batch, size = [], 0
        if batch:
            yield batch


# --------------------------------------------------------------------------- the SGLang hook

_reloaders: weakref.WeakKeyDictionary[Any, PartialReloader] = weakref.WeakKeyDictionary()


def reloader_for(model: Any) -> PartialReloader:
    """The reloader of one model (each TP rank, and a draft model, has its own)."""
    r = _reloaders.get(model)
    if r is None:
        r = _reloaders[model] = PartialReloader()
    return r


def _model_of(owner: Any) -> Any:
    """The model behind the hooked method's ``self``: 0.5.23's ``WeightUpdater`` (a frozen,
    slotted dataclass, so not a weak-ref key) has ``get_model()``; older ``ModelRunner``s have
    ``.model``."""
    get_model = getattr(owner, "get_model", None)
    return get_model() if callable(get_model) else getattr(owner, "model", None)


def _partial_allowed(
    owner: Any, model: Any, load_format: str | None, recapture: bool
) -> str | None:
    """None when the partial path may run, else why not."""
    if os.environ.get(ENV_PARTIAL, "1").strip() == "0":
        return f"{ENV_PARTIAL}=0"
    if load_format not in _PARTIAL_FORMATS:
        return f"load_format={load_format!r}"
    if recapture:
        return "recapture_cuda_graph requested"
    if getattr(getattr(owner, "model_config", None), "quantization", None) is not None:
        return "quantized model"
    if not callable(getattr(model, "load_weights", None)):
        return "the model has no load_weights"
    return None


def update_weights_from_disk_hook(
    original_fn: Callable[..., LoadResult],
    owner: Any,
    model_path: str,
    load_format: str | None = None,
    weight_name_filter: Callable[[str], bool] | None = None,
    recapture_cuda_graph: bool = False,
    **kwargs: Any,
) -> LoadResult:
    """AROUND hook of ``update_weights_from_disk(self, model_path, load_format, ...)``; ``owner``
    is a ``WeightUpdater`` (0.5.23) or a ``ModelRunner`` (older)."""

    # pass on only what the caller gave: older SGLang signatures lack the newer parameters
    if weight_name_filter is not None:
        kwargs["weight_name_filter"] = weight_name_filter
    if recapture_cuda_graph:
        kwargs["recapture_cuda_graph"] = recapture_cuda_graph

    def full() -> LoadResult:
        return original_fn(owner, model_path, load_format, **kwargs)

    if weight_name_filter is not None:  # a partial reload of SGLang's own (EPLB): not ours
        return full()
    model = _model_of(owner)
    why_not = _partial_allowed(owner, model, load_format, recapture_cuda_graph)
    if why_not is not None:
        with contextlib.suppress(TypeError):  # a model that is no weak-ref key has none
            reloader_for(model).loaded = None
        logger.info("asyncsync: full reload (%s)", why_not)
        ok, msg = full()
        return ok, f"{msg} [asyncsync: full reload ({why_not})]"
    ok, msg = reloader_for(model).reload(model, model_path, full)
    config = getattr(owner, "model_config", None)
    if ok and config is not None:
        config.model_path = model_path  # as SGLang's own reload records it
    return ok, msg


def find_target(candidates: Iterable[str]) -> str | None:
    """The first of ``candidates`` (dotted paths) that resolves to a callable."""
    for target in candidates:
        try:
            fn = pkgutil.resolve_name(target)
        except (ImportError, AttributeError, ValueError) as exc:
            logger.debug("asyncsync: no hook target %s (%s)", target, exc)
            continue
        if callable(fn):
            return target
    return None


def register() -> None:
    """Entry point (group ``sglang.srt.plugins``): hook SGLang's reload method, probing
    :data:`HOOK_TARGETS` (or ``$ASYNCSYNC_SGLANG_HOOK_TARGET``). Without SGLang's plugin
    registry or any target, it warns and hooks nothing: reloads then stay full."""
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    except ImportError as exc:
        logger.warning("asyncsync SGLang plugin inactive: no plugin hook registry (%s)", exc)
        return
    override = os.environ.get(ENV_TARGET, "").strip()
    candidates = (override,) if override else HOOK_TARGETS
    target = find_target(candidates)
    if target is None:
        logger.warning(
            "asyncsync SGLang plugin INACTIVE: none of %s exists in this SGLang, so the partial "
            "reload is OFF and every reload is SGLang's full one (the receiver's /status says "
            "so). Set %s to this SGLang's update_weights_from_disk.",
            ", ".join(candidates),
            ENV_TARGET,
        )
        return
    HookRegistry.register(target, update_weights_from_disk_hook, HookType.AROUND)
    logger.info("asyncsync SGLang plugin: partial reloads hooked on %s", target)
