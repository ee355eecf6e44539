"""The one error tree of asyncsync, grouped by how a caller reacts.

::

    AsyncSyncError
    ├── ConfigError (ValueError)        bad argument or option: fix the call
    ├── FormatError                     the shared directory holds something we cannot trust
    │   ├── ManifestError               a manifest is malformed, unsafe or of an unknown format
    │   ├── ChecksumMismatch            bytes differ from what the manifest promises
    │   └── IncompleteVersion           a committed version lacks a shard it names
    ├── ChainError                      versions cannot be applied in order from what is on disk
    │   └── OutOfOrder                  a delta whose base is not the engine's version
    ├── PublishError                    a publish failed; nothing was committed, the next one works
    │   ├── OutcomeUnknown              (multi-rank) this rank missed the commit decision; the
    │   │                               next publish learns it and resolves the snapshot
    │   ├── CoordinationError           (multi-rank) ranks could not exchange a message in time
    │   └── StepBehind                  (multi-rank, step=) this rank's step is older than the
    │                                   group's: publish the group's step, not the same again
    ├── LockHeld                        another live process owns the root or the engine
    ├── ApplyFailed                     an engine refused a version, keeps its last good one
    │   ├── EngineStateError            an engine's persisted state is unreadable or inconsistent
    │   └── IncompatibleVersion         a delta/zero diff names other tensors than the engine holds
    └── AckTimeout (TimeoutError)       engines did not acknowledge in time; names who is behind

Foreign errors (OSError, json, safetensors) are translated at the boundary with
``raise NewError(...) from exc`` so callers catch one family.

Every error of the tree survives pickling (a Ray actor's or a worker process's error reaches
the caller as the same class with the same fields): unpickling restores the arguments and the
fields without calling ``__init__``, whose keyword-only fields (``AckTimeout.version``) pickle's
default would not pass.
"""

from __future__ import annotations

import math
import numbers
import threading
from typing import Any

__all__ = [
    "AckTimeout",
    "ApplyFailed",
    "AsyncSyncError",
    "ChainError",
    "ChecksumMismatch",
    "ConfigError",
    "EngineStateError",
    "FormatError",
    "IncompatibleVersion",
    "IncompleteVersion",
    "LockHeld",
    "ManifestError",
    "ManifestUnreadable",
    "CoordinationError",
    "OutOfOrder",
    "OutcomeUnknown",
    "PublishError",
    "StepBehind",
]


class AsyncSyncError(Exception):
    """Base of every error asyncsync raises on purpose."""

    def __reduce__(self) -> tuple[Any, ...]:
        # BaseException's reduce re-calls cls(*args): fields given as keywords would be lost
        # (or required, as AckTimeout's are, so that unpickling raised TypeError)
        return (_rebuild, (type(self), self.args, dict(self.__dict__)))


def _rebuild(
    cls: type[AsyncSyncError], args: tuple[Any, ...], state: dict[str, Any]
) -> AsyncSyncError:
    """An error of the tree from its pickled arguments and fields (see the module docstring)."""
    exc = cls.__new__(cls, *args)
    exc.args = args
    exc.__dict__.update(state)
    return exc


class ConfigError(AsyncSyncError, ValueError):
    """An argument or option is invalid; the message says which and what is allowed."""


class FormatError(AsyncSyncError):
    """Something in the shared directory cannot be trusted."""


class ManifestError(FormatError):
    """A manifest (or ack, or log line) is malformed, unsafe, or of an unknown format version."""


class ManifestUnreadable(ManifestError):
    """The file's bytes are not (yet) a JSON object: on a network filesystem a file can show
    before its data, so a reader may read it again; anything else wrong is final."""


class ChecksumMismatch(FormatError):
    """Bytes on disk or in an engine differ from the checksum the manifest records.

    ``path`` names the file and ``tensor`` the tensor (when known).
    """

    def __init__(self, message: str, *, path: str | None = None, tensor: str | None = None):
        super().__init__(message)
        self.path = path
        self.tensor = tensor


class IncompleteVersion(FormatError):
    """A committed version names a shard that is missing or has the wrong size."""


class ChainError(AsyncSyncError):
    """The versions on disk do not let an engine reach the target version."""


class OutOfOrder(ChainError):
    """A delta's base version is not the version the engine holds."""


class PublishError(AsyncSyncError):
    """Publishing a version failed. Nothing was committed; the next publish starts clean.

    In a multi-rank publish, ``ranks`` names the ranks that failed or never answered.
    """

    def __init__(self, message: str, *, ranks: tuple[int, ...] = ()):
        super().__init__(message)
        self.ranks = ranks


class OutcomeUnknown(PublishError):
    """A rank of a multi-rank publish could not learn whether its version was committed.

    Its snapshot is unchanged and the changes of the attempt are kept: the next publish of the
    group tells which attempt was committed last, and the rank advances its snapshot then.
    """


class CoordinationError(PublishError):
    """The ranks of a multi-rank publisher could not exchange a message in time (a rank died,
    hung, or the coordinator failed). Raised by coordinators; publishers translate it."""


class StepBehind(PublishError):
    """(multi-rank, publish with ``step=``) This rank's call is for an older step than another
    rank's: nothing was published by it, and calling again with the same step never succeeds.
    Publish the group's step ``group_step`` (or a later one) on this rank; ``ranks`` names this
    rank, ``step`` its call's step."""

    def __init__(
        self,
        message: str,
        *,
        ranks: tuple[int, ...] = (),
        step: int | None = None,
        group_step: int | None = None,
    ):
        super().__init__(message, ranks=ranks)
        self.step = step
        self.group_step = group_step


class LockHeld(AsyncSyncError):
    """Another live process holds the lock (one publisher per root, one agent per engine)."""


class ApplyFailed(AsyncSyncError):
    """An engine could not take a version. It still holds (and reports) its last good version."""


class EngineStateError(ApplyFailed):
    """An engine's persisted state is unreadable or inconsistent with its files."""


class IncompatibleVersion(ApplyFailed):
    """A delta or zero-diff version names another tensor set (names, dtypes, shapes) than the
    version the engine holds. Refused before the engine changes anything; the agent treats the
    version as bad and moves on from a keyframe (docs/FORMAT.md section 8)."""


class AckTimeout(AsyncSyncError, TimeoutError):
    """Engines did not acknowledge a version in time.

    ``behind`` maps each engine that is behind to the version it last acknowledged
    (``None`` when it never acknowledged anything).
    """

    def __init__(self, message: str, *, version: int, behind: dict[str, int | None]):
        super().__init__(message)
        self.version = version
        self.behind = behind


def first_error(exc: BaseException) -> BaseException:
    """The first leaf of an exception group (what a TaskGroup raises), or ``exc`` itself.

    Our pipelines fail fast on the first error of a stage; callers want that error, not a group.
    """
    while isinstance(exc, BaseExceptionGroup):
        group: BaseExceptionGroup[Any] = exc
        exc = group.exceptions[0]
    return exc


def check_number(
    name: str,
    value: Any,
    *,
    integer: bool = False,
    minimum: float = 0,
    above: bool = False,
    optional: bool = False,
) -> None:
    """ConfigError unless ``value`` is a finite number (an integer if ``integer``; never a
    bool) ``>= minimum`` (``> minimum`` if ``above``); None passes if ``optional``. For the
    public constructors' numeric options: a wrong type must not reach a comparison (TypeError)
    and NaN must not slip through one (every comparison with NaN is False)."""
    if optional and value is None:
        return
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind):
        what = "an integer" if integer else "a number"
        raise ConfigError(f"{name} must be {what}, got {shown(value)}")
    try:
        finite = math.isfinite(value)
    except OverflowError:  # a number too large for a float (10**400) is still finite
        finite = True
    if not finite:
        raise ConfigError(f"{name} must be finite, got {value!r}")
    if value < minimum or (above and value == minimum):
        raise ConfigError(
            f"{name} must be {'>' if above else '>='} {minimum:g}, got {shown(value)}"
        )


# The longest duration that threading, asyncio and time arithmetic all take (~292 years): a
# longer one (``timeout=10**400``) was an OverflowError from deep inside the wait, not a
# ConfigError at the call.
MAX_SECONDS = threading.TIMEOUT_MAX


def check_seconds(
    name: str,
    value: Any,
    *,
    above: bool = False,
    optional: bool = False,
    forever: bool = False,
) -> None:
    """ConfigError unless ``value`` is a number of seconds (never a bool, never NaN) ``>= 0``
    (``> 0`` if ``above``) and at most :data:`MAX_SECONDS`. ``inf`` passes only with
    ``forever`` (a wait without a limit); None only with ``optional``."""
    if optional and value is None:
        return
    if forever and isinstance(value, float) and value == math.inf:
        return
    check_number(name, value, above=above)
    if value > MAX_SECONDS:
        none = "; None waits without a limit" if optional and forever else ""
        raise ConfigError(
            f"{name} must be at most {MAX_SECONDS:.0f} seconds (~292 years){none}, "
            f"got {shown(value)}"
        )


#: The largest byte size an option takes (1 PiB): a bucket, a shard, a prefetch budget, a
#: retention size. Far above any model; ``prefetch_bytes=10**400`` passed unchecked before.
MAX_BYTES = 1 << 50


def check_bytes(name: str, value: Any, *, minimum: int = 1, optional: bool = False) -> None:
    """ConfigError unless ``value`` is an integer number of bytes from ``minimum`` to
    :data:`MAX_BYTES` (1 PiB); None passes if ``optional``."""
    check_number(name, value, integer=True, minimum=minimum, optional=optional)
    if value is not None and value > MAX_BYTES:
        raise ConfigError(f"{name} must be at most 1 PiB ({MAX_BYTES} bytes), got {shown(value)}")


#: The shortest poll interval taken (seconds): an idle receiver polling its root every 1 ms
#: took ~60 % of a core, every 10 ms ~12 %; inotify wakes a receiver sooner where it works.
MIN_POLL_SECONDS = 0.01


#: The shortest poll of a wait that is short by nature (an ack wait, a rendezvous among ranks):
#: the bench polls acks every 2 ms on purpose (a 10 ms poll would add up to 10 ms to each
#: latency it measures); below 1 ms such a wait spins a core.
MIN_SHORT_POLL_SECONDS = 0.001


def check_poll_interval(name: str, value: Any, *, minimum: float = MIN_POLL_SECONDS) -> None:
    """ConfigError unless ``value`` is a number of seconds from ``minimum`` (default
    :data:`MIN_POLL_SECONDS`) to :data:`MAX_SECONDS`: the interval of a loop that polls (a
    shorter one spins a core)."""
    check_seconds(name, value, above=True)
    if value < minimum:
        raise ConfigError(
            f"{name} must be at least {minimum:g} seconds (a shorter poll spins a "
            f"core), got {shown(value)}"
        )


def shown(value: Any) -> str:
    """``repr(value)`` for a message, but an integer too long to print (Python refuses
    ``repr(10**5000)``: ValueError) or to read is shown by its size."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 10**30:
        return f"an integer of {value.bit_length()} bits"
    return repr(value)
