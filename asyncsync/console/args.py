"""argparse types shared by every command-line tool (``asyncsync``, ``asyncsync-receiver``)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from asyncsync.errors import MAX_SECONDS
from asyncsync.fsio import parse_size

__all__ = [
    "int_at_least",
    "non_negative_float",
    "non_negative_int",
    "positive_float",
    "positive_int",
    "size_bytes",
]


def _seconds(zero_ok: bool) -> Callable[[str], float]:
    """An argparse type: a finite number of seconds, > 0 (or >= 0 with ``zero_ok``)."""

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a number of seconds, got {text!r}"
            ) from None
        if not (v >= 0 if zero_ok else v > 0) or v == float("inf"):
            raise argparse.ArgumentTypeError(f"must be {'>=' if zero_ok else '>'} 0, got {text}")
        if v > MAX_SECONDS:  # a longer wait overflows (threading, time arithmetic)
            raise argparse.ArgumentTypeError(
                f"must be at most {MAX_SECONDS:.0f} seconds (~292 years), got {text}"
            )
        return v

    return parse


positive_float = _seconds(zero_ok=False)
non_negative_float = _seconds(zero_ok=True)


def size_bytes(text: str) -> int:
    """An argparse type: a size as SyncConfig takes it (``500M``, ``2GiB``, ``1MB``, ``4096``;
    K/M/G/T and KiB... are powers of 1024, KB/MB... of 1000), at least 1 byte."""
    try:
        v = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 byte, got {text!r}")
    return v


def int_at_least(lo: int, hi: int | None = None) -> Callable[[str], int]:
    """An argparse type: a whole number (``_`` separators allowed) of at least ``lo`` (and at
    most ``hi`` when given)."""

    def parse(text: str) -> int:
        try:
            v = int(text.replace("_", ""))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        if hi is not None and v > hi:
            raise argparse.ArgumentTypeError(f"must be <= {hi}, got {v}")
        return v

    return parse


non_negative_int = int_at_least(0)
positive_int = int_at_least(1)
