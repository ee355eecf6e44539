"""A process that takes an engine-id lease on a line of stdin, for the concurrency tests.

``python -m tests.lease_taker ROOT [--settle S] [--ttl T] [--clock-behind C]``: prints
``ready``, waits for a line, then tries to take ``e1`` and prints ``won OWNER`` or ``refused
MESSAGE``. A winner renews its lease every ``ttl / 3`` seconds until stdin closes, then releases
it. ``--clock-behind C``: the winner's lease and claim carry the mtimes a writer whose clock runs
``C`` seconds behind would give them on an object-store mount (rclone, s3fs, gcsfuse keep the
writer's mtime): each is set back by ``C`` (``os.utime``, which rclone keeps) after each write.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

from asyncsync.errors import LockHeld
from asyncsync.format.lease import EngineLease


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("root")
    p.add_argument("--settle", type=float, default=None)
    p.add_argument("--ttl", type=float, default=30.0)
    p.add_argument("--engine-id", default="e1")
    p.add_argument("--clock-behind", type=float, default=0.0)
    args = p.parse_args()
    kw = {} if args.settle is None else {"settle": args.settle}  # (a build without claims)
    lease = EngineLease(args.root, args.engine_id, ttl=args.ttl, **kw)
    print("ready", flush=True)
    sys.stdin.readline()
    try:
        lease.acquire()
    except LockHeld as exc:
        print("refused", " ".join(str(exc).split()), flush=True)
        sys.stdin.read()
        return 0
    print("won", lease.owner, flush=True)
    done = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    while True:
        if args.clock_behind:  # as the writer's clock dated them
            t = time.time() - args.clock_behind
            for path in (lease.path, lease.claim):
                os.utime(path, (t, t))
        if done.wait(args.ttl / 3):
            break
        lease.renew()
    lease.release()
    return 0


if __name__ == "__main__":
    sys.exit(main())
