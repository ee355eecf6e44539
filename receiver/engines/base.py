"""The contract between the receiver agent and an engine.

The agent owns discovery, reading, verification of shard bytes and decoding; an engine owns
where the weights live. For each version the agent calls, in order::

    await engine.begin(manifest, mode)      # mode "delta": patch the base; "full": replace all
    await engine.apply(updates)             # once per shard, any number of times
    fingerprint = await engine.commit()     # verify per-tensor checksums, persist the version

An engine that ``streams`` may be begun with a provisional manifest before the version's
manifest exists (``receiver.stream``) and is then ``confirm``-ed with the real one before
the remaining applies and the commit.

or ``await engine.abort()`` after any failure, which leaves the engine at the version it held
before ``begin``. A zero-diff version is ``await engine.bump(manifest)``. ``engine.state`` tells
the version the engine holds (``None`` when it holds nothing yet); it changes only in
``commit``/``bump``, so an engine never reports a version it does not fully hold.
"""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from asyncsync.codec import Patch
from asyncsync.format import Manifest, TensorEntry

__all__ = ["AuditReport", "Engine", "EngineState", "TensorUpdate"]


@dataclass(frozen=True)
class EngineState:
    """What an engine holds: version, the run that produced it, and the model fingerprint."""

    version: int | None = None
    run_id: str | None = None
    fingerprint: str | None = None


@dataclass(frozen=True)
class TensorUpdate:
    """One tensor's new data: either a codec patch on its int view, or its complete new value."""

    entry: TensorEntry
    patch: Patch | None = None
    full: torch.Tensor | None = None  # CPU tensor with entry's dtype and shape

    def __post_init__(self) -> None:
        if (self.patch is None) == (self.full is None):
            raise ValueError("a TensorUpdate carries exactly one of patch or full")


@dataclass(frozen=True)
class AuditReport:
    """What an engine found comparing the bytes it *serves* with a manifest's checksums.

    ``checked``: tensors compared; ``mismatched``: those whose served bytes differ;
    ``skipped``: tensors it could not compare, each with the reason (an audit that skips
    everything proves nothing, and says so); ``how``: the method, for the operator."""

    version: int
    checked: int
    mismatched: tuple[str, ...] = ()
    skipped: dict[str, str] = field(default_factory=dict)
    how: str = ""

    @property
    def ok(self) -> bool:
        return not self.mismatched


class Engine(abc.ABC):
    """Base class of engines. Subclasses implement the abstract coroutines."""

    #: the version the engine holds, persisted where the engine can persist it
    state: EngineState = EngineState()
    #: seconds between the audits the receiver runs when not told otherwise (None: audits only
    #: when asked, ``receiver.audit.receiver_auditor``); an engine whose :meth:`audit` is cheap
    #: and is the only thing standing between a bad engine and traffic sets it (SGLang)
    audit_interval: float | None = None
    #: whether the agent may begin a delta from the version's self-describing shards, before
    #: its manifest exists (receiver.stream), and then :meth:`confirm` it
    streams: bool = False
    #: set by the agent: awaited when the engine finds that it no longer serves the version it
    #: holds, before it repairs that (the agent then withdraws the ack: :meth:`ackable`)
    on_lost: Callable[[], Awaitable[None]] | None = None

    def ackable(self) -> EngineState:
        """What an ack may name now (FORMAT.md 7: the version the engine holds): ``state``,
        or nothing while the engine knows it does not serve it (a restarted server)."""
        return self.state

    async def open(self) -> EngineState:
        """Load persisted state (recovering from an interrupted apply) and return it."""
        return self.state

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release locks and files."""

    @abc.abstractmethod
    async def begin(self, manifest: Manifest, mode: Literal["delta", "full"]) -> None:
        """Start moving to ``manifest.version``. ``delta`` needs state.version == base_version."""

    @abc.abstractmethod
    async def apply(self, updates: list[TensorUpdate]) -> None:
        """Apply some tensors of the version being begun (each tensor at most once)."""

    @abc.abstractmethod
    async def commit(self) -> str:
        """Verify the new bytes of every touched tensor against the manifest, persist the version.

        Raises ChecksumMismatch naming the tensor (after rolling back) when they differ.
        Returns the manifest's fingerprint.
        """

    async def confirm(self, manifest: Manifest) -> None:
        """Streaming (``streams``): the delta begun with a provisional manifest (the base's
        tensors under the new version number) is confirmed by the real ``manifest``, which
        replaces it for the rest of the transaction (further applies, the commit's checks).
        The agent has checked that what was applied is what ``manifest`` commits."""
        raise NotImplementedError(f"{type(self).__name__} does not stream")

    @abc.abstractmethod
    async def abort(self) -> None:
        """Roll back to the version held before ``begin``."""

    @abc.abstractmethod
    async def bump(self, manifest: Manifest) -> None:
        """Take a zero-diff version: no data changes, only the version number."""

    async def serving_version(self) -> int | None:
        """The version being served right now (the receiver's ``/readyz``); an engine behind a
        server asks the server. Default: ``state.version``."""
        return self.state.version

    async def reconcile(self) -> None:  # noqa: B027 - optional hook
        """Called when there is no newer version to apply: bring a server that lost the
        version held (restarted) back to it."""

    async def audit(self, manifest: Manifest) -> AuditReport | None:
        """Compare the bytes the engine serves now with ``manifest`` (the version it holds);
        None: this engine cannot tell (``receiver.audit``). Never changes the weights."""
        return None

    async def repair(self) -> None:  # noqa: B027 - optional hook
        """After an audit found served bytes that differ: load the held version again in
        full, from where it is kept (not from what the engine serves)."""

    def info(self) -> dict[str, Any] | None:
        """Engine-specific facts for ``/status`` (None: nothing to add)."""
        return None

    def metrics(self) -> dict[str, tuple[str, float | None]]:
        """Engine-specific gauges for ``/metrics``: name -> (help, value; None is NaN),
        exported as ``asyncsync_receiver_engine_<name>``."""
        return {}

    async def acknowledged(self) -> None:  # noqa: B027 - optional hook
        """The agent has acknowledged the version just committed: the place for deferred work
        that should not delay the ack (LocalCheckpoint flushes its pages to disk here)."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} version={self.state.version}>"
