"""Bounded staleness: how far the trainer may run ahead of the engines' acknowledgements.

After publishing version ``N`` the trainer waits until the engines it watches acknowledge
``N - max_staleness``::

    max_staleness = 0   publish N, wait for N          (synchronous, like slime's updaters)
    max_staleness = 1   publish N, wait for N - 1      (train step N+1 while engines apply N)
    max_staleness = k   publish N, wait for N - k

Which engines: all of ``engines`` (by id), or any ``quorum`` of them, or nobody (no wait) when
neither is given. Versions older than the first one this trainer published (its seed) are never
waited for: they belong to an earlier run of the trainer. Example::

    gate = StalenessGate(publisher, AckPolicy(quorum=2, max_staleness=1, timeout=300), floor=0)
    res = await publisher.publish(model.state_dict())
    wait = await gate.wait(res.version)      # returns once 2 engines hold res.version - 1
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from asyncsync.errors import ConfigError, check_seconds
from asyncsync.format import AckRecord

__all__ = ["AckPolicy", "AckWait", "StalenessGate"]


class _Waiter(Protocol):
    async def wait_acked(
        self,
        version: int,
        *,
        engines: list[str] | None = None,
        quorum: int | None = None,
        timeout: float | None = None,
    ) -> dict[str, AckRecord]: ...


@dataclass(frozen=True)
class AckPolicy:
    """Whom to wait for after a publish, for how long, and how far behind they may be.

    Args:
        engines: engine ids that must all acknowledge.
        quorum: or: how many engines (any) must acknowledge.
        timeout: seconds per wait before :class:`~asyncsync.errors.AckTimeout` (None: forever).
        max_staleness: versions the trainer may run ahead of the engines it waits for (>= 0).
    """

    engines: tuple[str, ...] = ()
    quorum: int | None = None
    timeout: float | None = 600.0
    max_staleness: int = 0

    def __post_init__(self) -> None:
        # (checked as SyncConfig's fields are: engines given as one string 'e0' were waited for
        # as the engines 'e' and '0'; a quorum or staleness of 2.5 or '2' failed later, or as a
        # TypeError)
        from asyncsync.training.settings import FIELD_SPECS, parse_value

        for name, field_name in (
            ("engines", "ack_engines"),
            ("quorum", "ack_quorum"),
            ("max_staleness", "max_staleness"),
        ):
            try:
                value = parse_value(FIELD_SPECS[field_name], getattr(self, name))
            except (ValueError, TypeError) as exc:
                raise ConfigError(f"ack policy: {name} {exc}") from None
            object.__setattr__(self, name, value)
        if self.engines and self.quorum is not None:
            raise ConfigError(
                "ack policy: give engines (wait for each named engine) or quorum (wait for any N "
                "engines), not both"
            )
        check_seconds("ack policy: timeout", self.timeout, above=True, optional=True, forever=True)

    @property
    def waits(self) -> bool:
        """Whether this policy waits for anyone (engines or a quorum are given)."""
        return bool(self.engines) or self.quorum is not None

    def describe(self) -> str:
        if self.engines:
            who = f"engines {list(self.engines)}"
        elif self.quorum is not None:
            who = f"any {self.quorum} engine(s)"
        else:
            return "no ack wait"
        return f"{who}, at most {self.max_staleness} version(s) behind, timeout {self.timeout}s"


@dataclass(frozen=True)
class AckWait:
    """The outcome of one :meth:`StalenessGate.wait`.

    ``target`` is the version waited for (None when nothing was waited for), ``acks`` the
    acknowledgements that satisfied the wait, ``seconds`` the time spent waiting.
    """

    published: int
    target: int | None
    seconds: float
    acks: Mapping[str, AckRecord] = field(default_factory=dict)

    @property
    def slowest(self) -> int | None:
        """The lowest version among the acknowledging engines (None when none were read)."""
        return min((a.version for a in self.acks.values()), default=None)

    @property
    def staleness(self) -> int | None:
        """How many versions the slowest acknowledging engine is behind ``published``."""
        slowest = self.slowest
        return None if slowest is None else max(0, self.published - slowest)


class StalenessGate:
    """Waits, after each publish, until the engines are at most ``max_staleness`` behind.

    ``floor`` is the first version this trainer published (its seed): older versions are
    never waited for. ``policy`` may be replaced between waits (e.g. when engines connect).
    The gate holds no task and no thread.
    """

    def __init__(self, publisher: _Waiter, policy: AckPolicy, *, floor: int = 0) -> None:
        self.publisher = publisher
        self.policy = policy
        self.floor = floor

    def target(self, published: int) -> int | None:
        """The version to wait for after publishing ``published`` (None: no wait)."""
        if not self.policy.waits:
            return None
        target = published - self.policy.max_staleness
        return target if target >= self.floor else None

    async def wait(self, published: int) -> AckWait:
        """Wait per the gate's policy after ``published`` was committed.

        Raises :class:`~asyncsync.errors.AckTimeout` naming the engines that are behind.
        """
        policy = self.policy
        target = self.target(published)
        if target is None:
            return AckWait(published=published, target=None, seconds=0.0)
        t0 = time.perf_counter()
        acks = await self.publisher.wait_acked(
            target,
            engines=list(policy.engines) if policy.engines else None,
            quorum=policy.quorum,
            timeout=policy.timeout,
        )
        return AckWait(
            published=published, target=target, seconds=time.perf_counter() - t0, acks=acks
        )

    def __repr__(self) -> str:
        return f"<StalenessGate floor={self.floor} {self.policy.describe()}>"
