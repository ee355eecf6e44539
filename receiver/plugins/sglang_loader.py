"""In-engine SGLang plugin: a version applied in place, in milliseconds, inside the server.

SGLang's reload method is wrapped (an AROUND hook of SGLang's plugin registry, entry-point
group ``sglang.srt.plugins``). The method is found by probing at registration, newest first
(:data:`HOOK_TARGETS`): SGLang 0.5.23 has it on ``WeightUpdater``
(``model_runner_components/weight_updater.py``, reached as ``ModelRunner.weight_updater``),
older releases on ``ModelRunner``. When none exists the plugin says so loudly at start and
hooks nothing; the receiver then never sends a stage (answers carry no
:data:`STAGE_CAPABILITY`) and its ``/status`` reports the plugin off.

``POST /update_weights_from_disk {"model_path": P}`` then does, in every TP rank's process
(:class:`~receiver.plugins.inplace.InEngineLoader`, one per model):

* ``P`` is a **stage** (``<checkpoint>/.asyncsync/engine-stage/vN``, written by the receiver
  before the pause, :mod:`receiver.plugins.stage`): verified, its base checked against what
  the model holds, and each changed tensor's XOR routed through the model's own
  ``load_weights`` into an in-place XOR of its parameters' integer views
  (:mod:`receiver.plugins.routing`): SGLang's own ``stacked_params_mapping``, per-rank
  slicing and tied embeddings decide where each element goes. Tensors SGLang does not copy
  as they are (``default_weight_loader``'s ``fill_`` of one-element parameters, AMX packing,
  quantized layers: :func:`sglang_guard`) are read whole from the checkpoint, verified and
  loaded as SGLang always did. Anything that cannot be proven safe goes through the
  checkpoint instead, in the same call, and the answer says why.
* ``P`` is an asyncsync **checkpoint**: the tensors whose checksum differs from what the model
  holds are read, verified, and loaded whole; SGLang's own full reload when the base is
  unknown (first load, another directory, another tensor set).
* Refused (``success: false``, nothing loaded, SGLang keeps its weights and stays up): bytes
  that fail their checksum, a checkpoint that is not clean or not at the stage's version, a
  stage removed before the call came to it (never handed to SGLang as a model path).
  SGLang 0.5.23 cannot survive a checkpoint it fails to load (its rollback re-reads the new
  path and the scheduler dies), so only verified bytes ever reach it.

A full reload through SGLang's own code for a quantized model, a ``load_format`` other than
the default/safetensors, ``recapture_cuda_graph``, or an error midway through ``load_weights``.
Calls with a ``weight_name_filter`` (EPLB) pass through untouched. A draft model (speculative
decoding) takes a stage through the checkpoint.

Each model gets an :class:`~receiver.plugins.audit.Auditor` thread that compares what it
serves with the trainer's bytes after every change and on a schedule, and records the result
in ``<checkpoint>/.asyncsync/audit/`` for the receiver.

Each call logs one line (``asyncsync: in-engine apply: ...``, ``asyncsync: partial reload:
...``, ``asyncsync: full reload (why)``, ``asyncsync: stage not applied in place (why); ...``,
``asyncsync: refused to load: ...``) in the server's log; the HTTP answer carries the same
words.

Environment: ``ASYNCSYNC_IN_PLACE=0`` (stages through the checkpoint),
``ASYNCSYNC_SGLANG_PARTIAL=0`` (every checkpoint load full), ``ASYNCSYNC_AUDIT=0``,
``ASYNCSYNC_AUDIT_BYTES_PER_S``, ``ASYNCSYNC_AUDIT_INTERVAL``, ``ASYNCSYNC_SGLANG_HOOK_TARGET``
(the function to hook instead of probing), ``ASYNCSYNC_SGLANG_BATCH_BYTES`` (bytes handed to
``load_weights`` at once, 1 GiB).

This module imports without SGLang; only :func:`register` (called by SGLang) touches it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pkgutil
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from receiver.plugins.audit import Auditor
from receiver.plugins.clean_load import load_whole_version
from receiver.plugins.held import CheckpointSnapshot, read_snapshot
from receiver.plugins.inplace import InEngineLoader, LoadResult, checkpoint_of_stage
from receiver.plugins.prefetch import start_prefetch
from receiver.plugins.stage import STAGE_CAPABILITY, is_stage
from receiver.state import STATE_DIR_NAME

__all__ = [
    "HOOK_TARGET",
    "HOOK_TARGETS",
    "STAGE_CAPABILITY",
    "CheckpointSnapshot",
    "find_target",
    "loader_for",
    "read_snapshot",
    "register",
    "sglang_guard",
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
#: SGLang's load of the model at start (the checkpoint when ``--model-path`` names it)
START_TARGET = "sglang.srt.model_loader.loader.DefaultModelLoader.load_model"
#: where SGLang 0.5.23 renames its served model to each reload's ``model_path``
NAME_TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager._update_model_path_info"
ENV_TARGET = "ASYNCSYNC_SGLANG_HOOK_TARGET"
ENV_PARTIAL = "ASYNCSYNC_SGLANG_PARTIAL"
_PARTIAL_FORMATS = (None, "auto", "safetensors")
#: SGLang's weight methods that copy HF bytes as they are (their post-processing aside)
_COPYING_METHODS = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")


def sglang_guard(param: str, module: Any) -> str | None:
    """Why SGLang transforms what is loaded into ``module`` (None: plain copies)."""
    if getattr(module, "use_intel_amx_backend", False):
        return "AMX-packed after loading (process_weights_after_loading)"
    qm = getattr(module, "quant_method", None)
    if qm is not None and type(qm).__name__ not in _COPYING_METHODS:
        return f"{type(qm).__name__} post-processes it after loading"
    derived = getattr(module, "_derived_weight_cache_error", None)
    if derived:
        return f"a derived-weight cache ({derived})"
    return None


# --------------------------------------------------------------------------- the SGLang hook

_loaders: weakref.WeakKeyDictionary[Any, InEngineLoader] = weakref.WeakKeyDictionary()
_auditors: list[Auditor] = []


def _rank_of(owner: Any) -> tuple[int, int, str]:
    """(tp rank, tp size, "target" | "draft") of the runner behind the hooked method."""
    runner = owner
    get_runner = getattr(owner, "get_model_runner", None)
    if callable(get_runner):
        with contextlib.suppress(Exception):
            runner = get_runner()
    rank = getattr(owner, "tp_rank", None)
    rank = getattr(runner, "tp_rank", 0) if rank is None else rank
    size = getattr(runner, "tp_size", None)
    if size is None:
        try:
            from sglang.srt.runtime_context import get_parallel

            size = get_parallel().tp_size
        except Exception:
            size = 1
    role = "draft" if getattr(runner, "is_draft_worker", False) else "target"
    return int(rank or 0), int(size or 1), role


def loader_for(model: Any, owner: Any = None) -> InEngineLoader:
    """The loader of one model (each TP rank, and a draft model, has its own), with its
    auditor running."""
    loader = _loaders.get(model)
    if loader is None:
        partial = os.environ.get(ENV_PARTIAL, "1").strip() != "0"
        loader = _loaders[model] = InEngineLoader(model, guard=sglang_guard, partial=partial)
        rank, size, role = _rank_of(owner)
        auditor = Auditor(loader, rank=rank, tp_size=size, role=role)
        auditor.start()
        _auditors.append(auditor)
        start_prefetch(loader)
    return loader


def _model_of(owner: Any) -> Any:
    """The model behind the hooked method's ``self``: 0.5.23's ``WeightUpdater`` (a frozen,
    slotted dataclass, so not a weak-ref key) has ``get_model()``; older ``ModelRunner``s have
    ``.model``."""
    get_model = getattr(owner, "get_model", None)
    return get_model() if callable(get_model) else getattr(owner, "model", None)


def _partial_allowed(
    owner: Any, model: Any, load_format: str | None, recapture: bool
) -> str | None:
    """None when the plugin may run (partial reloads, in-place applies), else why not."""
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
    is a ``WeightUpdater`` (0.5.23) or a ``ModelRunner`` (older). ``model_path`` is a stage
    (applied in place), an asyncsync checkpoint (changed tensors only) or anything else
    (SGLang's own reload)."""

    # pass on only what the caller gave: older SGLang signatures lack the newer parameters
    if weight_name_filter is not None:
        kwargs["weight_name_filter"] = weight_name_filter
    if recapture_cuda_graph:
        kwargs["recapture_cuda_graph"] = recapture_cuda_graph

    def full_of(path: str) -> LoadResult:
        return original_fn(owner, path, load_format, **kwargs)

    if weight_name_filter is not None:  # a partial reload of SGLang's own (EPLB): not ours
        return full_of(model_path)
    path = model_path
    stage = is_stage(model_path)
    if not stage and checkpoint_of_stage(Path(model_path).resolve()) is not None:
        # the receiver removed it before we came to it (its call timed out, or a new receiver
        # started): never SGLang's own load of that path (a hub repo id to it), nothing changes
        msg = (
            f"asyncsync: refused to load: the stage {model_path} is gone (its receiver removed "
            "it: it gave up waiting for this call, or restarted); nothing was loaded, the "
            "server keeps its weights"
        )
        logger.error("%s", msg)
        return False, msg + STAGE_CAPABILITY
    if stage:
        ckpt = checkpoint_of_stage(Path(model_path).resolve())
        if ckpt is None:
            msg = f"asyncsync: refused to load: {model_path} is a stage outside a checkpoint"
            logger.error("%s", msg)
            return False, msg + STAGE_CAPABILITY
        path = str(ckpt)
    model = _model_of(owner)
    why_not = _partial_allowed(owner, model, load_format, recapture_cuda_graph)
    if why_not is not None:
        with contextlib.suppress(TypeError):  # a model that is no weak-ref key has none
            loader_for(model, owner).forget(why_not)
        logger.info("asyncsync: full reload (%s)", why_not)
        ok, msg = full_of(path)
        return ok, f"{msg} [asyncsync: full reload ({why_not})]{STAGE_CAPABILITY}"
    loader = loader_for(model, owner)
    if stage and _rank_of(owner)[2] == "draft":
        ok, msg = loader.reload_checkpoint(path, lambda: full_of(path))
    elif stage:
        ok, msg = loader.apply_stage(model_path, full_of)
    else:
        ok, msg = loader.reload_checkpoint(path, lambda: full_of(path))
    config = getattr(owner, "model_config", None)
    if ok and config is not None:
        config.model_path = path  # as SGLang's own reload records it (never the stage)
    return ok, msg + STAGE_CAPABILITY


def keep_served_name_hook(
    original_fn: Callable[..., Any], manager: Any, model_path: str, *args: Any, **kwargs: Any
) -> Any:
    """AROUND hook of SGLang 0.5.23's ``TokenizerManager._update_model_path_info(self,
    model_path, load_format)``, run after every successful reload: SGLang renames the served
    model to ``model_path`` (``/v1/models``, ``/model_info``, the ``model`` of its answers,
    the name ``/v1/responses`` and ``/v1/models/<name>`` accept). For an asyncsync stage or
    checkpoint the weights changed, not the model: the name it was started with is kept, and
    ``model_path`` names the checkpoint (never a stage, removed once applied). Other paths are
    SGLang's own rename."""
    resolved = Path(model_path).resolve()
    ckpt = checkpoint_of_stage(resolved)
    if ckpt is None and not (resolved / STATE_DIR_NAME).is_dir():
        return original_fn(manager, model_path, *args, **kwargs)
    name = getattr(manager, "served_model_name", None)
    out = original_fn(manager, str(ckpt or model_path), *args, **kwargs)
    if name is not None:
        manager.served_model_name = name
    return out


def whole_version_start_hook(
    original_fn: Callable[..., Any], loader: Any, *args: Any, **kwargs: Any
) -> Any:
    """AROUND hook of ``DefaultModelLoader.load_model(self, *, model_config, device_config)``:
    SGLang started with ``--model-path`` on an asyncsync checkpoint reads it only whole, never
    while its receiver patches it (:mod:`receiver.plugins.clean_load`)."""
    path = str(getattr(kwargs.get("model_config"), "model_path", "") or "")
    if not path or not os.path.isdir(path):
        return original_fn(loader, *args, **kwargs)
    return load_whole_version(path, lambda: original_fn(loader, *args, **kwargs), logger)


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
    if find_target((START_TARGET,)) is not None:
        HookRegistry.register(START_TARGET, whole_version_start_hook, HookType.AROUND)
    if find_target((NAME_TARGET,)) is not None:
        HookRegistry.register(NAME_TARGET, keep_served_name_hook, HookType.AROUND)
    else:  # an SGLang that does not rename, or renames elsewhere: see docs/ENGINES.md
        logger.warning("asyncsync SGLang plugin: no %s: the served model name may follow "
                       "each reload's path", NAME_TARGET)  # fmt: skip
    logger.info("asyncsync SGLang plugin: in-place applies and partial reloads hooked on %s",
                target)  # fmt: skip
