"""``asyncsync``: the operator's command line for a shared root.

::

    asyncsync inspect ROOT                 table of committed versions
    asyncsync inspect ROOT 42              manifest summary and per-tensor table of version 42
    asyncsync inspect ROOT latest --json   the manifest JSON
    asyncsync tail ROOT -f                 the manifest log, then new versions and acks as they land
    asyncsync verify ROOT --checkpoint DIR [--version N]
                                           is a LocalCheckpoint directory bit-exact at a version?

Why a CLI: operators debug weight sync on hosts where a Python REPL is a hassle. ``inspect``,
``tail`` and ``verify`` only read the root (nothing is locked or written). ``status`` and
``gc --dry-run`` only read it too, save one write: ack and lease ages are measured on the file
server's clock (a receiver's clock, or this host's, may be off by hours: FORMAT.md 7), and the
one way to read that clock is the mtime of a file made there, so each creates a temp file
(``.tmp.clock.<hex>``, a name every reader ignores) in the root and removes it at once, which
changes the root directory's mtime; on a root it cannot write (a read-only mount, an operator
without write access) it writes nothing and takes this host's clock instead, and says so on
stderr (``status --json``: ``"clock": "this host"``). ``gc`` deletes versions and trims the
log; ``prepare`` sets modes. None locks anything: each is safe next to a live publisher and
live receivers.

Exit status: 0 on success; 1 when ``verify`` finds mismatching tensors or a command fails (one
line on stderr saying what to do, no traceback); 2 for bad usage.

``ASYNCSYNC_THROTTLE`` (a simulated slow filesystem, ``200MB/s,5ms[@/path]``) applies to every
command; one that does not parse is refused by every command before it reads the root (one
line, exit 1), as a Publisher, a receiver and the bench refuse it: a typo never runs a command
unthrottled that was meant to be throttled, nor leaves an operator wondering which it did.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Sequence

from asyncsync.console.logsetup import (
    CliParser,
    add_logging_arguments,
    print_error,
    setup_logging,
    sniff_log_format,
)
from asyncsync.errors import AsyncSyncError, first_error
from asyncsync.fsio import check_throttle_env
from asyncsync.ops.bench import cli as bench
from asyncsync.ops.cli import gc, prepare, status, verify, versions
from asyncsync.ops.cli.common import human_bytes
from asyncsync.ops.cli.verify import VerifyReport, verify_checkpoint_dir

__all__ = [
    "VerifyReport",
    "build_parser",
    "human_bytes",
    "main",
    "verify_checkpoint_dir",
]

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    p = CliParser(
        prog="asyncsync",
        description="Inspect, check and prune an asyncsync shared root.",
        epilog="exit status: 0 ok; 1 verify found mismatching tensors, or the command failed "
        "(one line on stderr); 2 bad usage; 3 status found stragglers",
    )
    add_logging_arguments(p, default_level="WARNING")
    # --log-level and --log-format are accepted after the subcommand too
    common = argparse.ArgumentParser(add_help=False)
    add_logging_arguments(common, default_level=None, hidden=True)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    for module in (versions, verify, status, gc, prepare, bench):
        module.register(sub, common)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (the console script passes it to ``sys.exit``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    CliParser.log_format = sniff_log_format(argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error argparse already printed
        return exc.code if isinstance(exc.code, int) else 2
    setup_logging(args.log_level, args.log_format)
    try:
        try:
            check_throttle_env()  # read at import (a bad one: no throttle): refused by each
            return int(args.func(args))
        except BaseExceptionGroup as group:  # a TaskGroup's (tail -f): its first error is the one
            raise first_error(group) from None
    except BrokenPipeError:  # e.g. `asyncsync inspect ROOT | head`: not an error
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # quiet exit flush
        return 0
    except (AsyncSyncError, OSError) as exc:
        why = str(exc)
        if isinstance(exc, PermissionError):  # (it said only "[Errno 13] Permission denied: P")
            why += (
                f": not allowed to uid {os.geteuid()}; run as a user who may read it (and, for "
                "gc or prepare, write it)"
            )
        print_error(f"asyncsync {args.command}", why, args.log_format)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
