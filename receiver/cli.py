"""``asyncsync-receiver``: keep a local safetensors checkpoint at the newest version of a root.

::

    asyncsync-receiver --root /shared/weights --engine-id node3-gpu0 --checkpoint /local/ckpt
    asyncsync-receiver --root /shared/weights --engine-id node3-gpu0 --checkpoint /local/ckpt --once

Why a separate process: the receiver runs next to an inference engine, which reloads (or mmaps)
the checkpoint directory; the receiver owns that directory (one agent per engine, a lock) and
acknowledges each version once the directory holds it bit for bit.

Without ``--once`` it runs until SIGINT or SIGTERM, then finishes (or rolls back) the version
in flight and exits 0. ``--once`` applies everything committed so far, prints the version held
and exits. Errors print one line on stderr and exit 1. uvloop is used when it is installed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from asyncsync.errors import AsyncSyncError
from receiver.agent import ReceiverAgent
from receiver.engines.checkpoint import LocalCheckpoint

__all__ = ["build_parser", "main"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
_STOP_GRACE = 120.0  # seconds a version in flight may take to finish after a stop signal


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="asyncsync-receiver",
        description="Keep a local safetensors checkpoint at the newest version of a shared root.",
    )
    p.add_argument("--root", required=True, help="the shared root the publisher writes")
    p.add_argument(
        "--engine-id", required=True, help="this engine's name in acks ([A-Za-z0-9._-], unique)"
    )
    p.add_argument(
        "--checkpoint",
        required=True,
        metavar="DIR",
        help="local checkpoint directory (created if missing; must be empty the first time)",
    )
    p.add_argument("--once", action="store_true", help="apply what is committed now, then exit")
    p.add_argument(
        "--poll-interval",
        type=_positive_float,
        default=1.0,
        metavar="S",
        help="seconds between polls of the root (inotify wakes it sooner; default 1.0)",
    )
    p.add_argument(
        "--force-polling",
        action="store_true",
        help="do not use inotify (use on NFS/FUSE mounts written by other hosts)",
    )
    p.add_argument(
        "--log-level",
        default="INFO",
        type=str.upper,
        choices=LOG_LEVELS,
        help="logging level on stderr (default INFO)",
    )
    return p


def run_async(main_fn: Callable[[], Coroutine[Any, Any, _T]]) -> _T:
    """Run a coroutine function on uvloop when it is importable, else on asyncio's loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main_fn())
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main_fn())


def _make_agent(args: argparse.Namespace) -> ReceiverAgent:
    engine = LocalCheckpoint(args.checkpoint)
    return ReceiverAgent(
        args.root,
        engine,
        args.engine_id,
        poll_interval=args.poll_interval,
        use_inotify=False if args.force_polling else None,
    )


async def _once(args: argparse.Namespace) -> int | None:
    async with _make_agent(args) as agent:
        return await agent.sync_once()


async def _serve(args: argparse.Namespace) -> int | None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    installed: list[signal.Signals] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
    try:
        async with _make_agent(args) as agent:
            logger.info(
                "receiver %s: root=%s checkpoint=%s holding version %s",
                args.engine_id,
                args.root,
                args.checkpoint,
                agent.version,
            )
            task = asyncio.create_task(agent.run(stop=stop), name=f"agent {args.engine_id}")
            stopped = asyncio.create_task(stop.wait())
            await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                logger.info("receiver %s: stopping", args.engine_id)
                try:
                    # agent.run checks the stop event after each poll or finished version
                    await asyncio.wait_for(task, args.poll_interval + _STOP_GRACE)
                except TimeoutError:
                    logger.warning(
                        "receiver %s: version in flight did not finish; rolled back", args.engine_id
                    )
            stopped.cancel()
            if task.done() and not task.cancelled():
                task.result()  # re-raise what ended the agent, if anything
            return agent.version
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the receiver; returns the exit status (the console script passes it to sys.exit)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    logging.basicConfig(
        level=getattr(logging, args.log_level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # watchfiles logs every batch of changes at INFO: noise next to the agent's own lines
    logging.getLogger("watchfiles").setLevel(max(logging.WARNING, getattr(logging, args.log_level)))
    try:
        if args.once:
            version = run_async(lambda: _once(args))
            if version is None:
                print(f"{args.engine_id}: holds no version ({args.root} has none committed yet)")
            else:
                print(f"{args.engine_id}: holds version {version}")
            return 0
        version = run_async(lambda: _serve(args))
        logger.info("receiver %s: stopped at version %s", args.engine_id, version)
        return 0
    except (AsyncSyncError, OSError, ValueError) as exc:
        print(f"asyncsync-receiver {args.engine_id}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # a signal before the handlers were installed
        return 0


if __name__ == "__main__":
    sys.exit(main())
