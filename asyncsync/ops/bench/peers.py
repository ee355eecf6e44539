"""``asyncsync bench --peers``: this project end to end beside re-implementations of its peers.

The peers, written from their documented designs (``/work/shared/REFERENCE.md``), each as a
writer (trainer side) and an applier (engine side) over files in the shared root:

``gen1``  slime's first-generation disk delta: per changed tensor its positions as
          ``deltas_zstd`` (gaps, zstd level 1) and its new values raw, in one safetensors file
          per version; the engine decodes and scatters the values into its weights in memory.
``gen2``  slime's second-generation delta: the whole-tensor ``new XOR old`` of each changed
          tensor, zstd level 1, one file per version; the engine decompresses and XORs in memory.
``full``  a full checkpoint: ``safetensors`` save of the whole state, one file; the engine loads
          it and copies it into its weights.
``ours``  :class:`~asyncsync.publish.publisher.Publisher` and a
          :class:`~receiver.agent.ReceiverAgent` with a crash-safe ``LocalCheckpoint`` (journal,
          per-tensor verification, streaming apply).
``ours-mem``  the same publisher (its own root) to an agent with a ``TorchModule`` engine:
          the weights patched in memory, as the peers' appliers do (per-tensor verification,
          an in-memory undo journal; no streaming: the shards are prefetched).

Two fresh processes (:func:`run_peer_publish`, :func:`run_peer_receive`) hold every system's
side; both start from the same generated version 0 (the scale sweep's bf16 states at ~3 %,
:func:`asyncsync.ops.bench.scale.make_state`), so no system pays for a seed. Per version the
publisher steps the state once, then runs the systems **interleaved** (the order rotates per
version, so the machine's noise falls on all of them alike): each writes the version, and the
latency is from its write start to the engine's ack (the peers' ack is a small file the applier
writes after applying; ours is its ack). Version 1 is a warm-up round, run by every system and
left out of the medians: in three runs at 1 GiB before it was, version 1 was the slowest of its
system's three in 11 of 15 cases (the first touch of each system's buffers). Between two systems
the machine's dirty pages are written back (``sync``) and it settles (:func:`_quiesce`): without
that the full checkpoint's unsynced gigabyte, or our checkpoint's flush after its ack, fell into
the next system's window. In the receiver process one system's engine side runs per window
(:func:`_dispatch`: the publisher announces each turn before that pause): the peers' poll loops
no longer run through every other system's window, ours included. The shared root is
throttled like the rest of the bench (``--throttle``, or none with ``--throttle none``), in both
processes. The peers' files are written with :func:`asyncsync.fsio.atomic_write` and read
with :func:`asyncsync.fsio.read_bytes`, the throttled calls ours uses.

As the real ones do (audit-35 read slime's code), the peers' per-tensor work runs on a pool, this
project's (:func:`asyncsync.pipeline.parallel_map`, one worker per core, as ours): slime's
second generation diffs and applies on ``min(32, cores)`` threads. zstd compresses straight
from the arrays; the appliers read each file's tensors as views of its bytes (a loader's mmap),
not copies. A peer's file is fsynced before its rename, its directory is not (slime's writers);
the full checkpoint is not fsynced at all (slime's ``save_file``). What the peers still do not
pay and the real systems do: slime's checksums (gen-2 hashes each tensor, gen-1 with
``torch.hash_tensor``), gen-1's NaN-masked ``load_weights`` and gen-2's full reload after the
XOR; ours pays its own (per-tensor verification, the undo journal, a durable checkpoint).
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import struct
import time
import warnings
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch
import zstandard

from asyncsync import codec, fsio
from asyncsync.format import acks
from asyncsync.format.names import MAX_SHARD_BYTES
from asyncsync.memory import freeze_startup_objects
from asyncsync.ops.bench.job import Job
from asyncsync.ops.bench.probes import reset_peak_rss, rss
from asyncsync.ops.bench.scale import make_state, step_state
from asyncsync.pipeline import parallel_map
from asyncsync.publish.publisher import Publisher
from receiver.agent import ReceiverAgent
from receiver.engines.checkpoint import LocalCheckpoint
from receiver.engines.torch_module import TorchModule

__all__ = ["PEERS", "run_peer_publish", "run_peer_receive"]

PEERS = ("ours", "ours-mem", "gen1", "gen2", "full")
_OURS = ("ours", "ours-mem")
_POLL = 0.002


def _order(version: int) -> list[str]:
    k = version % len(PEERS)
    return [*PEERS[k:], *PEERS[:k]]


# ----------------------------------------------------------------------------- the writers
# Each peer's per-tensor work runs on this project's pool (one worker per core, as ours; slime
# uses a pool of min(32, cores) for its second generation): NumPy's comparisons and zstd
# release the GIL. Their files are renamed into place after an fsync of the file only (slime
# fsyncs no directory); the full checkpoint is not fsynced at all (slime's ``save_file``).
def _gen1_one(item: tuple[str, torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
    name, old, new = item
    a, b = codec.int_view(old).numpy(), codec.int_view(new).numpy()
    idx = np.flatnonzero(a != b)
    if not idx.size:
        return {}
    gaps = np.diff(idx, prepend=-1) - 1
    width = "<u2" if gaps.max() <= 0xFFFF else "<u4" if gaps.max() <= 0xFFFFFFFF else "<u8"
    pos = zstandard.ZstdCompressor(level=1).compress(gaps.astype(width))  # type: ignore[arg-type]
    return {
        f"{name}.pos": torch.frombuffer(bytearray(pos), dtype=torch.uint8),
        f"{name}.val": torch.from_numpy(b[idx].view(np.uint8)),
    }


def _gen2_one(item: tuple[str, torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
    name, old, new = item
    x = np.bitwise_xor(codec.int_view(old).numpy(), codec.int_view(new).numpy())
    if not x.any():
        return {}
    blob = zstandard.ZstdCompressor(level=1).compress(x)  # from the array: no copy
    return {name: torch.frombuffer(bytearray(blob), dtype=torch.uint8)}


def _per_tensor(
    fn: Callable[[tuple[str, torch.Tensor, torch.Tensor]], dict[str, torch.Tensor]],
    old: dict[str, torch.Tensor],
    new: dict[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    items = [(name, old[name], t) for name, t in new.items()]
    blobs: dict[str, torch.Tensor] = {}
    for part in parallel_map(fn, items, cost=lambda it: it[2].nbytes):
        blobs.update(part)
    return blobs


def _write_gen1(path: Path, old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> None:
    blobs = _per_tensor(_gen1_one, old, new)
    fsio.atomic_write(path, safetensors.torch.save(blobs), sync_dir=False)


def _write_gen2(path: Path, old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> None:
    blobs = _per_tensor(_gen2_one, old, new)
    fsio.atomic_write(path, safetensors.torch.save(blobs), sync_dir=False)


def _write_full(path: Path, old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> None:
    fsio.atomic_write(path, safetensors.torch.save(dict(new)), fsync=False, sync_dir=False)


_WRITERS: dict[str, Callable[[Path, dict[str, torch.Tensor], dict[str, torch.Tensor]], None]] = {
    "gen1": _write_gen1,
    "gen2": _write_gen2,
    "full": _write_full,
}


# ----------------------------------------------------------------------------- the appliers
def _views(data: bytes) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors as views of ``data`` (no copy, as a loader's mmap gives)."""
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header.pop("__metadata__", None)
    out = {}
    with warnings.catch_warnings():  # read only: they are read, never written
        warnings.filterwarnings("ignore", "The given buffer is not writable")
        for name, info in header.items():
            lo, hi = info["data_offsets"]
            dtype = _DTYPES[info["dtype"]]
            if hi == lo:
                out[name] = torch.empty(info["shape"], dtype=dtype)
                continue
            raw = torch.frombuffer(data, dtype=torch.uint8, count=hi - lo, offset=8 + n + lo)
            out[name] = raw.view(dtype).view(info["shape"])
    return out


_DTYPES = {"U8": torch.uint8, "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
           "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
           "BOOL": torch.bool, "F64": torch.float64}  # fmt: skip


def _apply_gen1(data: bytes, state: dict[str, torch.Tensor]) -> None:
    blobs = _views(data)

    def one(key: str) -> None:
        name = key[: -len(".pos")]
        flat = codec.int_view(state[name]).numpy()
        vals = blobs[f"{name}.val"].numpy().view(flat.dtype)
        raw = zstandard.ZstdDecompressor().decompress(memoryview(blobs[key].numpy()))  # type: ignore[arg-type]
        width = len(raw) // vals.size
        gaps = np.frombuffer(raw, f"<u{width}").astype(np.int64)
        flat[np.cumsum(gaps + 1) - 1] = vals  # the scatter

    keys = [k for k in blobs if k.endswith(".pos")]
    parallel_map(one, keys, cost=lambda k: state[k[: -len(".pos")]].nbytes)


def _apply_gen2(data: bytes, state: dict[str, torch.Tensor]) -> None:
    blobs = _views(data)

    def one(name: str) -> None:
        flat = codec.int_view(state[name]).numpy()
        blob = memoryview(blobs[name].numpy())  # type: ignore[arg-type]
        flat ^= np.frombuffer(zstandard.ZstdDecompressor().decompress(blob), flat.dtype)

    parallel_map(one, list(blobs), cost=lambda k: state[k].nbytes)


def _apply_full(data: bytes, state: dict[str, torch.Tensor]) -> None:
    blobs = _views(data)
    parallel_map(lambda k: state[k].copy_(blobs[k]), list(blobs), cost=lambda k: state[k].nbytes)


_APPLIERS: dict[str, Callable[[bytes, dict[str, torch.Tensor]], None]] = {
    "gen1": _apply_gen1,
    "gen2": _apply_gen2,
    "full": _apply_full,
}


def _file(root: Path, system: str, version: int) -> Path:
    return root / system / f"v{version:06d}.safetensors"


def _ack(root: Path, system: str) -> Path:
    return root / system / "ack.json"


# ----------------------------------------------------------------------------- the children
async def run_peer_publish(job: Job) -> dict[str, Any]:
    """Step the state per version; per system (interleaved) write it and wait for the ack."""
    root = Path(job.root)
    sd = make_state(job.scale_bytes, job.seed)
    old = {k: t.clone() for k, t in sd.items()}  # the peers' previous version (they diff it)
    for system in _WRITERS:
        (root / system).mkdir(parents=True, exist_ok=True)
    out: dict[str, list[dict[str, float]]] = {s: [] for s in PEERS}
    pubs = {
        s: Publisher(root / s, bucket_bytes=job.bucket_bytes, keyframe_interval=0) for s in _OURS
    }
    async with pubs["ours"], pubs["ours-mem"]:
        for p in pubs.values():
            await p.seed(sd)
        await _wait(Path(job.ready), job.timeout)
        gc.collect()
        reset_peak_rss()
        for v in range(1, _last(job) + 1):
            step_state(sd, v, job.density, job.seed)
            fsio.set_throttle(_throttle(job))
            for system in _order(v):
                await asyncio.to_thread(_announce, root, system, v)
                await _quiesce(job)  # (the receiver sees the turn meanwhile: see _dispatch)
                t0 = time.perf_counter()
                if system in pubs:
                    res = await pubs[system].publish(sd)
                    t1 = time.perf_counter()
                    await acks.wait_acked(
                        root / system, res.version, engines=[job.engine_id], timeout=job.timeout,
                        poll_interval=_POLL, max_poll_interval=_POLL,
                    )  # fmt: skip
                else:
                    await asyncio.to_thread(_WRITERS[system], _file(root, system, v), old, sd)
                    t1 = time.perf_counter()
                    await _wait_ack(_ack(root, system), v, job.timeout)
                t2 = time.perf_counter()
                row = {"version": v, "write": t1 - t0, "e2e": t2 - t0}
                out[system].append({**row, "warmup": True} if v == 1 else row)
            fsio.set_throttle(None)
            for k, t in sd.items():
                old[k].copy_(t)
        await asyncio.to_thread(_announce, root, _DONE, _last(job))
    return {"systems": out, "rss": rss(), "model_bytes": sum(t.nbytes for t in sd.values())}


async def run_peer_receive(job: Job) -> dict[str, Any]:
    """Every system's engine side: ours a running agent, the peers a poll loop each."""
    root = Path(job.root)
    engine = LocalCheckpoint(job.checkpoint)
    mem = TorchModule(_module(make_state(job.scale_bytes, job.seed)))
    agents = [
        ReceiverAgent(root / s, e, job.engine_id, poll_interval=job.poll_interval)
        for s, e in (("ours", engine), ("ours-mem", mem))
    ]
    applies: dict[str, list[float]] = {s: [] for s in _APPLIERS}
    async with agents[0], agents[1], asyncio.timeout(job.timeout):
        for agent in agents:
            while await agent.sync_once() is None:
                await asyncio.sleep(0.01)
        await engine.flushed()
        states = {s: make_state(job.scale_bytes, job.seed) for s in _APPLIERS}
        freeze_startup_objects()  # as the receiver command does (the peers' appliers gain too)
        fsio.set_throttle(_throttle(job))
        Path(job.ready).write_text("ready\n")
        stop = asyncio.Event()
        go: dict[str, asyncio.Queue[int]] = {s: asyncio.Queue() for s in _APPLIERS}
        done: dict[str, asyncio.Queue[int]] = {s: asyncio.Queue() for s in _APPLIERS}

        async def peer(system: str) -> None:
            for v in range(1, _last(job) + 1):
                if await go[system].get() != v:
                    raise RuntimeError(f"{system}: turns out of order (v{v} expected)")
                path = _file(root, system, v)
                while not await asyncio.to_thread(path.exists):
                    await asyncio.sleep(_POLL)
                t0 = time.perf_counter()
                data = await asyncio.to_thread(fsio.read_bytes, path, limit=MAX_SHARD_BYTES)
                await asyncio.to_thread(_APPLIERS[system], data, states[system])
                del data
                applies[system].append(time.perf_counter() - t0)
                text = json.dumps({"version": v})
                await asyncio.to_thread(fsio.atomic_write, _ack(root, system), text.encode())
                done[system].put_nowait(v)

        async def window(system: str, version: int) -> None:
            if system in _APPLIERS:
                go[system].put_nowait(version)
                while await done[system].get() < version:
                    pass
                return
            agent = agents[_OURS.index(system)]
            while agent.version is None or agent.version < version:
                await asyncio.sleep(_OURS_CHECK)  # in memory: no thread, no file

        async def turns() -> None:
            await _dispatch(root, window)
            stop.set()  # every system acked the last version (the publisher saw each ack)

        async with asyncio.TaskGroup() as tg:
            for agent in agents:
                tg.create_task(agent.run(stop=stop))
            tg.create_task(turns())
            for system in _APPLIERS:
                tg.create_task(peer(system))
        fsio.set_throttle(None)
        status = agents[0].status()
    return {"applies": applies, "streamed_shards": status.streamed_shards, "rss": rss()}


def _module(sd: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A module whose state dict is ``sd`` (its tensors as frozen parameters)."""
    top = torch.nn.Module()
    for name, t in sd.items():
        *path, leaf = name.split(".")
        mod = top
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, torch.nn.Parameter(t, requires_grad=False))
    return top


def _last(job: Job) -> int:
    """The last version: the warm-up round (version 1) and then ``job.versions`` timed."""
    return job.versions + 1


_TURN = "turn.json"
_DONE = "done"
_OURS_CHECK = 0.005  # how often the receiver looks at our agent's version (in memory)


def _announce(root: Path, system: str, version: int) -> None:
    """The publisher's word of whose window comes next (``_DONE`` after the last)."""
    text = json.dumps({"system": system, "version": version})
    fsio.atomic_write(root / _TURN, text.encode(), sync_dir=False)


def _read_turn(root: Path) -> tuple[str, int] | None:
    try:
        turn = json.loads((root / _TURN).read_text())
        return str(turn["system"]), int(turn["version"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


async def _dispatch(root: Path, window: Callable[[str, int], Awaitable[None]]) -> None:
    """Hand each turn the publisher announces to ``window`` and look for the next one only
    once that window closed (its system applied the version), until ``_DONE``.

    So that in a system's window the receiver process runs that system's engine side alone,
    as a deployment's engine process does: before, the three peers' poll loops (a stat in a
    thread every 2 ms each, ~25 % of a core together) and a loop reading both our agents' ack
    files every 10 ms ran through every other system's window, and ours, the shortest and the
    most CPU-bound on this 2-core host, lost the most to them. The publisher announces a turn
    before the sync and settle that precede its window (:func:`_quiesce`), so the turn is seen
    (a poll every 2 ms) before the window opens. Our agents are not held back: they run
    throughout, their idle watch and lease beat included, as in a deployment."""
    seen: tuple[str, int] | None = None
    while True:
        turn = await asyncio.to_thread(_read_turn, root)
        if turn is not None and turn != seen:
            seen = turn
            if turn[0] == _DONE:
                return
            await window(*turn)
            continue
        await asyncio.sleep(_POLL)


async def _quiesce(job: Job) -> None:
    """Between two systems: the machine's dirty pages written back (``sync``: a full checkpoint
    not fsynced, a checkpoint's flush after its ack) and a pause, so that no system's window
    holds another's deferred work, as the sweep waits for its flush and settles per version."""
    await asyncio.to_thread(os.sync)
    await asyncio.sleep(job.settle)


def _throttle(job: Job) -> fsio.Throttle | None:
    if job.bandwidth is None and not job.latency:
        return None
    return job.throttle


async def _wait(path: Path, timeout: float) -> None:
    async with asyncio.timeout(timeout):
        while not path.exists():
            await asyncio.sleep(0.005)


async def _wait_ack(path: Path, version: int, timeout: float) -> None:
    async with asyncio.timeout(timeout):
        while True:
            try:
                if json.loads(path.read_text())["version"] >= version:
                    return
            except (OSError, ValueError, KeyError):
                pass
            await asyncio.sleep(_POLL)


# ----------------------------------------------------------------------------- the report
def peers_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per size: each system's median end to end (and write), the versions' min and max, and
    each peer's median over ours (above 1: ours is faster)."""
    out = []
    for row in rows:
        systems = {
            s: [v for v in vs if not v.get("warmup")]
            for s, vs in row["publisher"]["systems"].items()
        }
        med = {s: _median([v["e2e"] for v in vs]) for s, vs in systems.items()}
        out.append(
            {
                "model_bytes": row["publisher"]["model_bytes"],
                "e2e_s": med,
                "e2e_range_s": {
                    s: [min(v["e2e"] for v in vs), max(v["e2e"] for v in vs)]
                    for s, vs in systems.items()
                },
                "write_s": {s: _median([v["write"] for v in vs]) for s, vs in systems.items()},
                "peer_vs_ours": {s: med[s] / med["ours"] for s in med if s != "ours"},
                "versions": len(systems["ours"]),
                "streamed_shards": row["receiver"]["streamed_shards"],
                "raw": row["publisher"]["systems"],  # the warm-up round marked
            }
        )
    return {"peers": out}


def peers_markdown(summary: dict[str, Any], throttle: str) -> str:
    rows = summary.get("peers") or []
    if not rows:
        return ""
    lines = [
        f"## Peers, end to end (throttle {throttle or 'none'}; median of the versions, "
        "min-max; peer / ours)",
        "",
        "| model | ours (LocalCheckpoint) | ours (TorchModule, in memory) | gen-1 deltas_zstd "
        "+ scatter | gen-2 XOR+zstd | full safetensors |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = []
        for s in PEERS:
            lo, hi = r["e2e_range_s"][s]
            ratio = "" if s == "ours" else f" ({r['peer_vs_ours'][s]:.2f}x)"
            cells.append(f"{1e3 * r['e2e_s'][s]:,.0f} ms [{1e3 * lo:,.0f}-{1e3 * hi:,.0f}]{ratio}")
        lines.append(f"| {r['model_bytes'] / 1e9:.2f} GB | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return float("nan") if not n else s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
