"""Build the trainer-side publisher that a :class:`~asyncsync.training.config.SyncConfig` describes.

::

    from asyncsync.training.config import SyncConfig
    from asyncsync.training.factory import create_publisher

    publisher = create_publisher(SyncConfig.from_env())
    async with publisher:
        await publisher.seed(model.state_dict())

Implementations are imported when the factory runs, not when this module is imported: the
publisher, the optional retention policy (``asyncsync.publish.retention``, used only when the
install has it and the publisher accepts ``retention=``) and the pre-commit hook's module.

What is refused (:class:`~asyncsync.errors.ConfigError`, raised by the configuration's
validation, so also when a plain mapping is given here): a transport other than ``disk``;
mode ``delta`` with colocated engines; both ``ack_engines`` and ``ack_quorum``; any value out
of range. Here in addition: a hook import path that does not resolve to a callable.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from asyncsync.errors import ConfigError
from asyncsync.publish.hooks import describe_callable, resolve_callable
from asyncsync.training.config import SyncConfig

if TYPE_CHECKING:
    from asyncsync.publish.publisher import Publisher

__all__ = ["create_publisher", "publisher_kwargs"]

logger = logging.getLogger(__name__)

RETENTION_MODULE = "asyncsync.publish.retention"


def create_publisher(
    config: SyncConfig | Mapping[str, Any],
    *,
    producer: Mapping[str, Any] | None = None,
    coordinator: Any = None,
) -> Publisher:
    """The publisher for ``config`` (a :class:`SyncConfig` or a mapping of its fields).

    The publisher is not opened: use it as ``async with publisher:`` (or
    :class:`asyncsync.training.session.SyncSession` from synchronous code). ``producer`` adds fields
    to every manifest's ``producer`` record (the factory adds ``mode`` and ``start_version``). The
    ack policy is not the publisher's business: see ``config.ack_policy``. ``coordinator``: this
    process is one rank of a multi-rank publisher (:mod:`asyncsync.publish.distributed`).
    """
    from asyncsync.publish.publisher import Publisher

    config = _as_config(config)
    kwargs = publisher_kwargs(config, Publisher, producer=producer)
    if coordinator is not None:
        kwargs["coordinator"] = coordinator
    return Publisher(**kwargs)


def publisher_kwargs(
    config: SyncConfig, publisher_cls: Any, *, producer: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The keyword arguments :func:`create_publisher` passes to ``publisher_cls``."""
    kwargs: dict[str, Any] = {
        "root": config.root,
        "mode": config.mode,
        "encoding": config.encoding,
        "checksum": config.checksum,
        "bucket_bytes": config.bucket_bytes,
        "max_in_flight": config.max_in_flight,
        "keyframe_interval": config.keyframe_interval,
        "zstd_level": config.zstd_level,
        "pre_commit_hook": None,
        "producer": {
            "mode": config.mode,
            "start_version": config.start_version,
            **(producer or {}),
        },
    }
    if config.pre_commit_hook is not None:
        kwargs["pre_commit_hook"] = resolve_callable(config.pre_commit_hook, what="pre_commit_hook")
        kwargs["producer"].setdefault("pre_commit_hook", describe_callable(config.pre_commit_hook))
    retention = _retention(config, publisher_cls)
    if retention is not None:
        kwargs["retention"] = retention
    return kwargs


def _as_config(config: SyncConfig | Mapping[str, Any]) -> SyncConfig:
    if isinstance(config, SyncConfig):
        return config
    if isinstance(config, Mapping):
        return SyncConfig.from_dict(config)
    raise ConfigError(
        f"create_publisher needs a SyncConfig or a mapping of its fields, got "
        f"{type(config).__name__}"
    )


def _retention(config: SyncConfig, publisher_cls: Any) -> Any | None:
    """A RetentionPolicy when one is asked for and this install supports it, else None."""
    if not config.retention_requested:
        return None
    try:
        module = importlib.import_module(RETENTION_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name != RETENTION_MODULE:
            raise
        module = None
    policy_cls = getattr(module, "RetentionPolicy", None)
    try:
        accepts = "retention" in inspect.signature(publisher_cls).parameters
    except (TypeError, ValueError):
        accepts = False
    if policy_cls is None or not accepts:
        logger.warning(
            "retention requested (keep_versions=%s, keep_bytes=%s) but this install has no "
            "%s.RetentionPolicy accepted by %s: every version is kept",
            config.keep_versions,
            config.keep_bytes,
            RETENTION_MODULE,
            getattr(publisher_cls, "__name__", publisher_cls),
        )
        return None
    return policy_cls(keep_versions=config.keep_versions, keep_bytes=config.keep_bytes)
