"""argparse types shared by every command-line tool (``asyncsync``, ``asyncsync-receiver``), and
:func:`parse_size`, the sizes they and :class:`~asyncsync.training.config.SyncConfig` take."""

from __future__ import annotations

import argparse
import logging
import os
import re
from collections.abc import Callable

from asyncsync.errors import MAX_BYTES, MAX_SECONDS, MIN_POLL_SECONDS

__all__ = [
    "env_size",
    "int_at_least",
    "non_negative_float",
    "non_negative_int",
    "parse_size",
    "poll_seconds",
    "positive_float",
    "positive_int",
    "size_bytes",
]

logger = logging.getLogger(__name__)

_SIZE_UNITS = {
    "": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 10**3, "m": 1 << 20, "mib": 1 << 20,
    "mb": 10**6, "g": 1 << 30, "gib": 1 << 30, "gb": 10**9, "t": 1 << 40, "tib": 1 << 40,
    "tb": 10**12, "p": 1 << 50, "pib": 1 << 50, "pb": 10**15,
}  # fmt: skip
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def parse_size(text: str) -> int:
    """Bytes in ``text``: ``4096``, ``32MiB``, ``1.5G`` (K/M/G/T/P = 1024^n, KB/MB/... =
    1000^n), at most :data:`~asyncsync.errors.MAX_BYTES` (1 PiB)."""
    m = _SIZE_RE.match(text.replace("_", ""))
    unit = m.group(2).lower() if m else ""
    shown = repr(text) if len(text) <= 40 else f"{text[:24]!r}... ({len(text)} characters)"
    if m is None or unit not in _SIZE_UNITS:
        raise ValueError(f"{shown} is not a size; write e.g. 33554432, 32MiB or 1G")
    value = float(m.group(1)) * _SIZE_UNITS[unit]  # 400 digits: inf, no OverflowError
    if value > MAX_BYTES:
        raise ValueError(f"{shown} is more than 1 PiB: a size must be at most 1 PiB")
    if value != int(value):
        raise ValueError(f"{shown} is not a whole number of bytes")
    return int(value)


def env_size(name: str, default: int) -> int:
    """``$name`` as a size (:func:`parse_size`, at least 1 byte), else ``default``. A value that
    is no such size is a WARNING naming it, and the default: a tuning setting read inside an
    inference engine must not fail its model load."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = parse_size(text)
        if value < 1:
            raise ValueError("a size must be at least 1 byte")
    except ValueError as exc:
        logger.warning("$%s=%.40r is not a usable size (%s); using %d", name, text, exc, default)
        return default
    return value


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


def poll_seconds(text: str) -> float:
    """An argparse type: a poll interval, :func:`positive_float` of at least
    :data:`~asyncsync.errors.MIN_POLL_SECONDS` (a shorter poll spins a core)."""
    v = positive_float(text)
    if v < MIN_POLL_SECONDS:
        raise argparse.ArgumentTypeError(
            f"must be at least {MIN_POLL_SECONDS:g} seconds (a shorter poll spins a core), "
            f"got {text}"
        )
    return v


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
