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
held, the server never came up) is raised by ``wait_ready`` and shown by ``status()``. A
receiver whose actor died raises Ray's ``RayActorError`` from every fleet call.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from asyncsync.errors import AckTimeout, ConfigError
from asyncsync.training.ray.base import (
    DEFAULT_RESOURCE,
    Placement,
    ReceiverSpec,
    import_ray,
    placement_options,
    plain,
    where,
)

if TYPE_CHECKING:
    from receiver.agent import ReceiverAgent
    from receiver.engines.base import Engine
    from receiver.server import StatusServer

__all__ = ["ReceiverActor", "ReceiverFleet", "start_receivers"]

logger = logging.getLogger(__name__)

STOP_GRACE = 120.0  # seconds a version in flight may take to finish after stop(), as in the CLI


def build_engine(spec: ReceiverSpec) -> Engine:
    """The engine ``spec`` describes, built where it runs (reads the API key file there)."""
    from receiver.cli import API_KEY_ENV
    from receiver.engines import VLLM, LocalCheckpoint, SGLang

    if spec.engine == "checkpoint":
        return LocalCheckpoint(spec.checkpoint)
    key: str | None = os.environ.get(API_KEY_ENV, "").strip() or None
    if spec.api_key_file:
        try:
            with open(spec.api_key_file, encoding="utf-8") as f:
                key = f.read().strip()
        except OSError as exc:
            raise ConfigError(f"{spec.engine_id}: cannot read api_key_file: {exc}") from exc
    assert spec.url is not None  # checked by the spec
    cls: type[SGLang] | type[VLLM] = SGLang if spec.engine == "sglang" else VLLM
    return cls(
        spec.url,
        spec.checkpoint,
        api_key=key,
        model_path=spec.model_path,
        version_offset=spec.version_offset,
    )


class ReceiverActor:
    """The body of one receiver's Ray actor (:func:`start_receivers` wraps it in ``ray.remote``).

    ``start()`` builds the engine and agent and starts the agent's loop; ``wait_ready()``
    returns once the engine is open (or raises what stopped it); ``status()``, ``version()``,
    ``sync_now()``, ``verify()`` and ``stop()`` are what the fleet calls. Results are plain
    dicts and ints.
    """

    def __init__(self, root: str, spec: ReceiverSpec) -> None:
        self.root = os.fspath(root)
        self.spec = spec
        self._agent: ReceiverAgent | None = None
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._opened = asyncio.Event()
        self._server: StatusServer | None = None

    def __repr__(self) -> str:
        return f"<ReceiverActor {self.spec.engine_id} agent={self._agent!r}>"

    async def start(self) -> dict[str, Any]:
        """Start the agent's loop (idempotent); returns where this actor runs."""
        if self._task is None:
            from receiver.agent import ReceiverAgent

            s = self.spec
            options: dict[str, Any] = {"poll_interval": s.poll_interval, **s.agent_options}
            if s.force_polling:
                options["use_inotify"] = False
            self._agent = ReceiverAgent(self.root, build_engine(s), s.engine_id, **options)
            self._task = asyncio.create_task(self._main(self._agent), name=f"agent {s.engine_id}")
        return where()

    async def _main(self, agent: ReceiverAgent) -> None:
        try:
            await agent.open()
            self._opened.set()
            if self.spec.status_port is not None:
                from receiver.server import StatusServer

                self._server = StatusServer(
                    agent, host=self.spec.status_host, port=self.spec.status_port
                )
                await self._server.start()
            logger.info("receiver %s: running at version %s", agent.engine_id, agent.version)
            await agent.run(stop=self._stop)
        finally:
            if self._server is not None:
                await self._server.stop()
            await agent.close()

    async def wait_ready(self) -> int | None:
        """Wait until the engine is open; return its version. Raises what ended the loop."""
        task = self._require_task()
        opened = asyncio.ensure_future(self._opened.wait())
        try:
            await asyncio.wait({task, opened}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            opened.cancel()
        if not self._opened.is_set():
            task.result()  # raises the error that ended it before the engine opened
        return self.version()

    def version(self) -> int | None:
        """The version the engine holds (None: none yet)."""
        return None if self._agent is None else self._agent.version

    def status(self) -> dict[str, Any]:
        """The agent's :class:`~receiver.agent.AgentStatus` as a dict, with ``running``,
        ``stopped_by`` (the error that ended the loop, if one did), ``status_url`` and ``node``."""
        task = self._task
        out: dict[str, Any] = plain(self._agent.status()) if self._agent is not None else {}
        out["engine_id"] = self.spec.engine_id
        out["running"] = task is not None and not task.done()
        out["stopped_by"] = None
        if task is not None and task.done() and not task.cancelled() and task.exception():
            out["stopped_by"] = f"{type(task.exception()).__name__}: {task.exception()}"
        out["status_url"] = self._server.url if self._server is not None else None
        out["node"] = where()
        return out

    async def sync_now(self) -> int | None:
        """Apply every committed version now (not waiting for the next poll); return the
        version held. Raises when a version cannot be applied (the engine keeps its last)."""
        if self._agent is None:
            raise RuntimeError(f"receiver {self.spec.engine_id} is not started")
        return await self._agent.sync_once()

    async def verify(self, attempts: int = 5) -> dict[str, Any]:
        """Check the local checkpoint bit for bit against the manifest of the version it holds.

        Returns ``{"version": N, "mismatched": [tensor names]}`` (an empty list: bit-exact).
        A version applied meanwhile makes it check again, up to ``attempts`` times.
        """
        from asyncsync.format.store import read_manifest
        from receiver.engines import verify_checkpoint

        agent = self._agent
        if agent is None:
            raise RuntimeError(f"receiver {self.spec.engine_id} is not started")
        for _ in range(attempts):
            version, before = agent.version, agent.status().applying
            if version is None:
                return {"version": None, "mismatched": []}
            if before is None:
                m = await asyncio.to_thread(read_manifest, agent.root, version)
                bad = await asyncio.to_thread(verify_checkpoint, self.spec.checkpoint, m)
                if agent.version == version and agent.status().applying is None:
                    return {"version": version, "mismatched": bad}
            await asyncio.sleep(0.2)
        raise TimeoutError(f"receiver {self.spec.engine_id}: never quiet long enough to verify")

    async def stop(self, grace: float = STOP_GRACE) -> int | None:
        """Stop the loop (a version in flight finishes, or rolls back after ``grace`` s)."""
        self._stop.set()
        task = self._task
        if task is not None and not task.done():
            try:
                await asyncio.wait_for(asyncio.shield(task), grace)
            except TimeoutError:
                logger.warning("receiver %s: version in flight rolled back", self.spec.engine_id)
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if task is not None and task.done() and not task.cancelled() and task.exception():
            logger.error("receiver %s stopped by %r", self.spec.engine_id, task.exception())
        return self.version()

    def _require_task(self) -> asyncio.Task[None]:
        if self._task is None:
            raise RuntimeError(f"receiver {self.spec.engine_id} is not started: call start()")
        return self._task


class ReceiverFleet:
    """The receivers :func:`start_receivers` started, by engine id (blocking calls, for drivers).

    ``actors`` maps engine ids to the Ray actor handles, for calls not wrapped here (every
    :class:`ReceiverActor` method, awaitable as ``await handle.version.remote()``).
    """

    def __init__(self, root: str, actors: Mapping[str, Any], nodes: Mapping[str, Any]):
        self.root = root
        self.actors = dict(actors)
        self.nodes = dict(nodes)  # engine id -> {"node_id", "host", "pid"}
        self._stopped = False

    def __repr__(self) -> str:
        state = "stopped" if self._stopped else f"{len(self.actors)} receivers"
        return f"<ReceiverFleet root={self.root!r} {state}: {sorted(self.actors)}>"

    def __enter__(self) -> ReceiverFleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _each(self, method: str, *args: Any, timeout: float | None = 60.0) -> dict[str, Any]:
        ray = import_ray()
        refs = {e: getattr(a, method).remote(*args) for e, a in self.actors.items()}
        values = ray.get(list(refs.values()), timeout=timeout)
        return dict(zip(refs, values, strict=True))

    def versions(self) -> dict[str, int | None]:
        """The version each engine holds (None: none yet)."""
        return self._each("version")

    def statuses(self) -> dict[str, dict[str, Any]]:
        """Each receiver's :meth:`ReceiverActor.status`."""
        return self._each("status")

    def sync_now(self, *, timeout: float | None = 600.0) -> dict[str, int | None]:
        """Make every receiver apply what is committed now; the versions they hold."""
        return self._each("sync_now", timeout=timeout)

    def verify(self, *, timeout: float | None = 600.0) -> dict[str, dict[str, Any]]:
        """Each receiver's :meth:`ReceiverActor.verify` (bit-exact check, on its node)."""
        return self._each("verify", timeout=timeout)

    def wait_for(
        self, version: int, *, timeout: float | None = 60.0, poll_interval: float = 0.2
    ) -> dict[str, int]:
        """Wait until every engine holds ``version`` or later; return their versions.

        Raises :class:`~asyncsync.errors.AckTimeout` naming the engines behind, and at once
        when a receiver's loop has stopped (its error in the message).
        """
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
                if not statuses[e]["running"]
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

    def stop(self, *, grace: float = STOP_GRACE) -> dict[str, int | None]:
        """Stop every receiver (versions in flight finish), end the actors; the versions held."""
        if self._stopped:
            return {}
        ray = import_ray()
        try:
            return self._each("stop", grace, timeout=grace + 30)
        finally:
            for actor in self.actors.values():
                ray.kill(actor, no_restart=True)
            self._stopped = True


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
            minutes to start); None: return at once.
        actor_options: more Ray actor options (``runtime_env``, ``namespace``, ``lifetime``...).

    Actors are named ``asyncsync-receiver-<engine_id>`` (``ray.get_actor`` finds them), so a
    second receiver for an engine is refused by Ray. Raises the first receiver's error (after
    ending every actor started here) when one cannot open, TimeoutError when some are not ready
    within ``ready_timeout``.

    Example::

        ray.init(address="auto")
        specs = [ReceiverSpec(f"engine{i}", "/local/ckpt", node_id=n)
                 for i, n in enumerate(engine_nodes("GPU"))]
        with start_receivers("/shared/weights", specs) as fleet:
            fleet.wait_for(3, timeout=120)
    """
    ray = import_ray()
    ids = [s.engine_id for s in specs]
    if not specs:
        raise ConfigError("start_receivers needs at least one ReceiverSpec")
    if len(set(ids)) != len(ids):
        raise ConfigError(f"engine ids must be unique, got {ids}")
    if num_cpus < 0:
        raise ConfigError(f"num_cpus must be >= 0, got {num_cpus}")
    placed = placement_options(specs, placement, resource)
    remote = ray.remote(ReceiverActor)
    actors: dict[str, Any] = {}
    try:
        for spec, where_opts in zip(specs, placed, strict=True):
            options = {
                "name": f"asyncsync-receiver-{spec.engine_id}",
                "num_cpus": num_cpus,
                "max_restarts": 0,
                **where_opts,
                **(actor_options or {}),
            }
            actors[spec.engine_id] = remote.options(**options).remote(os.fspath(root), spec)
        nodes = dict(zip(actors, ray.get([a.start.remote() for a in actors.values()]), strict=True))
        fleet = ReceiverFleet(os.fspath(root), actors, nodes)
        if ready_timeout is not None:
            refs = {a.wait_ready.remote(): e for e, a in actors.items()}
            done, pending = ray.wait(list(refs), num_returns=len(refs), timeout=ready_timeout)
            ray.get(done)  # raises the first receiver's error
            if pending:
                late = sorted(refs[r] for r in pending)
                raise TimeoutError(f"receivers {late} did not open within {ready_timeout}s")
    except BaseException:
        for actor in actors.values():
            ray.kill(actor, no_restart=True)
        raise
    logger.info("started %d receivers: %s", len(actors), nodes)
    return fleet
