"""``asyncsync inspect`` and ``asyncsync tail``: what is committed, and what lands."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncsync.console.args import poll_seconds
from asyncsync.console.logsetup import print_notice
from asyncsync.errors import ConfigError
from asyncsync.format import Manifest, TensorEntry
from asyncsync.format.acks import AckRecord, read_acks
from asyncsync.format.log import follow_log, read_log
from asyncsync.format.store import read_manifest, read_root_info
from asyncsync.ops.cli.common import (
    check_root,
    fmt_density,
    fmt_time,
    human_bytes,
    printable,
    resolve_version,
    table,
    version_spec,
    version_summaries,
)

__all__ = ["cmd_inspect", "cmd_tail", "register"]

logger = logging.getLogger(__name__)


def _tensor_mode(e: TensorEntry) -> str:
    modes: list[str] = sorted({p.delta.mode for p in e.spans if p.delta is not None})
    if not modes and any(p.full is not None for p in e.spans):
        modes = ["full"]
    mode = "/".join(modes) or "-"
    return f"{mode} ({len(e.parts)} parts)" if e.parts else mode


def _tensor_shard(m: Manifest, e: TensorEntry) -> str:
    refs = [m.shards[r.shard].file for p in e.spans for r in (p.delta, p.full) if r is not None]
    return ",".join(dict.fromkeys(refs)) or "-"


def cmd_inspect(args: argparse.Namespace) -> int:
    root = Path(args.root)
    versions = check_root(root)
    version = resolve_version(root, versions, args.version)
    if version is None:
        summaries = version_summaries(root, versions, _notice("inspect", args))
        if args.json:
            print(json.dumps(summaries, indent=1))
            return 0
        if not summaries:
            print(f"{printable(root)}: no committed version yet")
            return 0
        rows = [
            [
                s.get("version", "?"),
                s.get("kind", "?"),
                "-" if s.get("base_version") is None else s["base_version"],
                s.get("changed", 0),
                fmt_density(s.get("density")),
                human_bytes(s.get("wire_bytes", 0)),
                s.get("shards", "?"),
                fmt_time(s.get("committed_at")),
            ]
            for s in summaries
        ]
        headers = ["version", "kind", "base", "changed", "density", "wire", "shards", "committed"]
        print(
            table(headers, rows, right=("version", "base", "changed", "density", "wire", "shards"))
        )
        return 0
    m = read_manifest(root, version)
    if args.json:
        sys.stdout.write(m.to_json())
        return 0
    print(_manifest_summary(root, m))
    print()
    rows = [
        [
            e.name,
            e.dtype,
            "x".join(map(str, e.shape)) or "()",
            e.changed,
            _tensor_mode(e),
            _tensor_shard(m, e),
        ]
        for e in m.tensors
    ]
    print(table(["name", "dtype", "shape", "changed", "mode", "shard"], rows, right=("changed",)))
    return 0


def _manifest_summary(root: Path, m: Manifest) -> str:
    t = m.totals
    ratio = (
        f"{t.model_bytes / t.wire_bytes:.1f}x smaller than the full model"
        if t.wire_bytes
        else "nothing to transfer"
    )
    lines = [
        f"version      {m.version} ({m.kind}, base {m.base_version})",
        f"path         {root / f'v{m.version:012d}'}",
        f"run          {m.run_id}",
        f"committed    {fmt_time(m.committed_at)} "
        f"(built in {max(0.0, m.committed_at - m.created_at):.3f}s)",
        f"encoding     {m.encoding}, checksums {m.checksum_algorithm}",
        f"fingerprint  {m.fingerprint}",
        f"tensors      {t.tensors} ({t.elements:,} elements, {human_bytes(t.model_bytes)})",
        f"changed      {t.changed:,} elements ({fmt_density(t.density)})",
        f"wire         {human_bytes(t.wire_bytes)} ({ratio}); "
        f"delta {human_bytes(t.delta_bytes)}, raw payload {human_bytes(t.raw_bytes)}",
        f"shards       {len(m.shards)}",
        *(f"  {s.file}  {s.role}  {human_bytes(s.bytes)}" for s in m.shards),
    ]
    if m.shard_dir:
        lines.append(f"shard_dir    {m.shard_dir}")
    if m.producer:
        lines.append(f"producer     {json.dumps(m.producer, sort_keys=True)}")
    return "\n".join(map(printable, lines))  # the manifest's strings are any writer's


# --------------------------------------------------------------------------- tail


def _notice(command: str, args: argparse.Namespace) -> Callable[[str], None]:
    """One line on stderr, ``asyncsync COMMAND: ...``, its text :func:`printable`."""
    fmt = getattr(args, "log_format", "text")
    return lambda message: print_notice(f"asyncsync {command}", printable(message), fmt)


def _log_line(rec: dict[str, Any]) -> str:
    return printable(
        f"v{rec.get('version', '?')}  {rec.get('kind', '?'):<5}  "
        f"density={fmt_density(rec.get('density'))}  changed={rec.get('changed', 0)}  "
        f"wire={human_bytes(rec.get('wire_bytes', 0))}  {fmt_time(rec.get('committed_at'))}"
    )


def cmd_tail(args: argparse.Namespace) -> int:
    root = Path(args.root)
    if not args.follow:
        check_root(root)
        for rec in read_log(root, notice=_notice("tail", args)):
            print(_log_line(rec))
        return 0
    if not root.is_dir():
        raise ConfigError(f"{root} is not a directory: pass the shared root the publisher writes")
    if read_root_info(root) is None:
        logger.warning("%s holds no asyncsync root yet: waiting for a publisher", root)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_follow(root, args.interval, _notice("tail", args)))
    return 0


async def _follow(root: Path, interval: float, notice: Callable[[str], None]) -> None:
    """Print log lines and acks as they land, an ack only after the line of its version (or of
    a later one of its run): a receiver may ack a version before the publisher appends its
    log line, and the two are polled apart (an ack line came before its version's)."""
    shown: dict[object, int] = {}  # the newest version printed from the log, per run
    held: dict[str, AckRecord] = {}  # each engine's newest ack, until its version is printed

    def print_acks() -> None:
        for engine, ack in sorted(held.items()):
            if shown.get(ack.run_id, -1) >= ack.version:
                del held[engine]
                print(printable(f"ack engine={engine} version={ack.version}"), flush=True)

    async def log_task() -> None:
        async for rec in follow_log(root, poll_interval=interval, notice=notice):
            print(_log_line(rec), flush=True)
            run = rec.get("run_id")
            shown[run] = max(shown.get(run, -1), rec["version"])
            print_acks()

    async def ack_task() -> None:
        seen: dict[str, int] = {}
        while True:
            for engine, ack in (await asyncio.to_thread(read_acks, root)).items():
                if seen.get(engine) != ack.version:
                    seen[engine] = ack.version
                    held[engine] = ack
            print_acks()
            await asyncio.sleep(interval)

    async with asyncio.TaskGroup() as tg:
        tg.create_task(log_task())
        tg.create_task(ack_task())


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    sp = sub.add_parser(
        "inspect", parents=[common], help="list versions, or show one version's manifest"
    )
    sp.add_argument("root", metavar="ROOT", help="the shared root")
    sp.add_argument(
        "version", metavar="VERSION", nargs="?", type=version_spec,
        help="a version number or 'latest'",
    )  # fmt: skip
    sp.add_argument("--json", action="store_true", help="print JSON instead of tables")
    sp.set_defaults(func=cmd_inspect)

    sp = sub.add_parser(
        "tail", parents=[common], help="print the manifest log; -f keeps following (and acks)"
    )
    sp.add_argument("root", metavar="ROOT", help="the shared root")
    sp.add_argument(
        "-f", "--follow", action="store_true", help="keep printing new versions and acks"
    )
    sp.add_argument(
        "--interval",
        type=poll_seconds,
        default=0.5,
        metavar="S",
        help="poll interval in seconds with -f, at least 0.01 (default 0.5)",
    )
    sp.set_defaults(func=cmd_tail)
