"""Coordination of the ranks of a multi-rank publisher.

Every rank of a trainer can publish its own part of the weights into one root::

    dist.init_process_group("gloo")      # or reuse the trainer's group (see below)
    async with Publisher(root, coordinator=TorchDistCoordinator()) as pub:
        await pub.seed(my_state_dict, slices={"lm_head.weight": TensorSlice(off, shape)})
        ...
        await pub.publish(my_state_dict, slices=...)

Each publish is two *exchanges*; in each, every rank sends rank 0 a small JSON-able message and
rank 0 answers all ranks with one result it computes from the messages (``decide``): first the
plan (which version, delta or full, the attempt's id), then the commit (each rank reports its
part record or its error; rank 0 merges and writes the manifest, or gives up). This module
holds the transport of those exchanges; :mod:`asyncsync.publish.group` holds the protocol.

Two transports:

* :class:`TorchDistCoordinator` — ``torch.distributed`` object collectives (``gather_object``,
  ``broadcast_object_list``) on a process group; any backend, gloo recommended (with NCCL, pass a
  gloo group from ``dist.new_group(backend="gloo")`` so no GPU work is involved). Its timeout is
  the process group's (``init_process_group(timeout=...)``); a rank that dies breaks the group,
  as it does for training: restart all ranks.
* :class:`FileRendezvous` — files in ``ROOT/.rendezvous/``, for frameworks without
  ``torch.distributed``. Exact-path reads and atomic renames only (fine on NFS); rank 0 waits
  ``timeout`` seconds for the others, the others ``2 * timeout`` for rank 0. A rank that dies can
  be restarted alone.

A coordinator raises :class:`~asyncsync.errors.CoordinationError` when its rank cannot learn the
result of an exchange; rank 0 never does: it decides with ``None`` for ranks it did not hear from.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import json
import logging
import os
import secrets
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from asyncsync.errors import ConfigError, CoordinationError
from asyncsync.fsio import atomic_write, read_bytes

__all__ = [
    "RENDEZVOUS_DIR",
    "Coordinator",
    "Decide",
    "FileRendezvous",
    "TorchDistCoordinator",
]

logger = logging.getLogger(__name__)

RENDEZVOUS_DIR = ".rendezvous"
Message = dict[str, Any]
Decide = Callable[[list[Message | None]], Awaitable[Message]]


class Coordinator(abc.ABC):
    """How the ranks of one multi-rank publisher exchange messages (see the module docstring)."""

    rank: int
    world_size: int

    @abc.abstractmethod
    async def exchange(
        self, step: str, key: str | None, message: Message, decide: Decide
    ) -> Message:
        """One gather-decide-broadcast round.

        Rank 0 collects every rank's ``message`` (``None`` for a rank not heard from in time),
        awaits ``decide(messages)`` and sends its result to every rank; every rank returns that
        result. ``step`` names the round ("plan", "commit"); ``key``, when not None, is an id
        every rank knows in advance (the attempt), so a late message of an earlier round is
        never taken for this one. Raises CoordinationError (never on rank 0) when this rank
        cannot learn the result.
        """

    def __repr__(self) -> str:
        return f"<{type(self).__name__} rank={self.rank}/{self.world_size}>"


def _check_rank(rank: int, world_size: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size must be an int >= 1, got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ConfigError(f"rank must be an int in 0..{world_size - 1}, got {rank!r}")


# --------------------------------------------------------------------------- torch.distributed


class TorchDistCoordinator(Coordinator):
    """Exchanges through ``torch.distributed`` object collectives on ``process_group`` (default:
    the default group, which must be initialised). Collectives run in a worker thread."""

    def __init__(self, process_group: Any = None) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError(
                "torch.distributed is not initialised: call dist.init_process_group(...) first, "
                "or use FileRendezvous"
            )
        self._dist = dist
        self.group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        # object collectives take global ranks; rank 0 of a subgroup is not global rank 0
        self._src = 0 if process_group is None else dist.get_global_rank(process_group, 0)

    def _gather(self, message: Message) -> list[Message | None] | None:
        out: list[Message | None] | None = [None] * self.world_size if self.rank == 0 else None
        self._dist.gather_object(message, out, dst=self._src, group=self.group)
        return out

    def _broadcast(self, result: Message | None) -> Message:
        box = [result]
        self._dist.broadcast_object_list(box, src=self._src, group=self.group)
        if not isinstance(box[0], dict):
            raise CoordinationError(f"rank 0 sent {type(box[0]).__name__}, not a result")
        return box[0]

    async def exchange(
        self, step: str, key: str | None, message: Message, decide: Decide
    ) -> Message:
        try:
            got = await asyncio.to_thread(self._gather, message)
        except Exception as exc:  # gloo/NCCL errors: a rank died, a timeout, a broken group
            if self.rank != 0:
                raise CoordinationError(
                    f"rank {self.rank}: the {step} exchange with rank 0 failed: {exc}"
                ) from exc
            logger.error("rank 0: the %s exchange failed (%s); deciding alone", step, exc)
            result = await decide([message] + [None] * (self.world_size - 1))
            return result
        if self.rank != 0:
            try:
                return await asyncio.to_thread(self._broadcast, None)
            except CoordinationError:
                raise
            except Exception as exc:
                raise CoordinationError(
                    f"rank {self.rank}: no {step} result from rank 0: {exc}"
                ) from exc
        assert got is not None
        result = await decide(got)
        try:
            await asyncio.to_thread(self._broadcast, result)
        except Exception as exc:  # the decision stands; the others learn it at the next plan
            logger.error("rank 0: sending the %s result failed: %s", step, exc)
        return result


# --------------------------------------------------------------------------- files


class FileRendezvous(Coordinator):
    """Exchanges through files in ``ROOT/.rendezvous/`` (see the module docstring).

    A rank's message for a step is ``{step}-r{rank:04d}.json`` (``{"nonce", "key", "body"}``),
    rank 0's result ``{step}.json`` (``{"key", "nonces", "body"}``): a rank takes the result
    whose ``nonces`` lists the nonce of the message it sent. Rank 0 takes each rank's newest
    message it has not taken yet (with the round's ``key`` when there is one).

    Args:
        root: the publisher's root (shared by all ranks).
        rank, world_size: this process's rank and the number of ranks.
        timeout: seconds rank 0 waits for the other ranks' messages (then decides without
            them); the other ranks wait ``2 * timeout`` for rank 0's result.
        poll_interval: first delay between polls (grows to 20x while nothing arrives).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        rank: int,
        world_size: int,
        *,
        timeout: float = 300.0,
        poll_interval: float = 0.005,
    ) -> None:
        _check_rank(rank, world_size)
        if not timeout > 0 or not poll_interval > 0:
            raise ConfigError(
                f"timeout and poll_interval must be > 0, got {timeout}, {poll_interval}"
            )
        self.root = Path(root)
        self.dir = self.root / RENDEZVOUS_DIR
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.poll_interval = poll_interval
        self._taken: dict[tuple[str, int], str] = {}  # (step, rank) -> nonce rank 0 took last

    def _message_path(self, step: str, rank: int) -> Path:
        return self.dir / f"{step}-r{rank:04d}.json"

    async def exchange(
        self, step: str, key: str | None, message: Message, decide: Decide
    ) -> Message:
        await asyncio.to_thread(self.dir.mkdir, parents=True, exist_ok=True)
        if self.rank == 0:
            return await self._lead(step, key, message, decide)
        return await self._follow(step, key, message)

    async def _follow(self, step: str, key: str | None, message: Message) -> Message:
        nonce = secrets.token_hex(8)
        path = self._message_path(step, self.rank)
        record = {"nonce": nonce, "key": key, "host": socket.gethostname(), "body": message}
        await asyncio.to_thread(atomic_write, path, json.dumps(record).encode())
        result_path = self.dir / f"{step}.json"
        deadline = time.monotonic() + 2 * self.timeout
        async for _ in self._polls(deadline):
            res = await asyncio.to_thread(_read_json, result_path)
            # ours: it answers our message, or it is the decision on our round's key (final for
            # every rank of that round, even one whose message came too late)
            if res is not None and (
                res.get("nonces", {}).get(str(self.rank)) == nonce
                or (key is not None and res.get("key") == key)
            ):
                body = res.get("body")
                if isinstance(body, dict):
                    return body
        # Withdraw the message so that a restarted rank 0 does not take it for a live one.
        with contextlib.suppress(OSError):
            mine = await asyncio.to_thread(_read_json, path)
            if mine is not None and mine.get("nonce") == nonce:
                await asyncio.to_thread(path.unlink)
        raise CoordinationError(
            f"rank {self.rank}: no {step} result from rank 0 within {2 * self.timeout:g}s "
            f"(in {self.dir})"
        )

    async def _lead(self, step: str, key: str | None, message: Message, decide: Decide) -> Message:
        got: list[Message | None] = [message] + [None] * (self.world_size - 1)
        nonces: dict[str, str] = {}
        deadline = time.monotonic() + self.timeout
        async for _ in self._polls(deadline):
            for r in range(1, self.world_size):
                if got[r] is not None:
                    continue
                m = await asyncio.to_thread(_read_json, self._message_path(step, r))
                if (
                    m is None
                    or not isinstance(m.get("body"), dict)
                    or (key is not None and m.get("key") != key)
                    or m.get("nonce") == self._taken.get((step, r))
                ):
                    continue
                got[r] = m["body"]
                nonces[str(r)] = str(m.get("nonce"))
            if all(m is not None for m in got):
                break
        result = await decide(got)
        record = {"key": key, "nonces": nonces, "body": result}
        await asyncio.to_thread(
            atomic_write, self.dir / f"{step}.json", json.dumps(record).encode()
        )
        for rs, nonce in nonces.items():
            self._taken[(step, int(rs))] = nonce
        return result

    async def _polls(self, deadline: float) -> AsyncIterator[None]:
        """Yield at once, then after growing sleeps, until ``deadline``."""
        delay = self.poll_interval
        while True:
            yield
            left = deadline - time.monotonic()
            if left <= 0:
                return
            await asyncio.sleep(min(delay, left))
            delay = min(delay * 1.5, 20 * self.poll_interval)


def _read_json(path: Path) -> dict[str, Any] | None:
    """A rendezvous file's JSON object, or None while it does not exist (or is not one)."""
    try:
        data = read_bytes(path, limit=1 << 30)
        obj = json.loads(data)
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None
