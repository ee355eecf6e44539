"""asyncsync: lossless sparse-delta weight sync from RL trainers to inference engines.

Trainer side::

    from asyncsync import Publisher
    async with Publisher("/shared/weights") as pub:
        await pub.seed(model.state_dict())
        res = await pub.publish(model.state_dict())
        await pub.wait_acked(res.version, quorum=1, timeout=60)

The engine side lives in the ``receiver`` package. ``docs/FORMAT.md`` specifies the directory
format both sides share.
"""

from asyncsync.errors import (
    AckTimeout,
    ApplyFailed,
    AsyncSyncError,
    ChainError,
    ChecksumMismatch,
    ConfigError,
    EngineStateError,
    FormatError,
    IncompleteVersion,
    LockHeld,
    ManifestError,
    OutOfOrder,
    PublishError,
)
from asyncsync.format import FORMAT_VERSION, AckRecord, Manifest, TensorEntry
from asyncsync.publisher import Publisher, PublisherStats, PublishResult

__version__ = "0.1.0"

__all__ = [
    "FORMAT_VERSION",
    "AckRecord",
    "AckTimeout",
    "ApplyFailed",
    "AsyncSyncError",
    "ChainError",
    "ChecksumMismatch",
    "ConfigError",
    "EngineStateError",
    "FormatError",
    "IncompleteVersion",
    "LockHeld",
    "Manifest",
    "ManifestError",
    "OutOfOrder",
    "PublishError",
    "PublishResult",
    "Publisher",
    "PublisherStats",
    "TensorEntry",
    "__version__",
]
