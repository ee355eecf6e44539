"""Helpers shared by the ``asyncsync`` subcommands: formatting, argument types, root checks."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from asyncsync.console.args import (
    int_at_least,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    size_bytes,
)
from asyncsync.console.logsetup import printable  # every string from a root file shown
from asyncsync.errors import ConfigError, FormatError
from asyncsync.format.log import read_log
from asyncsync.format.store import list_versions, read_manifest, read_root_info

__all__ = [
    "check_root",
    "fmt_density",
    "fmt_time",
    "human_bytes",
    "int_at_least",
    "non_negative_float",
    "non_negative_int",
    "positive_float",
    "positive_int",
    "printable",
    "resolve_version",
    "size_bytes",
    "version_spec",
    "table",
    "version_summaries",
]


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
    """Text columns two spaces apart; columns named in ``right`` are right-aligned. Cells are
    shown :func:`printable`: a control character in one cannot forge a row or clear a screen."""
    cells = [[printable(c) for c in r] for r in rows]
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


def check_root(root: Path) -> list[int]:
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


def version_spec(text: str) -> str:
    """An argparse type: a version number or ``latest`` (anything else is a usage error)."""
    if text != "latest" and not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"VERSION must be a number or 'latest', got {text!r}")
    return text


def resolve_version(root: Path, versions: list[int], spec: str | None) -> int | None:
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


def version_summaries(
    root: Path, versions: list[int], notice: Callable[[str], None] | None = None
) -> list[dict[str, Any]]:
    """One summary per committed version: from the log, else from the manifest.

    The log is cheap to read; manifests are read only for versions it lacks (a torn last line,
    a lost append), and log lines of versions no longer on disk are dropped. A manifest that
    cannot be read gives ``{"version", "kind": "bad", "error"}``: the others are still listed.
    A log that cannot be read whole (larger than ``MAX_LOG_BYTES``, not a regular file, not
    readable by this user) is skipped, one line to ``notice`` saying so: every version is then
    read from its manifest.
    """
    try:
        log = read_log(root)
    except (FormatError, OSError) as exc:
        if notice is not None:
            notice(f"skipped the log: {exc}; versions listed from their manifests")
        log = []
    by_version: dict[int, dict[str, Any]] = {}
    for line in log:
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
            except (FormatError, OSError) as exc:  # one damaged version: listed as such
                rec = {"version": v, "kind": "bad", "error": str(exc)}
        out.append(rec)
    return out
