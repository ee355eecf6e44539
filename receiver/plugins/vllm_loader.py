"""In-engine apply for vLLM: a version applied in place inside every vLLM worker.

Two hooks of vLLM's own, both from ``pip install asyncsync`` in vLLM's environment:

* **The worker extension** (``--worker-extension-cls
  receiver.plugins.vllm_worker.AsyncSyncWorkerExtension``): the receiver calls its methods
  through ``POST /collective_rpc`` (``VLLM_SERVER_DEV_MODE=1``), which runs them in every
  worker, i.e. on every tensor-parallel rank, between two scheduler steps. They are thin:
  the work is :func:`apply_stage` and :func:`load_checkpoint` here, on top of the
  engine-agnostic :class:`~receiver.plugins.inplace.InEngineLoader` (stage verification, the
  base check, the XOR routed through the model's own ``load_weights``, every fallback).
* **A general plugin** (entry-point group ``vllm.general_plugins``, :func:`register`, loaded
  by vLLM in every process before the model is built): on vLLM's CPU build, when the operator
  opts in with ``ASYNCSYNC_VLLM_INPLACE=1``, linear layers keep their plain weights.

Why the opt-in: on the CPU build, after loading, every unquantized linear layer's weight is
packed for a GEMM kernel (oneDNN, sgl-kernel's ``weight_packed_linear`` or zentorch) and the
parameter replaced by an empty tensor (``dispatch_cpu_unquantized_gemm(layer,
remove_weight=True)`` in ``vllm/model_executor/layers/utils.py``, from
``UnquantizedLinearMethod.process_weights_after_loading``); the (tied) ``lm_head`` keeps its
parameter but computes from a packed copy (``UnquantizedEmbeddingMethod``, ``remove_weight=
False``). Then neither an in-place XOR nor a load of whole tensors into the parameters
changes what is served: only vLLM's ``reload_weights`` (which restores the layers, loads and
packs again) does. With ``ASYNCSYNC_VLLM_INPLACE=1`` the plugin replaces that dispatch for
2-D weights with what vLLM itself does for layers marked ``_cpu_skip_gemm_dispatch``:
``layer.cpu_linear = torch.nn.functional.linear``, weight kept. Generation then multiplies by
the parameters through PyTorch's own CPU GEMM instead of the packed kernel (the cost is
measured in BENCHMARKS.md). On GPU vLLM never packs unquantized weights this way: the
parameters are plain and the variable changes nothing.

Without the opt-in (or with quantized layers) :func:`packed` names why the served bytes are
not in the parameters; the worker then never applies in place nor loads tensors into
parameters: every version is vLLM's own full ``reload_weights``, and the answer (and the
server's log) says why. The receiver asks first (:func:`capabilities`) and does not even
write stages for such a server.

Each call logs one line in the server's log, through vLLM's own logging (logger
``vllm.asyncsync``, prefixed ``[rank R/N]``: ``asyncsync: in-engine apply: ...``,
``asyncsync: partial reload: ...``, ``asyncsync: full reload (why)``, ``asyncsync: stage not
applied in place (why); ...``, ``asyncsync: refused to load: ...``) and answers it.

This module imports without vLLM; only :func:`register` and the worker touch it.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from receiver.plugins.clean_load import WAIT_LINE, load_whole_version
from receiver.plugins.inplace import InEngineLoader, LoadResult, checkpoint_of_stage
from receiver.plugins.prefetch import start_prefetch
from receiver.plugins.stage import FORMAT_VERSION as STAGE_FORMAT_VERSION

__all__ = [
    "ENV_PLAIN",
    "WAIT_LINE",
    "apply_stage",
    "capabilities",
    "guard_start_load",
    "load_checkpoint",
    "loader_for",
    "packed",
    "register",
    "vllm_guard",
]

#: a child of vLLM's logger: vLLM configures only its own tree, so this is what its log shows
server_log = logging.getLogger("vllm.asyncsync")

ENV_PLAIN = "ASYNCSYNC_VLLM_INPLACE"
ENV_PARTIAL = "ASYNCSYNC_VLLM_PARTIAL"
DISPATCH = "vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm"
#: vLLM's weight methods that hold HF bytes as they are (once the CPU dispatch is plain)
_COPYING_METHODS = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")
_PLAIN = torch.nn.functional.linear


def _opted_in() -> bool:
    return os.environ.get(ENV_PLAIN, "").strip().lower() in ("1", "true", "yes", "on")


# ------------------------------------------------------------------------- the general plugin
def register() -> None:
    """Entry point (group ``vllm.general_plugins``): with ``ASYNCSYNC_VLLM_INPLACE=1``, keep the
    CPU build's linear weights plain (see the module docstring). Idempotent: vLLM loads
    general plugins in each of its processes, possibly more than once. Always: vLLM's load
    at start waits for a checkpoint its receiver is patching (:func:`guard_start_load`)."""
    guard_start_load()
    if not _opted_in():
        server_log.info(
            "asyncsync vLLM plugin: %s is not set: CPU linear weights stay packed (every "
            "version is vLLM's reload_weights on CPU)",
            ENV_PLAIN,
        )
        return
    try:
        import vllm.model_executor.layers.utils as utils
    except ImportError as exc:
        server_log.warning("asyncsync vLLM plugin: cannot import vLLM's layer utils (%s)", exc)
        return
    original = getattr(utils, "dispatch_cpu_unquantized_gemm", None)
    if original is None:
        server_log.warning(
            "asyncsync vLLM plugin: %s does not exist in this vLLM: CPU weights stay as vLLM "
            "packs them (in-place applies off)",
            DISPATCH,
        )
        return
    if getattr(original, "_asyncsync_plain", False):
        return

    def plain_dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
        w = getattr(layer, "weight", None)
        if isinstance(w, torch.Tensor) and not w.is_meta and w.ndim == 2:
            # what vLLM does for layers marked _cpu_skip_gemm_dispatch
            setattr(layer, "cpu_linear", _PLAIN)  # noqa: B010
            return
        original(layer, remove_weight)

    plain_dispatch._asyncsync_plain = True  # type: ignore[attr-defined]
    utils.dispatch_cpu_unquantized_gemm = plain_dispatch
    server_log.info(
        "asyncsync vLLM plugin: %s=1: CPU linear weights stay plain parameters "
        "(torch.nn.functional.linear), so versions can be applied in place",
        ENV_PLAIN,
    )


def guard_start_load() -> None:
    """Wrap vLLM's ``DefaultModelLoader.load_weights`` (the load at start) so that an asyncsync
    checkpoint is read only whole: never while its receiver patches it, and again if it
    changed while it was read (:mod:`receiver.plugins.clean_load`). Idempotent."""
    try:
        from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    except ImportError as exc:
        server_log.warning("asyncsync vLLM plugin: no DefaultModelLoader (%s): a start on a "
                           "checkpoint mid-apply is not held", exc)  # fmt: skip
        return
    original = DefaultModelLoader.load_weights
    if getattr(original, "_asyncsync_whole", False):
        return

    def load_weights(self: Any, model: Any, model_config: Any) -> Any:
        directory = str(getattr(model_config, "model", "") or "")
        if not directory or not os.path.isdir(directory):
            return original(self, model, model_config)
        return load_whole_version(
            directory, lambda: original(self, model, model_config), server_log
        )

    load_weights._asyncsync_whole = True  # type: ignore[attr-defined]
    DefaultModelLoader.load_weights = load_weights


# --------------------------------------------------------------------------- the worker side
def _module_problem(module: Any) -> str | None:
    """Why what ``module`` serves is not the bytes of its parameters (None: it is)."""
    qm = getattr(module, "quant_method", None)
    if qm is not None and type(qm).__name__ not in _COPYING_METHODS:
        return f"{type(qm).__name__} post-processes its weights after loading"
    linear = getattr(module, "cpu_linear", None)
    if linear is not None and linear is not _PLAIN:
        w = getattr(module, "weight", None)
        state = "emptied" if isinstance(w, torch.Tensor) and w.numel() == 0 else "kept"
        return (
            f"its weight is packed for vLLM's CPU GEMM kernel (parameter {state}); start vLLM "
            f"with {ENV_PLAIN}=1 to keep plain weights"
        )
    return None


def vllm_guard(param: str, module: Any) -> str | None:
    """The routing's veto (:data:`receiver.plugins.routing.Guard`) for vLLM modules."""
    return _module_problem(module)


def packed(model: Any) -> str | None:
    """Why the model cannot take in-place applies or tensor loads (None: it can): a module
    whose served bytes are not its parameters' (packed CPU weights, quantized layers)."""
    for name, module in model.named_modules():
        why = _module_problem(module)
        if why is not None:
            return f"{name or 'the model'}: {why}"
    if not callable(getattr(model, "load_weights", None)):
        return "the model has no load_weights"
    return None


_loaders: weakref.WeakKeyDictionary[Any, InEngineLoader] = weakref.WeakKeyDictionary()


def loader_for(model: Any) -> InEngineLoader:
    """The loader of one worker's model (one per tensor-parallel rank)."""
    loader = _loaders.get(model)
    if loader is None:
        partial = os.environ.get(ENV_PARTIAL, "1").strip() != "0"
        loader = _loaders[model] = InEngineLoader(model, guard=vllm_guard, partial=partial)
        start_prefetch(loader)
    return loader


def _rank(worker: Any) -> tuple[int, int]:
    pc = getattr(worker, "parallel_config", None)
    size = int(getattr(pc, "tensor_parallel_size", 1) or 1)
    rank = getattr(worker, "rank", None)
    if rank is None:
        rank = getattr(worker, "local_rank", 0)
    return int(rank or 0), size


def capabilities(worker: Any, model: Any) -> dict[str, Any]:
    """What this worker can do: stages (format version), in place or why not."""
    rank, size = _rank(worker)
    why = packed(model)
    loader = loader_for(model)
    held = None if loader.held is None else loader.held.version.version
    return {
        "stage_format": STAGE_FORMAT_VERSION,
        "in_place": why is None and loader.in_place,
        "why_not": why if why is not None else (None if loader.in_place else "in-place off"),
        "rank": rank,
        "tp_size": size,
        "held": held,
        "opted_in": _opted_in(),
    }


def _full_reload(worker: Any) -> Callable[[str], LoadResult]:
    """vLLM's own full reload (``Worker.reload_weights``) of a checkpoint directory."""

    def full(path: str) -> LoadResult:
        try:
            worker.reload_weights(weights_path=path)
        except Exception as exc:  # vLLM's layers may now be on the meta device: not adopted
            server_log.error("asyncsync: vLLM reload_weights of %s failed: %s", path, exc)
            return False, f"vLLM reload_weights failed: {type(exc).__name__}: {exc}"
        return True, f"vLLM reload_weights of {path}"

    return full


def _answer(ok: bool, msg: str, loader: InEngineLoader, worker: Any) -> dict[str, Any]:
    rank, size = _rank(worker)
    held = None if loader.held is None else loader.held.version.version
    server_log.log(logging.INFO if ok else logging.ERROR, "[rank %d/%d] %s", rank, size, msg)
    return {"ok": ok, "message": msg, "rank": rank, "tp_size": size, "held": held}


def apply_stage(worker: Any, model: Any, stage_dir: str) -> dict[str, Any]:
    """Apply the stage in ``stage_dir`` in place, or bring the model to its version through
    the checkpoint (partial, else vLLM's ``reload_weights``): the answer says which, and why."""
    loader = loader_for(model)
    full = _full_reload(worker)
    ckpt = checkpoint_of_stage(Path(stage_dir).resolve())
    if ckpt is None:
        msg = f"asyncsync: refused to load: {stage_dir} is not a stage of an asyncsync checkpoint"
        return _answer(False, msg, loader, worker)
    why = packed(model)
    if why is not None:
        return _whole(worker, model, str(ckpt), f"stage not applied in place ({why})")
    try:
        ok, msg = loader.apply_stage(stage_dir, full)
    except Exception as exc:  # midway: what the model holds is no longer known
        loader.forget(f"an in-place apply failed: {exc}")
        why = f"{type(exc).__name__}: {exc}"
        msg = f"asyncsync: in-engine apply failed ({why}); weights unknown until a full reload"
        return _answer(False, msg, loader, worker)
    return _answer(ok, msg, loader, worker)


def load_checkpoint(worker: Any, model: Any, directory: str, full: bool) -> dict[str, Any]:
    """Bring the model to the checkpoint in ``directory``: only the tensors that differ from
    what it holds (plain weights, base known), else vLLM's ``reload_weights``; ``full``: always
    the latter (a repair)."""
    why = packed(model)
    if why is not None:
        return _whole(worker, model, directory, why)
    loader = loader_for(model)
    if full:
        loader.forget("a full reload was asked for")
    try:
        ok, msg = loader.reload_checkpoint(directory, lambda: _full_reload(worker)(directory))
    except Exception as exc:
        loader.forget(f"a reload failed midway: {exc}")
        why = f"{type(exc).__name__}: {exc}"
        msg = f"asyncsync: reload failed ({why}); weights unknown until a full reload"
        return _answer(False, msg, loader, worker)
    return _answer(ok, msg, loader, worker)


def _whole(worker: Any, model: Any, directory: str, why: str) -> dict[str, Any]:
    """vLLM's own full reload, for a model whose parameters are not what it serves."""
    loader = loader_for(model)
    loader.forget(why)
    ok, msg = _full_reload(worker)(directory)
    loader.stats.full += 1
    return _answer(ok, f"asyncsync: full reload ({why}): {msg}", loader, worker)
