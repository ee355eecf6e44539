"""``asyncsync status ROOT``: which engines hold which version, who lags, who went quiet.

Read from the ack records in the root, so it works from any host that mounts the root, without
reaching the receivers. Ages are measured on the root filesystem's clock (file mtimes against
that of a temp file made in the root and removed at once: the one write of ``status``, see
:mod:`asyncsync.ops.cli`; this host's clock on a root it cannot write, a read-only mount or
operator, said on stderr and in the JSON's ``clock``: ``"root"`` or ``"this host"``); the
``skew`` column is how far a receiver's clock was from it when it wrote its ack, and ``bad``
lists the versions a receiver found damaged and went past. An engine is a *straggler* when it
is more than ``--max-lag`` versions behind the newest, or was last heard of (its ack, its
lease's heartbeat) more than ``--stale`` seconds ago while it is behind. The *newest* a lag is
counted from is the newest committed version whose manifest reads and that the engine has not
marked bad: a damaged or planted ``v999999999999`` above the publisher's versions is no lag of
10^12 (it stays in the header's newest version and in the engine's ``bad``), while the good
versions committed above a bad one still count (a receiver stuck below a bad version with no
keyframe past it falls behind and is a straggler).
An ack (or lease heartbeat) dated more than a second in the future of the root's clock (its
writer's clock ahead on an object-store mount, the file server's clock stepped back, a hand-set
mtime) has no age to show: one line says so (JSON: ``ack_ahead_seconds``). Such an engine, and
one whose ack and lease look older than ``--stale``, is judged by its lease when it is behind:
``status`` watches it (up to its ttl, 30 s by default) and counts the engine silent, so a
straggler, unless it sees a heartbeat (JSON: ``lease_renewed``); mtimes on rclone, s3fs and
gcsfuse are the writers' clocks. ``gc`` judges an engine dated more than ``ack_ttl`` ahead
by its lease the same way (within ``ack_ttl`` ahead: live, the safe side).
Exit status 0, or 3 when there are stragglers (for scripts and alerts), or 1 when the root,
its ``acks/`` or one of the ack files in it cannot be read (never "0 engines, all clear" for
acks it could not see: an unreadable ack file is listed, and its engine's version is unknown).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Any

from asyncsync.errors import FormatError
from asyncsync.format import ACKS_DIR
from asyncsync.format.acks import ack_ages, read_acks, root_clock
from asyncsync.format.lease import unreadable_leases
from asyncsync.format.liveness import WATCH_LIMIT, watch_leases
from asyncsync.format.store import read_manifest
from asyncsync.fsio import scan
from asyncsync.ops.cli.common import (
    check_root,
    fmt_time,
    non_negative_int,
    positive_float,
    printable,
    table,
)

__all__ = ["cmd_status", "engine_rows", "register"]

STRAGGLERS_EXIT = 3
AHEAD_SLACK = 1.0  # seconds: mtime granularity, and this host's clock on a read-only root


def engine_rows(
    root: Path,
    *,
    max_lag: int,
    stale: float,
    unreadable: dict[Path, str] | None = None,
    now: float | None = None,
    watch: float = WATCH_LIMIT,
) -> tuple[int | None, list[dict[str, Any]]]:
    """(newest version, one row per engine with its version, lag, ack age and straggler flag);
    the ack files that cannot be read go to ``unreadable`` (path -> why), when given. Ages are
    counted to ``now`` on the root's clock (default: :func:`root_now`, a probe file). An engine
    behind whose ack looks older than ``stale``, or is dated ahead (its age unknown), is judged
    by its lease instead, watched up to ``watch`` seconds: silent (a straggler) unless it is
    seen renewed."""
    versions = check_root(root)
    latest = versions[-1] if versions else None
    # the run of the newest manifest that reads; the versions above it (a damaged newest
    # manifest, a planted v999999999999) are bad for every receiver: no lag is counted to them
    # (every version down to it, not a window: the receivers go past any number of such, and
    # with none that reads no lag is counted at all)
    run_id = None
    counted: list[int] = []
    for i in reversed(range(len(versions))):
        with contextlib.suppress(FileNotFoundError, FormatError):
            run_id = read_manifest(root, versions[i]).run_id
            counted = versions[: i + 1]
            break
    acks = read_acks(root, unreadable)
    ages = ack_ages(root, acks, now)  # on the root filesystem's clock, not the receivers'
    rows, lags, behind = [], {}, set()
    for engine, ack in acks.items():
        other_run = run_id is not None and ack.run_id != run_id
        newest = _newest_not_bad(counted, ack.bad_versions)
        lag = lags[engine] = None if newest is None or other_run else newest - ack.version
        if other_run or (lag is not None and lag > 0):
            behind.add(engine)
    # behind and not heard of within --stale by the mtimes, or dated ahead (no age): what the
    # mtimes say is a writer's clock on an object-store mount; its lease's heartbeat tells
    quiet = [e for e in behind if ages[e].age > stale or ages[e].ahead > AHEAD_SLACK]
    heard = watch_leases(root, quiet, wait=watch) if quiet else {}
    for engine, ack in sorted(acks.items()):
        other_run = run_id is not None and ack.run_id != run_id
        lag = lags[engine]
        age = ages[engine].age
        silent = engine in heard and heard[engine] is not True
        straggler = other_run or (lag is not None and lag > max_lag) or silent
        rows.append(
            {
                "engine_id": engine,
                "version": ack.version,
                "lag": lag,
                "acked_at": ack.applied_at,
                "ack_age_seconds": round(age, 3),
                "clock_skew_seconds": round(ages[engine].skew, 3),
                "ack_ahead_seconds": round(ages[engine].ahead, 3),
                "lease_renewed": heard.get(engine),  # null: not watched (heard of lately)
                "bad_versions": list(ack.bad_versions),
                "host": ack.host,
                "run_id": ack.run_id,
                "other_run": other_run,
                "straggler": straggler,
            }
        )
    return latest, rows


def _newest_not_bad(versions: list[int], bad: tuple[int, ...]) -> int | None:
    """The newest of ``versions`` (ascending) that is not in ``bad``, or None."""
    skip = set(bad)
    return next((v for v in reversed(versions) if v not in skip), None)


def cmd_status(args: argparse.Namespace) -> int:
    root = Path(args.root)
    with contextlib.suppress(FileNotFoundError):  # no acks/ yet: no engine has acked
        scan(root / ACKS_DIR, root=root)  # OSError (one line, exit 1): a file, symlink, mode
    unreadable: dict[Path, str] = {}
    now, clock = root_clock(root)  # once: the one write of status (asyncsync.ops.cli says why)
    if clock is not None:  # a read-only root: said, the ages may carry this host's skew
        print(f"note: {clock}", file=sys.stderr)
    latest, rows = engine_rows(
        root, max_lag=args.max_lag, stale=args.stale, unreadable=unreadable, now=now
    )
    lost = [{"path": str(p), "reason": why} for p, why in sorted(unreadable.items())]
    stragglers = [r["engine_id"] for r in rows if r["straggler"]]
    bad = [
        {"engine_id": e, "path": str(u.path), "reason": u.reason,
         "age_seconds": round(max(now - u.mtime, 0.0), 3)}
        for e, u in unreadable_leases(root).items()
    ]  # fmt: skip
    if args.json:
        doc = {"latest": latest, "engines": rows, "stragglers": stragglers,
               "clock": "root" if clock is None else "this host"}  # fmt: skip
        print(json.dumps({**doc, "unreadable_leases": bad, "unreadable_acks": lost}, indent=1))
    else:
        print(f"root {printable(root)}: newest version {latest if latest is not None else '-'}, "
              f"{len(rows)} engines, {len(stragglers)} stragglers")  # fmt: skip
        if rows:
            headers = ["engine", "version", "lag", "acked", "age s", "skew s", "host", "state"]
            right = ["version", "lag", "age s", "skew s"]
            print(table(headers, [_row(r) for r in rows], right=right))
        for b in bad:
            print(
                printable(
                    f"lease of {b['engine_id']} UNREADABLE: {b['path']} ({b['reason']}), "
                    f"written {b['age_seconds']:.0f}s ago; taken over once older than a "
                    "receiver's ttl"
                )
            )
        for r in rows:
            if r["ack_ahead_seconds"] > AHEAD_SLACK:
                print(printable(
                    f"ack of {r['engine_id']} dated {r['ack_ahead_seconds']:.0f} s in the future "
                    "of the root's clock (its writer's clock ahead, a clock stepped back, a "
                    "hand-set mtime): its age unknown; --stale judges it by its lease's "
                    "heartbeat; gc too, once it is dated more than ack_ttl ahead"
                ))  # fmt: skip
        for u in lost:
            print(printable(f"ack UNREADABLE: {u['path']} ({u['reason']})"))
    if lost:  # an engine whose version it could not see: never "all clear"
        raise FormatError(
            f"{len(lost)} ack file(s) in {root / ACKS_DIR} cannot be read ({lost[0]['path']}: "
            f"{lost[0]['reason']}): their engines' versions are unknown; remove what no "
            "receiver wrote"
        )
    return STRAGGLERS_EXIT if stragglers else 0


def _row(r: dict[str, Any]) -> list[object]:
    state = "OTHER RUN" if r["other_run"] else "STRAGGLER" if r["straggler"] else "ok"
    lag = "-" if r["lag"] is None else r["lag"]
    if r["bad_versions"]:
        state += " bad " + ",".join(f"v{v}" for v in r["bad_versions"])
    age, skew = f"{r['ack_age_seconds']:.1f}", f"{r['clock_skew_seconds']:+.1f}"
    return [r["engine_id"], r["version"], lag, fmt_time(r["acked_at"]), age, skew, r["host"], state]


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    sp = sub.add_parser(
        "status",
        parents=[common],
        help="engines, their versions, lag and stragglers (from the acks); exit 3 on stragglers",
    )
    sp.add_argument("root", metavar="ROOT", help="the shared root")
    sp.add_argument(
        "--max-lag", type=non_negative_int, default=2, metavar="N",
        help="more than N versions behind the newest is a straggler (default 2)",
    )  # fmt: skip
    sp.add_argument(
        "--stale", type=positive_float, default=300.0, metavar="S",
        help="behind and silent for more than S seconds is a straggler (default 300)",
    )  # fmt: skip
    sp.add_argument("--json", action="store_true", help="print JSON")
    sp.set_defaults(func=cmd_status)
