"""Discovery latency over a FUSE mount where inotify is blind (docs/RELIABILITY.md, section 3).

The publisher writes through the real directory; the receiver watches the bindfs view of it
with inotify on, so only its polls can find new versions. Prints commit-to-ack latency.

    python stress/fuse_latency.py [--versions 10] [--poll 0.5]    (root, bindfs installed)
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from asyncsync import Publisher
from receiver import ReceiverAgent
from receiver.engines.checkpoint import LocalCheckpoint


def _state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(256, 256, generator=g).bfloat16(), "b": torch.randn(256, generator=g)}


async def measure(base: Path, versions: int, poll: float) -> list[float]:
    real, fuse = base / "real", base / "fuse"
    real.mkdir()
    fuse.mkdir()
    subprocess.run(["bindfs", str(real), str(fuse)], check=True)
    try:
        async with Publisher(real / "root") as pub:
            await pub.seed(_state(0))
            agent = ReceiverAgent(fuse / "root", LocalCheckpoint(base / "ckpt"), "e",
                                  poll_interval=poll)  # fmt: skip
            stop = asyncio.Event()
            task = asyncio.create_task(agent.run(stop=stop))
            await pub.wait_acked(0, engines=["e"], timeout=60)
            latencies = []
            for i in range(1, versions + 1):
                await asyncio.sleep((0.37 * i) % poll)  # land at different points of a poll cycle
                r = await pub.publish(_state(i))
                t0 = time.monotonic()
                await pub.wait_acked(r.version, engines=["e"], timeout=60)
                latencies.append(time.monotonic() - t0)
            stop.set()
            agent.request_sync()
            await task
            await agent.close()
        return latencies
    finally:
        subprocess.run(["umount", "-l", str(fuse)], check=False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--versions", type=int, default=10)
    ap.add_argument("--poll", type=float, default=0.5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        lat = asyncio.run(measure(Path(d), args.versions, args.poll))
    print(
        f"commit->ack over bindfs (inotify blind), poll {args.poll} s: median "
        f"{statistics.median(lat):.3f} s, max {max(lat):.3f} s, {len(lat)} versions, all found"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
