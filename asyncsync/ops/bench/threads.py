"""Thread scaling of publish and apply: ``python -m asyncsync.ops.bench.threads``.

Runs the scale sweep (``asyncsync bench --scale``) at one size once per thread count (each side's
CPU pool and torch's intra-op threads, ``--threads``), and prints the GB/s of publish and of
apply (model bytes / median seconds of the versions) with the trainer floor of each run::

    python -m asyncsync.ops.bench.threads                       # 1 and 2 threads, 1 GiB
    python -m asyncsync.ops.bench.threads --threads 1,2,4,8,16 --size 4GiB --json out.json

On a machine with more cores (the 16-core accelerator host) pass the counts to measure; the
runs are sequential, each a fresh publisher and receiver process over a throttled root, as
BENCHMARKS.md describes the sweep.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from asyncsync.training.settings import parse_size

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m asyncsync.ops.bench.threads")
    ap.add_argument("--threads", default="1,2", help="thread counts, e.g. 1,2,4,8,16")
    ap.add_argument("--size", default="1GiB", help="model bytes (default 1GiB)")
    ap.add_argument("--versions", type=int, default=3)
    ap.add_argument("--throttle", default="200MB/s,5ms")
    ap.add_argument("--json", help="write the rows as JSON")
    args = ap.parse_args(argv)
    size = parse_size(args.size)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="asyncsync-threads-") as tmp:
        for n in [int(x) for x in args.threads.split(",") if x.strip()]:
            out = Path(tmp) / f"scale-{n}.json"
            cmd = [sys.executable, "-m", "asyncsync", "bench", "--scale"]
            cmd += ["--scale-sizes", str(size), "--versions", str(args.versions)]
            cmd += ["--threads", str(n), "--throttle", args.throttle, "--json", str(out)]
            print(f"threads {n}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            (row,) = json.loads(out.read_text())["scale"]
            gb = row["model_bytes"] / 1e9
            rows.append(
                {
                    "threads": n,
                    "publish_gb_s": gb / row["publish_s"],
                    "apply_gb_s": gb / row["apply_s"],
                    "e2e_s": row["e2e_s"],
                    "trainer_floor_s": row["trainer_floor_s"],
                    "publish": row["repeats"]["publish"],
                    "apply": row["repeats"]["apply"],
                }
            )
    print("| threads | publish GB/s | apply GB/s | end to end | trainer floor |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['threads']} | {r['publish_gb_s']:.2f} | {r['apply_gb_s']:.2f} | "
            f"{1e3 * r['e2e_s']:,.0f} ms | {1e3 * r['trainer_floor_s']:,.0f} ms |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
