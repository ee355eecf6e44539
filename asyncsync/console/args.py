"""argparse types shared by every command-line tool (``asyncsync``, ``asyncsync-receiver``)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

__all__ = ["int_at_least", "non_negative_int", "positive_float", "positive_int"]


def positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return v


def int_at_least(lo: int) -> Callable[[str], int]:
    """An argparse type: a whole number (``_`` separators allowed) of at least ``lo``."""

    def parse(text: str) -> int:
        try:
            v = int(text.replace("_", ""))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        return v

    return parse


non_negative_int = int_at_least(0)
positive_int = int_at_least(1)
