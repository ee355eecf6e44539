"""Receiver agents as Ray actors: one per engine, placed on the engine's node.

Example::

    fleet = start_receivers("/shared/weights", [
        ReceiverSpec("node3-gpu0", "/local/ckpt", engine="sglang", url="http://127.0.0.1:30000"),
        ReceiverSpec("node4-gpu0", "/local/ckpt", engine="sglang", url="http://127.0.0.1:30000"),
    ], placement="resource")   # engine nodes started with --resources='{"asyncsync_engine": 1}'
    fleet.wait_for(12, timeout=120)     # every engine holds version 12 or later
    fleet.versions()                    # {"node3-gpu0": 12, "node4-gpu0": 12}
    fleet.stop()

Each actor owns a :class:`~receiver.agent.ReceiverAgent` whose ``run()`` loop is a task on the
actor's event loop, as ``asyncsync-receiver`` runs it: the engine is built on the node from the
:class:`~asyncsync.training.ray.base.ReceiverSpec`. A failed sync is logged and retried on the
next poll (``status()["last_error"]``); an error that ends the loop (the checkpoint's lock is
held, the server never came up) is raised by ``wait_ready`` and shown by ``status()``.

A receiver whose actor died (its worker killed, its node lost) is reported by ``statuses()``
(``alive`` False, ``stopped_by`` the reason) and ``versions()`` (None) instead of raising;
``wait_for`` raises AckTimeout naming it; :meth:`ReceiverFleet.replace_dead` starts a new actor
under the same engine id and placement, which takes the engine id's lease over (at once on the
same host, once the dead one's lease is stale elsewhere) and goes on from the checkpoint's
version. ``stop()`` never raises for a dead receiver.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

from asyncsync.errors import AckTimeout, ConfigError, check_poll_interval, check_seconds
from asyncsync.format.lease import DEFAULT_LEASE_TTL
from asyncsync.training.ray.base import (
    DEFAULT_RESOURCE,
    Placement,
    ReceiverSpec,
    engine_nodes,
    import_ray,
    placement_options,
)
from asyncsync.training.ray.receiver_actor import STOP_GRACE, ReceiverActor

__all__ = ["ReceiverActor", "ReceiverFleet", "start_receivers"]

logger = logging.getLogger(__name__)


class ReceiverFleet:
    """The receivers :func:`start_receivers` started, by engine id (blocking calls, for drivers).

    ``actors`` maps engine ids to the Ray actor handles, for calls not wrapped here (every
    :class:`ReceiverActor` method, awaitable as ``await handle.version.remote()``); ``restarts``
    counts the replacements of each (:meth:`replace_dead`).
    """

    def __init__(
        self,
        root: str,
        actors: Mapping[str, Any],
        nodes: Mapping[str, Any],
        *,
        specs: Mapping[str, ReceiverSpec] | None = None,
        options: Mapping[str, Mapping[str, Any]] | None = None,
    ):
        self.root = root
        self.actors = dict(actors)
        self.nodes = dict(nodes)  # engine id -> {"node_id", "host", "pid"}
        self.specs = dict(specs or {})
        self.restarts = dict.fromkeys(self.actors, 0)
        self._options = {e: dict(o) for e, o in (options or {}).items()}  # to start it again
        self._starting: dict[str, Any] = {}  # engine id -> start() ref of a replacement
        self._stopped = False

    def __repr__(self) -> str:
        state = "stopped" if self._stopped else f"{len(self.actors)} receivers"
        return f"<ReceiverFleet root={self.root!r} {state}: {sorted(self.actors)}>"

    def __enter__(self) -> ReceiverFleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _each(
        self, method: str, *args: Any, timeout: float | None = 60.0, lost: Any = None
    ) -> dict[str, Any]:
        """``method`` on every receiver at once. A receiver whose actor is dead, or that has
        not answered within ``timeout``, gets ``lost(engine_id, error)`` (None: raise it)."""
        ray = import_ray()
        from ray import exceptions as rx

        gone = (rx.RayActorError, rx.GetTimeoutError, rx.ActorUnschedulableError, rx.NodeDiedError)
        refs = {e: getattr(a, method).remote(*args) for e, a in self.actors.items()}
        ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout)
        out: dict[str, Any] = {}
        for e, ref in refs.items():
            try:
                out[e] = ray.get(ref, timeout=0)
            except gone as exc:
                if lost is None:
                    raise
                out[e] = lost(e, exc)
        return out

    def versions(self) -> dict[str, int | None]:
        """The version each engine holds (None: none yet, or its receiver is dead)."""
        return self._each("version", lost=lambda e, exc: None)

    def statuses(self, *, timeout: float = 30.0) -> dict[str, dict[str, Any]]:
        """Each receiver's :meth:`ReceiverActor.status`; a dead one's says ``alive`` False and
        why in ``stopped_by``, one not up yet ``starting`` True. Each has ``restarts``."""
        check_seconds("ReceiverFleet.statuses: timeout", timeout)

        def lost(e: str, exc: BaseException) -> dict[str, Any]:
            from ray.exceptions import GetTimeoutError

            starting = isinstance(exc, GetTimeoutError)
            why = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            return {"engine_id": e, "alive": starting, "starting": starting, "running": False,
                    "opened": False, "version": None, "node": self.nodes.get(e),
                    "stopped_by": None if starting else f"{type(exc).__name__}: {why}"}  # fmt: skip

        out = self._each("status", timeout=timeout, lost=lost)
        for e, st in out.items():
            st["restarts"] = self.restarts.get(e, 0)
        return out

    def sync_now(self, *, timeout: float | None = 600.0) -> dict[str, int | None]:
        """Make every receiver apply what is committed now; the versions they hold. Raises
        Ray's ``RayActorError`` when a receiver is dead. ``timeout`` None or inf: no limit."""
        return self._each("sync_now", timeout=_limit("ReceiverFleet.sync_now: timeout", timeout))

    def verify(self, *, timeout: float | None = 600.0) -> dict[str, dict[str, Any]]:
        """Each receiver's :meth:`ReceiverActor.verify` (bit-exact check, on its node).
        ``timeout`` None or inf: no limit."""
        return self._each("verify", timeout=_limit("ReceiverFleet.verify: timeout", timeout))

    def wait_for(
        self, version: int, *, timeout: float | None = 60.0, poll_interval: float = 0.2
    ) -> dict[str, int]:
        """Wait until every engine holds ``version`` or later; return their versions.

        Raises :class:`~asyncsync.errors.AckTimeout` naming the engines behind, and at once
        when a receiver's loop has stopped or its actor died (its error in the message).
        ``timeout`` None or inf: no limit.
        """
        timeout = _limit("ReceiverFleet.wait_for: timeout", timeout)
        check_poll_interval("ReceiverFleet.wait_for: poll_interval", poll_interval)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            statuses = self.statuses()
            held: dict[str, int | None] = {e: st["version"] for e, st in statuses.items()}
            behind = {e: v for e, v in held.items() if v is None or v < version}
            if not behind:
                return {e: v for e, v in held.items() if v is not None}
            dead = {
                e: statuses[e]["stopped_by"] or "stopped"
                for e in behind
                if not statuses[e]["running"] and not statuses[e].get("starting")
            }
            if dead:
                raise AckTimeout(
                    f"receivers stopped before version {version}: {dead}",
                    version=version,
                    behind=behind,
                )
            if deadline is not None and time.monotonic() >= deadline:
                raise AckTimeout(
                    f"engines still behind version {version} after {timeout}s: {behind}",
                    version=version,
                    behind=behind,
                )
            time.sleep(poll_interval)

    def replace_dead(self, *, take_over: float | None = None) -> dict[str, str]:
        """Start a new actor for each receiver whose actor died: the same engine id, spec and
        placement (a node given by id must be alive: else it is left, and said why). It takes
        the engine id's lease over (waiting up to ``take_over`` seconds, default twice the
        lease's ttl, for a dead holder's lease to go stale) and goes on from the version its
        checkpoint holds. Returns, per engine not running, what was done ("replaced", or why
        not). Does not wait for the new actors: :meth:`statuses` shows them come up."""
        check_seconds("ReceiverFleet.replace_dead: take_over", take_over, optional=True)
        if self._stopped:
            return {}
        ray = import_ray()
        done: dict[str, str] = {}
        alive_nodes: list[str] | None = None
        for e, st in self.statuses().items():
            if st["alive"] or st.get("starting") or e not in self.specs:
                continue
            spec, options = self.specs[e], self._options.get(e, {})
            node = getattr(options.get("scheduling_strategy"), "node_id", None)
            if node is not None:
                alive_nodes = engine_nodes() if alive_nodes is None else alive_nodes
                if node not in alive_nodes:
                    done[e] = f"not replaced: its node {node} is not alive"
                    continue
            ttl = float(spec.agent_options.get("lease_ttl", DEFAULT_LEASE_TTL))
            wait = 2 * ttl + 10 if take_over is None else take_over
            with contextlib.suppress(Exception):
                ray.kill(self.actors[e], no_restart=True)  # releases its name
            try:
                actor = _create(ray, options, self.root, spec, wait)
            except Exception as exc:  # placement errors, a name still taken by a live actor
                done[e] = f"not replaced: {type(exc).__name__}: {exc}"
                continue
            self.actors[e] = actor
            self._starting[e] = actor.start.remote()
            self.restarts[e] = self.restarts.get(e, 0) + 1
            done[e] = "replaced"
            logger.warning("receiver %s died (%s): started a new one", e, st["stopped_by"])
        return done

    def stop(self, *, grace: float = STOP_GRACE) -> dict[str, int | None]:
        """Stop every receiver (versions in flight finish), end the actors; the versions held
        (None for a receiver that was dead). Never raises for a dead receiver or node."""
        check_seconds("ReceiverFleet.stop: grace", grace)
        if self._stopped:
            return {}
        ray = import_ray()
        try:
            return self._each("stop", grace, timeout=grace + 30, lost=_lost_at_stop)
        finally:
            for actor in self.actors.values():
                with contextlib.suppress(Exception):
                    ray.kill(actor, no_restart=True)
            self._stopped = True


def _limit(name: str, timeout: float | None) -> float | None:
    """``timeout`` checked as seconds; None (no limit) for None or inf, as Ray takes it."""
    check_seconds(name, timeout, optional=True, forever=True)
    return None if timeout is None or timeout == float("inf") else timeout


def _lost_at_stop(engine_id: str, exc: BaseException) -> None:
    logger.warning("receiver %s was gone at stop: %s", engine_id, str(exc).split("\n")[0])


def _create(ray: Any, options: Mapping[str, Any], root: str, spec: ReceiverSpec, take_over: float
            ) -> Any:  # fmt: skip
    """A receiver actor under ``options``; a dead actor still holding the name is ended first
    (Ray keeps a dead actor's name until it is killed)."""
    from ray.exceptions import ActorAlreadyExistsError, RayActorError

    remote = ray.remote(ReceiverActor)
    for tries in range(20):
        try:
            return remote.options(**options).remote(root, spec, take_over)
        except ActorAlreadyExistsError:
            old = ray.get_actor(options["name"], namespace=options.get("namespace"))
            try:
                ray.get(old.__ray_ready__.remote(), timeout=30)
            except RayActorError:  # dead: end it, which frees the name
                ray.kill(old, no_restart=True)
                time.sleep(0.1 * (tries + 1))
                continue
            raise ConfigError(
                f"a receiver for engine {spec.engine_id} is running (Ray actor "
                f"{options['name']!r}): stop it first (ReceiverFleet.stop), or use another id"
            ) from None
    raise ConfigError(f"Ray kept the name {options['name']!r} of a dead receiver")


def start_receivers(
    root: str | os.PathLike[str],
    specs: Sequence[ReceiverSpec],
    *,
    placement: Placement = "node",
    resource: str = DEFAULT_RESOURCE,
    num_cpus: float = 0.0,
    ready_timeout: float | None = 300.0,
    actor_options: Mapping[str, Any] | None = None,
) -> ReceiverFleet:
    """Start one receiver actor per spec on the connected Ray cluster.

    Args:
        root: the shared root as the engine nodes see it.
        specs: one :class:`ReceiverSpec` per engine (unique engine ids).
        placement: ``"node"``: on ``spec.node_id`` (hard affinity), or one distinct alive node
            each for specs without one; ``"resource"``: wherever ``spec.resources`` (default one
            unit of ``resource``) is offered, so engine nodes started with
            ``--resources='{"asyncsync_engine": 1}'`` get one receiver each.
        num_cpus: CPUs each actor reserves (default 0: it shares the node with its engine;
            decoding runs in threads either way).
        ready_timeout: wait this long for every engine to open (an SGLang server may take
            minutes to start); None: return at once; inf: wait without a limit.
        actor_options: more Ray actor options (``runtime_env``, ``namespace``, ``lifetime``...).

    Actors are named ``asyncsync-receiver-<engine_id>`` (``ray.get_actor`` finds them), so a
    second receiver for an engine is refused (ConfigError); a dead one's name is taken over.
    Raises the first receiver's error (after ending every actor started here) when one cannot
    open, TimeoutError when some are not ready within ``ready_timeout``.

    Example::

        ray.init(address="auto")
        specs = [ReceiverSpec(f"engine{i}", "/local/ckpt", node_id=n)
                 for i, n in enumerate(engine_nodes("GPU"))]
        with start_receivers("/shared/weights", specs) as fleet:
            fleet.wait_for(3, timeout=120)
    """
    check_seconds("start_receivers: ready_timeout", ready_timeout, optional=True, forever=True)
    ray = import_ray()
    ids = [s.engine_id for s in specs]
    if not specs:
        raise ConfigError("start_receivers needs at least one ReceiverSpec")
    if len(set(ids)) != len(ids):
        raise ConfigError(f"engine ids must be unique, got {ids}")
    if num_cpus < 0:
        raise ConfigError(f"num_cpus must be >= 0, got {num_cpus}")
    placed = placement_options(specs, placement, resource)
    actors: dict[str, Any] = {}
    options: dict[str, dict[str, Any]] = {}
    try:
        for spec, where_opts in zip(specs, placed, strict=True):
            options[spec.engine_id] = {
                "name": f"asyncsync-receiver-{spec.engine_id}",
                "num_cpus": num_cpus,
                "max_restarts": 0,
                **where_opts,
                **(actor_options or {}),
            }
            actors[spec.engine_id] = _create(
                ray, options[spec.engine_id], os.fspath(root), spec, 0.0
            )
        nodes = dict(zip(actors, ray.get([a.start.remote() for a in actors.values()]), strict=True))
        fleet = ReceiverFleet(
            os.fspath(root), actors, nodes, specs={s.engine_id: s for s in specs}, options=options
        )
        if ready_timeout is not None:
            refs = {a.wait_ready.remote(): e for e, a in actors.items()}
            limit = _limit("ready_timeout", ready_timeout)
            done, pending = ray.wait(list(refs), num_returns=len(refs), timeout=limit)
            ray.get(done)  # raises the first receiver's error
            if pending:
                late = sorted(refs[r] for r in pending)
                raise TimeoutError(f"receivers {late} did not open within {ready_timeout}s")
    except BaseException:
        for actor in actors.values():
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        raise
    logger.info("started %d receivers: %s", len(actors), nodes)
    return fleet
