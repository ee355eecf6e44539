"""The agent's idle check of the engine: does the server still serve the version held?

An inference server restarted by its supervisor comes back with the weights it loads from
disk, not the version the receiver acked. Nothing noticed that until the next version arrived
or something asked ``/readyz``; :func:`watch_engine` asks the engine every ``interval`` seconds
(``Engine.serving_version``: one cheap request to the server, ``GET /model_info`` on SGLang),
and wakes the agent's sync when the engine serves nothing it holds. The sync then finds nothing
newer and calls ``Engine.reconcile``, which reloads the held version into the server.

It asks while a version is being applied too: a server restarted while the receiver patches
its checkpoint (minutes for a large model) must not keep the ack meanwhile. The engine judges
no label read across a reload in flight, and withdraws the ack itself when the server no longer
serves the version held (``Engine.on_lost``), so nothing here touches the ack.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from receiver.engines.base import Engine

__all__ = ["ENGINE_CHECK_INTERVAL", "watch_engine"]

logger = logging.getLogger(__name__)

#: seconds between two checks of the version an idle engine's server serves
ENGINE_CHECK_INTERVAL = 3.0


async def watch_engine(
    engine: Engine,
    wake: asyncio.Event,
    busy: Callable[[], bool],
    interval: float = ENGINE_CHECK_INTERVAL,
) -> None:
    """Until cancelled: every ``interval`` seconds, unless the engine holds nothing, ask it what
    it serves; set ``wake`` when it does not serve the version it holds, unless ``busy()`` (a
    sync is applying a version: it reconciles the server with that version's reload)."""
    while True:
        await asyncio.sleep(interval)
        held = engine.state.version
        if held is None:
            continue
        try:
            serving = await engine.serving_version()
        except Exception as exc:  # never ends the agent: the next check asks again
            logger.info("engine check failed: %s", exc)
            continue
        if serving is None and not busy() and engine.state.version == held:
            logger.info("the engine does not serve v%s it holds: reconciling", held)
            wake.set()
