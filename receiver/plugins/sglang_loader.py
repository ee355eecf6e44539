"""In-engine SGLang plugin: a reload that loads only the tensors that changed.

Without the plugin, every ``POST /update_weights_from_disk`` makes SGLang read and load every
shard of the checkpoint. With it, SGLang's ``ModelRunner.update_weights_from_disk`` is wrapped
(an AROUND hook of SGLang's plugin registry, entry-point group ``sglang.srt.plugins``): when the
directory is an asyncsync :class:`~receiver.engines.checkpoint.LocalCheckpoint`, the hook
compares the per-tensor checksums the checkpoint records for its version (``.asyncsync/
state.json``) with those of the version this model last loaded, reads only the tensors whose
checksum differs, verifies each against its recorded checksum, and passes them to the model's
own ``load_weights``. That is where SGLang maps HF names onto its parameters: fused
``qkv_proj``/``gate_up_proj`` (``stacked_params_mapping`` with shard ids), the slice of each
tensor-parallel rank, tied embeddings, so none of that is re-implemented here. Unchanged
tensors are not read.

Where the new values come from: the host-local checkpoint the receiver already patched and
verified, not the delta shards. Inside the engine the HF-named, unfused old tensor a delta
applies to no longer exists (it was fused and sliced at load), so a delta path would need a
host copy of every managed HF tensor per TP rank (the full model in host RAM, per rank) or
old bytes that the receiver has just overwritten. Reading new bytes from the verified
checkpoint needs neither, re-uses the one decoder and verifier (the receiver's), and is
correct however many versions passed since the model last loaded (it diffs checksums against
what the model holds, not against the previous version). The receiver side is unchanged: the
same HTTP call, now cheaper.

Anything the hook cannot prove safe is a full reload through SGLang's own code: the first
reload after start (it does not know what the model holds), quantized models (their
``process_weights_after_loading`` needs every weight), a ``load_format`` other than the
default/safetensors, a changed set of tensors, a checksum mismatch, or an error midway. Calls
with a ``weight_name_filter`` (EPLB) pass through untouched. ``ASYNCSYNC_SGLANG_PARTIAL=0``
disables the partial path; ``ASYNCSYNC_SGLANG_HOOK_TARGET`` overrides the hooked function.

This module imports without SGLang; only :func:`register` (called by SGLang) touches it.
"""

from __future__ import annotations

import json
import logging
import os
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import safetensors
import torch

from asyncsync.errors import AsyncSyncError, ChecksumMismatch
from asyncsync.format.checksum import layout_checksum, tensor_bytes
from asyncsync.fsio import read_bytes
from receiver.state import STATE_DIR_NAME, STATE_NAME, PersistedState

__all__ = [
    "HOOK_TARGET",
    "CheckpointSnapshot",
    "PartialReloader",
    "read_snapshot",
    "register",
    "update_weights_from_disk_hook",
]

logger = logging.getLogger(__name__)

HOOK_TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.update_weights_from_disk"
ENV_TARGET = "ASYNCSYNC_SGLANG_HOOK_TARGET"
ENV_PARTIAL = "ASYNCSYNC_SGLANG_PARTIAL"
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


def read_snapshot(directory: str | os.PathLike[str]) -> CheckpointSnapshot | None:
    """The snapshot of ``directory``, or None when it is not a clean asyncsync checkpoint."""
    d = Path(directory).resolve()
    try:
        state = PersistedState.from_json(
            read_bytes(d / STATE_DIR_NAME / STATE_NAME, limit=256 << 20), where=str(d)
        )
        index = _read_weight_map(d / INDEX_NAME)
    except (OSError, ValueError, AsyncSyncError) as exc:
        logger.debug("%s is not a usable asyncsync checkpoint: %s", d, exc)
        return None
    if (
        state.applying
        or state.version is None
        or state.checksum_algorithm is None
        or set(state.checksums) != set(index)
    ):
        return None
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


class PartialReloader:
    """Keeps one model at the checkpoint's version, loading only changed tensors.

    Args:
        batch_bytes: tensors are handed to ``load_weights`` in batches of about this size
            (bounds the host memory of one reload).
    """

    def __init__(self, *, batch_bytes: int = 1 << 30):
        self.batch_bytes = batch_bytes
        self.loaded: CheckpointSnapshot | None = None  # what the model holds, when known

    def __repr__(self) -> str:
        v = None if self.loaded is None else self.loaded.version
        return f"<PartialReloader loaded_version={v}>"

    def changed(self, snap: CheckpointSnapshot) -> list[str] | None:
        """Names whose checksum differs from what the model holds; None: a full reload is due."""
        held = self.loaded
        if (
            held is None
            or held.directory != snap.directory
            or held.algorithm != snap.algorithm
            or held.checksums.keys() != snap.checksums.keys()
        ):
            return None
        return [n for n in snap.weight_map if held.checksums[n] != snap.checksums[n]]

    def reload(
        self,
        model: SupportsLoadWeights,
        directory: str | os.PathLike[str],
        full_reload: Callable[[], LoadResult],
    ) -> LoadResult:
        """Bring ``model`` to the checkpoint in ``directory``; ``full_reload`` is SGLang's own."""
        snap = read_snapshot(directory)
        names = None if snap is None else self.changed(snap)
        if snap is None or names is None:
            return self._full(directory, full_reload, "no known base")
        try:
            self._load(model, snap, names)
        except Exception as exc:  # the model may be half-updated: reload all of it
            logger.warning("asyncsync: partial reload of v%s failed (%s)", snap.version, exc)
            return self._full(directory, full_reload, f"partial reload failed: {exc}")
        self.loaded = snap
        msg = (
            f"asyncsync: loaded {len(names)} changed of {len(snap.checksums)} tensors "
            f"(checkpoint v{snap.version})"
        )
        logger.info("%s", msg)
        return True, msg

    def _full(
        self, directory: str | os.PathLike[str], full_reload: Callable[[], LoadResult], why: str
    ) -> LoadResult:
        self.loaded = None
        before = read_snapshot(directory)
        ok, msg = full_reload()
        # the receiver does not touch the checkpoint during the call; if it did, forget it
        if ok and before is not None and read_snapshot(directory) == before:
            self.loaded = before
        logger.info("asyncsync: full reload (%s): %s", why, msg)
        return ok, msg

    def _load(self, model: SupportsLoadWeights, snap: CheckpointSnapshot, names: list[str]) -> None:
        by_file: dict[str, list[str]] = {}
        for n in names:
            by_file.setdefault(snap.weight_map[n], []).append(n)
        batch: list[tuple[str, torch.Tensor]] = []
        size = 0
        for file, file_names in by_file.items():
            with safetensors.safe_open(str(snap.directory / file), framework="pt") as f:
                for n in file_names:
                    t = f.get_tensor(n)
                    got = layout_checksum(
                        tensor_bytes(t), t.element_size(), snap.parts.get(n), snap.algorithm
                    )
                    if got != snap.checksums[n]:
                        raise ChecksumMismatch(
                            f"{file}: tensor {n!r} has checksum {got}, state.json says "
                            f"{snap.checksums[n]} (the checkpoint changed during the reload?)",
                            path=str(snap.directory / file),
                            tensor=n,
                        )
                    batch.append((n, t))
                    size += t.numel() * t.element_size()
                    if size >= self.batch_bytes:
                        model.load_weights(batch)
                        batch, size = [], 0
        if batch:
            model.load_weights(batch)


# --------------------------------------------------------------------------- the SGLang hook

_reloaders: weakref.WeakKeyDictionary[Any, PartialReloader] = weakref.WeakKeyDictionary()


def reloader_for(runner: Any) -> PartialReloader:
    """The reloader of one model runner (each TP rank, and a draft model, has its own)."""
    r = _reloaders.get(runner)
    if r is None:
        r = _reloaders[runner] = PartialReloader()
    return r


def _partial_allowed(runner: Any, load_format: str | None, recapture: bool) -> str | None:
    """None when the partial path may run, else why not."""
    if os.environ.get(ENV_PARTIAL, "1").strip() == "0":
        return f"{ENV_PARTIAL}=0"
    if load_format not in _PARTIAL_FORMATS:
        return f"load_format={load_format!r}"
    if recapture:
        return "recapture_cuda_graph requested"
    if getattr(getattr(runner, "model_config", None), "quantization", None) is not None:
        return "quantized model"
    if not callable(getattr(getattr(runner, "model", None), "load_weights", None)):
        return "the model has no load_weights"
    return None


def update_weights_from_disk_hook(
    original_fn: Callable[..., LoadResult],
    runner: Any,
    model_path: str,
    load_format: str | None = None,
    weight_name_filter: Callable[[str], bool] | None = None,
    recapture_cuda_graph: bool = False,
    **kwargs: Any,
) -> LoadResult:
    """AROUND hook of ``ModelRunner.update_weights_from_disk(model_path, load_format, ...)``."""

    # pass on only what the caller gave: older SGLang signatures lack the newer parameters
    if weight_name_filter is not None:
        kwargs["weight_name_filter"] = weight_name_filter
    if recapture_cuda_graph:
        kwargs["recapture_cuda_graph"] = recapture_cuda_graph

    def full() -> LoadResult:
        return original_fn(runner, model_path, load_format, **kwargs)

    if weight_name_filter is not None:  # a partial reload of SGLang's own (EPLB): not ours
        return full()
    reloader = reloader_for(runner)
    why_not = _partial_allowed(runner, load_format, recapture_cuda_graph)
    if why_not is not None:
        reloader.loaded = None
        logger.debug("asyncsync: full reload (%s)", why_not)
        return full()
    ok, msg = reloader.reload(runner.model, model_path, full)
    if ok and getattr(runner, "model_config", None) is not None:
        runner.model_config.model_path = model_path  # as SGLang's own reload records it
    return ok, msg


def register() -> None:
    """Entry point (group ``sglang.srt.plugins``): hook SGLang's reload. A no-op without
    SGLang's plugin registry (older SGLang): reloads then stay full."""
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    except ImportError as exc:
        logger.warning("asyncsync SGLang plugin inactive: no plugin hook registry (%s)", exc)
        return
    target = os.environ.get(ENV_TARGET, HOOK_TARGET)
    HookRegistry.register(target, update_weights_from_disk_hook, HookType.AROUND)
    logger.info("asyncsync SGLang plugin: partial reloads hooked on %s", target)
