"""Weight sync from synchronous code: a publisher on a private event loop in a background thread.

Training loops are usually synchronous, and some callers (slime's Ray actors) must not run an
event loop of their own. :class:`SyncSession` runs a :class:`~asyncsync.publish.publisher.Publisher`
on an event loop that lives in one daemon thread it owns, and gives blocking calls::

    cfg = SyncConfig(root="/shared/weights", ack_quorum=2, max_staleness=1)
    with SyncSession(cfg) as sync:
        for batch in data:
            loss_fn(model(batch)).backward()
            optimizer.step()
            step = sync.publish({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()})
        sync.wait_acked()                      # engines hold the last version before exit

The first :meth:`~SyncSession.publish` seeds (a full version); every later one publishes the
next version and then waits, per ``config.ack_policy``, until the engines are at most
``max_staleness`` versions behind (:mod:`asyncsync.training.staleness`). ``publish`` returns
once the version is committed, so the caller may then modify the tensors it passed.

Interrupting a blocking call (``KeyboardInterrupt``) cancels the work on the loop and waits for
its cleanup: a half-written version is removed, as with any failed publish. :meth:`close` (or
leaving the ``with`` block) closes the publisher, releasing the root's lock, and stops the
thread. Calls from several threads are serialised.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import torch

from asyncsync.console.progress import ProgressWatcher
from asyncsync.errors import ConfigError, PublishError, check_seconds
from asyncsync.training.config import SyncConfig
from asyncsync.training.staleness import AckPolicy, AckWait, StalenessGate

if TYPE_CHECKING:
    from asyncsync.publish.publisher import Publisher, PublisherStats, PublishResult

__all__ = ["SyncSession", "SyncStep", "collect_state_dict"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
Weights = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


def collect_state_dict(weights: Weights) -> dict[str, torch.Tensor]:
    """A state dict from a mapping or an iterable of ``(name, tensor)`` pairs (no copies).

    An iterable is consumed completely, so a generator that gathers tensors (collectives in a
    distributed trainer) runs to its end. Repeated names are refused.
    """
    if isinstance(weights, Mapping):
        return dict(weights)
    if isinstance(weights, str | bytes | torch.Tensor) or not isinstance(weights, Iterable):
        raise ConfigError(
            f"weights must be a state dict or an iterable of (name, tensor) pairs; got "
            f"{type(weights).__name__}"
        )
    out: dict[str, torch.Tensor] = {}
    for item in weights:
        if not isinstance(item, tuple) or len(item) != 2:
            raise ConfigError(
                f"weights must be a state dict or an iterable of (name, tensor) pairs; got an "
                f"item of type {type(item).__name__}"
            )
        name, tensor = item
        if name in out:
            raise ConfigError(f"weights name {name!r} twice; each tensor must be given once")
        out[name] = tensor
    return out


@dataclass(frozen=True)
class SyncStep:
    """One :meth:`SyncSession.publish`: what was committed and what was waited for."""

    result: PublishResult
    ack: AckWait
    weight_version: int
    seeded: bool


class _LoopThread:
    """An event loop running forever in one daemon thread; :meth:`run` blocks on a coroutine."""

    def __init__(self, name: str, cancel_grace: float) -> None:
        self.cancel_grace = cancel_grace
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            try:
                pending = asyncio.all_tasks(self._loop)
                for task in pending:
                    task.cancel()
                if pending:
                    self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
                self._loop.run_until_complete(self._loop.shutdown_default_executor())
            finally:
                self._loop.close()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._loop.is_closed()

    def run(self, coro: Coroutine[Any, Any, _T]) -> _T:
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("SyncSession methods block: do not call them from its own loop")
        if not self.alive:
            coro.close()
            raise PublishError("the session is closed")
        done: concurrent.futures.Future[_T] = concurrent.futures.Future()
        holder: list[asyncio.Task[_T]] = []

        def start() -> None:
            task = self._loop.create_task(coro)
            holder.append(task)
            task.add_done_callback(lambda t: _settle(t, done))

        self._loop.call_soon_threadsafe(start)
        try:
            return done.result()
        except BaseException:
            if not done.done():  # interrupted in this thread: cancel, let the task clean up
                self._loop.call_soon_threadsafe(lambda: holder and holder[0].cancel())
                concurrent.futures.wait([done], timeout=self.cancel_grace)
            raise

    def stop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            if threading.current_thread() is not self._thread:
                self._thread.join()


def _settle(task: asyncio.Task[_T], done: concurrent.futures.Future[_T]) -> None:
    if task.cancelled():
        done.set_exception(concurrent.futures.CancelledError())
    elif (exc := task.exception()) is not None:
        done.set_exception(exc)
    else:
        done.set_result(task.result())


class SyncSession:
    """A publisher for synchronous callers (see the module docstring).

    Args:
        config: the settings (or a mapping of their fields); the publisher is built by
            :func:`asyncsync.training.factory.create_publisher`.
        producer: extra fields for each manifest's ``producer`` record.
        coordinator: a :class:`~asyncsync.publish.distributed.Coordinator` when this process is
            one rank of a multi-rank publisher (each rank publishes its own tensors).
        cancel_grace: seconds an interrupted call waits for the cancelled work to clean up.
    """

    def __init__(
        self,
        config: SyncConfig | Mapping[str, Any],
        *,
        producer: Mapping[str, Any] | None = None,
        coordinator: Any = None,
        cancel_grace: float = 30.0,
    ) -> None:
        from asyncsync.training.factory import _as_config, create_publisher

        check_seconds("cancel_grace", cancel_grace)
        # (a mapping of the fields, as create_publisher takes: it was taken, then failed with
        # AttributeError: 'dict' object has no attribute 'ack_policy')
        config = _as_config(config)
        self.config = config
        self._publisher: Publisher = create_publisher(
            config, producer=producer, coordinator=coordinator
        )
        self._policy = config.ack_policy
        self._gate: StalenessGate | None = None
        self._seed_version: int | None = None
        self._last: SyncStep | None = None
        self._last_result: PublishResult | None = None
        self._lock = threading.Lock()
        self._cancel_grace = cancel_grace
        self._loop: _LoopThread | None = None
        self._closed = False

    # ------------------------------------------------------------------ lifecycle
    def open(self) -> SyncSession:
        """Start the loop thread and open the publisher (take the root's lock). Idempotent."""
        with self._lock:
            if self._closed:
                raise PublishError("the session is closed; create a new one")
            if self._loop is None:
                loop = _LoopThread(f"asyncsync-{self.config.root.name}", self._cancel_grace)
                try:
                    loop.run(self._publisher.open())
                except BaseException:
                    loop.stop()
                    raise
                self._loop = loop
        return self

    def close(self) -> None:
        """Close the publisher (release the root's lock) and stop the thread. Idempotent."""
        with self._lock:
            loop, self._loop = self._loop, None
            self._closed = True
            if loop is None:
                return
            try:
                loop.run(self._publisher.close())
            finally:
                loop.stop()

    def __enter__(self) -> SyncSession:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ public API
    @property
    def publisher(self) -> Publisher:
        return self._publisher

    @property
    def ack_policy(self) -> AckPolicy:
        """Whom the session waits for after each publish (settable, e.g. when engines join)."""
        return self._policy

    @ack_policy.setter
    def ack_policy(self, policy: AckPolicy) -> None:
        # (anything else was taken, then failed the next publish after its commit)
        if not isinstance(policy, AckPolicy):
            raise ConfigError(
                f"ack_policy must be an AckPolicy (asyncsync.training.staleness), got "
                f"{type(policy).__name__}"
            )
        self._policy = policy
        if self._gate is not None:
            self._gate.policy = policy

    @property
    def version(self) -> int | None:
        """The last version committed in the root (None before the first)."""
        return self._publisher.version

    @property
    def seed_version(self) -> int | None:
        """The version of this session's first publish (0 on a new root)."""
        return self._seed_version

    @property
    def last_step(self) -> SyncStep | None:
        """The last completed :meth:`publish` (publish and ack wait)."""
        return self._last

    @property
    def last_result(self) -> PublishResult | None:
        """The last committed version's result, also when its ack wait then failed."""
        return self._last_result

    def weight_version(self, version: int) -> int:
        """The trainer's weight version of root ``version``: start_version + versions since seed."""
        if self._seed_version is None:
            raise PublishError("nothing published by this session yet")
        return self.config.start_version + (version - self._seed_version)

    def publish(
        self,
        weights: Weights,
        *,
        keyframe: bool = False,
        committed: Callable[[PublishResult], object] | None = None,
        step: int | None = None,
    ) -> SyncStep:
        """Seed (first call) or publish the next version, then wait per the ack policy.

        ``weights`` is a state dict or an iterable of ``(name, tensor)``; tensors may live on
        any device and must not change until this returns. ``committed(result)``, when given,
        runs (in a worker thread) once the version is committed and before the ack wait, e.g.
        to flush a filesystem so that the engines can see the version; what it raises is
        raised here. Raises :class:`~asyncsync.errors.AckTimeout` when engines fall too far
        behind. Either way the version is committed regardless (see :attr:`version`). ``step``:
        the training step, which the ranks of a multi-rank publisher meet by
        (:meth:`Publisher.publish <asyncsync.publish.publisher.Publisher.publish>`).
        """
        state_dict = collect_state_dict(weights)
        with self._lock:
            loop = self._require_loop()
            return loop.run(self._publish(state_dict, keyframe, committed, step))

    def abstain(self, reason: Exception, *, step: int | None = None) -> NoReturn:
        """This rank cannot publish this step: fail the round on every rank of the group, then
        raise ``reason`` (:meth:`Publisher.abstain
        <asyncsync.publish.publisher.Publisher.abstain>`)."""
        with self._lock:
            loop = self._require_loop()
            loop.run(self._publisher.abstain(reason, step=step))
        raise reason  # abstain always raises

    def wait_acked(self, version: int | None = None, *, timeout: float | None = None) -> AckWait:
        """Wait until the watched engines hold ``version`` (default: the last one published).

        Uses the ack policy's engines or quorum with no staleness allowance; ``timeout``
        defaults to the policy's. Returns at once when the policy waits for nobody.
        """
        if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
            raise ConfigError(f"wait_acked: version must be an int, got {version!r}")
        with self._lock:
            loop = self._require_loop()
            target = self.version if version is None else version
            if target is None:
                raise PublishError("nothing published yet: nothing to wait for")
            if self.version is None or target > self.version:  # (waited for ever: none acks it)
                raise ConfigError(
                    f"wait_acked: version {target} is not published yet (the last is "
                    f"{self.version}): no engine can acknowledge it"
                )
            policy = AckPolicy(
                engines=self._policy.engines,
                quorum=self._policy.quorum,
                timeout=self._policy.timeout if timeout is None else timeout,
                max_staleness=0,
            )
            gate = StalenessGate(self._publisher, policy, floor=self._seed_version or 0)
            return loop.run(gate.wait(target))

    def statistics(self) -> PublisherStats:
        return self._publisher.statistics()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("open" if self._loop is not None else "new")
        return (
            f"<SyncSession {state} root={str(self.config.root)!r} mode={self.config.mode} "
            f"version={self.version} {self._policy.describe()}>"
        )

    # ------------------------------------------------------------------ internals
    def _require_loop(self) -> _LoopThread:
        if self._loop is None:
            if self._closed:
                raise PublishError("the session is closed; create a new one")
            raise PublishError("the session is not open: use `with SyncSession(...)` or open()")
        return self._loop

    async def _publish(
        self,
        state_dict: dict[str, torch.Tensor],
        keyframe: bool,
        committed: Callable[[PublishResult], object] | None = None,
        step: int | None = None,
    ) -> SyncStep:
        seeded = self._seed_version is None
        async with ProgressWatcher(lambda: self._publisher.progress, unit="bucket"):
            if seeded:
                result = await self._publisher.seed(state_dict, step=step)
                self._seed_version = result.version
                self._gate = StalenessGate(self._publisher, self._policy, floor=result.version)
            else:
                result = await self._publisher.publish(state_dict, keyframe=keyframe, step=step)
        self._last_result = result
        if committed is not None:
            await asyncio.to_thread(committed, result)
        assert self._gate is not None
        ack = await self._gate.wait(result.version)
        done = SyncStep(result, ack, self.weight_version(result.version), seeded)
        self._last = done
        return done
