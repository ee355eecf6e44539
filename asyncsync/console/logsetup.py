"""Logging set-up for the command-line tools: human text, or one JSON object per line.

``--log-format json`` is for log shippers (Loki, Elasticsearch, Cloud Logging): every record
becomes ``{"ts", "level", "logger", "msg", ...}`` with the exception text and any ``extra=``
fields included, one per line on stderr.

Text for a terminal goes through :func:`printable`, the one place control characters are
escaped: the text log's lines, a command's error line, the tables and lines of ``asyncsync``
(a path or a root file's string may hold an escape sequence or a newline).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import Any, NoReturn

__all__ = [
    "LOG_FORMATS",
    "LOG_LEVELS",
    "CliParser",
    "JsonFormatter",
    "TextFormatter",
    "add_logging_arguments",
    "print_error",
    "print_notice",
    "printable",
    "setup_logging",
    "sniff_log_format",
]

LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


def printable(value: object) -> str:
    """``str(value)`` with every character that is not printable escaped as Python writes it
    (``\\x1b``, ``\\n``, ``\\u2028``, ``\\u202e``): an escape sequence cannot recolour or
    clear the terminal, a newline cannot forge a line. Idempotent: the escapes are printable,
    so text escaped once is left as it is."""
    text = str(value)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


class TextFormatter(logging.Formatter):
    """``asctime level logger: message``, the line escaped by :func:`printable`; a traceback
    keeps its lines, each escaped."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        return printable(super().formatMessage(record))

    def formatException(self, ei: Any) -> str:
        return _lines(super().formatException(ei))

    def formatStack(self, stack_info: str) -> str:
        return _lines(super().formatStack(stack_info))


def _lines(text: str) -> str:
    return "\n".join(map(printable, text.split("\n")))


class JsonFormatter(logging.Formatter):
    """One JSON object per record; non-standard record attributes (``extra=``) are kept."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                doc[key] = value
        return json.dumps(doc, default=str)


def setup_logging(level: str = "WARNING", fmt: str = "text") -> None:
    """Configure the root logger on stderr (replacing earlier handlers)."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, got {fmt!r}")
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter())
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper()))


def add_logging_arguments(
    parser: argparse.ArgumentParser, *, default_level: str | None, hidden: bool = False
) -> None:
    """``--log-level`` and ``--log-format`` (``hidden``: repeated on subcommands, no defaults,
    so they may be given after the subcommand too)."""
    level_default: object = argparse.SUPPRESS if hidden else default_level
    format_default: object = argparse.SUPPRESS if hidden else "text"
    parser.add_argument(
        "--log-level", default=level_default, type=str.upper, choices=LOG_LEVELS,
        help=argparse.SUPPRESS if hidden else f"logging level on stderr (default {default_level})",
    )  # fmt: skip
    parser.add_argument(
        "--log-format", default=format_default, choices=LOG_FORMATS,
        help=argparse.SUPPRESS if hidden
        else "text, or json: one JSON object per log record (default text)",
    )  # fmt: skip


def sniff_log_format(argv: list[str]) -> str:
    """The ``--log-format`` given in ``argv`` (before it is parsed: for errors of parsing)."""
    fmt = "text"
    for i, a in enumerate(argv):
        if a == "--log-format" and i + 1 < len(argv):
            fmt = argv[i + 1]
        elif a.startswith("--log-format="):
            fmt = a.partition("=")[2]
    return fmt if fmt in LOG_FORMATS else "text"


def print_error(prog: str, message: str, fmt: str = "text") -> None:
    """The one error line a command prints before it exits: text, or a JSON log record."""
    _print_line(prog, logging.ERROR, "error: ", message, fmt)


def print_notice(prog: str, message: str, fmt: str = "text") -> None:
    """One line on stderr about something a command went past: text, or a JSON log record."""
    _print_line(prog, logging.WARNING, "", message, fmt)


def _print_line(prog: str, level: int, label: str, message: str, fmt: str) -> None:
    if fmt == "json":
        record = logging.LogRecord(prog, level, "", 0, message, None, None)
        print(JsonFormatter().format(record), file=sys.stderr, flush=True)
    else:  # one line, whatever a path in it holds (a newline, a terminal's escape sequence)
        print(printable(f"{prog}: {label}{message}"), file=sys.stderr, flush=True)


class CliParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors follow ``--log-format`` (set ``log_format``)."""

    log_format = "text"

    def error(self, message: str) -> NoReturn:
        if CliParser.log_format == "json":
            print_error(self.prog, message, "json")
            self.exit(2)
        super().error(message)
