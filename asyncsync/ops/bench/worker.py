"""The benchmark's child processes: ``python -m asyncsync.ops.bench JOB.json``.

Why separate processes: peak RSS is per process, and a trainer and an inference engine never
share one. Each child is started fresh (so its peak measures only its own side), reads its
:class:`Job` from a JSON file, does one role and writes a JSON result next to it:

``publish``  a Publisher: seed version 0, wait for the receiver, then per version load the
             state dict, ``publish`` it over the throttled filesystem and wait for the ack
             (the end-to-end latency, publish start to ack).
``receive``  a ReceiverAgent with a LocalCheckpoint: take version 0, then ``run()`` until the
             last version is acked.
``scale-*``  the scale sweep's publisher, receiver and floors (:mod:`asyncsync.ops.bench.scale`).
``cost``     the unthrottled costs: one ``torch.ne`` pass over the tensors (the floor), the
             publish, the receiver's apply, a per-component breakdown of both, and the
             full-checkpoint sync (safetensors save + load) over the throttle.

Memory is reported relative to the *baseline* RSS of the child after its imports (Python plus
torch) and a warm-up round trip on a tiny model (:func:`warm_up`: code pages, thread pools),
so the ratio says what the data costs, not what the interpreter costs. Peak RSS is
``VmHWM``; ``/proc/self/clear_refs`` resets it between the start-up phase (seed / first full
sync) and the steady phase (deltas), so both are reported.
"""

from __future__ import annotations

import asyncio
import faulthandler
import gc
import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any

import torch

from asyncsync import fsio
from asyncsync.console.logsetup import setup_logging
from asyncsync.format import acks
from asyncsync.format.checksum import checksum_tensor
from asyncsync.ops.bench import peers, scale
from asyncsync.ops.bench.job import Job
from asyncsync.ops.bench.probes import (
    RssSampler,
    full_sync,
    load_state_dict,
    model_bytes,
    ne_pass,
    profile_round_trip,
    publish_components,
    receive_components,
    reset_peak_rss,
    rss,
    run_until_acked,
    timed,
)
from asyncsync.ops.workload import Workload, WorkloadConfig
from asyncsync.pipeline import set_threads
from asyncsync.publish.publisher import Publisher
from receiver.agent import ReceiverAgent
from receiver.engines.checkpoint import LocalCheckpoint

__all__ = ["Job", "main", "run_cost", "run_publish", "run_receive", "warm_up"]  # Job: job.py

_ACK_POLL = 0.002  # seconds; the ack wait must not add more than this to the latency


# ------------------------------------------------------------------------------------ roles
async def _wait_file(path: Path, timeout: float) -> None:
    async with asyncio.timeout(timeout):
        while not path.exists():
            await asyncio.sleep(0.005)


def _mark(job: Job, marks: dict[str, float], name: str) -> None:
    """Seconds since the parent spawned this child, for the timeline in the results."""
    marks[name] = time.time() - job.spawned_at


async def warm_up(scratch: Path) -> None:
    """One tiny publish and receive, so the code pages and thread pools every later step uses
    are already in the baseline RSS: the ratios then measure what the data costs."""
    wl = Workload(WorkloadConfig(layers=1, hidden=32, vocab=64, seed=0))
    root = scratch / "root"
    engine = LocalCheckpoint(scratch / "ckpt")
    async with (
        Publisher(root, keyframe_interval=0) as pub,
        ReceiverAgent(root, engine, "warmup", use_inotify=False) as agent,
    ):
        await pub.seed(wl.state_dict())
        await agent.sync_once()
        wl.step()
        await pub.publish(wl.state_dict())
        await agent.sync_once()
    shutil.rmtree(scratch, ignore_errors=True)


async def _baseline(job: Job, marks: dict[str, float]) -> dict[str, int]:
    _mark(job, marks, "imported")
    await warm_up(Path(job.result).with_suffix(".warmup"))
    _mark(job, marks, "warmed up")
    return rss()


async def run_publish(job: Job) -> dict[str, Any]:
    marks: dict[str, float] = {}
    base = await _baseline(job, marks)
    sampler = RssSampler().start()  # each phase's peak split by kind (anon, file, shmem)
    sd = load_state_dict(job.states[0])  # the "trainer's parameters": updated in place below
    size = model_bytes(sd)
    root = Path(job.root)
    versions: list[dict[str, Any]] = []
    async with Publisher(
        root, bucket_bytes=job.bucket_bytes, keyframe_interval=0, pipelined=job.pipelined
    ) as pub:
        await pub.seed(sd)
        _mark(job, marks, "seeded")
        await _wait_file(Path(job.ready), job.timeout)
        _mark(job, marks, "receiver ready")
        gc.collect()
        startup = {**rss(), "sampled": sampler.take()}
        reset_peak_rss()
        fsio.set_throttle(job.throttle)
        for path in job.states[1:]:
            load_state_dict(path, into=sd)
            await asyncio.sleep(job.settle)
            t0 = time.perf_counter()
            res = await pub.publish(sd)
            t1 = time.perf_counter()
            await acks.wait_acked(
                root,
                res.version,
                engines=[job.engine_id],
                timeout=job.timeout,
                poll_interval=_ACK_POLL,
                max_poll_interval=_ACK_POLL,
            )
            t2 = time.perf_counter()
            versions.append(
                {
                    "version": res.version,
                    "publish": t1 - t0,
                    "e2e": t2 - t0,
                    "wire_bytes": res.wire_bytes,
                    "shards": res.shards,
                    "changed": res.changed,
                    "elements": res.total,
                    "stages": dict(res.seconds),
                }
            )
        fsio.set_throttle(None)
    _mark(job, marks, "done")
    steady = {**rss(), "sampled": sampler.stop()}
    return {
        "model_bytes": size,
        "rss": {"base": base, "startup": startup, "steady": steady},
        "versions": versions,
        "marks": marks,
    }


async def run_receive(job: Job) -> dict[str, Any]:
    marks: dict[str, float] = {}
    base = await _baseline(job, marks)
    sampler = RssSampler().start()
    root = Path(job.root)
    final = len(job.states) - 1
    agent = ReceiverAgent(
        root,
        LocalCheckpoint(job.checkpoint),
        job.engine_id,
        poll_interval=job.poll_interval,
        pipelined=job.pipelined,
        prefetch=job.prefetch,
    )
    async with agent, asyncio.timeout(job.timeout):
        while await agent.sync_once() is None:  # version 0, unthrottled
            await asyncio.sleep(0.01)
        _mark(job, marks, "synced v0")
        gc.collect()
        startup = {**rss(), "sampled": sampler.take()}
        reset_peak_rss()
        fsio.set_throttle(job.throttle)
        Path(job.ready).write_text("ready\n")
        applies = await run_until_acked(agent, final)
        fsio.set_throttle(None)
        _mark(job, marks, "last acked")
        status = agent.status()
    _mark(job, marks, "done")
    steady = {**rss(), "sampled": sampler.stop()}
    return {
        "marks": marks,
        "rss": {"base": base, "startup": startup, "steady": steady},
        "applies": applies,
        "prefetched_shards": status.prefetched_shards,
    }


async def run_cost(job: Job) -> dict[str, Any]:
    root = Path(job.root)
    # two buffers, alternately overwritten: the previous and the current version
    bufs = [load_state_dict(job.states[0]), load_state_dict(job.states[1])]
    size = model_bytes(bufs[0])
    ne: list[float] = []
    publishes: list[dict[str, Any]] = []
    applies: list[float] = []
    flushes: list[float] = []  # the background flush after each ack (off the latency path)
    engine = LocalCheckpoint(job.checkpoint)
    async with (
        Publisher(root, bucket_bytes=job.bucket_bytes, keyframe_interval=0) as pub,
        ReceiverAgent(root, engine, job.engine_id, use_inotify=False) as agent,
    ):
        await pub.seed(bufs[0])
        await agent.sync_once()
        for k in range(1, len(job.states)):
            prev, cur = bufs[(k - 1) % 2], bufs[k % 2]
            if k > 1:
                load_state_dict(job.states[k], into=cur)
            ne.extend(ne_pass(prev, cur) for _ in range(job.repeats))
            res = await pub.publish(cur)
            t0 = time.perf_counter()
            await agent.sync_once()
            t1 = time.perf_counter()
            applies.append(t1 - t0)
            await engine.flushed()
            flushes.append(time.perf_counter() - t1)
            publishes.append(
                {
                    "total": res.seconds["total"],
                    "stages": dict(res.seconds),
                    "wire_bytes": res.wire_bytes,
                    "changed": res.changed,
                    "elements": res.total,
                }
            )
        components = publish_components(prev, cur)
        receiving = receive_components(root, res.version)
        receiving["checksum_model"], _ = timed(lambda: [checksum_tensor(t) for t in cur.values()])
        profile = await profile_round_trip(pub, agent, prev)
    full = [
        full_sync(cur, root / "full.safetensors", job.throttle) for _ in range(job.full_repeats)
    ]
    return {
        "model_bytes": size,
        "ne_pass": ne,
        "publishes": publishes,
        "applies": applies,
        "flushes": flushes,
        "publish_components": components,
        "receive_components": receiving,
        "profile": profile,
        "full_sync": full,
    }


_ROLES = {
    "publish": run_publish,
    "receive": run_receive,
    "cost": run_cost,
    "scale-publish": scale.run_scale_publish,
    "scale-receive": scale.run_scale_receive,
    "scale-cost": scale.run_scale_cost,
    "peer-publish": peers.run_peer_publish,
    "peer-receive": peers.run_peer_receive,
}


async def _with_task_dumps(role: Coroutine[Any, Any, dict[str, Any]]) -> dict[str, Any]:
    """Run ``role``; on SIGUSR2 print the stack of every asyncio task to stderr (the log)."""

    def dump() -> None:
        for task in asyncio.all_tasks():
            print(f"--- asyncio task {task.get_name()}:", file=sys.stderr)
            coro: Any = task.get_coro()
            while coro is not None:  # the chain of awaits, outermost first
                f = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None)
                if f is not None:
                    code = f.f_code
                    print(f'  File "{code.co_filename}", line {f.f_lineno} in {code.co_name}',
                          file=sys.stderr)  # fmt: skip
                coro = getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None)
        sys.stderr.flush()

    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR2, dump)
    return await role


def main(argv: Sequence[str] | None = None) -> int:
    """Run the job in ``argv[0]`` and write its result JSON; 1 on failure (traceback on stderr)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m asyncsync.ops.bench.worker JOB.json", file=sys.stderr)
        return 2
    job = Job.read(args[0])
    # the parent sends SIGUSR2 then SIGUSR1 to a child that overruns its timeout: every
    # asyncio task's and every thread's stack into the log it then quotes (measure._finish)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    faulthandler.enable(all_threads=True)  # a crash in a C kernel: the stacks, then exit -11
    # its log: warnings by default; ASYNCSYNC_BENCH_LOG_LEVEL=INFO shows each apply's time
    setup_logging(os.environ.get("ASYNCSYNC_BENCH_LOG_LEVEL", "WARNING").upper() or "WARNING")
    if job.threads and not job.role.endswith("cost"):  # the floors stay the machine's
        set_threads(job.threads)
        torch.set_num_threads(job.threads)
    result = asyncio.run(_with_task_dumps(_ROLES[job.role](job)))
    Path(job.result).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
