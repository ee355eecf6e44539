"""A fresh engine's catch-up from a keyframe: ``python -m asyncsync.ops.bench.catchup``.

An engine that starts late, or restarts without its checkpoint, applies the newest keyframe in
full: every shard read, verified, parsed and staged into its checkpoint. This seeds a root with
a keyframe of ``--size`` bytes of bf16 (tensors of 16 Mi elements, the last one smaller), then
applies it ``--repeats`` times, each in a fresh process (a peak RSS of its own) into an empty
``LocalCheckpoint``, and prints the median wall, CPU and peak RSS (above the process's RSS
before the agent starts, as a multiple of the keyframe; the spread in brackets), beside a
floor: reading the keyframe's shard files once (the same process, the same reads)::

    python -m asyncsync.ops.bench.catchup                 # 1 GiB, 3 repeats
    python -m asyncsync.ops.bench.catchup --size 4GiB --repeats 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from asyncsync import fsio
from asyncsync.console.args import parse_size
from asyncsync.format.names import version_dir
from asyncsync.ops.bench.probes import cpu_seconds, rss
from asyncsync.publish.publisher import Publisher

__all__ = ["main", "measure"]

_NUMEL = 16 << 20  # elements of each tensor (32 MiB of bf16)
_MODULE = "asyncsync.ops.bench.catchup"  # (run as a script, __name__ is __main__)


async def seed(root: Path, size: int) -> None:
    """A root whose version 0 is a keyframe of ``size`` bytes of generated bf16."""
    g = torch.Generator().manual_seed(0)
    sd, left, i = {}, size // 2, 0
    while left > 0:
        n = min(_NUMEL, left)
        sd[f"layers.{i}.w"] = torch.randint(
            0x3A80, 0x3D80, (n,), dtype=torch.int16, generator=g
        ).view(torch.bfloat16)
        left, i = left - n, i + 1
    async with Publisher(root, keyframe_interval=0) as pub:
        await pub.seed(sd)


async def _apply(root: Path, checkpoint: Path) -> dict[str, float]:
    """One catch-up in this process: (wall, CPU) seconds and peak RSS bytes, and the floor."""
    from receiver.agent import ReceiverAgent
    from receiver.engines.checkpoint import LocalCheckpoint

    files = sorted(version_dir(root, 0).glob("full-*.safetensors"))
    start = rss()["peak"]  # VmHWM (ru_maxrss starts at the forking parent's RSS)
    t, c = time.perf_counter(), cpu_seconds()
    async with ReceiverAgent(root, LocalCheckpoint(checkpoint), "catchup") as agent:
        if await agent.sync_once() != 0:
            raise RuntimeError("the keyframe was not applied")
    wall, cpu, peak = time.perf_counter() - t, cpu_seconds() - c, rss()["peak"] - start
    t = time.perf_counter()
    for f in files:  # the floor: the shards' bytes read once (now from the page cache)
        fsio.read_buffer(f, limit=1 << 40)
    return {"wall": wall, "cpu": cpu, "peak": peak, "floor": time.perf_counter() - t}


def measure(size: int, repeats: int) -> dict[str, list[float]]:
    """Each repeat's wall and CPU seconds, peak RSS bytes and floor seconds."""
    out: dict[str, list[float]] = {"wall": [], "cpu": [], "peak": [], "floor": []}
    with tempfile.TemporaryDirectory(prefix="asyncsync-catchup-") as tmp:
        root = Path(tmp) / "root"
        asyncio.run(seed(root, size))
        os.sync()  # its files written back now, not while a repeat runs
        for k in range(repeats):
            ckpt = Path(tmp) / f"ckpt{k}"
            cmd = [sys.executable, "-m", _MODULE, "--apply", str(root), str(ckpt)]
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if done.returncode:
                raise RuntimeError(f"catch-up {k} failed: {done.stderr.strip()[-2000:]}")
            for key, value in json.loads(done.stdout.splitlines()[-1]).items():
                out[key].append(value)
            shutil.rmtree(ckpt)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m asyncsync.ops.bench.catchup")
    ap.add_argument("--size", default="1GiB", help="the keyframe's bytes (default 1GiB)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--apply", nargs=2, metavar=("ROOT", "CHECKPOINT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.apply:  # one repeat, in its own process
        print(json.dumps(asyncio.run(_apply(Path(args.apply[0]), Path(args.apply[1])))))
        return 0
    try:
        size = parse_size(args.size)
    except ValueError as exc:
        ap.error(f"--size: {exc}")
    if size < 1 << 20 or args.repeats < 1:
        ap.error("--size must be at least 1MiB and --repeats at least 1")
    res = measure(size, args.repeats)

    def med(key: str, scale: float = 1.0, fmt: str = ".2f") -> str:
        xs = [x * scale for x in res[key]]
        return f"{statistics.median(xs):{fmt}} [{min(xs):{fmt}}-{max(xs):{fmt}}]"

    print(
        f"catch-up of a {size / 2**30:.2f} GiB keyframe ({args.repeats} repeats): "
        f"wall {med('wall')} s, cpu {med('cpu')} s, peak RSS {med('peak', 1 / size)}x, "
        f"floor (its shards read once) {med('floor')} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
