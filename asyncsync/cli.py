"""``asyncsync``: the operator's command line for a shared root.

::

    asyncsync inspect ROOT                 table of committed versions
    asyncsync inspect ROOT 42              manifest summary and per-tensor table of version 42
    asyncsync inspect ROOT latest --json   the manifest JSON
    asyncsync tail ROOT -f                 the manifest log, then new versions and acks as they land
    asyncsync verify ROOT --checkpoint DIR [--version N]
                                           is a LocalCheckpoint directory bit-exact at a version?

Why a CLI: operators debug weight sync on hosts where a Python REPL is a hassle; everything here
only reads the root (nothing is locked or written), so it is safe next to a live publisher and
live receivers.

Exit status: 0 on success; 1 when ``verify`` finds mismatching tensors or a command fails (one
line on stderr saying what to do, no traceback); 2 for bad usage.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncsync.acks import read_acks
from asyncsync.errors import AsyncSyncError, ConfigError
from asyncsync.format import Manifest, TensorEntry
from asyncsync.log import follow_log, read_log
from asyncsync.store import list_versions, read_manifest, read_root_info

__all__ = [
    "VerifyReport",
    "build_parser",
    "human_bytes",
    "main",
    "verify_checkpoint_dir",
]

logger = logging.getLogger(__name__)

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


# --------------------------------------------------------------------------- formatting


def human_bytes(n: float) -> str:
    """``1536`` -> ``1.5 KiB``; plain bytes below 1 KiB."""
    if n < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
    raise AssertionError("unreachable")


def fmt_time(ts: float | None) -> str:
    if not ts:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def fmt_density(d: float | None) -> str:
    return "-" if d is None else f"{100 * d:.3f}%"


def table(
    headers: Sequence[str], rows: Sequence[Sequence[object]], right: Sequence[str] = ()
) -> str:
    """Text columns two spaces apart; columns named in ``right`` are right-aligned."""
    cells = [[str(c) for c in r] for r in rows]
    widths = [len(h) for h in headers]
    for r in cells:
        for i, c in enumerate(r):
            widths[i] = max(widths[i], len(c))
    align_right = [h in right for h in headers]

    def line(vals: Sequence[str]) -> str:
        out = [
            v.rjust(widths[i]) if align_right[i] else v.ljust(widths[i]) for i, v in enumerate(vals)
        ]
        return "  ".join(out).rstrip()

    return "\n".join([line(list(headers)), *(line(r) for r in cells)])


# --------------------------------------------------------------------------- root helpers


def _check_root(root: Path) -> list[int]:
    """The committed versions of ``root``; a ConfigError when it is not an asyncsync root."""
    if not root.is_dir():
        raise ConfigError(f"{root} is not a directory: pass the shared root the publisher writes")
    versions = list_versions(root)
    if not versions and read_root_info(root) is None:
        raise ConfigError(
            f"{root} is not an asyncsync root (no asyncsync.json and no versions): "
            "pass the directory given to Publisher(...)"
        )
    return versions


def _resolve_version(root: Path, versions: list[int], spec: str | None) -> int | None:
    if spec is None:
        return None
    if spec == "latest":
        if not versions:
            raise ConfigError(f"{root} has no committed version yet")
        return versions[-1]
    try:
        v = int(spec)
    except ValueError:
        raise ConfigError(f"VERSION must be an integer or 'latest', got {spec!r}") from None
    if v not in versions:
        have = f"{versions[0]}..{versions[-1]}" if versions else "none"
        raise ConfigError(f"version {v} is not committed in {root} (committed: {have})")
    return v


def version_summaries(root: Path, versions: list[int]) -> list[dict[str, Any]]:
    """One summary per committed version: from the log, else from the manifest.

    The log is cheap to read; manifests are read only for versions it lacks (a torn last line,
    a lost append), and log lines of versions no longer on disk are dropped.
    """
    by_version: dict[int, dict[str, Any]] = {}
    for line in read_log(root):
        n = line.get("version")
        if isinstance(n, int) and not isinstance(n, bool):
            by_version[n] = line
    out = []
    for v in versions:
        rec = by_version.get(v)
        if rec is None:
            try:
                rec = read_manifest(root, v).log_record()
            except FileNotFoundError:
                continue  # removed since the scan
        out.append(rec)
    return out


def _tensor_mode(e: TensorEntry) -> str:
    if e.delta is not None:
        return e.delta.mode
    if e.full is not None:
        return "full"
    return "-"


def _tensor_shard(m: Manifest, e: TensorEntry) -> str:
    refs = []
    if e.delta is not None:
        refs.append(m.shards[e.delta.shard].file)
    if e.full is not None:
        refs.append(m.shards[e.full.shard].file)
    return ",".join(refs) or "-"


# --------------------------------------------------------------------------- inspect


def cmd_inspect(args: argparse.Namespace) -> int:
    root = Path(args.root)
    versions = _check_root(root)
    version = _resolve_version(root, versions, args.version)
    if version is None:
        summaries = version_summaries(root, versions)
        if args.json:
            print(json.dumps(summaries, indent=1))
            return 0
        if not summaries:
            print(f"{root}: no committed version yet")
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
        f"shards       {len(m.shards)}"
        + "".join(f"\n  {s.file}  {s.role}  {human_bytes(s.bytes)}" for s in m.shards),
    ]
    if m.shard_dir:
        lines.append(f"shard_dir    {m.shard_dir}")
    if m.producer:
        lines.append(f"producer     {json.dumps(m.producer, sort_keys=True)}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- tail


def _log_line(rec: dict[str, Any]) -> str:
    return (
        f"v{rec.get('version', '?')}  {rec.get('kind', '?'):<5}  "
        f"density={fmt_density(rec.get('density'))}  changed={rec.get('changed', 0)}  "
        f"wire={human_bytes(rec.get('wire_bytes', 0))}  {fmt_time(rec.get('committed_at'))}"
    )


def cmd_tail(args: argparse.Namespace) -> int:
    root = Path(args.root)
    if not args.follow:
        _check_root(root)
        for rec in read_log(root):
            print(_log_line(rec))
        return 0
    if not root.is_dir():
        raise ConfigError(f"{root} is not a directory: pass the shared root the publisher writes")
    if read_root_info(root) is None:
        logger.warning("%s holds no asyncsync root yet: waiting for a publisher", root)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_follow(root, args.interval))
    return 0


async def _follow(root: Path, interval: float) -> None:
    async def log_task() -> None:
        async for rec in follow_log(root, poll_interval=interval):
            print(_log_line(rec), flush=True)

    async def ack_task() -> None:
        seen: dict[str, int] = {}
        while True:
            for engine, ack in sorted((await asyncio.to_thread(read_acks, root)).items()):
                if seen.get(engine) != ack.version:
                    seen[engine] = ack.version
                    print(f"ack engine={engine} version={ack.version}", flush=True)
            await asyncio.sleep(interval)

    async with asyncio.TaskGroup() as tg:
        tg.create_task(log_task())
        tg.create_task(ack_task())


# --------------------------------------------------------------------------- verify


@dataclass(frozen=True)
class VerifyReport:
    """Outcome of checking a checkpoint directory against one version's manifest."""

    directory: Path
    version: int
    tensors: int
    mismatched: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatched

    def describe(self) -> str:
        if self.ok:
            return (
                f"OK: {self.directory} is bit-exact at version {self.version} "
                f"({self.tensors} tensors)"
            )
        return (
            f"MISMATCH: {self.directory} differs from version {self.version} in "
            f"{len(self.mismatched)} of {self.tensors} tensors: " + ", ".join(self.mismatched)
        )


def verify_checkpoint_dir(
    root: str | Path, checkpoint: str | Path, version: int | None = None
) -> VerifyReport:
    """Check every tensor of a LocalCheckpoint directory against ``version``'s checksums.

    ``version`` defaults to the version the checkpoint's state says it holds, else the newest
    in ``root``. Read-only and lock-free: run it when no receiver is applying to the directory.
    """
    from receiver.engines.checkpoint import verify_checkpoint
    from receiver.state import STATE_DIR_NAME, StateStore

    root, checkpoint = Path(root), Path(checkpoint)
    versions = _check_root(root)
    if not checkpoint.is_dir():
        raise ConfigError(f"checkpoint directory {checkpoint} does not exist")
    if version is None:
        state = StateStore(checkpoint / STATE_DIR_NAME).load()
        if state is not None and state.applying:
            logger.warning(
                "%s is in the middle of applying version %s: stop its receiver for a stable answer",
                checkpoint,
                state.target_version,
            )
        if state is not None and state.version is not None:
            version = state.version
        elif versions:
            version = versions[-1]
        else:
            raise ConfigError(f"{root} has no committed version to verify against")
    try:
        manifest = read_manifest(root, version)
    except FileNotFoundError:
        raise ConfigError(
            f"version {version} is not committed in {root}; pass --version with one that is"
        ) from None
    bad = verify_checkpoint(checkpoint, manifest)
    return VerifyReport(checkpoint, version, len(manifest.tensors), list(bad))


def cmd_verify(args: argparse.Namespace) -> int:
    report = verify_checkpoint_dir(args.root, args.checkpoint, args.version)
    if report.ok:
        print(report.describe())
        return 0
    print(
        f"MISMATCH: {report.directory} differs from version {report.version} in "
        f"{len(report.mismatched)} of {report.tensors} tensors:"
    )
    for name in report.mismatched:
        print(f"  {name}")
    return 1


# --------------------------------------------------------------------------- main


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return v


def _non_negative_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a version number, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="asyncsync",
        description="Inspect and check an asyncsync shared root (read-only).",
        epilog="exit status: 0 ok; 1 verify found mismatching tensors, or the command failed "
        "(one line on stderr); 2 bad usage",
    )
    p.add_argument(
        "--log-level",
        default="WARNING",
        type=str.upper,
        choices=LOG_LEVELS,
        help="logging level on stderr (default WARNING)",
    )
    # --log-level is accepted after the subcommand too
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--log-level", default=argparse.SUPPRESS, type=str.upper, choices=LOG_LEVELS,
        help=argparse.SUPPRESS,
    )  # fmt: skip
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sp = sub.add_parser(
        "inspect", parents=[common], help="list versions, or show one version's manifest"
    )
    sp.add_argument("root", metavar="ROOT", help="the shared root")
    sp.add_argument("version", metavar="VERSION", nargs="?", help="a version number or 'latest'")
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
        type=_positive_float,
        default=0.5,
        metavar="S",
        help="poll interval in seconds with -f (default 0.5)",
    )
    sp.set_defaults(func=cmd_tail)

    sp = sub.add_parser(
        "verify", parents=[common], help="check a LocalCheckpoint directory bit for bit"
    )
    sp.add_argument("root", metavar="ROOT", help="the shared root")
    sp.add_argument("--checkpoint", required=True, metavar="DIR", help="the checkpoint directory")
    sp.add_argument(
        "--version",
        type=_non_negative_int,
        default=None,
        metavar="N",
        help="version to check against (default: the one the checkpoint holds, else the newest)",
    )
    sp.set_defaults(func=cmd_verify)
    return p


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (the console script passes it to ``sys.exit``)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error argparse already printed
        return exc.code if isinstance(exc.code, int) else 2
    setup_logging(args.log_level)
    try:
        return int(args.func(args))
    except BrokenPipeError:  # e.g. `asyncsync inspect ROOT | head`: not an error
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # quiet exit flush
        return 0
    except (AsyncSyncError, OSError) as exc:
        print(f"asyncsync {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
