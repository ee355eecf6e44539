"""The scale sweep (``asyncsync bench --scale``): cost against model size, against the floors.

For each size (bf16, 256 MB, 1 GB and 4 GB by default, ~3 % of elements changed per version)
three fresh children run over one root (:func:`run_scale_publish`, :func:`run_scale_receive`
over the throttled filesystem, :func:`run_scale_cost` unthrottled), and the parent computes,
from numbers measured in that run:

* the **trainer floor**: one ``torch.ne`` pass over the int views of new and snapshot, into a
  mask buffer already faulted in, on torch's threads or on one, whichever was faster
  (:func:`trainer_floor`);
* the **receiver floor**: dirtying every page of the tensors the version changes in a mapped
  file that holds the old bytes (one store per 4 KiB page). At ~3 % density every page of a
  bf16 tensor holds changed elements (2048 elements a page), so any receiver that keeps the
  engine's weights in a host-local checkpoint in place must write every one of those pages:
  this is the page-fault and copy-on-write cost of the page cache itself, whatever the
  decoder. It is a physical bound of the machine, not a timing of our apply (no decode, no
  journal, no verification, no flush);
* the **transfer floor**: wire bytes / bandwidth + per-file latency of the files written and
  read (the simulated shared filesystem, ``200MB/s,5ms``);
* **floor** = max(the three, (trainer CPU-seconds + receiver CPU-seconds) / cores): in the
  bench both sides share this machine's cores; ``floor_production_s`` leaves that term out
  (in production they run on different hosts).

Each floor is the **minimum** of its repeats (wall and CPU alike): a floor is the best the
machine did; under load the median of a 2-thread pass inflates and flatters the ratios.

Then publish, apply (to the ack), end to end (publish start to ack), full-checkpoint sync
(safetensors save + load over the throttle), peak RSS of each process, and their ratios.

The states are made cheaply, so 4 GB fits this machine with publisher and receiver in separate
processes: weights are random bf16 of typical magnitude (1e-3..6e-2, alternating signs), and a
step moves ~``density`` of the elements by one ulp up or down, the pattern Adam steps leave in
a bf16 view (the changes sit in the low mantissa bits; :mod:`asyncsync.ops.workload` measures
the real thing at small sizes). The generator is seeded: every child makes the same versions.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import mmap
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asyncsync import codec, fsio
from asyncsync.format import acks
from asyncsync.memory import freeze_startup_objects
from asyncsync.ops.bench.job import Job
from asyncsync.ops.bench.probes import (
    RssSampler,
    cpu_seconds,
    full_sync,
    reset_peak_rss,
    rss,
    run_until_acked,
)
from asyncsync.ops.workload import config_for_elements
from asyncsync.publish.publisher import Publisher
from receiver.agent import ReceiverAgent
from receiver.engines.checkpoint import LocalCheckpoint

__all__ = [
    "DEFAULT_SIZES",
    "make_state",
    "peak_split",
    "receiver_floor",
    "trainer_floor",
    "ne_passes",
    "run_scale_cost",
    "run_scale_publish",
    "run_scale_receive",
    "step_state",
]

DEFAULT_SIZES = (256 << 20, 1 << 30, 4 << 30)
_LOW, _HIGH = 0x3A80, 0x3D80  # bf16 bit patterns of about 1e-3 .. 6e-2
_PAGE = mmap.PAGESIZE
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14


def make_state(model_bytes: int, seed: int) -> dict[str, torch.Tensor]:
    """Version 0: a transformer-shaped bf16 state dict of about ``model_bytes``."""
    cfg = config_for_elements(max(1000, model_bytes // 2), extras=False)
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in cfg.param_shapes().items():
        bits = torch.randint(_LOW, _HIGH, shape, dtype=torch.int16, generator=g)
        bits.view(-1)[1::2] |= -32768  # the sign bit on every other element
        out[name] = bits.view(torch.bfloat16)
    return out


def step_state(sd: dict[str, torch.Tensor], step: int, density: float, seed: int) -> None:
    """Version ``step`` from version ``step - 1``, in place: ~``density`` of the elements of
    every tensor move one ulp (positions and directions drawn from ``seed`` and ``step``)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    for t in sd.values():
        flat = t.view(-1).view(torch.int16)
        k = max(1, round(flat.numel() * density))
        pos = torch.randint(0, flat.numel(), (k,), generator=g)
        delta = torch.randint(0, 2, (k,), dtype=torch.int16, generator=g) * 2 - 1
        flat[pos] += delta


def _state_at(job: Job, version: int, sd: dict[str, torch.Tensor] | None = None) -> Any:
    if sd is None:
        sd = make_state(job.scale_bytes, job.seed)
    for k in range(1, version + 1):
        step_state(sd, k, job.density, job.seed)
    return sd


def trainer_floor(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> float:
    """Seconds of one bytewise ``torch.ne`` pass over every pair of int views into one bool
    buffer whose pages are already faulted in (a trainer would reuse it every step; at GBs the
    first touch of a fresh buffer costs as much as the compare, see ``probes.ne_pass``): the
    faster of a pass on torch's threads and one on a single thread (:func:`ne_passes`)."""
    return min(wall for wall, _ in ne_passes(old, new))


def ne_passes(
    old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]
) -> list[tuple[float, float]]:
    """(wall, CPU) seconds of the ``torch.ne`` pass of :func:`trainer_floor`, once on torch's
    threads and, where that is more than one, once on a single thread. A multi-thread pass on a
    host where another process holds a core waits at each call's barrier for its descheduled
    thread: beside a test run on the 2-core host 1 GiB read 1.8-3.7 s against 130-200 ms when
    quiet, a floor no trainer would accept (the ratios against it passed for nothing)."""
    pairs = [(codec.int_view(old[k]), codec.int_view(new[k])) for k in new]
    mask = torch.ones(sum(b.numel() for _, b in pairs), dtype=torch.bool)  # faulted in
    threads, out = torch.get_num_threads(), []
    try:
        for n in sorted({threads, 1}, reverse=True):
            torch.set_num_threads(n)
            t0, c0 = time.perf_counter(), time.process_time()
            start = 0
            for a, b in pairs:
                torch.ne(a, b, out=mask[start : start + b.numel()])
                start += b.numel()
            out.append((time.perf_counter() - t0, time.process_time() - c0))
    finally:
        torch.set_num_threads(threads)
    return out


def receiver_floor(
    old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], scratch: Path
) -> tuple[float, float]:
    """(wall, CPU) seconds to dirty every page of the changed tensors' bytes in a mapped file
    holding the old version (see the module docstring): the cheaper of one store per page
    and ``madvise(MADV_POPULATE_WRITE)`` (one call that write-faults the whole range) followed
    by the stores. The file is written and fsynced first, so its pages are in the page cache
    and clean, as after the last flush, and mapped afresh, as each version maps them."""
    names = [k for k in new if not torch.equal(codec.int_view(old[k]), codec.int_view(new[k]))]
    offsets, total = {}, 0
    for k in names:
        offsets[k] = total
        total += -(-old[k].numel() * old[k].element_size() // _PAGE) * _PAGE
    path = scratch / "receiver-floor.bin"
    best = (math.inf, math.inf)
    try:
        for populate in (False, True):
            with open(path, "wb") as out:
                for k in names:
                    out.seek(offsets[k])
                    out.write(codec.int_view(old[k]).numpy().tobytes())
                out.truncate(total)
                out.flush()
                os.fsync(out.fileno())
            if total == 0:
                return 0.0, 0.0
            with open(path, "r+b") as f, mmap.mmap(f.fileno(), total) as mm:
                t0, c0 = time.perf_counter(), time.process_time()
                if populate:
                    # an older kernel refuses: the stores below fault the pages instead
                    with contextlib.suppress(OSError, AttributeError):
                        mm.madvise(_MADV_POPULATE_WRITE, 0, total)
                pages = np.frombuffer(mm, dtype=np.uint8)[::_PAGE]
                pages += 0  # one store per page, as a patch into the page makes
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                del pages
            best = min(best, (wall, cpu))
    finally:
        path.unlink(missing_ok=True)
    return best


async def run_scale_publish(job: Job) -> dict[str, Any]:
    """Seed version 0 (unthrottled), then publish versions 1..N over the throttle, each
    timed from publish start to the receiver's ack."""
    base = rss()
    sampler = RssSampler(smaps=_smaps(job, "publisher")).start()  # each phase's peak, by kind
    sd = _state_at(job, 0)
    size = sum(t.numel() * t.element_size() for t in sd.values())
    root = Path(job.root)
    versions: list[dict[str, Any]] = []
    async with Publisher(root, bucket_bytes=job.bucket_bytes, keyframe_interval=0) as pub:
        await pub.seed(sd)
        await _wait(Path(job.ready), job.timeout)
        gc.collect()
        startup = {**rss(), "sampled": sampler.take()}
        reset_peak_rss()
        for v in range(1, job.versions + 1):
            step_state(sd, v, job.density, job.seed)
            fsio.set_throttle(job.throttle)
            t0, c0, k0 = time.perf_counter(), cpu_seconds(), cpu_seconds(system_only=True)
            res = await pub.publish(sd)
            t1, c1, k1 = time.perf_counter(), cpu_seconds(), cpu_seconds(system_only=True)
            await acks.wait_acked(
                root, res.version, engines=[job.engine_id], timeout=job.timeout,
                poll_interval=0.002, max_poll_interval=0.002,
            )  # fmt: skip
            t2 = time.perf_counter()
            fsio.set_throttle(None)
            versions.append(
                {
                    "version": res.version, "publish": t1 - t0, "e2e": t2 - t0,
                    "publish_cpu": c1 - c0, "publish_cpu_sys": k1 - k0,
                    "wire_bytes": res.wire_bytes, "shards": res.shards, "changed": res.changed,
                    "elements": res.total, "stages": dict(res.seconds),
                }
            )  # fmt: skip
    steady = {**rss(), "sampled": sampler.stop()}
    return {
        "model_bytes": size,
        "rss": {"base": base, "startup": startup, "steady": steady},
        "versions": versions,
    }


async def run_scale_receive(job: Job) -> dict[str, Any]:
    """Take version 0 (unthrottled), then run until the last version is acked."""
    base = rss()
    sampler = RssSampler(smaps=_smaps(job, "receiver")).start()  # each phase's peak, by kind
    root = Path(job.root)
    # with a redo log: compactions when N records are held only (not when idle), so that the
    # cycle's CPU below is that of a receiver whose versions come back to back
    engine = LocalCheckpoint(job.checkpoint, redo_log=job.redo_log, compact_idle=job.timeout)
    compactions = _time_compactions(engine)
    agent = ReceiverAgent(root, engine, job.engine_id, poll_interval=job.poll_interval)
    async with agent, asyncio.timeout(job.timeout):
        while await agent.sync_once() is None:
            await asyncio.sleep(0.01)
        await engine.flushed()
        freeze_startup_objects()  # as the receiver command does once its agent is open
        startup = {**rss(), "sampled": sampler.take()}
        reset_peak_rss()
        fsio.set_throttle(job.throttle)
        Path(job.ready).write_text("ready\n")
        cpu: list[float] = []
        cpu_sys: list[float] = []
        c0, w0 = cpu_seconds(), _written()
        compactions.clear()
        applies = await run_until_acked(agent, job.versions, cpu=cpu, cpu_sys=cpu_sys)
        if engine.redo_held:  # the records left: merged, and charged to the cycle
            await engine._run(engine._compact, "bench")
        await engine.flushed()  # without a redo log: the last version's flush, charged too
        cycle_cpu, w1 = cpu_seconds() - c0, _written()
        written = None if w0 is None or w1 is None else w1 - w0
        fsio.set_throttle(None)
    steady = {**rss(), "sampled": sampler.stop()}
    return {
        # the whole run: every version and every compaction (with a redo log), all threads
        "cycle_cpu": cycle_cpu,
        "compactions": list(compactions),  # (records, seconds) of each in the run
        "disk_write_bytes": written,  # /proc/self/io write_bytes (None elsewhere)
        "redo_log": job.redo_log,
        "rss": {"base": base, "startup": startup, "steady": steady},
        "applies": applies,  # each from its manifest to the ack (streamed shards came before)
        "apply_cpu": cpu,  # each from its directory's first sight to the ack, every thread
        "apply_cpu_sys": cpu_sys,  # of which the kernel's (page faults, the flush's writeback)
        "streamed_shards": agent.status().streamed_shards,
    }


def _smaps(job: Job, side: str) -> Path | None:
    """With ASYNCSYNC_BENCH_SMAPS=DIR: where the child copies its smaps at each phase's peak
    (``DIR/smaps-receiver-1G.0`` the start-up, ``.1`` the steady phase)."""
    where = os.environ.get("ASYNCSYNC_BENCH_SMAPS")
    if not where:
        return None
    Path(where).mkdir(parents=True, exist_ok=True)
    return Path(where) / f"smaps-{side}-{job.scale_bytes >> 20}M"


def _time_compactions(engine: LocalCheckpoint) -> list[tuple[int, float]]:
    """(records, seconds) of each compaction of ``engine`` from now on."""
    out: list[tuple[int, float]] = []
    real = engine._compact

    def timed(why: str) -> None:
        n, t0 = engine.redo_held, time.perf_counter()
        real(why)
        if n:
            out.append((n, time.perf_counter() - t0))

    engine._compact = timed  # type: ignore[method-assign]
    return out


def _written() -> int | None:
    """Bytes this process caused to be written to storage (dirtied pages included)."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("write_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


async def run_scale_cost(job: Job) -> dict[str, Any]:
    """The floors (unthrottled) and the full-checkpoint sync (over the throttle)."""
    old = _state_at(job, 0)
    new = {k: t.clone() for k, t in old.items()}
    step_state(new, 1, job.density, job.seed)
    ne_wall, ne_cpu = [], []
    for _ in range(job.repeats):
        for wall, cpu in ne_passes(old, new):
            ne_wall.append(wall)
            ne_cpu.append(cpu)
    scratch = Path(job.checkpoint)
    scratch.mkdir(parents=True, exist_ok=True)
    floors = [receiver_floor(old, new, scratch) for _ in range(job.repeats)]
    del old
    gc.collect()
    full = [
        full_sync(new, scratch / "full.safetensors", job.throttle) for _ in range(job.full_repeats)
    ]
    return {
        "ne_pass": ne_wall,
        "ne_pass_cpu": ne_cpu,
        "receiver_floor": [w for w, _ in floors],
        "receiver_floor_cpu": [c for _, c in floors],
        "full_sync": full,
    }


async def _wait(path: Path, timeout: float) -> None:
    async with asyncio.timeout(timeout):
        while not path.exists():
            await asyncio.sleep(0.005)


def jobs_for(job: Job, work: Path, size: int) -> dict[str, Job]:
    """The three children of one size (``job`` carries the shared settings)."""
    tag = f"{size >> 20}M"
    root = work / f"root-scale-{tag}"
    root.mkdir()
    pub = replace(
        job,
        role="scale-publish",
        root=str(root),
        result=str(work / f"result-scale-pub-{tag}.json"),
        ready=str(work / f"ready-scale-{tag}"),
        scale_bytes=size,
    )
    return {
        "cost": replace(
            pub,
            role="scale-cost",
            root=str(work / f"root-scale-cost-{tag}"),
            result=str(work / f"result-scale-cost-{tag}.json"),
            checkpoint=str(work / f"scratch-scale-{tag}"),
        ),
        "publish": pub,
        "receive": replace(
            pub,
            role="scale-receive",
            result=str(work / f"result-scale-rec-{tag}.json"),
            checkpoint=str(work / f"ckpt-scale-{tag}"),
        ),
    }


def summarise_size(
    size: int, cost: dict[str, Any], pub: dict[str, Any], rec: dict[str, Any], cfg: dict[str, Any]
) -> dict[str, Any]:
    """One row of ``scale`` in the JSON summary (see the module docstring)."""
    med = _median
    # A floor is the best this machine did: the minimum of the repeats, not their median (on a
    # loaded machine the median of a 2-thread pass inflates and flatters the ratios against it).
    best = min
    throttle = fsio.Throttle.parse(cfg["throttle"])
    bandwidth = throttle.bandwidth or math.inf
    cores = cfg.get("cores") or os.cpu_count() or 1
    vs = pub["versions"]
    wire, shards = med(v["wire_bytes"] for v in vs), med(v["shards"] for v in vs)
    model = pub["model_bytes"]
    trainer, receiver = best(cost["ne_pass"]), best(cost["receiver_floor"])
    # files written and read: the shards and the manifest, once each way
    transfer = wire / bandwidth + 2 * (shards + 1) * throttle.latency
    shared = (best(cost["ne_pass_cpu"]) + best(cost["receiver_floor_cpu"])) / cores
    production = max(trainer, receiver, transfer)
    floor = max(production, shared)
    publish, e2e = med(v["publish"] for v in vs), med(v["e2e"] for v in vs)
    apply_s, full = med(rec["applies"]), med(cost["full_sync"])
    gb, gib = model / 1e9, model / (1 << 30)
    # the two sides overlap when the end to end is the slower side plus one shard's transfer
    # (its write and its read, the mean shard of a version: the last one is no larger)
    one_shard = (wire / max(shards, 1)) / bandwidth + 2 * throttle.latency
    overlap = e2e / (max(publish, apply_s) + one_shard)
    publish_cpu = med(v["publish_cpu"] for v in vs) if all("publish_cpu" in v for v in vs) else None
    apply_cpu = med(rec["apply_cpu"]) if rec.get("apply_cpu") else None
    cycle = rec.get("cycle_cpu")
    written = rec.get("disk_write_bytes")
    return {
        "redo_log": rec.get("redo_log", 0),
        # the mean over the whole run (compactions charged), beside the per-version median
        "apply_cpu_cycle_s_per_gib": None if cycle is None else cycle / len(vs) / gib,
        "compactions": rec.get("compactions", []),
        "disk_writes_per_version_vs_model": None if written is None else written / len(vs) / model,
        "model_bytes": model,
        "density": med(v["changed"] / v["elements"] for v in vs),
        "wire_bytes": wire,
        "shards": shards,
        "trainer_floor_s": trainer,
        "receiver_floor_s": receiver,
        "transfer_floor_s": transfer,
        "shared_cores_floor_s": shared,
        "floor_s": floor,
        "floor_production_s": production,
        "publish_s": publish,
        "apply_s": apply_s,
        "e2e_s": e2e,
        "full_sync_s": full,
        "publish_vs_trainer_floor": publish / trainer,
        "apply_vs_receiver_floor": apply_s / receiver,
        "e2e_vs_floor": e2e / floor,
        "e2e_vs_production_floor": e2e / production,
        "e2e_vs_trainer_floor": e2e / trainer,  # issue 26: the one-pass torch.ne floor
        "overlap": overlap,  # issue 26: e2e / (max(publish, apply) + one shard's transfer)
        "full_sync_vs_e2e": full / e2e,
        "publish_s_per_gb": publish / gb,
        "apply_s_per_gb": apply_s / gb,
        # process CPU (user + system, every thread: the pools too) per GiB of model
        "publish_cpu_s_per_gib": None if publish_cpu is None else publish_cpu / gib,
        "apply_cpu_s_per_gib": None if apply_cpu is None else apply_cpu / gib,
        "streamed_shards": rec.get("streamed_shards", 0),
        "publisher_peak_rss_vs_model": _peak(pub, model),
        "receiver_peak_rss_vs_model": _peak(rec, model),
        # the sampled peak of the same phase split by kind: a file mapped twice reads high in
        # ``file`` with no second copy in memory; a temporary piling up reads in ``anon``
        "publisher_peak_rss_split": peak_split(pub, model),
        "receiver_peak_rss_split": peak_split(rec, model),
        "repeats": {
            "versions": len(vs),
            "publish": [v["publish"] for v in vs],
            "e2e": [v["e2e"] for v in vs],
            "apply": rec["applies"],
            "publish_cpu": [v.get("publish_cpu") for v in vs],
            "apply_cpu": rec.get("apply_cpu", []),
            "publish_cpu_sys": [v.get("publish_cpu_sys") for v in vs],
            "apply_cpu_sys": rec.get("apply_cpu_sys", []),
            "trainer_floor": cost["ne_pass"],
            "receiver_floor": cost["receiver_floor"],
            "full_sync": cost["full_sync"],
        },
    }


def _peak(side: dict[str, Any], model: int) -> float:
    r = side["rss"]
    base = r["base"]["now"]
    return max(r["startup"]["peak"] - base, r["steady"]["peak"] - base) / model


def peak_split(side: dict[str, Any], model: int) -> dict[str, Any] | None:
    """The phase (``startup`` or ``steady``) whose ``VmHWM`` gives :func:`_peak`, and its
    sampled peak above the baseline / model: ``rss`` (what the sampler saw: at most
    ``vmhwm``) = ``anon`` + ``file`` + ``shmem``; ``max_file`` the highest file part alone;
    the sampler's ``samples`` and ``cpu_s``. None from a child without a sampler."""
    r = side["rss"]
    base = r["base"]
    phase = max(("startup", "steady"), key=lambda p: r[p]["peak"])
    sampled = r[phase].get("sampled")
    if not sampled or not sampled["at_peak"]:
        return None
    at, top = sampled["at_peak"], sampled["max"]

    def above(x: dict[str, int], key: str) -> float:
        return (x[key] - base.get(key, 0)) / model

    return {
        "phase": phase,
        "vmhwm": (r[phase]["peak"] - base["now"]) / model,
        "rss": above(at, "now"),
        "anon": above(at, "anon"),
        "file": above(at, "file"),
        "shmem": above(at, "shmem"),
        "max_file": above(top, "file"),
        "samples": sampled["samples"],
        "cpu_s": sampled["cpu_s"],
    }


def _median(xs: Any) -> float:
    values = sorted(xs)
    if not values:
        return math.nan
    mid = len(values) // 2
    return float(values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2)
