"""One rank of a multi-rank publisher, run in its own process by tests/test_distributed.py.

The model is defined here so the test can rebuild it: every rank owns distinct tensors
(``rank{r}.*``, all dtypes) and a share of two sliced tensors, ``shared.weight`` (dim-0 rows)
and ``shared.emb`` (uneven flat ranges). Each step mutates a few percent of every tensor; one
step is a zero diff, one rewrites rank 0's rows of ``shared.weight`` entirely (a dense part next
to sparse ones). A rank publishes step after step; after a PublishError it retries the same step,
after OutcomeUnknown (only injected when the attempt was committed) it moves on. It records
what each call returned in ``out/rank{r}-{incarnation}.json``.

Fault injection (cfg keys): ``kill`` = [rank, step] SIGKILLs that rank after it wrote its first
shard of that step; ``slow`` = [rank, step] makes that rank's first shard write of that step
take 1.5 s longer (``[rank, step, s]``: s seconds; ``pg_timeout``: the gloo group's timeout,
30 s by default); ``skew`` = [rank, s] sets that rank's wall clock s seconds off, and the
mtimes of its rendezvous files and part records with it; ``exit_at`` = [rank, step] ends that
rank (code 5) before its call of that step;
``cancel_in_write`` = [rank, step] cancels that rank's call of that step
once it wrote its first shard (the step is then retried); ``miss`` = [rank, step] makes that
rank miss the commit outcome;
``fail`` = [rank, step] makes that rank's encode stage raise once; ``exit_on_error`` ends the
process (code 3) after a failed publish; ``kill_after_rename`` = [0, step] SIGKILLs rank 0 right
after it renamed that step's manifest into place; ``cancel_after_rename`` = [0, step] cancels
rank 0's publish of that step once its manifest exists, while ``slow_broadcast`` = [rank, step]
makes that rank join rank 0's broadcast of the commit result a second late (torch only).
``cancel_in_plan`` = [rank, step, s] cancels that rank's publish of that step s seconds in,
while it waits in the plan (rank 0 calls 3 s later). ``stepped`` passes the step to every
publish (``step=``); ``skip`` = [rank, step, n] makes that
rank skip the calls of n steps from that one (as a trainer whose steps failed before it could
publish; n = 1 when left out); a rank told that its call is behind the group's step
(``StepBehind``) moves on to the group's step, which the error names.
``in_adopt`` = [rank, step, how] acts while that rank's call of that step brings its snapshot
up to a version it missed (``miss``), half-way through the copy; ``after_commit`` = [rank, step,
how] while it brings it up to the version just committed. ``how``: "kill" (SIGKILL) or "cancel"
(the call is cancelled, the copy then finishes).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import os
import signal
import time
from contextlib import AbstractAsyncContextManager
from functools import cache
from pathlib import Path
from typing import Any

import torch

from asyncsync import OutcomeUnknown, Publisher, PublishError
from asyncsync.codec import raw_clone
from asyncsync.errors import CoordinationError, StepBehind
from asyncsync.format import manifest_path
from asyncsync.publish import commit as commit_mod
from asyncsync.publish import publisher as publisher_mod
from asyncsync.publish import snapshot as snapshot_mod
from asyncsync.publish import writer as writer_mod
from asyncsync.publish.distributed import Coordinator, Decide, TorchDistCoordinator
from asyncsync.publish.merge import TensorSlice
from asyncsync.publish.rendezvous import FileRendezvous
from tests.conftest import mixed_state, mutate, random_tensor

ROWS, COLS = 4, 24  # rows of shared.weight per rank
EMB_SHAPE = (10, 7)
ZERO_STEP, DENSE_STEP, KEYFRAME_STEP = 2, 3, 4


def emb_cuts(world: int) -> list[int]:
    n = EMB_SHAPE[0] * EMB_SHAPE[1]
    if world == 4:
        return [0, 13, 40, 41, n]  # uneven, one single-element part
    return [n * k // world for k in range(world + 1)]


@cache
def _state(step: int, world: int) -> dict[str, torch.Tensor]:
    if step == 0:
        g = torch.Generator().manual_seed(1234)
        sd = {f"rank{r}.{k}": v for r in range(world) for k, v in mixed_state(r).items()}
        sd["shared.weight"] = random_tensor((ROWS * world, COLS), torch.bfloat16, g)
        sd["shared.emb"] = random_tensor(EMB_SHAPE, torch.float32, g)
        return sd
    prev = _state(step - 1, world)
    if step == ZERO_STEP:
        return prev
    sd = mutate(prev, 0.03, seed=step)
    if step == DENSE_STEP:
        g = torch.Generator().manual_seed(step)
        sd["shared.weight"][:ROWS] = random_tensor((ROWS, COLS), torch.bfloat16, g)
    return sd


def full_state(step: int, world: int) -> dict[str, torch.Tensor]:
    """The whole model at ``step`` (what a receiver must end up holding)."""
    return {k: raw_clone(v) for k, v in _state(step, world).items()}  # a bool's bytes too


def portion(
    step: int, rank: int, world: int
) -> tuple[dict[str, torch.Tensor], dict[str, TensorSlice]]:
    """Rank ``rank``'s state dict at ``step`` and its slices."""
    sd = _state(step, world)
    mine = {k: raw_clone(v) for k, v in sd.items() if k.startswith(f"rank{rank}.")}
    mine["shared.weight"] = sd["shared.weight"][ROWS * rank : ROWS * (rank + 1)].clone()
    a, b = emb_cuts(world)[rank : rank + 2]
    mine["shared.emb"] = sd["shared.emb"].reshape(-1)[a:b].clone()
    slices = {
        "shared.weight": TensorSlice(ROWS * rank * COLS, (ROWS * world, COLS)),
        "shared.emb": TensorSlice(a, EMB_SHAPE),
    }
    return mine, slices


class MissOutcome(Coordinator):
    """Delegates to ``inner``; when ``armed``, the next commit exchange completes but this rank
    acts as if it never heard the result (as when rank 0's answer comes after our timeout)."""

    def __init__(self, inner: Coordinator) -> None:
        self.inner = inner
        self.rank, self.world_size = inner.rank, inner.world_size
        self.broken_grace, self.silence = inner.broken_grace, inner.silence
        self.armed = False

    async def open(self) -> None:
        await self.inner.open()

    def heartbeat(self, key: str) -> AbstractAsyncContextManager[None]:
        return self.inner.heartbeat(key)  # (without it this rank never beat: "silent")

    async def abandon(self, step: str, key: str, message: dict[str, Any]) -> None:
        await self.inner.abandon(step, key, message)

    async def exchange(
        self, step: str, key: str | None, message: dict[str, Any], decide: Decide
    ) -> dict[str, Any]:
        res = await self.inner.exchange(step, key, message, decide)
        if step == "commit" and self.armed:
            self.armed = False
            raise CoordinationError("injected: this rank missed the commit outcome")
        return res


def _arm_kill() -> None:
    real = writer_mod.VersionWriter.write

    def write_then_die(self: Any, *a: Any, **k: Any) -> None:
        real(self, *a, **k)
        os.kill(os.getpid(), signal.SIGKILL)

    writer_mod.VersionWriter.write = write_then_die  # type: ignore[method-assign]


def _arm_slow(seconds: float = 1.5) -> None:
    real = writer_mod.VersionWriter.write

    def slow_write(self: Any, *a: Any, **k: Any) -> None:
        writer_mod.VersionWriter.write = real  # type: ignore[method-assign]
        time.sleep(seconds)
        real(self, *a, **k)

    writer_mod.VersionWriter.write = slow_write  # type: ignore[method-assign]


def _arm_cancel(task: list[Any]) -> None:
    """The next shard write cancels ``task[0]`` (the call's), once the shard is written."""
    real, loop = writer_mod.VersionWriter.write, asyncio.get_running_loop()

    def write_then_cancel(self: Any, *a: Any, **k: Any) -> None:
        writer_mod.VersionWriter.write = real  # type: ignore[method-assign]
        real(self, *a, **k)
        loop.call_soon_threadsafe(task[0].cancel)

    writer_mod.VersionWriter.write = write_then_cancel  # type: ignore[method-assign]


def _arm_fail() -> None:
    real = publisher_mod.encode_bucket

    def fail_once(*a: Any, **k: Any) -> Any:
        publisher_mod.encode_bucket = real
        raise OSError(28, "No space left on device (injected)")

    publisher_mod.encode_bucket = fail_once  # type: ignore[assignment]


def _arm_kill_after_rename() -> None:
    real = commit_mod.atomic_write

    def write_then_die(path: Any, *a: Any, **k: Any) -> int:
        n = real(path, *a, **k)
        if Path(path).name == "manifest.json":
            os.kill(os.getpid(), signal.SIGKILL)
        return n

    commit_mod.atomic_write = write_then_die  # type: ignore[assignment]


def _arm_slow_broadcast(coord: Any) -> None:
    """The next commit result (the second broadcast from now) is joined a second late."""
    real, calls = coord._broadcast, [0]

    def late(result: Any) -> Any:
        calls[0] += 1
        if calls[0] == 2:
            time.sleep(1.0)
            coord._broadcast = real
        return real(result)

    coord._broadcast = late


def _arm_snapshot(how: str, task: list[Any], adopting: bool) -> None:
    """The next snapshot copy of an adoption (``adopting``) or after a commit kills this
    process or cancels ``task[0]`` half-way through (then finishes)."""
    real_advance, real_adopt = snapshot_mod.advance, Publisher.adopt
    inside = [False]
    loop = asyncio.get_running_loop()

    async def adopt(self: Publisher, a: Any) -> None:
        inside[0] = True
        try:
            await real_adopt(self, a)
        finally:
            inside[0] = False

    def advance(snap: Any, names: Any, pending: Any) -> Any:
        if inside[0] != adopting:
            return real_advance(snap, names, pending)
        snapshot_mod.advance = real_advance
        half = real_advance(snap, names[: len(names) // 2], pending)
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        loop.call_soon_threadsafe(task[0].cancel)
        time.sleep(0.2)  # the cancel lands while the copy runs
        return {**half, **real_advance(snap, names, pending)}

    snapshot_mod.advance = advance
    Publisher.adopt = adopt  # type: ignore[method-assign]


async def _cancelled_after_rename(pub: Publisher, root: Path, call: Any) -> None:
    """Run ``call``; cancel it once the manifest of the version it commits exists."""
    version = 0 if pub.version is None else pub.version + 1
    task = asyncio.ensure_future(call)
    while not task.done() and not manifest_path(root, version).exists():
        await asyncio.sleep(0.002)
    await asyncio.sleep(0.3)  # past the rename: rank 0 is sending the result
    task.cancel()
    await task


async def _run(cfg: dict[str, Any], coord: Coordinator) -> None:
    rank, world = cfg["rank"], cfg["world"]
    root, out = Path(cfg["root"]), Path(cfg["out"]) / f"rank{rank}-{cfg.get('incarnation', 0)}.json"
    log: list[dict[str, Any]] = []
    miss = coord if isinstance(coord, MissOutcome) else None
    async with Publisher(
        root, coordinator=coord, bucket_bytes=16 << 10, keyframe_interval=0
    ) as pub:
        step, tries = cfg.get("start", 0), 0
        while step <= cfg["steps"]:
            sd, slices = portion(step, rank, world)
            if cfg.get("kill") == [rank, step] and not cfg.get("incarnation"):
                _arm_kill()
            if (cfg.get("slow") or [None])[:2] == [rank, step] and not cfg.get("incarnation"):
                _arm_slow(*cfg["slow"][2:])
            if cfg.get("fail") == [rank, step] and tries == 0:
                _arm_fail()
            if miss is not None and cfg.get("miss") == [rank, step]:
                miss.armed = True
            first = not cfg.get("incarnation") and tries == 0
            if cfg.get("kill_after_rename") == [rank, step] and first:
                _arm_kill_after_rename()
            if cfg.get("slow_broadcast") == [rank, step] and first:
                _arm_slow_broadcast(coord)
            if cfg.get("exit_at") == [rank, step]:
                os._exit(5)  # gone before the plan: the others' exchange breaks
            rec: dict[str, Any] = {"step": step}
            if (k := cfg.get("skip")) and k[0] == rank and 0 <= step - k[1] < (k[2:] or [1])[0]:
                rec["skipped"] = True
                log.append(rec)
                step += 1
                continue
            kw = {"step": step} if cfg.get("stepped") else {}
            try:
                if step == 0:
                    call = pub.seed(sd, slices=slices, **kw)
                else:
                    call = pub.publish(sd, slices=slices, keyframe=step == KEYFRAME_STEP, **kw)
                if cfg.get("cancel_after_rename") == [rank, step] and first:
                    await _cancelled_after_rename(pub, root, call)
                    raise AssertionError("the publish was not cancelled")
                snap_fault = [(k, cfg[k][2]) for k in ("in_adopt", "after_commit")
                              if (cfg.get(k) or [None])[:2] == [rank, step] and first]  # fmt: skip
                if snap_fault:
                    call = asyncio.ensure_future(call)
                    _arm_snapshot(snap_fault[0][1], [call], snap_fault[0][0] == "in_adopt")
                if cfg.get("cancel_in_write") == [rank, step] and first:
                    call = asyncio.ensure_future(call)
                    _arm_cancel([call])
                if (c := cfg.get("cancel_in_plan")) and c[:2] == [rank, step] and first:
                    task = asyncio.ensure_future(call)  # rank 0 comes c[2] * 3 s later
                    asyncio.get_running_loop().call_later(c[2], task.cancel)
                    call = task
                elif (c := cfg.get("cancel_in_plan")) and rank == 0 and c[1] == step and first:
                    await asyncio.sleep(3 * c[2])
                res = await call
                rec.update(version=res.version, kind=res.kind, base=res.base_version)
                step, tries = step + 1, 0
            except asyncio.CancelledError:
                rec.update(cancelled=True)
                if (cfg.get("in_adopt") or [None])[:2] == [rank, step] or cfg.get(
                    "cancel_in_write"
                ) == [rank, step]:  # fmt: skip
                    tries += 1  # cancelled before the commit: this step was not published, again
                else:
                    if not cfg.get("cancel_in_plan"):  # (cancelled after the rename: committed)
                        rec.update(version=pub.version)
                    step, tries = step + 1, 0  # the version was committed: the step is out
            except OutcomeUnknown as exc:
                rec.update(unknown=str(exc))
                step, tries = step + 1, 0
            except PublishError as exc:
                at = pub.statistics().last_version
                nxt = manifest_path(root, 0 if at is None else at + 1)
                rec.update(error=str(exc), ranks=list(exc.ranks), at=at)
                rec.update(manifest_after_error=nxt.exists())
                tries += 1
                if isinstance(exc, StepBehind):  # the group went on: publish its step
                    step, tries = exc.group_step if exc.group_step is not None else step + 1, 0
                if tries > 6:
                    raise
            log.append(rec)
            out.write_text(json.dumps(log))
            if cfg.get("exit_on_error") and ("error" in rec or "unknown" in rec):
                os._exit(3)  # a torch.distributed group is broken once a rank died
            if step == 1 and cfg.get("gate"):  # v0 is out: wait until the test has read it
                while not Path(cfg["gate"]).exists():
                    await asyncio.sleep(0.01)


def _skew_clock(seconds: float) -> None:
    """This process's wall clock ``seconds`` off, and the mtimes of the rendezvous files and
    part records it writes set by it (as an object-store mount does: rclone, s3fs keep the
    writer's mtime), as a host whose clock is wrong."""
    from asyncsync.publish import group as group_mod
    from asyncsync.publish import rendezvous as rendezvous_mod

    real_time, real_write = time.time, rendezvous_mod.atomic_write
    time.time = lambda: real_time() + seconds  # type: ignore[assignment]

    def write_dated(path: Any, *a: Any, **k: Any) -> int:
        n = real_write(path, *a, **k)
        with contextlib.suppress(OSError):
            os.utime(path, (time.time(), time.time()))
        return n

    rendezvous_mod.atomic_write = write_dated  # type: ignore[assignment]
    group_mod.atomic_write = write_dated  # type: ignore[assignment]


def main(cfg: dict[str, Any]) -> None:
    rank, world = cfg["rank"], cfg["world"]
    if (skew := cfg.get("skew")) and skew[0] == rank:
        _skew_clock(skew[1])
    coord: Coordinator
    if cfg["coord"] == "torch":
        import torch.distributed as dist

        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(cfg["port"])
        dist.init_process_group(
            "gloo", rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=cfg.get("pg_timeout", 30)),
        )  # fmt: skip
        coord = TorchDistCoordinator()
    else:
        coord = FileRendezvous(cfg["root"], rank, world, timeout=cfg.get("timeout", 10.0))
    if cfg.get("miss"):
        coord = MissOutcome(coord)
    t0 = time.monotonic()
    try:
        asyncio.run(_run(cfg, coord))
    finally:
        if cfg["coord"] == "torch":
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
    print(f"rank {rank} done in {time.monotonic() - t0:.2f}s", flush=True)
