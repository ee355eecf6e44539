"""``asyncsync bench --profile``: where a publish and an apply spend their time at one size.

The scale sweep's setup (:mod:`asyncsync.ops.bench.scale`: the same generated bf16 states at
~3 %, 32 MiB buckets, the ``LocalCheckpoint`` engine, the shared root throttled), but both sides
in this one process, one after the other: the publish of version v, then the receiver's
``sync_once`` of it to the ack, then the receiver's flush (the sweep overlaps that flush with
the next publish; here it is waited for so the two sides' profiles stay apart). Since the
receiver starts only once the manifest exists, that is also what the sweep does.

Two views of each side, written as small text files (``profile_publish_<size>.txt``,
``profile_apply_<size>.txt``):

* **stages**: wall and thread-CPU seconds per call of the functions that make up the data path
  (:data:`PUBLISH_STAGES`, :data:`APPLY_STAGES`), wrapped for the timed versions; nested stages
  are indented under the stage that calls them, so each line's time includes those below it;
  where Linux says (schedstat) the wall is split further: the time the thread waited for a
  core (``queued``) and the rest of the wall beyond CPU (``asleep``: I/O, locks, the GIL);
* **samples**: one more version with a sampler thread that reads every thread's CPU clock every
  millisecond or so and charges the CPU used since to the thread's Python stack (self: the
  innermost frame; total: any frame on the stack). C code that holds the GIL delays a sample,
  so trust the stage table for those; C code that releases it (zstd, xxhash, the native
  kernels, torch) is charged to the Python function that called it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures.thread
import contextlib
import ctypes
import functools
import gc
import importlib
import inspect
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from asyncsync import fsio
from asyncsync.codec import native
from asyncsync.ops.bench.scale import make_state, receiver_floor, step_state, trainer_floor
from asyncsync.pipeline import set_threads, threads
from asyncsync.publish.publisher import Publisher
from receiver.agent import ReceiverAgent
from receiver.engines.checkpoint import LocalCheckpoint

__all__ = ["APPLY_STAGES", "PUBLISH_STAGES", "StageTimers", "StackSampler", "run_profile"]

# (depth, label, "module:attribute path") of each stage; depth only indents the report.
PUBLISH_STAGES: tuple[tuple[int, str, str], ...] = (
    (0, "publish (total)", "asyncsync.publish.publisher:Publisher._publish"),
    (1, "bucket items (snapshot views)", "asyncsync.publish.snapshot:bucket_items"),
    (
        1,
        "diff (C kernel: positions, values, xor, XXH3, snapshot advance)",
        "asyncsync.publish.publisher:diff_bucket",
    ),
    (1, "encode bucket", "asyncsync.publish.publisher:encode_bucket"),
    (2, "encode delta", "asyncsync.codec:encode_delta"),
    (3, "Elias-Fano positions", "asyncsync.codec.delta:_ef_encode"),
    (3, "byte planes", "asyncsync.codec.delta:_planes"),
    (3, "zstd values", "asyncsync.codec.delta:_zstd"),
    (2, "checksum new tensor bytes", "asyncsync.codec.shards:checksum_tensor"),
    (1, "write (pack, shard file)", "asyncsync.publish.writer:VersionWriter.write"),
    (1, "finish (last shard)", "asyncsync.publish.writer:VersionWriter.finish"),
    (
        2,
        "shard file write+fsync (throttled)",
        "asyncsync.publish.writer:VersionWriter._write_shard",
    ),
    (1, "commit manifest (throttled)", "asyncsync.publish.publisher:commit_version"),
    (1, "advance snapshot", "asyncsync.publish.advance:bring_up"),
    (1, "log + retention", "asyncsync.publish.publisher:log_and_collect"),
)
APPLY_STAGES: tuple[tuple[int, str, str], ...] = (
    (0, "sync_once (discover .. ack)", "receiver.agent:ReceiverAgent._sync"),
    (1, "apply version (begin .. commit)", "receiver.agent:ReceiverAgent._apply_version"),
    (
        2,
        "begin (state.json fsync, journal dir)",
        "receiver.engines.checkpoint.engine:LocalCheckpoint._begin",
    ),
    (2, "read shard (throttled)", "receiver.shard_reader:read_into"),
    (2, "verify shard checksum", "receiver.shard_reader:checksum_bytes"),
    (2, "parse shard", "receiver.agent:open_shard"),
    (2, "decode group", "receiver.agent:decode_pieces"),
    (3, "Elias-Fano positions", "asyncsync.codec.delta:_ef_decode"),
    (3, "zstd values", "asyncsync.codec.delta:_unzstd"),
    (3, "byte planes", "asyncsync.codec.delta:_unplanes"),
    (2, "engine apply group", "receiver.engines.checkpoint.engine:LocalCheckpoint._apply_delta"),
    (3, "journal + patch", "receiver.engines.checkpoint.inplace:journal_and_patch"),
    (4, "prefault (MADV_POPULATE_WRITE)", "receiver.engines.st_layout:FileMaps.prefault"),
    (4, "journal encode (gather old values)", "receiver.engines.checkpoint.journal:encode_parts"),
    (4, "journal encode (old values, EF)", "receiver.engines.checkpoint.journal:encode"),
    (4, "journal write+fsync", "receiver.engines.checkpoint.inplace:write_record"),
    (
        4,
        "journal record created (progressive: no fsync)",
        "receiver.engines.checkpoint.journal:create_progressive",
    ),
    (4, "patch (XOR)", "receiver.engines.checkpoint.inplace:apply_patch"),
    (
        4,
        "patch + checksum, old values saved first (one pass)",
        "receiver.engines.checkpoint.inplace:patch_and_checksum",
    ),
    (2, "commit", "receiver.engines.checkpoint.engine:LocalCheckpoint._commit_delta"),
    (3, "verify tensors (full checksum)", "receiver.engines.checkpoint.inplace:first_mismatch"),
    (3, "state.json write+fsync", "receiver.state:StateStore.save"),
    (
        3,
        "clear journal + index",
        "receiver.engines.checkpoint.engine:LocalCheckpoint._after_commit",
    ),
    (1, "ack (throttled)", "receiver.agent:ReceiverAgent._ack"),
    (
        0,
        "flush after the ack (not in apply)",
        "receiver.engines.checkpoint.engine:LocalCheckpoint._make_durable",
    ),
)


@dataclass
class _Tally:
    calls: int = 0
    wall: float = 0.0
    cpu: float = 0.0
    queued: float = 0.0  # runnable, not running (NaN where the kernel does not say)


class _RunQueue:
    """The calling thread's seconds spent runnable but not running so far (Linux schedstat's
    second field: waiting for a core), NaN where it cannot be read. Read without letting go of
    the GIL (``ctypes.PyDLL``): a stage timer that released it twice per call would add the
    very waits it measures. One descriptor per thread, closed by :meth:`close`."""

    def __init__(self) -> None:
        self._fds: dict[int, tuple[int, ctypes.Array[ctypes.c_char]]] = {}  # by thread id
        try:
            pread = ctypes.PyDLL(None).pread
        except (OSError, AttributeError):
            self._pread = None
        else:
            pread.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_long]
            pread.restype = ctypes.c_ssize_t
            self._pread = pread

    def __call__(self) -> float:
        if self._pread is None:
            return float("nan")
        tid = threading.get_native_id()
        for _ in range(2):
            at = self._fds.get(tid)
            if at is None:
                try:
                    fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
                except OSError:
                    fd = -1
                at = self._fds[tid] = (fd, ctypes.create_string_buffer(128))
            fd, buf = at
            n = self._pread(fd, buf, 127, 0) if fd >= 0 else -1
            if n >= 0 or fd < 0:
                break
            os.close(fd)  # a dead thread's (ESRCH), whose id this one reuses: opened again
            del self._fds[tid]
        fields = buf.raw[: max(n, 0)].split(None, 2)
        return int(fields[1]) / 1e9 if len(fields) >= 2 else float("nan")

    def close(self) -> None:
        for fd, _ in self._fds.values():
            if fd >= 0:
                os.close(fd)
        self._fds.clear()


def _resolve(target: str) -> tuple[Any, str]:
    module, _, path = target.partition(":")
    owner: Any = importlib.import_module(module)
    *parents, attr = path.split(".")
    for p in parents:
        owner = getattr(owner, p)
    return owner, attr


@dataclass
class StageTimers:
    """Wraps each stage's function to add up its calls, wall and thread-CPU seconds."""

    stages: tuple[tuple[int, str, str], ...]
    tallies: dict[str, _Tally] = field(default_factory=lambda: defaultdict(_Tally))
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _queued: _RunQueue = field(default_factory=_RunQueue)

    @contextlib.contextmanager
    def installed(self) -> Iterator[StageTimers]:
        saved = []
        for _, label, target in self.stages:
            try:
                owner, attr = _resolve(target)
                fn = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
            except (AttributeError, KeyError):  # a stage of another version of the code
                continue
            saved.append((owner, attr, fn))
            setattr(owner, attr, self._wrap(label, fn))
        try:
            yield self
        finally:
            for owner, attr, fn in reversed(saved):
                setattr(owner, attr, fn)
            self._queued.close()

    def _add(self, label: str, wall: float, cpu: float, queued: float = float("nan")) -> None:
        with self._lock:
            t = self.tallies[label]
            t.calls += 1
            t.wall += wall
            t.cpu += cpu
            t.queued += queued

    def _wrap(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def awrapper(*args: Any, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return await fn(*args, **kwargs)
                finally:
                    self._add(label, time.perf_counter() - t0, float("nan"))

            return awrapper

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0, c0 = time.perf_counter(), time.thread_time()
            q0 = self._queued()  # read inside the wall: queued + CPU never exceeds it
            try:
                return fn(*args, **kwargs)
            finally:
                queued = self._queued() - q0
                wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
                self._add(label, wall, cpu, queued)

        return wrapper


class StackSampler:
    """Charges each thread's CPU time to its Python stack, sampled every ``interval`` s.

    The sampler needs the GIL, so it mostly runs just as a thread lets go of it: when a pool
    worker finishes an item and waits for the next (``thread.py(_worker)``), when a thread
    waits on a condition, at a torch call (every torch op lets go of it: ``int_view``'s
    ``view``). Such a frame is charged the CPU the thread used since the previous sample,
    the tail of the work before it. So the pool workers' CPU between their work items is
    measured here too, per thread (:attr:`pool_cpu`, :attr:`pool_items_cpu`), not sampled.
    """

    def __init__(self, interval: float = 0.001):
        self.interval = interval
        self.self_cpu: dict[str, float] = defaultdict(float)
        self.total_cpu: dict[str, float] = defaultdict(float)
        self.cpu = 0.0
        self.samples = 0
        self.pool_cpu = 0.0  # the pool workers' thread CPU in the window
        self.pool_items_cpu = 0.0  # of which inside their work items
        self.pool_items = 0
        self._pool_start: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)
        self._lock = threading.Lock()

    def __enter__(self) -> StackSampler:
        self._pool_start = _pool_cpu()
        item = concurrent.futures.thread._WorkItem  # (the pool's item: the task and its result)
        self._saved_run = item.run
        item.run = self._timed_run(item.run)  # type: ignore[method-assign,assignment]
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        concurrent.futures.thread._WorkItem.run = self._saved_run  # type: ignore[method-assign]
        end = _pool_cpu()
        self.pool_cpu = sum(cpu - self._pool_start.get(i, 0.0) for i, cpu in end.items())

    def _timed_run(self, run: Callable[[Any], None]) -> Callable[[Any], None]:
        def timed(item: Any) -> None:
            if not threading.current_thread().name.startswith(_POOL_PREFIX):
                return run(item)
            c0 = time.thread_time()
            try:
                return run(item)
            finally:
                used = time.thread_time() - c0
                with self._lock:
                    self.pool_items_cpu += used
                    self.pool_items += 1

        return timed

    def _run(self) -> None:
        me = threading.get_ident()
        last: dict[int, float] = {}
        while not self._stop.wait(self.interval):
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                try:
                    now = time.clock_gettime(time.pthread_getcpuclockid(ident))
                except (OSError, ValueError):
                    continue
                used, last[ident] = now - last.get(ident, now), now
                if used <= 0:
                    continue
                self.samples += 1
                self.cpu += used
                seen: set[str] = set()
                f: Any = frame
                leaf = True
                while f is not None:
                    code = f.f_code
                    key = f"{Path(code.co_filename).name}:{code.co_firstlineno}({code.co_name})"
                    if leaf:
                        self.self_cpu[key] += used
                        leaf = False
                    if key not in seen:
                        self.total_cpu[key] += used
                        seen.add(key)
                    f = f.f_back


_POOL_PREFIX = "asyncsync-cpu"  # (asyncsync.pipeline's thread_name_prefix)


def _pool_cpu() -> dict[int, float]:
    """Thread CPU seconds so far of each live pool worker, by thread id."""
    out = {}
    for t in threading.enumerate():
        if t.name.startswith(_POOL_PREFIX) and t.ident is not None:
            with contextlib.suppress(OSError, ValueError):  # (one that has just ended)
                out[t.ident] = time.clock_gettime(time.pthread_getcpuclockid(t.ident))
    return out


def _stage_table(timers: StageTimers, versions: int, total_label: str) -> list[str]:
    total = timers.tallies[total_label].wall / versions if total_label in timers.tallies else 0
    lines = [
        f"{'stage':<58} {'calls/v':>8} {'wall ms/v':>10} {'CPU ms/v':>9} {'queued':>7} "
        f"{'asleep':>7} {'% of wall':>9}",
    ]
    for depth, label, _ in timers.stages:
        t = timers.tallies.get(label)
        if t is None or not t.calls:
            continue
        wall, cpu, queued = (1e3 * x / versions for x in (t.wall, t.cpu, t.queued))
        share = f"{100 * t.wall / versions / total:8.0f}%" if total else ""
        cpu_text = "" if cpu != cpu else f"{cpu:9.1f}"  # NaN: a coroutine
        queued_text, asleep_text = ("", "") if queued != queued else (
            f"{queued:7.1f}", f"{max(wall - cpu - queued, 0.0):7.1f}"
        )  # fmt: skip
        lines.append(
            f"{'  ' * depth + label:<58} {t.calls / versions:8.1f} {wall:10.1f} {cpu_text:>9} "
            f"{queued_text:>7} {asleep_text:>7} {share:>9}"
        )
    return lines


def _sample_table(s: StackSampler, n: int) -> list[str]:
    lines = [
        f"sampled CPU: {s.cpu * 1e3:.0f} ms in {s.samples} samples",
        f"pool workers ({_POOL_PREFIX}), measured per thread, not sampled: "
        f"{s.pool_cpu * 1e3:.1f} ms CPU, {s.pool_items_cpu * 1e3:.1f} ms of it inside "
        f"{s.pool_items} work items, {(s.pool_cpu - s.pool_items_cpu) * 1e3:.1f} ms between "
        "them (the pool's own glue)",
        "(a frame where a thread lets go of the GIL is charged the CPU of the work before it: "
        "thread.py(_worker), threading.py(wait) and a torch call such as int_view's are "
        "mostly that work's tail, not their own)",
        "",
    ]
    for title, table in (("self", s.self_cpu), ("total (self + callees)", s.total_cpu)):
        lines.append(f"top {n} by {title} CPU:")
        lines.append(f"{'CPU ms':>8} {'%':>5}  function")
        for key, cpu in sorted(table.items(), key=lambda kv: -kv[1])[:n]:
            lines.append(f"{cpu * 1e3:8.1f} {100 * cpu / max(s.cpu, 1e-12):5.1f}  {key}")
        lines.append("")
    return lines


def _machine() -> str:
    return (
        f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"native kernels {'on' if native.kernels is not None else 'OFF'}"
    )


async def run_profile(
    size: int,
    out_dir: Path,
    *,
    versions: int = 3,
    throttle: str = "200MB/s,5ms",
    density: float = 0.03,
    seed: int = 0,
    top: int = 25,
    workdir: Path | None = None,
    threads: int | None = None,
    say: Callable[[str], None] = lambda _: None,
) -> dict[str, Path]:
    """Profile publish and apply at ``size`` model bytes; write the two text files into
    ``out_dir`` and return their paths (``{"publish": ..., "apply": ...}``). ``throttle``: as
    ``fsio.Throttle.parse`` reads it, ``""`` for none (the local filesystem). ``threads``: the
    CPU pool's and torch's intra-op threads while publish and apply run, as the sweep's
    ``--threads`` sets them in its children (None: the machine's default); the floors keep
    the machine's, and both are put back afterwards."""
    work = Path(tempfile.mkdtemp(prefix="asyncsync-profile-", dir=workdir))
    try:
        return await _profile(
            size, out_dir, work, versions, throttle, density, seed, top, threads, say
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


@contextlib.contextmanager
def _threads_set(n: int | None) -> Iterator[int]:
    """The pool and torch at ``n`` threads (None: as they are) meanwhile; yields the pool size
    (after: ASYNCSYNC_THREADS or the CPU count, and torch's count as it was)."""
    if n is None:
        yield threads()
        return
    saved = torch.get_num_threads()
    set_threads(n)
    torch.set_num_threads(n)
    try:
        yield threads()
    finally:
        set_threads(None)
        torch.set_num_threads(saved)


async def _profile(
    size: int,
    out_dir: Path,
    work: Path,
    versions: int,
    throttle: str,
    density: float,
    seed: int,
    top: int,
    nthreads: int | None,
    say: Callable[[str], None],
) -> dict[str, Path]:
    root, ckpt = work / "root", work / "ckpt"
    spec = fsio.Throttle.parse(f"{throttle}@{root}") if throttle else None  # "": none
    sd = make_state(size, seed)
    model = sum(t.numel() * t.element_size() for t in sd.values())
    say(f"profile {model / 1e9:.2f} GB: floors")
    new = {k: t.clone() for k, t in sd.items()}
    step_state(new, 1, density, seed)
    floors = {
        "trainer floor (one torch.ne pass)": min(trainer_floor(sd, new) for _ in range(3)),
        "receiver floor (dirty every page)": min(
            receiver_floor(sd, new, work)[0] for _ in range(3)
        ),
    }
    del new
    gc.collect()
    pub_timers, rec_timers = StageTimers(PUBLISH_STAGES), StageTimers(APPLY_STAGES)
    samplers = {"publish": StackSampler(), "apply": StackSampler()}
    walls: dict[str, list[float]] = {"publish": [], "apply": []}
    engine = LocalCheckpoint(ckpt)
    agent = ReceiverAgent(root, engine, "profile", poll_interval=0.05)
    async with Publisher(root, bucket_bytes=32 << 20, keyframe_interval=0) as pub, agent:
        with _threads_set(nthreads) as pool:
            torch_threads = torch.get_num_threads()
            say(f"profile {model / 1e9:.2f} GB: seed (a pool of {pool} threads)")
            await pub.seed(sd)
            await agent.sync_once()
            await engine.flushed()
            for v in range(1, versions + 2):
                sampled = v == versions + 1  # the last version: sampled, not timed by stage
                say(f"profile: version {v}" + (" (sampled)" if sampled else ""))
                step_state(sd, v, density, seed)
                gc.collect()
                fsio.set_throttle(spec)
                try:
                    for side, step in (
                        ("publish", lambda: pub.publish(sd)),
                        ("apply", agent.sync_once),
                    ):
                        timers = pub_timers if side == "publish" else rec_timers
                        ctx: Any = samplers[side] if sampled else timers.installed()
                        with ctx:
                            t0 = time.perf_counter()
                            await step()
                            dt = time.perf_counter() - t0
                            if side == "apply":
                                await engine.flushed()
                        if not sampled:
                            walls[side].append(dt)
                finally:
                    fsio.set_throttle(None)
    given = (
        "--threads" if nthreads is not None else "the default: ASYNCSYNC_THREADS, else every core"
    )
    pool_line = (
        f"# CPU pool (asyncsync-cpu) {pool} threads, torch {torch_threads} intra-op threads "
        f"({given})"
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for side, timers, total in (
        ("publish", pub_timers, "publish (total)"),
        ("apply", rec_timers, "sync_once (discover .. ack)"),
    ):
        tag = f"{size >> 30}g" if size % (1 << 30) == 0 else f"{size >> 20}m"
        path = out_dir / f"profile_{side}_{tag}.txt"
        w = sorted(walls[side])
        lines = [
            f"# {side} at {model / 1e9:.2f} GB bf16, ~{100 * density:g} % changed, "
            + (f"throttle {throttle}" if throttle else "no throttle")
            + " on the shared root",
            f"# asyncsync bench --profile --scale-sizes {size >> 20}MiB"
            + (f" --threads {nthreads}" if nthreads is not None else "")
            + f"  ({_machine()})",
            pool_line,
            f"# {side} wall per version (s): "
            + ", ".join(f"{x:.3f}" for x in walls[side])
            + f"; median {w[len(w) // 2]:.3f}",
        ]
        lines += [f"# {k}: {1e3 * s:.1f} ms" for k, s in floors.items()]
        lines += ["", f"## stages (mean of {versions} versions)", ""]
        lines += [
            f"(CPU: the calling thread's; the tensors' work on the {pool}-thread pool "
            "(asyncsync-cpu) is in the samples below, not in this column. queued: the calling "
            "thread runnable but not running (waiting for a core); asleep: wall - CPU - "
            "queued (I/O, locks, the GIL, and for a stage that hands its work to the pool, "
            "the wait for it). Stages run on several threads at once add their walls up)",
            "",
        ]
        lines += _stage_table(timers, versions, total)
        lines += ["", "## samples (one more version)", ""]
        lines += _sample_table(samplers[side], top)
        path.write_text("\n".join(lines).rstrip() + "\n")
        paths[side] = path
    return paths


def main(
    size: int,
    out_dir: Path,
    *,
    versions: int = 3,
    throttle: str = "200MB/s,5ms",
    workdir: Path | None = None,
    threads: int | None = None,
) -> dict[str, Path]:
    """Run :func:`run_profile` in a fresh event loop (the CLI's entry), progress on stderr."""
    t0 = time.perf_counter()

    def say(msg: str) -> None:
        print(f"profile [{time.perf_counter() - t0:5.1f}s]: {msg}", file=sys.stderr, flush=True)

    return asyncio.run(
        run_profile(
            size,
            out_dir,
            versions=versions,
            throttle=throttle,
            workdir=workdir,
            threads=threads,
            say=say,
        )
    )
