"""asyncsync: lossless sparse-delta weight sync from RL trainers to inference engines.

Trainer side::

    from asyncsync import Publisher
    async with Publisher("/shared/weights") as pub:
        await pub.seed(model.state_dict())
        res = await pub.publish(model.state_dict())
        await pub.wait_acked(res.version, quorum=1, timeout=60)

Each rank of a trainer can publish its own part of the weights into one version
(``Publisher(root, coordinator=TorchDistCoordinator())``; see ``asyncsync.publish.distributed``).

The engine side lives in the ``receiver`` package. ``docs/FORMAT.md`` specifies the directory
format both sides share.
"""

import importlib
from typing import TYPE_CHECKING, Any

from asyncsync.errors import (
    AckTimeout,
    ApplyFailed,
    AsyncSyncError,
    ChainError,
    ChecksumMismatch,
    ConfigError,
    CoordinationError,
    EngineStateError,
    FormatError,
    IncompatibleVersion,
    IncompleteVersion,
    LockHeld,
    ManifestError,
    ManifestUnreadable,
    OutcomeUnknown,
    OutOfOrder,
    PublishError,
    StepBehind,
)

# Everything past the errors is imported on first use (PEP 562): `import asyncsync` and the
# command-line tools that only read a root start without torch.
_LAZY = {
    "FORMAT_VERSION": "asyncsync.format",
    "AckRecord": "asyncsync.format",
    "Manifest": "asyncsync.format",
    "TensorEntry": "asyncsync.format",
    "Coordinator": "asyncsync.publish.distributed",
    "FileRendezvous": "asyncsync.publish.rendezvous",
    "TorchDistCoordinator": "asyncsync.publish.distributed",
    "TensorSlice": "asyncsync.publish.merge",
    "Publisher": "asyncsync.publish.publisher",
    "RetentionPolicy": "asyncsync.publish.retention",
    "PublisherStats": "asyncsync.publish.stats",
    "PublishResult": "asyncsync.publish.stats",
    "SyncConfig": "asyncsync.training.config",
    "create_publisher": "asyncsync.training.factory",
    "SyncSession": "asyncsync.training.session",
    "AckPolicy": "asyncsync.training.staleness",
}

if TYPE_CHECKING:
    from asyncsync.format import FORMAT_VERSION, AckRecord, Manifest, TensorEntry
    from asyncsync.publish.distributed import Coordinator, TorchDistCoordinator
    from asyncsync.publish.merge import TensorSlice
    from asyncsync.publish.publisher import Publisher
    from asyncsync.publish.rendezvous import FileRendezvous
    from asyncsync.publish.retention import RetentionPolicy
    from asyncsync.publish.stats import PublisherStats, PublishResult
    from asyncsync.training.config import SyncConfig
    from asyncsync.training.factory import create_publisher
    from asyncsync.training.session import SyncSession
    from asyncsync.training.staleness import AckPolicy


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__version__ = "0.1.0"

__all__ = [
    "FORMAT_VERSION",
    "AckPolicy",
    "AckRecord",
    "AckTimeout",
    "ApplyFailed",
    "AsyncSyncError",
    "ChainError",
    "ChecksumMismatch",
    "ConfigError",
    "CoordinationError",
    "Coordinator",
    "EngineStateError",
    "FileRendezvous",
    "FormatError",
    "IncompatibleVersion",
    "IncompleteVersion",
    "LockHeld",
    "Manifest",
    "ManifestError",
    "ManifestUnreadable",
    "OutOfOrder",
    "OutcomeUnknown",
    "PublishError",
    "PublishResult",
    "Publisher",
    "PublisherStats",
    "RetentionPolicy",
    "StepBehind",
    "SyncConfig",
    "SyncSession",
    "TensorEntry",
    "TensorSlice",
    "TorchDistCoordinator",
    "__version__",
    "create_publisher",
]
