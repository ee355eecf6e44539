"""One receiver's Ray actor, :class:`ReceiverActor`, beside its engine (the fleet that starts
and drives them: :mod:`asyncsync.training.ray.receivers`).

Each actor owns a :class:`~receiver.agent.ReceiverAgent` whose ``run()`` loop is a task on the
actor's event loop, as ``asyncsync-receiver`` runs it: the engine is built on the node from the
:class:`~asyncsync.training.ray.base.ReceiverSpec` (:func:`build_engine`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import time
from typing import TYPE_CHECKING, Any

from asyncsync.errors import LockHeld, check_seconds
from asyncsync.format.lease import DEFAULT_LEASE_TTL
from asyncsync.memory import freeze_startup_objects
from asyncsync.training.ray.base import ReceiverSpec, plain, where

if TYPE_CHECKING:
    from receiver.agent import ReceiverAgent
    from receiver.engines.base import Engine
    from receiver.server import StatusServer

__all__ = ["STOP_GRACE", "ReceiverActor", "build_engine", "node_url"]

logger = logging.getLogger(__name__)

STOP_GRACE = 120.0  # seconds a version in flight may take to finish after stop(), as in the CLI


def build_engine(spec: ReceiverSpec) -> Engine:
    """The engine ``spec`` describes, built where it runs (reads the API key file there)."""
    from receiver.cli import ADMIN_API_KEY_ENV, API_KEY_ENV, read_secret
    from receiver.engines import VLLM, LocalCheckpoint, SGLang

    if spec.engine == "checkpoint":
        return LocalCheckpoint(spec.checkpoint)
    # a regular file of at most 64 KiB (a FIFO there would block this actor for ever)
    key = read_secret(spec.api_key_file, API_KEY_ENV, f"{spec.engine_id}: api_key_file")
    assert spec.url is not None  # checked by the spec
    common: dict[str, Any] = {
        "api_key": key,
        "model_path": spec.model_path,
        "version_offset": spec.version_offset,
    }
    if spec.engine == "vllm":  # the node's ASYNCSYNC_ADMIN_API_KEY is for its SGLang engines
        return VLLM(spec.url, spec.checkpoint, **common)
    admin = read_secret(
        spec.admin_api_key_file, ADMIN_API_KEY_ENV, f"{spec.engine_id}: admin_api_key_file"
    )
    return SGLang(spec.url, spec.checkpoint, admin_api_key=admin, **common)


class ReceiverActor:
    """The body of one receiver's Ray actor (:func:`start_receivers` wraps it in ``ray.remote``).

    ``start()`` builds the engine and agent and starts the agent's loop; ``wait_ready()``
    returns once the engine is open (or raises what stopped it); ``status()``, ``version()``,
    ``sync_now()``, ``verify()`` and ``stop()`` are what the fleet calls. Results are plain
    dicts and ints. ``take_over``: seconds to keep trying when the engine id's lease or the
    checkpoint's lock is held (a replacement waits for the dead receiver's lease to go stale;
    0: refuse at once).
    """

    def __init__(self, root: str, spec: ReceiverSpec, take_over: float = 0.0) -> None:
        check_seconds("ReceiverActor: take_over", take_over)
        self.root = os.fspath(root)
        self.spec = spec
        self.take_over = take_over
        self._agent: ReceiverAgent | None = None
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._opened = asyncio.Event()
        self._server: StatusServer | None = None
        self._url: str | None = None  # where the status server answers (from other nodes too)
        self._waiting: str | None = None  # why the open is waiting (a held lease)

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
        from receiver.audit import receiver_auditor

        auditing = None
        try:
            if self.spec.status_port is not None:  # serving from before the engine is open:
                # while a take-over waits or the engine starts, /readyz answers 503 saying why
                from receiver.server import StatusServer

                server = StatusServer(agent, host=self.spec.status_host, port=self.spec.status_port)
                server.starting = "opening the engine"
                self._server = server
                await server.start()
                self._url = node_url(server)
            await self._open(agent)
            freeze_startup_objects()  # this actor's process runs this one agent
            self._opened.set()
            auditor = receiver_auditor(agent)  # the engine's default (SGLang: its plugin's)
            if self._server is not None:
                self._server.attach(agent, auditor)
            if auditor is not None:
                auditing = asyncio.create_task(auditor.run(stop=self._stop), name="audit")
            logger.info("receiver %s: running at version %s", agent.engine_id, agent.version)
            await agent.run(stop=self._stop)
        finally:
            if auditing is not None:
                auditing.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await auditing
            if self._server is not None:
                self._url = None
                await self._server.stop()
            await agent.close()

    async def _open(self, agent: ReceiverAgent) -> None:
        """Open the agent; with ``take_over``, wait while the lease or lock is held."""
        deadline = time.monotonic() + self.take_over
        while True:
            try:
                await agent.open()
                self._waiting = None
                return
            except LockHeld as exc:
                if time.monotonic() >= deadline or self._stop.is_set():
                    raise
                self._waiting = f"LockHeld: {exc}"
                if self._server is not None:
                    self._server.starting = f"waiting to take over ({self._waiting})"
                logger.info("receiver %s: waiting to take over (%s)", self.spec.engine_id, exc)
                ttl = float(self.spec.agent_options.get("lease_ttl", DEFAULT_LEASE_TTL))
                await asyncio.sleep(min(ttl / 3, 5.0, max(0.0, deadline - time.monotonic())))

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
        ``stopped_by`` (the error that ended the loop, if one did), ``status_url`` (bound to every
        interface: at the node's address, for a driver elsewhere) and ``node``."""
        task = self._task
        out: dict[str, Any] = plain(self._agent.status()) if self._agent is not None else {}
        out["engine_id"] = self.spec.engine_id
        out["alive"] = True  # this actor answers (the fleet reports dead ones)
        out["opened"] = self._opened.is_set()
        out["waiting"] = self._waiting
        out["running"] = task is not None and not task.done()
        out["stopped_by"] = None
        if task is not None and task.done() and not task.cancelled() and task.exception():
            out["stopped_by"] = f"{type(task.exception()).__name__}: {task.exception()}"
        out["status_url"] = self._url
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
        check_seconds("ReceiverActor.stop: grace", grace)
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


def node_url(server: StatusServer) -> str:
    """Where a driver on another node reaches ``server``: bound to every interface (``::``,
    ``0.0.0.0``), the node's address as Ray knows it, when the server serves its family (its own
    :attr:`~receiver.server.StatusServer.url` says the loopback, for a client on the node)."""
    url = server.url
    if not server.every_interface:
        return url
    from receiver.listen import is_dual_stack

    try:
        import ray.util

        addr = ipaddress.ip_address(ray.util.get_node_ip_address())
    except (ImportError, ValueError):  # (in-process without Ray; a name)
        return url
    if addr.version == 4 and url.startswith("http://["):  # "::" bound IPv6 only
        logger.warning(
            "status server on %s serves IPv6 only (this system refused a dual-stack socket) and "
            "Ray knows this node as %s: status_url %s is reachable on this node only; give "
            "status_host 0.0.0.0 (or this node's IPv6 address)", server.host, addr, url,
        )  # fmt: skip
        return url
    if addr.version == 6 and not is_dual_stack(server.host):  # "0.0.0.0"
        return url
    host = f"[{str(addr).replace('%', '%25')}]" if addr.version == 6 else str(addr)
    return f"http://{host}:{server.port}"
