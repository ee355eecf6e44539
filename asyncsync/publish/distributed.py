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

Every message belongs to one *round* and one *run of the group*, and no rank ever takes a
message of another: the run is a group id rank 0 picks when it opens; a commit's round is its
attempt id (the ``key``); plan rounds are chained, each naming the round before it, so the k-th
publish of every rank meets the k-th of the others, and a rank that comes late to a round fails
that round rather than joining the next one.

Two transports:

* :class:`TorchDistCoordinator` — ``torch.distributed`` object collectives (``gather_object``,
  ``broadcast_object_list``) on a process group; any backend, gloo recommended (with NCCL, pass a
  gloo group from ``dist.new_group(backend="gloo")`` so no GPU work is involved). Its timeout is
  the process group's (``init_process_group(timeout=...)``); a rank that dies breaks the group,
  as it does for training: restart all ranks.
* :class:`FileRendezvous` — files in ``ROOT/.rendezvous/``, for frameworks without
  ``torch.distributed``. Exact-path reads and atomic renames only (fine on NFS). Liveness is a
  heartbeat: a rank that is publishing rewrites its beat file every ``timeout / 4``, and a rank
  is given up only after ``timeout`` seconds of silence (the others wait ``2 * timeout`` for
  rank 0), however long its work takes. A rank that dies can be restarted alone.

A coordinator raises :class:`~asyncsync.errors.CoordinationError` when its rank cannot learn the
result of an exchange; rank 0 decides with ``None`` for ranks it did not hear from (it raises
only when a plan it decided could not be sent).
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
from contextlib import AbstractAsyncContextManager
from functools import partial
from pathlib import Path
from typing import Any

from asyncsync import fsio
from asyncsync.errors import ConfigError, CoordinationError
from asyncsync.fsio import atomic_write, read_bytes
from asyncsync.pipeline import finish_thread

__all__ = [
    "RENDEZVOUS_DIR",
    "Coordinator",
    "Decide",
    "FileRendezvous",
    "TorchDistCoordinator",
]

logger = logging.getLogger(__name__)

RENDEZVOUS_DIR = ".rendezvous"
GROUP_FILE = "group.json"
Message = dict[str, Any]
Decide = Callable[[list[Message | None]], Awaitable[Message]]


class Coordinator(abc.ABC):
    """How the ranks of one multi-rank publisher exchange messages (see the module docstring)."""

    rank: int
    world_size: int

    async def open(self) -> None:  # noqa: B027 (optional hook)
        """Called when the publisher opens: rank 0 starts a new run of the group."""

    @abc.abstractmethod
    async def exchange(
        self, step: str, key: str | None, message: Message, decide: Decide
    ) -> Message:
        """One gather-decide-broadcast round.

        Rank 0 collects every rank's ``message`` (``None`` for a rank not heard from in time),
        awaits ``decide(messages)`` and sends its result to every rank; every rank returns that
        result. ``step`` names the exchange ("plan", "commit"); ``key``, when not None, is an id
        every rank knows in advance (the attempt), else the round is the one after the last
        plan round this rank took part in. A message of another round or another run of the
        group is never taken. Raises CoordinationError when this rank cannot learn the result.
        """

    def heartbeat(self, key: str) -> AbstractAsyncContextManager[None]:
        """While entered, tell the other ranks that this rank is alive and working on round
        ``key`` (rank 0 waits for a rank that says so). Default: nothing to do."""
        return contextlib.nullcontext()

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
    the default group, which must be initialised). Collectives run in a worker thread. The
    collectives pair the ranks' calls in order; each message also carries its step, key and
    group id, and one of another round is refused (a broken pairing, never silently merged)."""

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
        self.group_id: str | None = None  # rank 0's, learned by the others from its results

    async def open(self) -> None:
        if self.rank == 0:
            self.group_id = secrets.token_hex(8)

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
        if self.rank == 0 and self.group_id is None:
            await self.open()
        wrapped = {"group": self.group_id, "step": step, "key": key, "body": message}
        try:
            got = await asyncio.to_thread(self._gather, wrapped)
        except Exception as exc:  # gloo/NCCL errors: a rank died, a timeout, a broken group
            if self.rank != 0:
                raise CoordinationError(
                    f"rank {self.rank}: the {step} exchange with rank 0 failed: {exc}"
                ) from exc
            logger.error("rank 0: the %s exchange failed (%s); deciding alone", step, exc)
            return await decide([message] + [None] * (self.world_size - 1))
        if self.rank != 0:
            try:
                res = await asyncio.to_thread(self._broadcast, None)
            except CoordinationError:
                raise
            except Exception as exc:
                raise CoordinationError(
                    f"rank {self.rank}: no {step} result from rank 0: {exc}"
                ) from exc
            if (res.get("step"), res.get("key")) != (step, key) or not isinstance(
                res.get("body"), dict
            ):
                raise CoordinationError(
                    f"rank {self.rank}: rank 0 answered round {res.get('step')}/{res.get('key')} "
                    f"while this rank is in {step}/{key}: the ranks' calls are out of step"
                )
            self.group_id = res.get("group")
            return dict(res["body"])
        assert got is not None
        result = await decide([self._own_round(r, m, step, key) for r, m in enumerate(got)])
        out = {"group": self.group_id, "step": step, "key": key, "body": result}
        try:
            await asyncio.to_thread(self._broadcast, out)
        except Exception as exc:  # the decision stands; the others learn it at the next plan
            logger.error("rank 0: sending the %s result failed: %s", step, exc)
        return result

    def _own_round(self, rank: int, m: Any, step: str, key: str | None) -> Message | None:
        """The body of rank ``rank``'s message if it belongs to this round and run, else None."""
        ok = (
            isinstance(m, dict)
            and (m.get("step"), m.get("key")) == (step, key)
            and m.get("group") in (None, self.group_id)
            and isinstance(m.get("body"), dict)
        )
        if not ok:
            logger.error("rank 0: rank %d sent a message of another round: %.200r", rank, m)
            return None
        return dict(m["body"])


# --------------------------------------------------------------------------- files


class FileRendezvous(Coordinator):
    """Exchanges through files in ``ROOT/.rendezvous/`` (see the module docstring).

    ``group.json`` names the run of the group (rank 0 writes it when it opens, after removing
    every older file). A rank's message for a step is ``{step}-r{rank:04d}.json`` (``{"group",
    "key", "nonce", "body"}``), rank 0's result ``{step}.json`` (``{"group", "key", "id",
    "nonces", "body"}``), a rank's heartbeat ``beat-r{rank:04d}.json`` (``{"group", "key",
    "seq"}``). Rank 0 takes a message only of its group and round: the attempt for a commit, the
    id of the previous plan round (``id`` of the last plan result; the group id at first) for a
    plan. A rank takes the result of its round when it lists its message's nonce (a plan) or has
    its key (a commit, final for every rank of the round).

    Args:
        root: the publisher's root (shared by all ranks).
        rank, world_size: this process's rank and the number of ranks.
        timeout: seconds of silence after which a rank is given up: rank 0 waits this long for
            the others to join a plan, and for a rank that sends neither its part nor a
            heartbeat during a commit; the other ranks wait ``2 * timeout`` for rank 0.
        poll_interval: first delay between polls (grows to 20x while nothing arrives).
        max_wait: if set, rank 0 gives up on a rank that is alive but still working this many
            seconds into a commit (the error says "slow"); None (default) waits as long as
            it beats.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        rank: int,
        world_size: int,
        *,
        timeout: float = 300.0,
        poll_interval: float = 0.005,
        max_wait: float | None = None,
    ) -> None:
        _check_rank(rank, world_size)
        if not timeout > 0 or not poll_interval > 0 or not (max_wait is None or max_wait > 0):
            raise ConfigError(
                f"timeout, poll_interval and max_wait must be > 0, got {timeout}, "
                f"{poll_interval}, {max_wait}"
            )
        self.root = Path(root)
        self.dir = self.root / RENDEZVOUS_DIR
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.poll_interval = poll_interval
        self.max_wait = max_wait
        self.beat_interval = max(poll_interval, timeout / 4)
        self._group: str | None = None  # the run of the group this rank is in
        self._chain: str | None = None  # the key of this rank's next plan round

    def _path(self, name: str, rank: int | None = None) -> Path:
        return self.dir / (f"{name}.json" if rank is None else f"{name}-r{rank:04d}.json")

    async def open(self) -> None:
        """Rank 0: start a new run of the group (older rendezvous files are removed)."""
        if self.rank == 0:
            self._group = self._chain = await asyncio.to_thread(self._start_group)

    def _start_group(self) -> str:
        # every access below the root goes through fsio: a symlinked .rendezvous/ is refused,
        # never followed (rank 0 would empty and write another directory)
        fsio.make_dir(self.dir, root=self.root, exist_ok=True)
        for name, _ in fsio.scan(self.dir, root=self.root):
            if name != GROUP_FILE:
                with contextlib.suppress(OSError):
                    fsio.remove(self.dir / name, root=self.root)
        gid = secrets.token_hex(8)
        rec = {"group": gid, "host": socket.gethostname(), "pid": os.getpid()}
        atomic_write(self.dir / GROUP_FILE, json.dumps(rec).encode(), root=self.root)
        logger.info("rank 0: rendezvous group %s in %s", gid, self.dir)
        return gid

    async def exchange(
        self, step: str, key: str | None, message: Message, decide: Decide
    ) -> Message:
        if self.rank == 0:
            if self._group is None:
                await self.open()
            return await self._lead(step, key, message, decide)
        await asyncio.to_thread(partial(fsio.make_dir, self.dir, root=self.root, exist_ok=True))
        return await self._follow(step, key, message)

    # ------------------------------------------------------------------ the other ranks
    async def _join(self) -> None:
        """Learn the group's run (waiting for rank 0 to start it) and this rank's plan round."""
        deadline = time.monotonic() + 2 * self.timeout
        async for _ in self._polls(deadline):
            gid = (await asyncio.to_thread(_read_json, self.dir / GROUP_FILE) or {}).get("group")
            if isinstance(gid, str):
                break
        else:
            raise CoordinationError(
                f"rank {self.rank}: rank 0 has not started the group within "
                f"{2 * self.timeout:g}s (no {self.dir / GROUP_FILE})"
            )
        if gid != self._group:
            self._group, self._chain = gid, None
        if self._chain is None:  # (re)joining: the round after the newest one rank 0 decided
            res = await asyncio.to_thread(_read_json, self._path("plan"))
            newest = res.get("id") if res is not None and res.get("group") == gid else None
            self._chain = newest if isinstance(newest, str) else gid

    async def _follow(self, step: str, key: str | None, message: Message) -> Message:
        await self._join()
        chained = key is None
        nonce = secrets.token_hex(8)
        path = self._path(step, self.rank)

        async def send() -> None:
            record = {"group": self._group, "key": key if key is not None else self._chain,
                      "nonce": nonce, "host": socket.gethostname(), "body": message}  # fmt: skip
            data = json.dumps(record).encode()
            await asyncio.to_thread(partial(atomic_write, path, data, root=self.root))

        await send()
        heard = time.monotonic()  # rank 0's last sign of life (its heartbeat, in a commit)
        seq: object = None
        delay = self.poll_interval
        answered = False
        try:
            while True:
                res = await asyncio.to_thread(_read_json, self._path(step))
                if res is not None and res.get("group") == self._group:
                    if chained and res.get("key") == self._chain:  # our round is decided
                        self._chain = str(res.get("id"))
                        answered = True
                        if res.get("nonces", {}).get(str(self.rank)) == nonce:
                            return _body(res)
                        raise CoordinationError(
                            f"rank {self.rank}: rank 0 decided the {step} round without this "
                            "rank (it joined too late); the next publish joins the next round"
                        )
                    if chained and res.get("id") != self._chain:  # rank 0 went on without us
                        self._chain = str(res.get("id"))
                        raise CoordinationError(
                            f"rank {self.rank}: rank 0 is past the {step} round this rank "
                            "came for (it missed rounds); the next publish joins the next round"
                        )
                    if not chained and res.get("key") == key:  # the decision on our round
                        answered = True
                        return _body(res)
                gid = (await asyncio.to_thread(_read_json, self.dir / GROUP_FILE) or {}).get(
                    "group"
                )
                if isinstance(gid, str) and gid != self._group:  # rank 0 restarted
                    if not chained:
                        raise CoordinationError(
                            f"rank {self.rank}: rank 0 restarted (a new group) during the "
                            f"{step} of {key}; its outcome is resolved by the next plan"
                        )
                    self._group, self._chain = gid, None
                    await self._join()
                    await send()
                    heard = time.monotonic()
                if not chained:
                    beat = await asyncio.to_thread(_read_json, self._path("beat", 0))
                    if beat is not None and (beat.get("group"), beat.get("key")) == (
                        self._group, key
                    ) and beat.get("seq") != seq:  # fmt: skip
                        seq, heard = beat.get("seq"), time.monotonic()
                left = heard + 2 * self.timeout - time.monotonic()
                if left <= 0:
                    raise CoordinationError(
                        f"rank {self.rank}: rank 0 went silent: no {step} result and no "
                        f"heartbeat for {2 * self.timeout:g}s (in {self.dir})"
                    )
                await asyncio.sleep(min(delay, left))
                delay = min(delay * 1.5, 20 * self.poll_interval)
        finally:
            if not answered:  # withdraw it, so that no later round of rank 0 takes it
                with contextlib.suppress(OSError):
                    await asyncio.shield(
                        asyncio.to_thread(partial(fsio.remove, path, root=self.root))
                    )

    # ------------------------------------------------------------------ rank 0
    async def _lead(self, step: str, key: str | None, message: Message, decide: Decide) -> Message:
        chained = key is None
        rkey = key if key is not None else self._chain
        got: list[Message | None] = [message] + [None] * (self.world_size - 1)
        nonces: dict[str, str] = {}
        start = time.monotonic()
        heard = dict.fromkeys(range(1, self.world_size), start)
        seqs: dict[int, object] = {}
        delay = self.poll_interval
        while True:
            for r in range(1, self.world_size):
                if got[r] is not None:
                    continue
                m = await asyncio.to_thread(_read_json, self._path(step, r))
                ours = m is not None and (m.get("group"), m.get("key")) == (self._group, rkey)
                if ours and m is not None and isinstance(m.get("body"), dict):
                    got[r], nonces[str(r)] = m["body"], str(m.get("nonce"))
                    continue
                if not chained:
                    beat = await asyncio.to_thread(_read_json, self._path("beat", r))
                    if beat is not None and (beat.get("group"), beat.get("key")) == (
                        self._group, rkey
                    ) and beat.get("seq") != seqs.get(r):  # fmt: skip
                        seqs[r], heard[r] = beat.get("seq"), time.monotonic()
            missing = [r for r, m in enumerate(got) if m is None]
            now = time.monotonic()
            if not missing:
                break
            if chained:
                if now - start >= self.timeout:
                    break
            elif any(now - heard[r] > self.timeout for r in missing):
                for r in missing:  # the silent stay None; the others were alive
                    if now - heard[r] <= self.timeout:
                        got[r] = {"error": "still working when rank 0 gave up (another rank "
                                  "went silent)"}  # fmt: skip
                break
            elif self.max_wait is not None and now - start > self.max_wait:
                for r in missing:
                    got[r] = {"error": f"alive but slow: still working after {self.max_wait:g}s "
                              "(max_wait)"}  # fmt: skip
                break
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, 20 * self.poll_interval)
        result = await decide(got)
        rid = secrets.token_hex(8) if chained else None
        record = {"group": self._group, "key": rkey, "id": rid, "nonces": nonces, "body": result}
        if chained:  # whether or not the others learn it, the next plan round follows this one
            self._chain = rid
        try:
            data = json.dumps(record).encode()
            await asyncio.to_thread(partial(atomic_write, self._path(step), data, root=self.root))
        except OSError as exc:
            if chained:
                raise CoordinationError(f"rank 0: sending the {step} result failed: {exc}") from exc
            logger.error(
                "rank 0: sending the %s result failed (%s); the decision stands", step, exc
            )
        return result

    # ------------------------------------------------------------------ liveness
    def heartbeat(self, key: str) -> AbstractAsyncContextManager[None]:
        return self._beating(key)

    @contextlib.asynccontextmanager
    async def _beating(self, key: str) -> AsyncIterator[None]:
        task = asyncio.create_task(self._beat(key), name=f"heartbeat r{self.rank}")
        try:
            yield
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _beat(self, key: str) -> None:
        path = self._path("beat", self.rank)
        seq = 0
        while True:
            seq += 1
            data = json.dumps({"group": self._group, "key": key, "seq": seq}).encode()
            try:
                write = partial(
                    atomic_write, path, data, root=self.root, fsync=False, sync_dir=False
                )
                await finish_thread(write)
            except OSError as exc:
                logger.warning("rank %d: writing the heartbeat failed: %s", self.rank, exc)
            await asyncio.sleep(self.beat_interval)

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


def _body(res: Message) -> Message:
    body = res.get("body")
    if not isinstance(body, dict):
        raise CoordinationError(f"rank 0's result has no body: {res!r:.200}")
    return body


def _read_json(path: Path) -> dict[str, Any] | None:
    """A rendezvous file's JSON object, or None while it does not exist (or is not one)."""
    try:  # ROOT/.rendezvous/NAME: nothing below the root is followed or blocked on (fsio)
        data = read_bytes(path, limit=1 << 30, root=path.parent.parent)
        obj = json.loads(data)
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None
