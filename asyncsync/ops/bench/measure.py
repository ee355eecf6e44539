"""Run the benchmark: make the workloads, start the child processes, gather their numbers.

Everything comes from one run: the workloads are generated here, every timing and memory
figure is measured by a fresh child (:mod:`asyncsync.ops.bench.worker`) in the same run, and the
ratios are computed from those numbers (:func:`summarise`).

Sizes (``BenchConfig.quick()``): the main workload is 32M master elements (a ~64 MB bf16
publish view) stepped at ~3 % density; the density sweep (0.5, 1, 10 % and an fp32 model) uses
8M elements, since bytes per changed element barely depend on the size. The full run uses 96M
elements throughout and more repeats.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from asyncsync import fsio
from asyncsync.errors import AsyncSyncError
from asyncsync.ops.bench import scale
from asyncsync.ops.bench.baselines import all_sizes
from asyncsync.ops.bench.job import Job
from asyncsync.ops.bench.probes import save_state_dict
from asyncsync.ops.workload import Workload

__all__ = ["BenchConfig", "BenchFailed", "machine_info", "run_bench"]

logger = logging.getLogger(__name__)

Progress = Callable[[str], None]


class BenchFailed(AsyncSyncError):
    """A benchmark child failed; the message names its log."""


@dataclass(frozen=True)
class BenchConfig:
    """Sizes and settings of one benchmark run (see :meth:`quick` and :meth:`full`)."""

    elements: int = 96_000_000
    sweep_elements: int = 96_000_000
    versions: int = 5  # timed delta versions per end-to-end run
    density: float = 0.03  # the main workload
    sweep_densities: tuple[float, ...] = (0.005, 0.01, 0.10)  # plus the main one and fp32
    throttle: str = "200MB/s,5ms"
    bucket_bytes: int | None = None  # None: model / 16, in [1, 32] MiB (see bucket_size)
    repeats: int = 3  # torch.ne passes per version
    full_repeats: int = 3
    seed: int = 0
    workdir: str | None = None
    keep: bool = False
    timeout: float = 900.0
    name: str = "full"
    scale_sizes: tuple[int, ...] = ()  # model bytes of the scale sweep (empty: not run)
    scale_versions: int = 3
    scale_only: bool = False  # --scale: the sweep alone
    peers_only: bool = False  # --peers: the peer comparison alone, at scale_sizes
    threads: int = 0  # the children's CPU pool and torch threads (0: the machine's default)
    redo_log: int = 0  # --redo-log: the scale receiver keeps deltas as redo records

    def __post_init__(self) -> None:
        if self.elements < 1000 or self.sweep_elements < 1000:
            raise ValueError("elements and sweep_elements must be >= 1000")
        if self.versions < 1 or self.repeats < 1 or self.full_repeats < 1:
            raise ValueError("versions, repeats and full_repeats must be >= 1")
        if not 0 < self.density < 1 or not all(0 < d < 1 for d in self.sweep_densities):
            raise ValueError("densities must be in (0, 1)")
        fsio.Throttle.parse(self.throttle)  # raises ValueError when malformed

    @classmethod
    def quick(cls, **kw: Any) -> BenchConfig:
        """< 60 s on 2 cores: 32M elements (~64 MB bf16), sweep at 8M, 3 timed versions."""
        base = cls(
            elements=32_000_000,
            sweep_elements=8_000_000,
            versions=3,
            repeats=3,
            full_repeats=2,
            timeout=300.0,
            name="quick",
        )
        return replace(base, **kw)

    @classmethod
    def full(cls, **kw: Any) -> BenchConfig:
        """The full run: 96M elements and the scale sweep (:mod:`asyncsync.ops.bench.scale`)."""
        return replace(cls(scale_sizes=scale.DEFAULT_SIZES), **kw)

    @property
    def throttle_spec(self) -> fsio.Throttle:
        return fsio.Throttle.parse(self.throttle)

    @property
    def bucket_size(self) -> int:
        """Bytes per bucket (= per shard). By default 1/16 of the bf16 model, in [1, 32] MiB.

        A production model (GBs) is hundreds of the publisher's default 32 MiB buckets; a
        benchmark model of tens of MB in 32 MiB buckets would be two or three shards, which
        leaves the pipelines nothing to overlap and makes the bounded per-bucket buffers look
        like a large share of the model. Sixteen buckets keeps the production shape.
        """
        if self.bucket_bytes is not None:
            return self.bucket_bytes
        return min(32 << 20, max(1 << 20, (2 * self.elements // 16 + (1 << 19)) >> 20 << 20))


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = 0
    with contextlib.suppress(ValueError, OSError):
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_bytes": mem,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


# ------------------------------------------------------------------------------------ workloads
def _workload(elements: int, density: float | None, cfg: BenchConfig, **kw: Any) -> Workload:
    return Workload.for_elements(elements, density=density, seed=cfg.seed, **kw)


def _make_states(cfg: BenchConfig, work: Path) -> tuple[list[str], dict[str, int]]:
    """Write version 0..N of the main workload's publish view; sizes of the 0 -> 1 change."""
    wl = _workload(cfg.elements, cfg.density, cfg)
    paths: list[str] = []
    prev = wl.state_dict()
    sizes: dict[str, int] = {}
    for v in range(cfg.versions + 1):
        if v:
            wl.step()
            cur = wl.state_dict()
            if v == 1:
                sizes = all_sizes(prev, cur, bucket_bytes=cfg.bucket_size)
            prev = cur
        path = work / f"state-{v:03d}.safetensors"
        save_state_dict(prev, path)
        paths.append(str(path))
    return paths, sizes


def _sweep(cfg: BenchConfig, main: dict[str, int], progress: Progress) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    cases: list[tuple[str, float | None, torch.dtype]] = [
        (f"bf16 ~{100 * d:g} %", d, torch.bfloat16) for d in cfg.sweep_densities
    ]
    cases.append(("fp32 model", None, torch.float32))
    for label, density, dtype in cases:
        progress(f"sweep: {label}")
        wl = _workload(cfg.sweep_elements, density, cfg, publish_dtype=dtype)
        old = wl.state_dict()
        wl.step()
        rows.append(
            {
                "workload": label,
                "dtype": str(dtype).removeprefix("torch."),
                "target_density": density,
                **all_sizes(old, wl.state_dict(), bucket_bytes=cfg.bucket_size),
            }
        )
        del wl, old
        gc.collect()
    main_row = {
        "workload": f"bf16 ~{100 * cfg.density:g} % (main)",
        "dtype": "bfloat16",
        "target_density": cfg.density,
        **main,
    }
    rows.append(main_row)
    rows.sort(key=lambda r: (r["dtype"] != "bfloat16", r["changed"] / r["elements"]))
    return rows


# ------------------------------------------------------------------------------------ children
def _start(job: Job, work: Path, tag: str) -> tuple[subprocess.Popen[bytes], Path]:
    job_path = work / f"job-{tag}.json"
    replace(job, spawned_at=time.time()).write(job_path)
    log = work / f"log-{tag}.txt"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "asyncsync.ops.bench", str(job_path)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "ASYNCSYNC_THROTTLE": ""},  # children set it themselves
        )
    return proc, log


def _finish(procs: list[tuple[subprocess.Popen[bytes], Path, Job]], timeout: float) -> list[Any]:
    """Wait for the children; their results, or BenchFailed naming the first that failed.

    All of them at once: a publisher waits for its receiver's ack (and a receiver for the
    publisher's versions) up to the job's timeout, so a child that fails must fail the run
    at once, not after its peer has waited out that timeout."""
    deadline = time.monotonic() + timeout
    try:
        while any(proc.poll() is None for proc, _, _ in procs):
            for proc, log, _ in procs:
                if proc.poll() not in (None, 0):
                    raise _exited(proc, log)
            if time.monotonic() >= deadline:
                raise BenchFailed(
                    f"benchmark child timed out after {timeout:.0f}s; rerun with --keep to "
                    "keep the logs; the stacks of the children still running:\n" + _stacks(procs)
                )
            time.sleep(0.05)
        for proc, log, _ in procs:
            if proc.returncode != 0:
                raise _exited(proc, log)
    finally:
        for proc, _, _ in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return [json.loads(Path(job.result).read_text()) for _, _, job in procs]


def _exited(proc: subprocess.Popen[bytes], log: Path) -> BenchFailed:
    """The failure of a child: the signal that killed it, or its log's last line (the exception
    of a traceback), first; then the log's end (the error is printed on one line: a
    traceback's lines escaped in it)."""
    tail = log.read_text(errors="replace")[-2000:]
    rc = proc.returncode
    last = next((line.strip() for line in reversed(tail.splitlines()) if line.strip()), "")
    why = f"exited {rc}: {last or 'its log is empty'}"
    if rc is not None and rc < 0:  # its log's last line says nothing of a signal
        with contextlib.suppress(ValueError):
            why = f"killed by {signal.Signals(-rc).name}"
            why += " (the OOM killer?)" if -rc == signal.SIGKILL else ""
    return BenchFailed(f"benchmark child {why}; {log} (kept with --keep) ends with:\n{tail}")


def _stacks(procs: list[tuple[subprocess.Popen[bytes], Path, Job]]) -> str:
    """Every asyncio task's and thread's stack of each child still running (SIGUSR2, SIGUSR1:
    the worker's handlers), from the end of its log."""
    running = [(proc, log) for proc, log, _ in procs if proc.poll() is None]
    for sig in (signal.SIGUSR2, signal.SIGUSR1):  # asyncio tasks (on the loop), then threads
        for proc, _ in running:
            with contextlib.suppress(OSError):
                proc.send_signal(sig)
        time.sleep(1.0)  # each dump is written by the child itself
    return "\n".join(
        f"--- {log.name} (pid {proc.pid}):\n{log.read_text(errors='replace')[-12000:]}"
        for proc, log in running
    )


def _run_cost(cfg: BenchConfig, work: Path, states: list[str]) -> dict[str, Any]:
    t = cfg.throttle_spec
    job = Job(
        role="cost",
        root=str(work / "root-cost"),
        result=str(work / "result-cost.json"),
        states=states,
        checkpoint=str(work / "ckpt-cost"),
        bandwidth=t.bandwidth,
        latency=t.latency,
        bucket_bytes=cfg.bucket_size,
        repeats=cfg.repeats,
        full_repeats=cfg.full_repeats,
        timeout=cfg.timeout,
    )
    proc, log = _start(job, work, "cost")
    (out,) = _finish([(proc, log, job)], cfg.timeout)
    return dict(out)


def _run_e2e(cfg: BenchConfig, work: Path, states: list[str], pipelined: bool) -> dict[str, Any]:
    """A publisher child and a receiver child over one throttled root."""
    tag = "pipelined" if pipelined else "serialized"
    t = cfg.throttle_spec
    root = work / f"root-{tag}"
    root.mkdir()
    pub = Job(
        role="publish",
        root=str(root),
        result=str(work / f"result-pub-{tag}.json"),
        states=states,
        bandwidth=t.bandwidth,
        latency=t.latency,
        pipelined=pipelined,
        prefetch=pipelined,
        bucket_bytes=cfg.bucket_size,
        ready=str(work / f"ready-{tag}"),
        timeout=cfg.timeout,
    )
    rec = replace(
        pub,
        role="receive",
        result=str(work / f"result-rec-{tag}.json"),
        checkpoint=str(work / f"ckpt-{tag}"),
    )
    p_rec, l_rec = _start(rec, work, f"rec-{tag}")
    p_pub, l_pub = _start(pub, work, f"pub-{tag}")
    publisher, receiver = _finish([(p_pub, l_pub, pub), (p_rec, l_rec, rec)], cfg.timeout)
    return {"publisher": publisher, "receiver": receiver}


def _run_scale(cfg: BenchConfig, work: Path, say: Progress) -> list[dict[str, Any]]:
    """The scale sweep: per size a floors child, then a publisher and a receiver child."""
    t = cfg.throttle_spec
    shared = Job(
        role="scale-cost", root="", result="", bandwidth=t.bandwidth, latency=t.latency,
        bucket_bytes=32 << 20, repeats=cfg.repeats, full_repeats=1, timeout=cfg.timeout,
        versions=cfg.scale_versions, density=cfg.density, seed=cfg.seed, threads=cfg.threads,
        redo_log=cfg.redo_log,
    )  # fmt: skip
    rows = []
    for size in cfg.scale_sizes:
        jobs = scale.jobs_for(shared, work, size)
        say(f"scale {size / 1e9:.2f} GB: floors and full-checkpoint sync")
        (cost,) = _finish([(*_start(jobs["cost"], work, f"scale-cost-{size}"), jobs["cost"])],
                          cfg.timeout)  # fmt: skip
        say(f"scale {size / 1e9:.2f} GB: end to end over {cfg.throttle}")
        rec, pub = jobs["receive"], jobs["publish"]
        p_rec = (*_start(rec, work, f"scale-rec-{size}"), rec)
        p_pub = (*_start(pub, work, f"scale-pub-{size}"), pub)
        publisher, receiver = _finish([p_pub, p_rec], cfg.timeout)
        shutil.rmtree(rec.checkpoint, ignore_errors=True)
        shutil.rmtree(pub.root, ignore_errors=True)
        shutil.rmtree(jobs["cost"].checkpoint, ignore_errors=True)
        rows.append({"size": size, "cost": cost, "publisher": publisher, "receiver": receiver})
    return rows


def _run_peers(cfg: BenchConfig, work: Path, say: Progress) -> list[dict[str, Any]]:
    """The peer comparison (:mod:`asyncsync.ops.bench.peers`): per size a publisher and a
    receiver child holding every system's side, the systems interleaved per version."""
    t = cfg.throttle_spec
    rows = []
    for size in cfg.scale_sizes:
        tag = f"{size >> 20}M"
        root = work / f"root-peers-{tag}"
        root.mkdir()
        pub = Job(
            role="peer-publish", root=str(root), result=str(work / f"result-peers-pub-{tag}.json"),
            ready=str(work / f"ready-peers-{tag}"), bandwidth=t.bandwidth, latency=t.latency,
            bucket_bytes=32 << 20, timeout=cfg.timeout, versions=cfg.scale_versions,
            density=cfg.density, seed=cfg.seed, scale_bytes=size, threads=cfg.threads,
        )  # fmt: skip
        rec = replace(
            pub,
            role="peer-receive",
            result=str(work / f"result-peers-rec-{tag}.json"),
            checkpoint=str(work / f"ckpt-peers-{tag}"),
        )
        say(f"peers {size / 1e9:.2f} GB over {cfg.throttle}: ours, gen1, gen2, full interleaved")
        p_rec = (*_start(rec, work, f"peers-rec-{tag}"), rec)
        p_pub = (*_start(pub, work, f"peers-pub-{tag}"), pub)
        publisher, receiver = _finish([p_pub, p_rec], cfg.timeout)
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(rec.checkpoint, ignore_errors=True)
        rows.append({"size": size, "publisher": publisher, "receiver": receiver})
    return rows


def run_bench(cfg: BenchConfig, progress: Progress | None = None) -> dict[str, Any]:
    """Run every measurement of the benchmark once; return the raw results (see summarise)."""
    say = progress or (lambda msg: logger.info("%s", msg))
    t0 = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="asyncsync-bench-", dir=cfg.workdir))
    if cfg.peers_only or cfg.scale_only:  # one part alone: the peers or the sweep
        key, part = ("peers", _run_peers) if cfg.peers_only else ("scale", _run_scale)
        try:
            rows = part(cfg, work, say)
        finally:
            shutil.rmtree(work, ignore_errors=True) if not cfg.keep else say(f"kept {work}")
        return {
            "config": _config(cfg),
            "machine": machine_info(),
            key: rows,
            "seconds": time.perf_counter() - t0,
        }
    try:
        say(
            f"workload: {cfg.elements:,} elements at ~{100 * cfg.density:g} %, "
            f"{cfg.versions + 1} versions"
        )
        states, main = _make_states(cfg, work)
        gc.collect()
        sweep = _sweep(cfg, main, say)
        say("publish cost, apply throughput, full-checkpoint sync (one child)")
        cost = _run_cost(cfg, work, states)
        say(f"end to end over {cfg.throttle}: pipelined")
        pipelined = _run_e2e(cfg, work, states, pipelined=True)
        say(f"end to end over {cfg.throttle}: serialized")
        serialized = _run_e2e(cfg, work, states, pipelined=False)
        scale_rows = _run_scale(cfg, work, say) if cfg.scale_sizes else []
    finally:
        if cfg.keep:
            say(f"kept the work directory {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return {
        "config": _config(cfg),
        "machine": machine_info(),
        "main": main,
        "sweep": sweep,
        "cost": cost,
        "e2e": {"pipelined": pipelined, "serialized": serialized},
        "scale": scale_rows,
        "seconds": time.perf_counter() - t0,
    }


def _config(cfg: BenchConfig) -> dict[str, Any]:
    return {
        **{k: v for k, v in cfg.__dict__.items() if k not in ("workdir", "keep")},
        "bucket_bytes": cfg.bucket_size,
    }
