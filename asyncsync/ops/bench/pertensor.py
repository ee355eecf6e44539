"""The fixed cost of a tensor: ``python -m asyncsync.ops.bench.pertensor``.

A model of many small tensors (MoE experts, norms, biases: a 355B MoE has tens of thousands)
costs per tensor more than per byte. This publishes ``--tensors`` bf16 tensors of ``--numel``
elements each, ~3 % of each changed per version, and applies each version with a receiver
agent into a ``LocalCheckpoint``, both in this process, one after the other, and prints the
CPU seconds per tensor of each side (median of ``--versions``; the spread in brackets)::

    python -m asyncsync.ops.bench.pertensor                      # 2000 tensors of 8 KiB
    python -m asyncsync.ops.bench.pertensor --tensors 20000 --threads 1

``--threads``: the pool's size (default: every core). The publisher's side runs as it would in
a trainer (no :func:`~asyncsync.memory.freeze_startup_objects`); ``--freeze`` freezes this
process's startup objects as the ``receiver`` command does (both sides then gain from it).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from asyncsync.ops.bench.scale import step_state
from asyncsync.pipeline import MAX_THREADS, set_threads
from asyncsync.publish.publisher import Publisher
from receiver.agent import ReceiverAgent
from receiver.engines.checkpoint import LocalCheckpoint

__all__ = ["main", "measure"]


async def measure(
    tensors: int, numel: int, versions: int, *, freeze: bool = False
) -> dict[str, list[float]]:
    """CPU seconds per tensor of each version's publish and receive (sync + flush)."""
    g = torch.Generator().manual_seed(0)
    sd = {
        f"layers.{i}.w": torch.randint(
            0x3A80, 0x3D80, (numel,), dtype=torch.int16, generator=g
        ).view(torch.bfloat16)
        for i in range(tensors)
    }
    out: dict[str, list[float]] = {"publish": [], "receive": []}
    with tempfile.TemporaryDirectory(prefix="asyncsync-pertensor-") as tmp:
        root, engine = Path(tmp) / "root", LocalCheckpoint(Path(tmp) / "ckpt")
        agent = ReceiverAgent(root, engine, "pertensor", poll_interval=0.05)
        async with Publisher(root, keyframe_interval=0) as pub, agent:
            await pub.seed(sd)
            await agent.sync_once()
            await engine.flushed()
            if freeze:
                from asyncsync.memory import freeze_startup_objects

                freeze_startup_objects()
            for v in range(1, versions + 1):
                step_state(sd, v, 0.03, 0)
                c0 = time.process_time()
                await pub.publish(sd)
                c1 = time.process_time()
                await agent.sync_once()
                await engine.flushed()
                c2 = time.process_time()
                out["publish"].append((c1 - c0) / tensors)
                out["receive"].append((c2 - c1) / tensors)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m asyncsync.ops.bench.pertensor")
    ap.add_argument("--tensors", type=int, default=2000)
    ap.add_argument("--numel", type=int, default=4096, help="elements of each tensor")
    ap.add_argument("--versions", type=int, default=7)
    ap.add_argument("--threads", type=int, help="the pool's size (default: every core)")
    ap.add_argument("--freeze", action="store_true", help="freeze the startup objects first")
    args = ap.parse_args(argv)
    if args.tensors < 1 or args.numel < 1 or args.versions < 1:
        ap.error("--tensors, --numel and --versions must be at least 1")
    if args.threads is not None and not 1 <= args.threads <= MAX_THREADS:
        ap.error(f"--threads must be from 1 to {MAX_THREADS}")
    set_threads(args.threads)
    res = asyncio.run(measure(args.tensors, args.numel, args.versions, freeze=args.freeze))
    for side, xs in res.items():
        us = [x * 1e6 for x in xs]
        print(
            f"{side:8s} {statistics.median(us):7.0f} us/tensor [{min(us):.0f}-{max(us):.0f}]"
            f"  ({args.tensors} tensors of {args.numel} elements, {args.versions} versions)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
