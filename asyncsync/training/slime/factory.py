"""Sitting in slime's factory: asyncsync for disk transport, slime's own classes for the rest.

slime's actor picks its updater class from ``--update-weight-mode``, ``--update-weight-transport``
and ``--colocate`` (``MegatronTrainRayActor.init``). :func:`choose` is that choice, as each
slime generation makes it; :func:`create_weight_updater` builds asyncsync's updater where slime
would build a disk updater (full: ``UpdateWeightFromDisk``; delta: gen2a and gen2
``UpdateWeightFromDiskDelta``, gen1 ``UpdateWeightFromDistributedDelta`` with disk transport)
and slime's own class otherwise (nccl, colocate: imported from slime, which must be installed).

:func:`install` puts it into a running slime, before the actors build their updaters (in the
actor process, e.g. from a ``--custom-*`` hook module or a ``sitecustomize``)::

    from asyncsync.training.slime import install
    install()        # slime's actor now builds asyncsync's updater for disk transport
"""

from __future__ import annotations

import argparse
import importlib
import logging
from collections.abc import Callable, Mapping
from typing import Any

from asyncsync.errors import ConfigError
from asyncsync.training.session import Weights
from asyncsync.training.slime.args import slime_generation
from asyncsync.training.slime.updater import AsyncSyncWeightUpdater

__all__ = [
    "ASYNCSYNC",
    "ASYNCSYNC_ORIGINAL",
    "SLIME_CLASSES",
    "choose",
    "create_weight_updater",
    "install",
]

logger = logging.getLogger(__name__)

ASYNCSYNC = "asyncsync"
#: the attribute of an installed dispatcher naming slime's class it stands in for
ASYNCSYNC_ORIGINAL = "__asyncsync_original__"
_UW = "slime.backends.megatron_utils.update_weight"
#: slime's updater classes: name -> module
SLIME_CLASSES = {
    "UpdateWeightFromTensor": f"{_UW}.update_weight_from_tensor",
    "UpdateWeightFromDistributed": f"{_UW}.update_weight_from_distributed",
    "UpdateWeightFromDisk": f"{_UW}.update_weight_from_disk",
    "UpdateWeightFromDiskDelta": f"{_UW}.update_weight_from_disk_delta",
    "UpdateWeightFromDistributedDelta": f"{_UW}.update_weight_from_distributed_delta",
}


def slime_choice(args: argparse.Namespace) -> str:
    """The class slime's own actor builds for ``args`` (its generation's order of checks).

    Raises AssertionError with slime's message where slime's actor asserts.
    """
    mode = getattr(args, "update_weight_mode", "full")
    transport = getattr(args, "update_weight_transport", "nccl")
    colocate = bool(getattr(args, "colocate", False))
    if slime_generation(args) == "gen1":
        if colocate:
            assert mode == "full", "--update-weight-mode=delta is not supported with --colocate"
            return "UpdateWeightFromTensor"
        if mode == "delta":
            return "UpdateWeightFromDistributedDelta"
        if transport == "disk":
            return "UpdateWeightFromDisk"
        assert transport == "nccl", (
            f"unsupported weight sync mode/transport: {mode!r}/{transport!r}"
        )
        return "UpdateWeightFromDistributed"
    if mode == "delta":
        assert not colocate, "--update-weight-mode=delta is not supported with --colocate"
        assert transport == "disk", (
            "--update-weight-mode=delta requires --update-weight-transport=disk"
        )
        return "UpdateWeightFromDiskDelta"
    if transport == "disk":
        return "UpdateWeightFromDisk"
    if colocate:
        return "UpdateWeightFromTensor"
    assert mode == "full"
    assert transport == "nccl", f"unsupported weight sync mode/transport: {mode!r}/{transport!r}"
    return "UpdateWeightFromDistributed"


def choose(args: argparse.Namespace) -> str:
    """:data:`ASYNCSYNC` where slime would build a disk updater, else slime's class name."""
    name = slime_choice(args)
    disk = getattr(args, "update_weight_transport", "nccl") == "disk"
    if name in ("UpdateWeightFromDisk", "UpdateWeightFromDiskDelta") or (
        name == "UpdateWeightFromDistributedDelta" and disk
    ):
        return ASYNCSYNC
    return name


def slime_class(name: str) -> Any:
    """slime's own updater class ``name`` (slime must be importable)."""
    try:
        module = importlib.import_module(SLIME_CLASSES[name])
    except ImportError as exc:
        raise ConfigError(
            f"these arguments need slime's own {name} (asyncsync replaces only the disk "
            f"transport), and slime cannot be imported here: {exc}"
        ) from exc
    return getattr(module, name)


def create_weight_updater(
    args: argparse.Namespace,
    model: Any,
    weights_getter: Callable[[], Weights],
    *,
    model_name: str,
    quantization_config: Mapping[str, Any] | None,
    **kwargs: Any,
) -> Any:
    """slime's factory with asyncsync in it (module docstring). ``weight_version`` starts at
    ``args.update_weight_start_version`` (0 when absent), as slime's actor sets it.

    ``kwargs`` go to :class:`AsyncSyncWeightUpdater` (``converter=``, ``engine_link=`` ...).
    """
    name = choose(args)
    if name != ASYNCSYNC:
        cls = slime_class(name)
        updater = cls(
            args,
            model,
            weights_getter=weights_getter,
            model_name=model_name,
            quantization_config=quantization_config,
        )
    else:
        updater = AsyncSyncWeightUpdater(
            args,
            model,
            weights_getter,
            model_name=model_name,
            quantization_config=quantization_config,
            **kwargs,
        )
    updater.weight_version = getattr(args, "update_weight_start_version", None) or 0
    return updater


def _dispatcher(original: type) -> type:
    """A subclass of slime's class ``original`` that builds asyncsync's updater for disk
    transport and ``original`` otherwise, however it is called (slime's actor passes keywords;
    a subclass's ``super().__init__`` or a caller may pass ``weights_getter`` positionally).
    It stays a class: ``issubclass``, class attributes and subclassing keep working."""

    base: Any = original

    def __new__(cls: type, *a: Any, **kw: Any) -> Any:
        if cls is not dispatcher:  # a subclass of the dispatcher: an ordinary instance
            return base.__new__(cls)
        args = a[0] if a else kw.get("args")
        if args is not None and choose(args) == ASYNCSYNC:
            return AsyncSyncWeightUpdater(*a, **kw)
        return original(*a, **kw)  # not an instance of the dispatcher: __init__ not rerun

    dispatcher: type = type(
        original.__name__,
        (original,),
        {
            "__new__": __new__,
            "__module__": getattr(original, "__module__", __name__),
            "__qualname__": getattr(original, "__qualname__", original.__name__),
            "__doc__": original.__doc__,
            ASYNCSYNC_ORIGINAL: original,
        },
    )
    return dispatcher


def install(modules: Mapping[str, Any] | None = None) -> list[str]:
    """Make slime build asyncsync's updater for disk transport; return what was replaced.

    Replaces, where slime defines them, ``UpdateWeightFromDisk`` in slime's actor module and
    the delta classes in their modules, by dispatchers that keep slime's class for nccl and
    colocate. ``modules`` (name -> module) is for tests; default: imported from slime.
    """
    targets = {
        "slime.backends.megatron_utils.actor": ("UpdateWeightFromDisk",),
        SLIME_CLASSES["UpdateWeightFromDisk"]: ("UpdateWeightFromDisk",),
        SLIME_CLASSES["UpdateWeightFromDiskDelta"]: ("UpdateWeightFromDiskDelta",),
        SLIME_CLASSES["UpdateWeightFromDistributedDelta"]: ("UpdateWeightFromDistributedDelta",),
    }
    replaced = []
    made: dict[type, type] = {}  # one dispatcher per class (the actor module imports it too)
    for mod_name, names in targets.items():
        module = (modules or {}).get(mod_name) if modules is not None else _try_import(mod_name)
        if module is None:
            continue
        for name in names:
            current = getattr(module, name, None)
            if not isinstance(current, type) or ASYNCSYNC_ORIGINAL in vars(current):
                continue
            if current not in made:
                made[current] = _dispatcher(current)
            setattr(module, name, made[current])
            replaced.append(f"{mod_name}.{name}")
    if not replaced:
        raise ConfigError(
            "install(): no slime updater class found to replace (is slime installed?)"
        )
    logger.info("asyncsync: installed in slime's factory: %s", replaced)
    return replaced


def _try_import(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except Exception:  # ImportError, or slime's own imports failing
        return None
