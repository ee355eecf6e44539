"""What a receiver tells the root about its engine: the engine-id lease and the ack.

:class:`RootPresence` holds the lease of the agent's engine id (one live receiver per id,
``asyncsync.format.lease``), and keeps ``acks/<engine_id>.json`` equal to what the engine holds:

* :meth:`~RootPresence.ack` after each version the engine committed;
* :meth:`~RootPresence.reconcile` when the engine lost what it held (an ack must never name
  more than the engine holds);
* :meth:`~RootPresence.ensure` at the end of every sync: an ack deleted or changed from outside
  (an operator, a crash between the engine's commit and the ack) is written again, with the
  versions the receiver found bad.

Blocking file work runs in threads; the class itself is driven by the agent's one sync at a time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path

from asyncsync import fsio
from asyncsync.errors import LockHeld, ManifestError
from asyncsync.format import ack_path
from asyncsync.format.acks import AckRecord, read_ack, write_ack
from asyncsync.format.lease import DEFAULT_LEASE_TTL, EngineLease
from receiver.engines.base import Engine, EngineState

__all__ = ["RootPresence"]

logger = logging.getLogger(__name__)


class RootPresence:
    """The lease and the ack of one engine in one root (see the module docstring)."""

    def __init__(
        self, root: Path, engine_id: str, engine: Engine, *, lease_ttl: float = DEFAULT_LEASE_TTL
    ):
        self.root = root
        self.engine_id = engine_id
        self.engine = engine
        self.lease = EngineLease(root, engine_id, ttl=lease_ttl)
        self.acked: tuple[str, int] | None = None  # (run_id, version) of our last ack
        self.lost: str | None = None  # why the lease was lost, if it was
        self._renewed = 0.0

    # -- the lease -------------------------------------------------------------------------
    async def hold(self) -> None:
        """Take the lease (once the root exists), renew it when a third of its ttl passed.

        Raises LockHeld when another live receiver holds the engine id, or took it over.
        """
        if self.lost is not None:
            raise LockHeld(self.lost)
        if not self.lease.held:
            if not await asyncio.to_thread(self.root.is_dir):
                return  # waiting for the root: nothing can be acked there yet
            await asyncio.to_thread(self.lease.acquire)
            self._renewed = time.monotonic()
            return
        if time.monotonic() - self._renewed >= self.lease.ttl / 3:
            await self.renew()

    async def renew(self) -> None:
        if not self.lease.held:
            return
        try:
            await asyncio.to_thread(self.lease.renew)
        except LockHeld as exc:
            self.lost = str(exc)
            logger.error("agent %s: %s; stopping its syncs", self.engine_id, exc)
            raise
        self._renewed = time.monotonic()

    async def release(self) -> None:
        await asyncio.to_thread(self.lease.release)

    # -- the ack ---------------------------------------------------------------------------
    async def load(self) -> None:
        mine = await asyncio.to_thread(self._read)
        self.acked = (mine.run_id, mine.version) if mine else None

    def _read(self) -> AckRecord | None:
        try:
            return read_ack(self.root, self.engine_id)
        except (OSError, ManifestError) as exc:
            logger.warning("agent %s: unreadable ack (%s): it is rewritten", self.engine_id, exc)
            return None

    async def ack(self, version: int, fingerprint: str, run_id: str, bad: Sequence[int]) -> None:
        await asyncio.to_thread(
            write_ack, self.root, self.engine_id, version, fingerprint, run_id, tuple(bad)
        )
        self.acked = (run_id, version)

    async def ensure(self, bad: Sequence[int]) -> bool:
        """Rewrite the ack if it does not say what the engine holds; True if it was written."""
        st = self.engine.state
        if st.version is None or st.run_id is None or st.fingerprint is None:
            return False
        if not await asyncio.to_thread(self.root.is_dir):
            return False
        on_disk = await asyncio.to_thread(self._read)
        want = (st.version, st.fingerprint, st.run_id, tuple(bad))
        if (
            on_disk is not None
            and (on_disk.version, on_disk.fingerprint, on_disk.run_id, on_disk.bad_versions) == want
        ):
            self.acked = (st.run_id, st.version)
            return False
        if on_disk is None and self.acked is not None:
            logger.warning("agent %s: its ack is gone: writing it again", self.engine_id)
        await self.ack(st.version, st.fingerprint, st.run_id, bad)
        return True

    async def reconcile(self, state: EngineState, bad: Sequence[int]) -> None:
        """Make our ack name no more than the engine holds.

        An engine can lose what it held: a full apply that fails or is killed while its files
        are moved into place leaves none (LocalCheckpoint removes the mixed files), and a
        restarted in-memory engine starts empty. An ack written before would then claim a
        version the engine does not hold; it is rewritten to what the engine holds, or removed.
        """
        if self.acked is None:
            return
        run_id, version = self.acked
        if state.version is not None and state.run_id == run_id and state.version >= version:
            return
        if state.version is not None and state.run_id is not None and state.fingerprint is not None:
            logger.warning(
                "agent %s: ack names v%d, the engine holds v%d: rewriting the ack",
                self.engine_id, version, state.version,
            )  # fmt: skip
            await self.ack(state.version, state.fingerprint, state.run_id, bad)
            return
        logger.warning(
            "agent %s: ack names v%d, the engine holds nothing: removing the ack",
            self.engine_id, version,
        )  # fmt: skip
        path = ack_path(self.root, self.engine_id)
        await asyncio.to_thread(partial(fsio.remove, path, root=self.root))  # never followed
        self.acked = None
