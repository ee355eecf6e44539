"""How ``asyncsync-receiver`` starts: its agent opened, retried while the inference server
fails for now, and its status port answering meanwhile (``/readyz`` 503 saying why, not a
refused connection: a probe or an operator sees the receiver is there and what it waits for).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
from collections.abc import Awaitable, Callable
from typing import TypeVar

from asyncsync.console.logsetup import printable
from asyncsync.errors import ApplyFailed
from receiver.agent import ReceiverAgent
from receiver.engines.http_engine import transient
from receiver.server import StatusServer

__all__ = ["open_agent"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
#: seconds between attempts to open the engine after a transient failure: first, most
OPEN_RETRY = (1.0, 30.0)


async def until(aw: Awaitable[_T], stop: asyncio.Event) -> tuple[bool, _T | None]:
    """Await ``aw`` unless ``stop`` is set first (``aw`` is then cancelled): (done, result)."""
    task = asyncio.ensure_future(aw)
    stop_wait = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({task, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop_wait.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        return False, None
    return True, task.result()


async def _serve_status(args: argparse.Namespace, agent: ReceiverAgent) -> StatusServer:
    """The status server, started while the engine is not open yet (``starting`` says so)."""
    server = StatusServer(
        agent,
        host=args.status_host,
        port=args.status_port,
        token=args.control_token,
        ready_max_lag=args.ready_max_lag,
        option_names=("--status-host", "--status-port"),
    )
    server.starting = "opening the engine"
    await server.start()  # the port may have been taken since the check
    every = f" (every interface, {server.host})" if server.every_interface else ""
    print(f"{args.engine_id}: status on {server.url}{every}", file=sys.stderr, flush=True)
    return server


async def open_agent(
    args: argparse.Namespace,
    stop: asyncio.Event,
    make_agent: Callable[[argparse.Namespace], ReceiverAgent],
) -> tuple[ReceiverAgent | None, StatusServer | None]:
    """An opened agent (None when stopped first) and, with ``--status-port``, its status
    server, serving from before the first attempt (``attach`` the opened agent to it).

    Opening waits for an inference server that may take minutes to start, and makes it reload
    the checkpoint when it serves another version. A transient failure of that (no answer
    within a call's deadline: an update still running in the server; a 5xx) is retried with
    backoff by a new agent, nothing acked meanwhile; a configuration error (a refused key, a
    server that never came up within --engine-startup-timeout) ends the process with its one
    line."""
    if stop.is_set():  # a stop signal held while the receiver started (receiver.cli.main)
        logger.info("receiver %s: stopped before it started", args.engine_id)
        return None, None
    delay = OPEN_RETRY[0]
    server: StatusServer | None = None
    try:
        while True:
            agent = make_agent(args)
            if args.status_port is not None and server is None:
                server = await _serve_status(args, agent)
            try:
                opened, _ = await until(agent.open(), stop)
            except ApplyFailed as exc:
                if not transient(exc):
                    raise
                why = f"could not start ({printable(str(exc))}); retrying in {delay:g}s"
                logger.warning("receiver %s: %s", args.engine_id, why)
                if server is not None:
                    server.starting = why
                await agent.close()
                slept, _ = await until(asyncio.sleep(delay), stop)
                delay = min(delay * 2, OPEN_RETRY[1])
                if slept:
                    continue
                opened = False
            if not opened:
                logger.info("receiver %s: stopped while starting", args.engine_id)
                await agent.close()
                if server is not None:
                    await server.stop()
                return None, None
            return agent, server
    except BaseException:
        if server is not None:
            await server.stop()
        raise
