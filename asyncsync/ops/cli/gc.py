"""``asyncsync gc``: delete old versions no live engine needs (see asyncsync.publish.retention).

``--dry-run`` deletes nothing and trims nothing; like ``status`` it makes and removes one temp
file in the root to read the file server's clock, which ack ages are measured on (see
:mod:`asyncsync.ops.cli`): the preview then keeps and deletes what the real run would. On a
root it cannot write (a read-only mount or operator) it measures them on this host's clock and
says so on stderr. An engine whose ack looks older than ``--ack-ttl`` but that holds a lease is
watched for a heartbeat first (up to its lease's ttl, 30 s by default): a live one whose clock
runs behind keeps its versions (FORMAT.md 7)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from asyncsync.format.liveness import WATCH_LIMIT
from asyncsync.ops.cli.common import (
    check_root,
    human_bytes,
    non_negative_float,
    positive_int,
    size_bytes,
)
from asyncsync.publish.retention import RetentionPolicy, collect

__all__ = ["cmd_gc", "register"]


def cmd_gc(args: argparse.Namespace) -> int:
    root = Path(args.root)
    check_root(root)
    policy = RetentionPolicy(
        keep_versions=args.keep_versions,
        keep_bytes=args.keep_bytes,
        ack_ttl=None if args.ack_ttl == 0 else args.ack_ttl,
    )
    report = collect(root, policy, dry_run=args.dry_run, watch=WATCH_LIMIT)
    if report.clock is not None:  # a read-only root: said, the ages may carry this host's skew
        print(f"note: {report.clock}", file=sys.stderr)
    verb = "would delete" if args.dry_run else "deleted"
    if report.deleted:
        vs = ", ".join(f"v{v}" for v in report.deleted)
        print(f"{verb} {len(report.deleted)} versions ({human_bytes(report.freed_bytes)}): {vs}")
    elif report.kept:
        # the oldest kept version is the one a deletion would have taken: say why it stays
        oldest = report.kept[0]
        print(f"nothing to delete: v{oldest} (the oldest) is kept: {report.reasons[oldest]}"
              + ("" if args.verbose else " (-v: why each version is kept)"))  # fmt: skip
    else:
        print("nothing to delete: the root has no committed version")
    if args.verbose:
        for v in report.kept:
            print(f"  keep v{v}: {report.reasons[v]}")
    return 0


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    sp = sub.add_parser(
        "gc",
        parents=[common],
        help="delete old versions no live engine needs (keeps the newest keyframe and its chain)",
    )
    sp.add_argument("root", metavar="ROOT", help="the shared root")
    sp.add_argument(
        "--keep-versions", type=positive_int, default=10, metavar="N",
        help="keep at least the newest N versions (default 10)",
    )  # fmt: skip
    sp.add_argument(
        "--keep-bytes", type=size_bytes, default=None, metavar="SIZE",
        help="also keep the newest versions that fit in SIZE (e.g. 20G)",
    )  # fmt: skip
    sp.add_argument(
        "--ack-ttl", type=non_negative_float, default=3600.0, metavar="S",
        help="acks older than S seconds no longer pin versions (0: acks pin forever; "
        "default 3600)",
    )  # fmt: skip
    sp.add_argument("--dry-run", action="store_true", help="say what would be deleted")
    sp.add_argument("-v", "--verbose", action="store_true", help="say why each version is kept")
    sp.set_defaults(func=cmd_gc)
