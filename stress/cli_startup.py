"""Wall time of the command-line tools, as a monitoring loop calls them (README, "Command line").

    python stress/cli_startup.py [--runs 7] [--bin DIR ...]

Builds a small root in a temp directory (a seed and three deltas), then runs each command
``--runs`` times per ``--bin`` directory (default: this interpreter's) and prints the median,
min and max wall time, next to the floor (``python -c pass``). Run it under ``/work/bin/quiet``
or on an idle machine: the numbers are wall times. ``python -X importtime -m asyncsync status
ROOT`` shows where the import time goes.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COMMANDS = (
    ["--help"], ["status", "ROOT"], ["inspect", "ROOT"], ["inspect", "ROOT", "latest"],
    ["tail", "ROOT"],
)  # fmt: skip


async def _root(root: Path) -> None:
    import torch

    from asyncsync import Publisher

    async with Publisher(root, keyframe_interval=0) as pub:
        sd = {"w": torch.randn(256, 256)}
        await pub.seed(sd)
        for _ in range(3):
            sd = {"w": sd["w"] + (torch.rand(256, 256) < 0.01)}
            await pub.publish(sd)


def _time(argv: list[str], runs: int) -> tuple[float, float, float]:
    xs = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        xs.append(time.perf_counter() - t0)
    return statistics.median(xs), min(xs), max(xs)


def main() -> int:
    ap = argparse.ArgumentParser(description="Time the asyncsync command-line tools.")
    ap.add_argument("--runs", type=int, default=7, help="runs per command (default 7)")
    ap.add_argument("--bin", action="append", default=[], help="a venv's bin directory")
    args = ap.parse_args()
    bins = args.bin or [str(Path(sys.executable).parent)]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "root"
        asyncio.run(_root(root))
        rows = [("floor", "python -c pass", _time([sys.executable, "-c", "pass"], args.runs))]
        for b in bins:
            for cmd in COMMANDS:
                argv = [f"{b}/asyncsync", *(str(root) if a == "ROOT" else a for a in cmd)]
                rows.append((b, "asyncsync " + " ".join(cmd), _time(argv, args.runs)))
            rows.append((b, "asyncsync-receiver --help",
                         _time([f"{b}/asyncsync-receiver", "--help"], args.runs)))  # fmt: skip
    for where, what, (med, lo, hi) in rows:
        print(f"{what:28s} median {med:5.2f} s  (min {lo:.2f}, max {hi:.2f})  {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
