"""Child entry points of the crash stress (``python -m stress.children publisher ...``).

The publisher child is a trainer that restarts after every kill: it opens a
:class:`~asyncsync.Publisher` on the root (which removes what the killed one left), reports
that it is open and waits for the driver's go, then re-seeds (a restarted trainer has no
snapshot: its first publish is a full version at the next version number) and publishes
``state(v)`` for v = next, next+1, ... as fast as it can until it is killed.

Control files in ``--ctl`` (the driver's side of the handshake, no pipes, so both launch
modes work the same way): the child writes ``open-<pid>.json`` after ``Publisher.open``, waits
for ``go-<pid>``, and appends one JSON line per publish start and commit to ``events.jsonl``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from asyncsync.fsio import atomic_write
from asyncsync.publish.publisher import Publisher
from stress.states import VersionedState

__all__ = ["WORKLOAD_NAME", "main"]

WORKLOAD_NAME = "stress.states.VersionedState"


def _event(ctl: Path, **fields: object) -> None:
    line = json.dumps({"pid": os.getpid(), "t": time.time(), **fields}) + "\n"
    fd = os.open(ctl / "events.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


async def _publisher(args: argparse.Namespace) -> None:
    root, ctl = Path(args.root), Path(args.ctl)
    states = VersionedState(args.seed, args.elements)
    pub = Publisher(
        root,
        bucket_bytes=args.bucket_bytes,
        keyframe_interval=args.keyframe_interval,
        producer={"stress_workload": WORKLOAD_NAME, "stress_seed": args.seed},
    )
    await pub.open()
    v = 0 if pub.version is None else pub.version + 1
    sd = states.state(v)  # before the go, so the kill window starts with the publish
    pid = os.getpid()
    atomic_write(ctl / f"open-{pid}.json", json.dumps({"pid": pid, "next": v}).encode())
    go = ctl / f"go-{pid}"
    while not go.exists():
        await asyncio.sleep(0.001)
    kind = "seed"
    while True:
        # Like a trainer, compute the next state while this one is published, so the child is
        # almost always inside a publish and the kills land there.
        nxt = asyncio.create_task(asyncio.to_thread(states.state, v + 1))
        _event(ctl, ev="start", version=v, kind=kind)
        await (pub.seed(sd) if kind == "seed" else pub.publish(sd))
        _event(ctl, ev="commit", version=v, kind=kind)
        v, sd = v + 1, await nxt
        kf = args.keyframe_interval > 0 and v % args.keyframe_interval == 0
        kind = "keyframe" if kf else "delta"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m stress.children")
    sub = p.add_subparsers(dest="role", required=True)
    pp = sub.add_parser("publisher", help="re-seed, then publish state(v) until killed")
    pp.add_argument("--root", required=True)
    pp.add_argument("--ctl", required=True)
    pp.add_argument("--seed", type=int, default=0)
    pp.add_argument("--elements", type=int, default=300_000)
    pp.add_argument("--bucket-bytes", type=int, default=8 << 10)
    pp.add_argument("--keyframe-interval", type=int, default=5)
    args = p.parse_args(argv)
    asyncio.run(_publisher(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
