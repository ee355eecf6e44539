"""The file transport of a multi-rank publisher: :class:`FileRendezvous`.

Files in ``ROOT/.rendezvous/`` (docs/FORMAT.md section 10), for frameworks without
``torch.distributed``: exact-path reads and atomic renames only (fine on NFS). Rounds, runs of
the group and the caller's steps are as :mod:`asyncsync.publish.distributed` says; here:

* **liveness** is a heartbeat: a rank that is publishing rewrites its beat file every
  ``timeout / 4``, and a rank is given up only after ``timeout`` seconds of silence (the others
  wait ``2 * timeout`` for rank 0), however long its work takes. A rank that dies can be
  restarted alone; rank 0's restart starts a new run of the group, which the others join.
* **jobs**: every file names the job (a token every rank of one trainer shares), so two jobs
  pointed at one root never take each other's messages; a rank waits for its own job's rank 0.
* **rounds without a step** are paired by count: rank 0 names each plan round and remembers the
  recent ones; a rank's message names the last round it knows and how many of its calls since
  then ended without an answer (its own timeout, a cancel), which is the round it means. A call
  that came late fails (as rank 0's did) and the next calls meet.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import secrets
import socket
import stat
import time
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from functools import partial
from pathlib import Path
from typing import Any

from asyncsync import errors, fsio
from asyncsync.errors import ConfigError, CoordinationError, StepBehind, check_seconds
from asyncsync.format.liveness import LeftTemps
from asyncsync.fsio import atomic_write, is_temp_name, read_bytes
from asyncsync.pipeline import finish_thread
from asyncsync.publish.distributed import (
    JOB_ENV,
    Coordinator,
    Decide,
    Message,
    job_token,
    step_of,
)
from asyncsync.publish.rendezvous_rounds import RoundRules

__all__ = ["GROUP_FILE", "JOB_ENV", "RENDEZVOUS_DIR", "FileRendezvous"]

logger = logging.getLogger(__name__)

RENDEZVOUS_DIR = ".rendezvous"
#: the run of the group; "-v2": the rendezvous of issue 23 (job tokens, steps, counted calls),
#: so that a rank of an older asyncsync never joins a group of this one, nor the other way
GROUP_FILE = "group-v2.json"
MAX_RANKS = 1 << 16  # rank 0 polls a file per rank: a world larger than this is a typo
HISTORY = 64  # chained plan rounds rank 0 remembers (a rank further behind rejoins)
#: the largest rendezvous file read but a commit result (which carries the manifest): a planted
#: larger one is no message, never read whole at every poll
MESSAGE_LIMIT = 16 << 20
#: the least time rank 0 sees a temp file in ``.rendezvous/`` unchanged before it removes it
LEFT_TEMP_FLOOR = 60.0


class FileRendezvous(RoundRules, Coordinator):
    """Exchanges through files in ``ROOT/.rendezvous/`` (see the module docstring; the files
    are specified in docs/FORMAT.md section 10).

    ``group-v2.json`` names the run of the group and its job (rank 0 writes it when it opens, after
    removing the older files; a temp file another rank is writing stays). A rank's message for
    a step is ``{step}-r{rank:04d}.json``, rank 0's result ``{step}.json``, a rank's heartbeat
    ``beat-r{rank:04d}.json``; each names the group and job, and rank 0 takes a message only of
    its group, job and round, never one it took before.

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
        job: a token every rank of this trainer shares and no other job uses (``[A-Za-z0-9._:@-]``,
            up to 128); default: ``ASYNCSYNC_JOB``, else torchrun's ``TORCHELASTIC_RUN_ID``
            (unless ``none``, torchrun's default for every job), else ``SLURM_JOB_ID``, else
            none (then two jobs on one root are not told apart).
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
        job: str | None = None,
    ) -> None:
        self.check_rank(rank, world_size)
        if world_size > MAX_RANKS:  # (rank 0's first round: a bare MemoryError, or a poll per rank
            # of 10**7 files, each round, well past its timeout)
            raise ConfigError(
                f"FileRendezvous world_size must be at most {MAX_RANKS} (rank 0 polls a file per "
                f"rank), got {world_size}"
            )
        check_seconds("FileRendezvous timeout", timeout, above=True)
        errors.check_poll_interval(
            "FileRendezvous poll_interval", poll_interval, minimum=errors.MIN_SHORT_POLL_SECONDS
        )
        if poll_interval >= timeout:  # its heartbeats would come after the others gave it up
            raise ConfigError(
                f"FileRendezvous poll_interval ({poll_interval:g} s) must be below its timeout "
                f"({timeout:g} s): a rank that polls and beats less often is given up"
            )
        check_seconds("FileRendezvous max_wait", max_wait, above=True, optional=True)
        self.root = Path(root)
        self.dir = self.root / RENDEZVOUS_DIR
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.poll_interval = poll_interval
        self.max_wait = max_wait
        self.job = job_token(job)
        self.beat_interval = max(poll_interval, timeout / 4)
        self._group: str | None = None  # the run of the group this rank is in
        self._chain: str | None = None  # plans without step: the round this rank counts from
        self._skip = 0  # its calls since then that ended without learning their round
        self._history: collections.deque[str] = collections.deque(maxlen=HISTORY)  # rank 0
        self._taken: collections.deque[str] = collections.deque(maxlen=4 * HISTORY)  # nonces
        self._warned: set[str] = set()  # rank 0: nonces of late messages it told to give up
        self._temps: LeftTemps | None = None  # rank 0: the temps seen at open, not decided

    silence = "no part record and no heartbeat within the timeout (died or hung?)"

    def __repr__(self) -> str:
        return f"<FileRendezvous rank={self.rank}/{self.world_size} job={self.job!r} {self.dir}>"

    def _path(self, name: str, rank: int | None = None) -> Path:
        return self.dir / (f"{name}.json" if rank is None else f"{name}-r{rank:04d}.json")

    async def open(self) -> None:
        """Rank 0: start a new run of the group (older rendezvous files are removed)."""
        if self.rank == 0:
            try:
                gid = await asyncio.to_thread(self._start_group)
            except fsio.UnsafePath:
                raise  # the root's problem: Publisher.open reports it as a ConfigError
            except OSError as exc:
                msg = f"rank 0: cannot start the group in {self.dir}: {exc}"
                raise CoordinationError(msg) from exc
            self._group = self._chain = gid
            self._history.clear()
            self._history.append(gid)

    def _start_group(self) -> str:
        # every access below the root goes through fsio: a symlinked .rendezvous/ is refused,
        # never followed (rank 0 would empty and write another directory)
        fsio.make_dir(self.dir, root=self.root, exist_ok=True)
        for name, st in fsio.scan(self.dir, root=self.root):
            with contextlib.suppress(OSError):
                # a directory goes (the group file's included): no file could replace it; a temp
                # file may be another rank's write in flight: _temps removes a dead writer's
                if stat.S_ISDIR(st.st_mode) or not (is_temp_name(name) or name == GROUP_FILE):
                    fsio.remove_tree(self.dir / name, root=self.root)
        older = max(LEFT_TEMP_FLOOR, 2 * self.timeout)  # the cost: LeftTemps' docstring
        self._temps = LeftTemps(self.root, self.dir, is_temp_name, older)
        self._temps.sweep()
        gid = secrets.token_hex(8)
        self._write_group(gid)
        logger.info("rank 0: rendezvous group %s of job %r in %s", gid, self.job, self.dir)
        return gid

    def _write_group(self, gid: str) -> None:
        rec = {"group": gid, "job": self.job, "host": socket.gethostname(), "pid": os.getpid()}
        atomic_write(self.dir / GROUP_FILE, json.dumps(rec).encode(), root=self.root)

    def _keep_group(self) -> None:
        """Rank 0, at each plan: write its group file back if it names another run (rank 0
        holds the root's lock: no other run of the group is live). One written by hand or by
        any host that writes the root sent the other ranks to wait for that run's rank 0, in
        every round until rank 0 restarted."""
        if self._temps is not None:
            with contextlib.suppress(OSError):  # temps left by dead writers: seen long enough?
                self._temps.sweep()
        rec = _read_json(self.dir / GROUP_FILE) or {}
        if self._group is not None and rec.get("group") != self._group:
            logger.warning("rank 0: %s names another run (%.200r): writing ours back",
                           self.dir / GROUP_FILE, rec)  # fmt: skip
            with contextlib.suppress(OSError):
                self._write_group(self._group)

    async def exchange(
        self, step: str, key: str | None, message: Message, decide: Decide
    ) -> Message:
        if self.rank == 0:
            if self._group is None:
                await self.open()
            return await self._lead(step, key, message, decide)
        try:
            await asyncio.to_thread(partial(fsio.make_dir, self.dir, root=self.root, exist_ok=True))
        except OSError as exc:
            raise CoordinationError(f"rank {self.rank}: cannot reach {self.dir}: {exc}") from exc
        return await self._follow(step, key, message)

    # ------------------------------------------------------------------ the other ranks
    async def _join(self) -> None:
        """Learn the group's run (waiting for this job's rank 0 to start it) and this rank's
        plan round."""
        deadline = time.monotonic() + 2 * self.timeout
        other: Message | None = None
        async for _ in self._polls(deadline):
            rec = await asyncio.to_thread(_read_json, self.dir / GROUP_FILE) or {}
            gid = rec.get("group")
            if isinstance(gid, str) and rec.get("job", "") == self.job:
                break
            other = rec if isinstance(gid, str) else other
        else:
            if other is not None:
                raise CoordinationError(
                    f"rank {self.rank}: {self.dir / GROUP_FILE} names job {other.get('job')!r} "
                    f"(rank 0 on {other.get('host')} pid {other.get('pid')}), not this rank's job "
                    f"{self.job!r}: two jobs publish into one root? Give each its own root (and "
                    "every rank of one job the same job token)"
                )
            raise CoordinationError(
                f"rank {self.rank}: rank 0 has not started the group within "
                f"{2 * self.timeout:g}s (no {self.dir / GROUP_FILE} of job {self.job!r})"
            )
        if gid != self._group:
            self._group, self._chain = gid, None
        if self._chain is None:  # (re)joining: the round after the newest one rank 0 decided
            res = await asyncio.to_thread(_read_json, self._path("plan"))
            newest = res.get("id") if res is not None and self._ours(res) else None
            self._chain, self._skip = (newest if isinstance(newest, str) else gid), 0

    async def _follow(self, step: str, key: str | None, message: Message) -> Message:
        await self._join()
        chained, mine = step == "plan" and key is None, step_of(key) if step == "plan" else None
        nonce = secrets.token_hex(8)
        path = self._path(step, self.rank)
        seen: object = None  # a stepped plan: the newest result before our message

        async def send() -> None:
            nonlocal seen
            record: Message = {"group": self._group, "job": self.job, "key": key, "nonce": nonce,
                               "host": socket.gethostname(), "timeout": self.timeout,
                               "body": message}  # fmt: skip
            if chained:
                record.update(key=self._chain, skip=self._skip)
            elif mine is not None:
                seen = (await asyncio.to_thread(_read_json, self._path("plan")) or {}).get("id")
            data = json.dumps(record).encode()
            for tries in range(3):
                try:
                    await asyncio.to_thread(partial(atomic_write, path, data, root=self.root))
                    return
                except OSError as exc:
                    if tries == 2:
                        raise CoordinationError(
                            f"rank {self.rank}: cannot write its {step} message {path}: {exc}"
                        ) from exc
                    await asyncio.sleep(self.poll_interval)

        await send()
        heard = time.monotonic()  # rank 0's last sign of life (its heartbeat, in a commit)
        beat: object = None
        delay = self.poll_interval
        answered = False
        try:
            while True:
                res = await asyncio.to_thread(_read_json, self._path(step))
                if res is not None and self._ours(res):
                    verdict = self._verdict(step, key, nonce, mine, seen, res)
                    if verdict is not None:
                        answered = True
                        if chained:
                            self._chain, self._skip = str(res.get("id")), 0
                        if verdict == "ours":
                            return _body(res)
                        if isinstance(verdict, StepBehind):
                            raise verdict
                        raise CoordinationError(f"rank {self.rank}: {verdict}")
                rec = await asyncio.to_thread(_read_json, self.dir / GROUP_FILE) or {}
                gid = rec.get("group")
                if isinstance(gid, str) and (gid, rec.get("job", "")) != (self._group, self.job):
                    if step != "plan":  # rank 0 restarted (a new group)
                        raise CoordinationError(
                            f"rank {self.rank}: rank 0 restarted (a new group) during the "
                            f"{step} of {key}; its outcome is resolved by the next plan"
                        )
                    self._group, self._chain = None, None
                    await self._join()
                    await send()
                    heard = time.monotonic()
                if step != "plan":
                    b = await asyncio.to_thread(_read_json, self._path("beat", 0))
                    if self._ours(b) and b is not None and b.get("key") == key and b.get(
                        "seq"
                    ) != beat:  # fmt: skip
                        beat, heard = b.get("seq"), time.monotonic()
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
                if chained:
                    self._skip += 1  # this call is over: the next one is for the round after
                with contextlib.suppress(OSError):
                    await asyncio.shield(
                        asyncio.to_thread(partial(fsio.remove, path, root=self.root))
                    )

    # ------------------------------------------------------------------ rank 0
    async def _lead(self, step: str, key: str | None, message: Message, decide: Decide) -> Message:
        plan = step == "plan"
        if plan:
            await asyncio.to_thread(self._keep_group)
        chained, mine = plan and key is None, step_of(key) if plan else None
        rkey = self._chain if chained else key
        got: list[Message | None] = [message] + [None] * (self.world_size - 1)
        nonces: dict[str, str] = {}
        start = time.monotonic()
        heard = dict.fromkeys(range(1, self.world_size), start)
        seqs: dict[int, object] = {}
        delay = self.poll_interval
        result: Message | None = None
        behind: int | None = None  # the group's step, when rank 0's call is behind it
        try:
            while True:
                for r in range(1, self.world_size):
                    if got[r] is not None:
                        continue
                    m = await asyncio.to_thread(_read_json, self._path(step, r))
                    took = self._take(m, chained, rkey, mine)
                    if took == "ours" and m is not None:
                        why = self._odd_timeout(m) if plan else None  # (it learns why)
                        got[r] = m["body"] if why is None else {"error": why}
                        nonces[str(r)] = str(m.get("nonce"))
                    elif took == "late" and m is not None:
                        await self._send_late(m, mine)
                    elif took != "stale":
                        got[r] = {"error": took}
                    if not plan and got[r] is None:
                        b = await asyncio.to_thread(_read_json, self._path("beat", r))
                        if self._ours(b) and b is not None and b.get("key") == rkey and b.get(
                            "seq"
                        ) != seqs.get(r):  # fmt: skip
                            seqs[r], heard[r] = b.get("seq"), time.monotonic()
                missing = [r for r, m in enumerate(got) if m is None]
                now = time.monotonic()
                if not missing:
                    break
                if plan:
                    if now - start >= self.timeout:
                        break
                elif any(now - heard[r] > self.timeout for r in missing):
                    for r in missing:  # the silent stay None; the others were alive
                        if now - heard[r] <= self.timeout:
                            got[r] = {"error": "still working when rank 0 gave up (another "
                                      "rank went silent)"}  # fmt: skip
                    break
                elif self.max_wait is not None and now - start > self.max_wait:
                    for r in missing:
                        got[r] = {"error": f"alive but slow: still working after "
                                  f"{self.max_wait:g}s (max_wait)"}  # fmt: skip
                    break
                await asyncio.sleep(delay)
                delay = min(delay * 1.5, 20 * self.poll_interval)
            result = await decide(got)
        except StepBehind as exc:  # the ranks waiting in this round are behind the group too
            behind = exc.group_step
            raise
        finally:
            if plan and result is None:  # cancelled or failed: the round is given up, not reused
                record = self._plan_record(rkey, chained, nonces, None)
                record["aborted"] = "rank 0's call ended before it decided (cancelled or failed)"
                record["group_step"] = behind
                with contextlib.suppress(OSError):
                    data = json.dumps(record).encode()
                    write = partial(atomic_write, self._path(step), data, root=self.root)
                    await finish_thread(write)
        record = self._plan_record(rkey, chained, nonces, result) if plan else {
            "group": self._group, "job": self.job, "key": rkey, "id": None, "nonces": nonces,
            "body": result}  # fmt: skip
        try:
            data = json.dumps(record).encode()
            await asyncio.to_thread(partial(atomic_write, self._path(step), data, root=self.root))
        except OSError as exc:
            if plan:
                raise CoordinationError(f"rank 0: sending the {step} result failed: {exc}") from exc
            logger.error(
                "rank 0: sending the %s result failed (%s); the decision stands", step, exc
            )
        return result

    async def _send_late(self, m: Message, top: int | None) -> None:
        """A rank waits for an older step than rank 0's: tell it to give that step up (rank 0
        skipped it), so that its next call meets this round."""
        nonce = str(m.get("nonce"))
        if nonce in self._warned:
            return
        self._warned.add(nonce)
        record: Message = {"group": self._group, "job": self.job, "key": m.get("key"),
                           "id": secrets.token_hex(8), "nonces": {}, "group_step": top,
                  "aborted": "rank 0 is at a later step (it skipped this one)"}  # fmt: skip
        with contextlib.suppress(OSError):
            data = json.dumps(record).encode()
            await asyncio.to_thread(partial(atomic_write, self._path("plan"), data, root=self.root))

    async def abandon(self, step: str, key: str, message: Message) -> None:
        """Without waiting: rank 0 writes the round's result (failed, naming rank 0), another
        rank its message (rank 0 takes its error at once) and leaves it there."""
        record: Message = {"group": self._group, "job": self.job, "key": key}
        if self.rank == 0:
            why = f"rank 0: {message.get('error')}"
            record.update(id=None, nonces={}, body={"committed": False, "ranks": [0], "error": why})
        else:  # as _follow's send() writes it
            record.update(nonce=secrets.token_hex(8), timeout=self.timeout, body=message)
        path = self._path(step, None if self.rank == 0 else self.rank)
        data = json.dumps(record).encode()
        await finish_thread(partial(atomic_write, path, data, root=self.root))

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
            data = json.dumps({"group": self._group, "job": self.job, "key": key, "seq": seq})
            try:
                await finish_thread(
                    partial(
                        atomic_write,
                        path,
                        data.encode(),
                        root=self.root,
                        fsync=False,
                        sync_dir=False,
                    )
                )
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
    limit = 1 << 30 if path.name == "commit.json" else MESSAGE_LIMIT  # (a manifest in it)
    try:  # ROOT/.rendezvous/NAME: nothing below the root is followed or blocked on (fsio)
        data = read_bytes(path, limit=limit, root=path.parent.parent)
        obj = json.loads(data)
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None
