"""Coordination of the ranks of a multi-rank publisher.

Every rank of a trainer can publish its own part of the weights into one root::

    dist.init_process_group("gloo")      # or reuse the trainer's group (see below)
    async with Publisher(root, coordinator=TorchDistCoordinator()) as pub:
        await pub.seed(my_state_dict, slices={"lm_head.weight": TensorSlice(off, shape)}, step=0)
        ...
        await pub.publish(my_state_dict, slices=..., step=train_step)

Each publish is two *exchanges*; in each, every rank sends rank 0 a small JSON-able message and
rank 0 answers all ranks with one result it computes from the messages (``decide``): first the
plan (which version, delta or full, the attempt's id), then the commit (each rank reports its
part record or its error; rank 0 merges and writes the manifest, or gives up). This module
holds the transport of those exchanges; :mod:`asyncsync.publish.group` holds the protocol.

Every message belongs to one *round* and one *run of the group*, and no rank ever takes a
message of another: the run is a group id rank 0 picks when it opens; a commit's round is its
attempt id. A plan round is the caller's *step* when it passes one (``publish(step=...)``, the
training step: the same number on every rank for the same weights): rank 0 takes only
messages of its step, a rank whose step is behind the group's fails at once, and the others
meet its next call. Without ``step``, plan rounds are paired by count: each message names the
last round its rank knows and how many of its calls since then ended without an answer (a
timeout, a cancel), so the k-th call of every rank meets the k-th of the others, and a rank
that comes late fails that round rather than joining the next one. Only a caller's step can
tell a rank that skipped a call (an error before ``publish``) from one that comes late: pass
it, or take part in the round with :meth:`~asyncsync.publish.publisher.Publisher.abstain`.

Two transports:

* :class:`TorchDistCoordinator` — ``torch.distributed`` object collectives (``gather_object``,
  ``broadcast_object_list``) on a process group; any backend, gloo recommended (with NCCL, pass a
  gloo group from ``dist.new_group(backend="gloo")`` so no GPU work is involved). Its timeout is
  the process group's (``init_process_group(timeout=...)``); a rank that dies breaks the group,
  as it does for training: restart all ranks.
* :class:`~asyncsync.publish.rendezvous.FileRendezvous` — files in ``ROOT/.rendezvous/``, for
  frameworks without ``torch.distributed``; liveness by heartbeats, any rank restarted alone,
  every file naming the job so that two jobs on one root never mix (see that module).

A coordinator raises :class:`~asyncsync.errors.CoordinationError` when its rank cannot learn the
result of an exchange; rank 0 decides with ``None`` for ranks it did not hear from (it raises
only when a plan it decided could not be sent).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import os
import re
import secrets
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from asyncsync.errors import ConfigError, CoordinationError, StepBehind, check_seconds

__all__ = ["JOB_ENV", "Coordinator", "Decide", "Message", "TorchDistCoordinator", "job_token",
           "step_behind", "step_key", "step_of"]  # fmt: skip

logger = logging.getLogger(__name__)

Message = dict[str, Any]
Decide = Callable[[list[Message | None]], Awaitable[Message]]


def step_key(step: int) -> str:
    """The key of the plan round of the caller's ``step``."""
    return f"step-{step}"


def step_of(key: object) -> int | None:
    """The step a plan round's key names (None: a round paired by count, or not a plan)."""
    if isinstance(key, str) and (m := re.fullmatch(r"step-(-?\d+)", key)):
        return int(m.group(1))
    return None


#: the job token of a :class:`~asyncsync.publish.rendezvous.FileRendezvous`
JOB_ENV = "ASYNCSYNC_JOB"
#: where a job token comes from when none is given, first set wins (torchrun, Slurm)
JOB_SOURCES = (JOB_ENV, "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")
#: values of a source that name no job: torchrun's default ``--rdzv-id`` (every multi-node job
#: launched with --master-addr/--master-port gets it), which would hide SLURM_JOB_ID behind it
NO_JOB = {"TORCHELASTIC_RUN_ID": "none"}


def job_token(job: str | None) -> str:
    """``job``, or where none is given the first of :data:`JOB_SOURCES` set in the environment
    (empty: none); a :class:`~asyncsync.errors.ConfigError` for one that is no token."""
    if job is None:
        job = next((v for k in JOB_SOURCES if (v := os.environ.get(k)) and v != NO_JOB.get(k)), "")
    if not isinstance(job, str) or len(job) > 128 or not re.fullmatch(r"[A-Za-z0-9._:@-]*", job):
        raise ConfigError(f"job must be up to 128 of [A-Za-z0-9._:@-], got {job!r}")
    return job


class Coordinator(abc.ABC):
    """How the ranks of one multi-rank publisher exchange messages (see the module docstring)."""

    rank: int
    world_size: int
    #: seconds rank 0 waits for the part records of the ranks it heard nothing from when the
    #: exchange itself broke (a transport that fails at one rank's death hears from no one: a
    #: rank still writing its part is not to be blamed with the dead one); 0 where silence is
    #: judged by heartbeats and timeouts already
    broken_grace: float = 0.0

    @staticmethod
    def check_rank(rank: int, world_size: int) -> None:
        """A rank and world size a coordinator can take (a ConfigError otherwise)."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ConfigError(f"world_size must be an int >= 1, got {world_size!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ConfigError(f"rank must be an int in 0..{world_size - 1}, got {rank!r}")

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
        every rank knows in advance: the attempt of a commit, the caller's step of a plan
        (:func:`step_key`; a rank whose step is behind another's raises :class:`StepBehind` at
        once, and the others take part in the next round). A plan without a key is the round
        after the last one this rank took part in. A message of another round or another run of
        the group is never taken. Raises CoordinationError when this rank cannot learn the result.
        """

    #: how a silent rank is found, for the error that names it
    silence: str = "no part record within the timeout"

    def heartbeat(self, key: str) -> AbstractAsyncContextManager[None]:
        """While entered, tell the other ranks that this rank is alive and working on round
        ``key`` (rank 0 waits for a rank that says so). Default: nothing to do."""
        return contextlib.nullcontext()

    async def abandon(self, step: str, key: str, message: Message) -> None:
        """This rank's call ended (cancelled) before it took part in round ``key`` of ``step``
        (a commit, whose key every rank knows): tell the others as soon as the transport
        allows, so that they fail at once naming this rank (``message["error"]``), not after
        the timeout. Rank 0 answers every rank with a failure naming itself. Default: a full
        exchange (every rank's messages, then rank 0's failure)."""
        why = str(message.get("error"))

        async def failed(msgs: list[Message | None]) -> Message:
            return {"committed": False, "ranks": [0], "error": f"rank 0: {why}"}

        await self.exchange(step, key, message, failed)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} rank={self.rank}/{self.world_size}>"


def step_behind(rank: int, mine: int | None, top: int) -> StepBehind:
    """The error of a rank whose call is for step ``mine`` while another rank is at ``top``
    (the same words on every coordinator): it blames this rank and says what to do."""
    return StepBehind(
        f"rank {rank}: this call is for step {mine} while the group is at step {top} (rank "
        f"{rank} skipped a call, or came late): nothing was published by it; rank {rank} must "
        f"publish the group's step: call publish with step={top} or later (calling again with "
        f"step={mine} fails the same way)",
        ranks=(rank,),
        step=mine,
        group_step=top,
    )


# --------------------------------------------------------------------------- torch.distributed


class TorchDistCoordinator(Coordinator):
    """Exchanges through ``torch.distributed`` object collectives on ``process_group`` (default:
    the default group, which must be initialised). Collectives run in a worker thread. The
    collectives pair the ranks' calls in order; each message also carries its step, key and
    group id, and one of another round is refused (a broken pairing, never silently merged).
    Plan rounds with the caller's step realign: when the steps differ, the ranks behind fail
    their call and the others gather again, to meet the next call of the ranks behind.

    A collective broken by one rank's death hears from no rank: rank 0 then waits up to
    ``broken_grace`` seconds for the part records of the ranks still writing theirs, and names
    only the ranks whose record never came. A call cancelled during an exchange first completes
    it (rank 0 answers one it cannot decide with a failure): a collective half done would pair
    with another kind on the other ranks and break the group.

    There is no heartbeat: a collective cannot be left once every rank joined it, so a rank
    hung inside a round (a write stuck on a dead mount, a deadlock) holds every rank in the
    commit exchange until the process group's timeout (``init_process_group(timeout=...)``,
    30 minutes by default for gloo), after which rank 0 names it silent and the group is broken
    as by a dead rank. Use :class:`~asyncsync.publish.rendezvous.FileRendezvous` (heartbeats,
    ``max_wait``) where a hung rank must be found sooner. A rank whose call is cancelled before
    the commit exchange still takes part in it with its error (:meth:`abandon`): the others
    fail that round naming it, once every rank has reached the exchange."""

    silence = "nothing from it within the process group's timeout (hung or dead?)"

    def __init__(self, process_group: Any = None, *, broken_grace: float = 5.0) -> None:
        import torch.distributed as dist

        check_seconds("broken_grace", broken_grace)
        self.broken_grace = float(broken_grace)

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
        mine, rounds = step_of(key) if step == "plan" else None, 0
        while True:  # more than once only to realign ranks whose steps differ
            rounds += 1
            if self.rank != 0:
                res = await self._follow(step, key, wrapped)
                top = res.get("realign")
                if not isinstance(top, int):
                    self.group_id = res.get("group")
                    return dict(res["body"])
                if mine is None or mine < top:
                    raise step_behind(self.rank, mine, top)
                continue
            try:
                got = await _to_the_end(asyncio.to_thread(self._gather, wrapped))
            except asyncio.CancelledError:  # the others wait for an answer: give one
                await self._send(step, self._abort(step, key))
                raise
            except Exception as exc:  # gloo/NCCL errors: a rank died, a timeout, a broken group
                if step == "plan":  # nothing to decide alone: say what happened
                    raise CoordinationError(f"rank 0: {_broken(step, exc)}") from exc
                logger.error("rank 0: the %s exchange failed (%s); deciding alone", step, exc)
                return await decide([message] + [None] * (self.world_size - 1))
            assert got is not None
            bodies = [self._own_round(r, m, step, key) for r, m in enumerate(got)]
            known = [step_of(m.get("key")) for m in got if isinstance(m, dict)]
            steps = [s for s in known if s is not None]
            if mine is not None and min(steps) < max(steps):  # some ranks are behind: realign
                top = max(steps)
                await self._send(step, {"group": self.group_id, "step": step, "realign": top})
                if mine < top:
                    raise step_behind(0, mine, top)
                if rounds > 64:
                    raise CoordinationError(f"rank 0: ranks stayed behind step {top}: {steps}")
                continue
            try:
                result = await decide(bodies)
            except BaseException:  # cancelled or failed: the others wait for an answer
                await self._send(step, self._abort(step, key))
                raise
            await self._send(step, {"group": self.group_id, "step": step, "key": key,
                                    "body": result})  # fmt: skip
            return result

    async def _follow(self, step: str, key: str | None, wrapped: Message) -> Message:
        try:
            res = await _to_the_end(asyncio.to_thread(self._gather_and_receive, wrapped))
        except CoordinationError:
            raise
        except Exception as exc:  # gloo/NCCL errors: a rank died, a timeout, a broken group
            raise CoordinationError(f"rank {self.rank}: {_broken(step, exc)}") from exc
        if isinstance(res.get("realign"), int):
            return res
        if (res.get("step"), res.get("key")) != (step, key) or not isinstance(
            res.get("body"), dict
        ):
            raise CoordinationError(
                f"rank {self.rank}: rank 0 answered round {res.get('step')}/{res.get('key')} "
                f"while this rank is in {step}/{key}: the ranks' calls are out of step (pass "
                "step= to publish on every rank)"
            )
        return res

    def _gather_and_receive(self, wrapped: Message) -> Message:
        self._gather(wrapped)
        return self._broadcast(None)

    def _abort(self, step: str, key: str | None) -> Message:
        """Rank 0's answer when its call ended before its result (cancelled, or its decision
        failed): the round failed for every rank."""
        why = f"rank 0's {step} of round {key} ended without a result (its call was cancelled)"
        body = {"error": why, "ranks": [0], "committed": False}
        return {"group": self.group_id, "step": step, "key": key, "body": body}

    async def _send(self, step: str, out: Message) -> None:
        try:
            await _to_the_end(asyncio.to_thread(self._broadcast, out))
        except Exception as exc:  # the decision stands; the others learn it at the next plan
            logger.error("rank 0: sending the %s result failed: %s", step, exc)

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
            if isinstance(m, dict) and m.get("step") == step == "plan":
                return {"error": f"its call is for round {m.get('key')}, rank 0's for {key}: "
                        "pass step= to publish on every rank, or on none"}  # fmt: skip
            return None
        return dict(m["body"])


def _broken(step: str, exc: Exception) -> str:
    """What a collective that raised means (the transport's words, then what to do)."""
    return (
        f"the {step} exchange failed in torch.distributed ({exc}): a rank died or hung past the "
        "process group's timeout, and the group is likely broken for good (restart every rank, "
        "as after a rank's death)"
    )


async def _to_the_end(aw: Awaitable[Any]) -> Any:
    """Await a collective (in its thread) to its end, even when cancelled meanwhile, and then
    raise the cancellation: a collective that every other rank joined cannot be taken back,
    and a rank that left its exchange half done (a gather without its broadcast) paired its
    next collective with another kind on the others, which broke the process group for good,
    the trainer's own collectives on it included (helper-43)."""
    fut = asyncio.ensure_future(aw)
    cancelled = False
    while True:
        try:
            out = await asyncio.shield(fut)
        except asyncio.CancelledError:
            if fut.done():
                raise
            cancelled = True
            continue
        if cancelled:
            raise asyncio.CancelledError
        return out
