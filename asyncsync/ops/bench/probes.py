"""What the benchmark's children measure: memory, state files, floors, components, profiles.

Plain functions, used by :mod:`asyncsync.ops.bench.worker` inside fresh child processes (and by
the tests on tiny inputs): RSS readings from ``/proc``, the state-dict files the parent writes
for the children, one ``torch.ne`` pass (the floor a publish is compared with), a per-component
breakdown of a publish and of a receive, the full-checkpoint sync over the throttle, and a
cProfile of one publish and one receive with the worker-thread jobs run inline.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import cProfile
import json
import os
import pstats
import resource
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
import torch

from asyncsync import codec, fsio
from asyncsync.codec.shards import delta_shard_blob
from asyncsync.format import version_dir
from asyncsync.format.acks import read_acks
from asyncsync.format.checksum import checksum_bytes, checksum_tensor
from asyncsync.format.names import MAX_SHARD_BYTES
from asyncsync.format.store import read_manifest
from asyncsync.publish.publisher import Publisher
from receiver import shard_reader
from receiver.agent import ReceiverAgent
from receiver.engines.st_layout import read_layout

__all__ = [
    "cpu_seconds",
    "full_sync",
    "load_state_dict",
    "model_bytes",
    "ne_pass",
    "profile_round_trip",
    "publish_components",
    "receive_components",
    "reset_peak_rss",
    "rss",
    "RssSampler",
    "run_until_acked",
    "save_state_dict",
    "timed",
]


# ------------------------------------------------------------------------------------ memory
def _kb_lines(status: bytes, keys: Mapping[bytes, str]) -> dict[str, int]:
    """The ``kB`` lines of ``/proc/self/status`` text named in ``keys``, in bytes, under
    ``keys``' names (0 for a line that is not there)."""
    out = dict.fromkeys(keys.values(), 0)
    for line in status.splitlines():
        key = keys.get(line.partition(b":")[0])
        if key is not None:
            out[key] = int(line.split()[1]) * 1024
    return out


_KINDS = {b"VmRSS": "now", b"RssAnon": "anon", b"RssFile": "file", b"RssShmem": "shmem"}


def rss() -> dict[str, int]:
    """Bytes: ``now`` the current RSS, ``peak`` the highest since start or the last reset,
    ``anon``/``file``/``shmem`` the current anonymous, file-backed (mmap'd files) and shared
    memory parts (``now`` is their sum); all 0 where /proc is missing."""
    status = b""
    with contextlib.suppress(OSError):
        status = Path("/proc/self/status").read_bytes()
    return _kb_lines(status, {**_KINDS, b"VmHWM": "peak"})


class RssSampler:
    """A daemon thread that reads ``/proc/self/status`` every ``interval`` seconds and keeps
    the split of the highest ``VmRSS`` it saw into ``RssAnon`` / ``RssFile`` / ``RssShmem``.

    ``VmHWM`` says how high the RSS went, not of what: a file page mapped twice (two mappings
    of one data file) counts twice in ``RssFile`` without a second copy in memory, where a
    decode buffer counts once in ``RssAnon``. The sampled peak can miss a spike shorter than
    the interval (it is at most ``VmHWM``); :meth:`take` returns it beside the number of
    samples and the thread's own CPU seconds, which the process's CPU figures include. One
    sample reads ~1.5 KiB: 36 us in an idle process, ~0.2 ms in the bench's receiver at
    1 GiB on the loaded 2-core host, so one every 10 ms is ~2 % of a core. With ``smaps``
    also a copy of ``/proc/self/smaps`` at each new peak 16 MiB above the last (a walk of
    every mapping, ms at GBs: for a diagnosis only)."""

    def __init__(self, interval: float = 0.01, smaps: Path | None = None) -> None:
        if interval <= 0:
            raise ValueError(f"interval must be > 0, not {interval}")
        self.interval = interval
        # where to copy /proc/self/smaps at each phase's peak (``smaps.0``, ``smaps.1``, ...):
        # which mappings held the pages (the bench's ASYNCSYNC_BENCH_SMAPS)
        self.smaps = smaps
        self._phase = 0
        self._dumped = 0  # the RSS of the phase's last copy
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._at_peak: dict[str, int] = {}
        self._max: dict[str, int] = {}
        self._samples = 0
        self._cpu = 0.0  # the thread's CPU seconds since it started
        self._cpu_taken = 0.0  # ... at the last take
        self._thread: threading.Thread | None = None

    @staticmethod
    def read(fd: int) -> dict[str, int]:
        """The four readings, in bytes, from an open ``/proc/self/status`` descriptor."""
        out = _kb_lines(os.pread(fd, 8192, 0), _KINDS)
        if out["anon"] or out["file"]:  # VmRSS is their sum, but each read at its own instant
            out["now"] = out["anon"] + out["file"] + out["shmem"]
        return out

    def _sample(self, fd: int) -> None:
        """One reading, taken under the lock: a :meth:`take` between the reading and its
        record would have put a reading from before a phase into it (its peak, once: the
        pages of a mapping closed before the phase began)."""
        with self._lock:
            now = self.read(fd)
            self._samples += 1
            if now["now"] > self._at_peak.get("now", -1):
                self._at_peak = now
                dump = self.smaps is not None and now["now"] > self._dumped + (16 << 20)
                phase = self._phase
            else:
                dump = False
            for k, v in now.items():
                self._max[k] = max(self._max.get(k, 0), v)
        if dump and self.smaps is not None:  # a new peak 16 MiB above the last copy
            with contextlib.suppress(OSError):
                text = Path("/proc/self/smaps").read_bytes()
                self.smaps.with_name(f"{self.smaps.name}.{phase}").write_bytes(text)
                self._dumped = now["now"]

    def _loop(self) -> None:
        fd = os.open("/proc/self/status", os.O_RDONLY | os.O_CLOEXEC)
        try:
            c0 = time.thread_time()
            while not self._stop.is_set():
                self._sample(fd)
                with self._lock:
                    self._cpu = time.thread_time() - c0
                self._stop.wait(self.interval)
        finally:
            os.close(fd)

    def start(self) -> RssSampler:
        """Start sampling (nothing on a system without ``/proc``: :meth:`take` says 0 samples)."""
        if self._thread is None and Path("/proc/self/status").exists():
            self._thread = threading.Thread(target=self._loop, name="rss sampler", daemon=True)
            self._thread.start()
        return self

    def take(self) -> dict[str, Any]:
        """The phase since the start or the last take: ``at_peak`` (the four readings of the
        sample with the highest RSS), ``max`` (each reading's own highest), ``samples``,
        ``interval`` and ``cpu_s`` (the thread's CPU in the phase); then a new phase begins."""
        if self._thread is not None:  # one sample now: the phase's end is in it
            fd = os.open("/proc/self/status", os.O_RDONLY | os.O_CLOEXEC)
            try:
                self._sample(fd)
            finally:
                os.close(fd)
        with self._lock:
            out = {
                "at_peak": dict(self._at_peak),
                "max": dict(self._max),
                "samples": self._samples,
                "interval": self.interval,
                "cpu_s": self._cpu - self._cpu_taken,
            }
            self._cpu_taken = self._cpu
            self._at_peak, self._max, self._samples = {}, {}, 0
            self._phase, self._dumped = self._phase + 1, 0
        return out

    def stop(self) -> dict[str, Any]:
        """Stop the thread; the last phase's :meth:`take`."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        out = self.take()
        self._thread = None
        return out


def reset_peak_rss() -> bool:
    """Reset the peak RSS to the current RSS (Linux >= 4.0); False where not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


# ------------------------------------------------------------------------------------ states
def save_state_dict(sd: Mapping[str, torch.Tensor], path: Path) -> None:
    """Store one version's publish view for the children (local disk, not throttled).

    The state dict's order is kept in the metadata: the publisher numbers tensors by it.
    """
    # copied as ints: a non-contiguous bool's contiguous() writes its bytes as 0/1
    tensors = {k: v if v.is_contiguous() else codec.raw_clone(v) for k, v in sd.items()}
    safetensors.torch.save_file(tensors, str(path), metadata={"order": json.dumps(list(sd))})


def load_state_dict(
    path: str | Path, into: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """Read a file of :func:`save_state_dict` straight into tensors: fresh ones, or ``into``'s.

    Each tensor's byte range is read with ``readinto``: no mmap and no intermediate copy. With
    ``into`` (same names, dtypes and shapes) the tensors are overwritten in place, as a
    trainer's parameters are, so the process holds one copy of the model and the bench adds no
    allocation churn of its own to the publisher's memory. The result is in the saved order.
    """
    path = Path(path)
    layout = sorted(read_layout(path).values(), key=lambda loc: loc.begin)
    out: dict[str, torch.Tensor] = {}
    with open(path, "rb", buffering=0) as f:
        for loc in layout:
            t = into[loc.name] if into is not None else torch.empty(loc.shape, dtype=loc.dtype)
            if t.dtype != loc.dtype or tuple(t.shape) != loc.shape or not t.is_contiguous():
                raise ValueError(f"{path}: {loc.name} does not fit the tensor it is loaded into")
            if loc.nbytes:
                f.seek(loc.begin)
                buf = memoryview(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
                got = 0
                while got < loc.nbytes:
                    n = f.readinto(buf[got:])
                    if not n:
                        raise EOFError(f"{path}: {loc.name} is truncated")
                    got += n
            out[loc.name] = t
    with safetensors.safe_open(str(path), "pt") as f:
        order = json.loads((f.metadata() or {}).get("order", "[]"))
    return {k: out[k] for k in order} if sorted(order) == sorted(out) else out


def model_bytes(sd: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


# ------------------------------------------------------------------------------------ floors
def ne_pass(old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]) -> float:
    """Seconds of one bytewise ``torch.ne`` over every tensor pair into one bool buffer."""
    pairs = [(codec.int_view(old[k]), codec.int_view(new[k])) for k in new]
    mask = torch.empty(sum(b.numel() for _, b in pairs), dtype=torch.bool)
    t0 = time.perf_counter()
    start = 0
    for a, b in pairs:
        n = b.numel()
        torch.ne(a, b, out=mask[start : start + n])
        start += n
    return time.perf_counter() - t0


def timed(fn: Any, *args: Any) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


def publish_components(
    old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], level: int = 1
) -> dict[str, float]:
    """Seconds of each piece of a publish, run one after another on this thread (a profile).

    ``ne``: the floor; ``changed_positions``: ne + one nonzero + split; ``encode``: xef of
    every changed tensor; ``checksum``: the new bytes of every changed tensor (the manifest
    needs them); ``serialise``: the delta shard of the blobs.
    """
    names = list(new)
    olds = [codec.int_view(old[k]) for k in names]
    news = [codec.int_view(new[k]) for k in names]
    out = {"ne": ne_pass(old, new)}
    out["changed_positions"], positions = timed(codec.changed_positions, olds, news)
    t0 = time.perf_counter()
    blobs: dict[str, bytes] = {}
    for i, (a, b, p) in enumerate(zip(olds, news, positions, strict=True)):
        if p.numel():
            enc = codec.encode_delta(a, b, p, "xef", level=level)
            blobs[f"t{i}.pos"] = enc.positions
            blobs[f"t{i}.val"] = enc.values
    out["encode"] = time.perf_counter() - t0
    changed = [new[k] for k, p in zip(names, positions, strict=True) if p.numel()]
    out["checksum"], _ = timed(lambda: [checksum_tensor(t) for t in changed])
    out["serialise"], _ = timed(lambda: delta_shard_blob(blobs, version=1, run_id="0" * 16))
    return out


def receive_components(root: Path, version: int) -> dict[str, float]:
    """Seconds of the receiver's pure work on one delta version: verify and decode its shards
    (``receiver.shard_reader``, as the agent does), and checksum every tensor it touches (what
    the engine's commit verifies)."""
    m = read_manifest(root, version)
    vdir = root / f"v{version:012d}"
    out = {"verify": 0.0, "decode": 0.0}
    for idx, shard in enumerate(m.shards):
        if shard.role != "delta":
            continue
        data = (vdir / shard.file).read_bytes()
        dt, _ = timed(checksum_bytes, data, m.checksum_algorithm)
        out["verify"] += dt
        t0 = time.perf_counter()
        shard_reader.decode_shard(m, "delta", idx, shard, data, shard.file)  # the agent's decode
        out["decode"] += time.perf_counter() - t0
    return out


def cpu_seconds(system_only: bool = False) -> float:
    """CPU seconds (user + system, or system alone: the kernel's page faults and writeback)
    this process used so far, every thread (the pools too)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_stime if system_only else r.ru_utime + r.ru_stime


async def run_until_acked(
    agent: ReceiverAgent,
    final: int,
    *,
    cpu: list[float] | None = None,
    cpu_sys: list[float] | None = None,
) -> list[float]:
    """Run ``agent`` until its ack names ``final`` or later; the apply seconds of each version
    it applied meanwhile (``status().last_apply_seconds``). ``cpu``: gets the process's CPU
    seconds of each acked version, from when its directory was first seen (the streamed
    shards) to its ack; ``cpu_sys`` the system part. The watch polls the agent's version in memory
    every 5 ms and reads the ack file only once the agent holds a newer version, so its own
    CPU (a directory listing per poll before) stays out of the apply's."""
    applies: list[float] = []
    stop = asyncio.Event()

    async def watch() -> None:
        seen = agent.status().applied
        held = agent.version
        start: tuple[float, float] | None = None
        while True:
            s = agent.status()
            if s.applied != seen and s.last_apply_seconds is not None:
                applies.append(s.last_apply_seconds)
                seen = s.applied
            nxt = None if held is None else version_dir(agent.root, held + 1)
            if cpu is not None and start is None and nxt is not None:
                there = nxt.is_dir()  # one stat: the probe's own CPU stays out of the apply's
                start = (cpu_seconds(), cpu_seconds(system_only=True)) if there else None
            mine = None
            if held is None or (agent.version is not None and agent.version > held):
                mine = (await asyncio.to_thread(read_acks, agent.root)).get(agent.engine_id)
            if mine is not None and held is not None and mine.version > held:
                if cpu is not None and start is not None:
                    cpu.append(cpu_seconds() - start[0])
                    if cpu_sys is not None:
                        cpu_sys.append(cpu_seconds(system_only=True) - start[1])
                held, start = mine.version, None
            if mine is not None and mine.version >= final:
                stop.set()
                return
            await asyncio.sleep(0.005)

    async with asyncio.TaskGroup() as tg:
        tg.create_task(agent.run(stop=stop))
        tg.create_task(watch())
    return applies


def full_sync(sd: Mapping[str, torch.Tensor], path: Path, throttle: fsio.Throttle) -> float:
    """Seconds of a full-checkpoint sync over ``throttle``: safetensors save -> bytes ->
    atomic_write (trainer), then read_bytes -> safetensors load (engine)."""
    previous = fsio.get_throttle()
    fsio.set_throttle(throttle)
    try:
        t0 = time.perf_counter()
        fsio.atomic_write(path, safetensors.torch.save(dict(sd)))
        loaded = safetensors.torch.load(fsio.read_bytes(path, limit=MAX_SHARD_BYTES))
        dt = time.perf_counter() - t0
    finally:
        fsio.set_throttle(previous)
    del loaded
    path.unlink()
    return dt


class _InlineExecutor(concurrent.futures.ThreadPoolExecutor):
    """Runs each job on the submitting thread, at submit: ``asyncio.to_thread`` work then shows
    up in a cProfile of the event loop's thread (the stages run one after another)."""

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as exc:
            fut.set_exception(exc)
        return fut


def _top(prof: cProfile.Profile, n: int = 12) -> list[dict[str, Any]]:
    """The ``n`` functions with the most own time, as plain records."""
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    rows = []
    for (file, line, func), (_, calls, tottime, cumtime, _) in stats.items():
        where = func if file == "~" else f"{Path(file).name}:{line}({func})"
        rows.append({"function": where, "calls": calls, "tottime": tottime, "cumtime": cumtime})
    rows.sort(key=lambda r: -r["tottime"])
    return rows[:n]


async def profile_round_trip(
    pub: Publisher, agent: ReceiverAgent, state: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """cProfile of one more publish (of ``state``) and of the receiver taking it, with every
    worker-thread job run inline so the profile sees it."""
    loop = asyncio.get_running_loop()
    loop.set_default_executor(_InlineExecutor(max_workers=1))
    out: dict[str, Any] = {}
    for side, step in (("publish", lambda: pub.publish(state)), ("receive", agent.sync_once)):
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        await step()
        prof.disable()
        out[side] = {"seconds": time.perf_counter() - t0, "top": _top(prof)}
    return out
