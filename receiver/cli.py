"""``asyncsync-receiver``: keep a local safetensors checkpoint at the newest version of a root.

::

    asyncsync-receiver --root /shared/weights --engine-id node3-gpu0 --checkpoint /local/ckpt
    asyncsync-receiver --root /shared/weights --engine-id node3-gpu0 --checkpoint /local/ckpt --once
    asyncsync-receiver --root /shared/weights --engine-id node3-gpu0 --checkpoint /local/ckpt \
        --sglang-url http://127.0.0.1:30000 --api-key-file /run/secrets/sglang-api-key

With ``--sglang-url`` (or ``--vllm-url``) the receiver also makes that server reload the
checkpoint after each version and acknowledges a version only once the server reports it
(``receiver.engines.SGLang`` / ``VLLM``, docs/ENGINES.md). The server's API key comes from
``--api-key-file``, else the ``ASYNCSYNC_API_KEY`` environment variable; SGLang's admin key
(``--admin-api-key``) from ``--admin-api-key-file``, else ``ASYNCSYNC_ADMIN_API_KEY``. Keys are
never taken on the command line, where ``ps`` would show them.

Why a separate process: the receiver runs next to an inference engine, which reloads (or mmaps)
the checkpoint directory; the receiver owns that directory (one agent per engine, a lock) and
acknowledges each version once the directory holds it bit for bit.

Without ``--once`` it runs until SIGINT (Ctrl-C), SIGTERM or SIGHUP (unless ignored: nohup),
then finishes (or rolls back) the version in flight and exits 0; a second signal meanwhile is
ignored until it has exited (the status stays 0; SIGKILL still ends it at once). One while
it starts (importing, checking its paths) is held until its handlers are installed, then
stops it the same way: "stopped before it started", status 0 (``receiver.entry``). ``--once``
applies everything committed so far, prints the version held and exits (status 130 if
interrupted). An error prints one line on stderr, exit status 1. Without ``--once``, a
start-up call to the server that fails for now (no answer within its deadline: an update still
running in the server; a 5xx) is retried with backoff instead, nothing acked meanwhile, while
the status port answers ``/readyz`` 503 saying why (``receiver.cli_start``); a refused key
or a server that never came up within ``--engine-startup-timeout`` still ends it. uvloop is
used when it is installed.
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

from asyncsync.console.args import (
    non_negative_float,
    non_negative_int,
    poll_seconds,
    positive_float,
    size_bytes,
)
from asyncsync.console.logsetup import (
    CliParser,
    add_logging_arguments,
    print_error,
    printable,
    setup_logging,
    sniff_log_format,
)
from asyncsync.console.progress import Progress, ProgressWatcher
from asyncsync.errors import AsyncSyncError, ConfigError
from asyncsync.format.lease import DEFAULT_LEASE_TTL
from asyncsync.format.liveness import WATCH_LIMIT
from asyncsync.memory import freeze_startup_objects
from receiver.agent import VERIFY_DEADLINE, ReceiverAgent
from receiver.audit import receiver_auditor
from receiver.cli_checks import (
    MAX_SECRET_BYTES,
    MIN_TOKEN_CHARS,
    TOKEN_ENV,
    check_paths,
    check_status_options,
    engine_id_arg,
    port_arg,
    read_secret,
)
from receiver.cli_start import open_agent
from receiver.engines.base import Engine
from receiver.engines.checkpoint import LocalCheckpoint
from receiver.engines.http_engine import Timeouts
from receiver.engines.reloading import ReloadingEngine
from receiver.engines.sglang import AUDIT_INTERVAL as SGLANG_AUDIT_INTERVAL
from receiver.engines.sglang import PAUSE_MODES, SGLang
from receiver.engines.vllm import VLLM
from receiver.entry import stop_signals
from receiver.shard_reader import APPLY_GROUP_BYTES
from receiver.stream import STREAM_TIMEOUT

__all__ = ["MAX_SECRET_BYTES", "build_parser", "check_paths", "main", "read_secret"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_STOP_GRACE = 120.0  # seconds a version in flight may take to finish after a stop signal
#: --audit-after-apply on SGLang: seconds an audit waits for the plugin's pass over the version
SGLANG_AUDIT_WAIT = 120.0
API_KEY_ENV = "ASYNCSYNC_API_KEY"
ADMIN_API_KEY_ENV = "ASYNCSYNC_ADMIN_API_KEY"


def _lease_ttl(text: str) -> float:
    """``--lease-ttl``: seconds from 1 to :data:`~asyncsync.format.liveness.WATCH_LIMIT` (120):
    readers watch a lease for at most that long (FORMAT.md section 7.1), and a shorter ttl
    rewrites it more than three times a second."""
    v = positive_float(text)
    if not 1 <= v <= WATCH_LIMIT:
        raise argparse.ArgumentTypeError(
            f"must be from 1 to {WATCH_LIMIT:g} seconds (readers watch a lease for at most "
            f"{WATCH_LIMIT:g}), got {text}"
        )
    return v


def build_parser() -> argparse.ArgumentParser:
    p = CliParser(
        prog="asyncsync-receiver",
        description="Keep a local safetensors checkpoint at the newest version of a shared root.",
        epilog="Without --once, Ctrl-C (SIGINT), SIGTERM or SIGHUP stops it after the version in "
        f"flight (allowed {_STOP_GRACE:.0f} s); a second signal meanwhile is ignored. Exit "
        "status: 0 stopped, or --once done; 1 an error (one line on stderr); 2 bad usage; "
        "130 --once interrupted.",
    )
    p.add_argument("--root", required=True, help="the shared root the publisher writes")
    p.add_argument(
        "--engine-id",
        required=True,
        type=engine_id_arg,
        help="this engine's name in acks ([A-Za-z0-9._-], unique)",
    )
    p.add_argument(
        "--checkpoint",
        required=True,
        metavar="DIR",
        help="local checkpoint directory (created if missing; the first time it may hold the "
        "model's config and tokenizer files, but no *.safetensors)",
    )
    p.add_argument("--once", action="store_true", help="apply what is committed now, then exit")
    p.add_argument(
        "--apply-group-bytes",
        type=size_bytes,
        default=None,
        metavar="SIZE",
        help="decoded delta bytes handed to the engine at once (bounds memory; e.g. 8MiB; "
        f"default: 1/64 of the model within [1 MiB, {APPLY_GROUP_BYTES >> 20} MiB])",
    )
    p.add_argument(
        "--sync-before-ack",
        action="store_true",
        help="flush each delta to disk before acknowledging it (default: acknowledge once it "
        "is verified in the page cache and flush in the background; see LocalCheckpoint)",
    )
    p.add_argument(
        "--checkpoint-redo-log",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="keep each delta as a redo record beside the checkpoint's files and merge the "
        "records into them every N versions, when idle and at start and stop (default 0: patch "
        "each delta in place); the files are loadable by a server only while no record is held",
    )
    p.add_argument(
        "--checkpoint-compact-idle",
        type=positive_float,
        default=2.0,
        metavar="S",
        help="with --checkpoint-redo-log: merge the records after S seconds without a version "
        "(or twice the interval between versions where longer, at most 300; default 2)",
    )
    p.add_argument(
        "--poll-interval",
        type=poll_seconds,
        default=1.0,
        metavar="S",
        help="seconds between polls of the root, at least 0.01 (inotify wakes it sooner; "
        "default 1.0)",
    )
    p.add_argument(
        "--force-polling",
        action="store_true",
        help="do not use inotify (use on NFS/FUSE mounts written by other hosts)",
    )
    p.add_argument(
        "--verify-deadline",
        type=non_negative_float,
        default=VERIFY_DEADLINE,
        metavar="S",
        help="seconds a shard that is missing, short or fails its checksum (or a manifest that "
        "does not parse) is re-read before the version is refused as bad: above the time the "
        "root's filesystem takes to show another host's write in full (default "
        f"{VERIFY_DEADLINE:g}; docs/FORMAT.md section 8)",
    )
    p.add_argument(
        "--stream-timeout",
        type=positive_float,
        default=STREAM_TIMEOUT,
        metavar="S",
        help="seconds a version applied shard by shard before its manifest (docs/FORMAT.md "
        "section 8.1) may go without a new shard or its manifest before it is rolled back: the "
        "checkpoint holds part of it meanwhile, and a trainer that stalls or dies leaves it so "
        f"that long (default {STREAM_TIMEOUT:g})",
    )
    p.add_argument(
        "--lease-ttl",
        type=_lease_ttl,
        default=DEFAULT_LEASE_TTL,
        metavar="S",
        help="seconds another receiver must see this engine id's lease unchanged before it "
        "takes the id, when no pid check can tell (another host or container); this one "
        "rewrites it every third of that: how long a restart elsewhere waits for a dead "
        f"receiver's lease (1-120, default {DEFAULT_LEASE_TTL:g}; docs/FORMAT.md section 7.1)",
    )
    p.add_argument(
        "--lease-settle",
        type=non_negative_float,
        default=None,
        metavar="S",
        help="seconds between claiming the engine id and reading rival claims: above the time "
        "the root's filesystem takes to show another host's write (default: 0 on a local "
        "filesystem, 5 on NFS/FUSE; docs/FORMAT.md section 7.1)",
    )
    server = p.add_argument_group(
        "inference server", "make a server reload the checkpoint after each version"
    )
    urls = server.add_mutually_exclusive_group()
    urls.add_argument(
        "--sglang-url", metavar="URL", help="an SGLang server, e.g. http://127.0.0.1:30000"
    )
    urls.add_argument(
        "--vllm-url", metavar="URL", help="a vLLM server in dev mode (VLLM_SERVER_DEV_MODE=1)"
    )
    server.add_argument(
        "--api-key-file",
        metavar="F",
        help=f"file holding the server's API key (default: ${API_KEY_ENV}, if set)",
    )
    server.add_argument(
        "--admin-api-key-file",
        metavar="F",
        help="file holding SGLang's --admin-api-key, sent on the weight, pause, flush and "
        f"version endpoints (default: ${ADMIN_API_KEY_ENV}, if set; none: the API key)",
    )
    server.add_argument(
        "--engine-model-path",
        metavar="DIR",
        help="the checkpoint directory as the server sees it (default: --checkpoint)",
    )
    server.add_argument(
        "--version-offset",
        type=int,
        default=0,
        metavar="N",
        help="tell the server weight version v+N for root version v (slime's weight_version "
        "when its start version is not the root's; docs/INTEGRATION.md); acks still name v",
    )
    server.add_argument(
        "--pause-mode",
        choices=PAUSE_MODES,
        default="auto",
        help="SGLang pause mode around a weight change (default auto: retract on SGLang >= "
        "0.5.23, else abort; see docs/ENGINES.md)",
    )
    server.add_argument(
        "--engine-update-timeout",
        type=positive_float,
        default=Timeouts.update,
        metavar="S",
        help=f"seconds a weight reload may take (default {Timeouts.update:g})",
    )
    server.add_argument(
        "--engine-silence-timeout",
        type=positive_float,
        default=Timeouts.silence,
        metavar="S",
        help="seconds a server that answers nothing (stopped, hung) keeps the ack before it is "
        f"withdrawn; restored when it answers with the version (default {Timeouts.silence:g})",
    )
    server.add_argument(
        "--engine-startup-timeout",
        type=positive_float,
        default=Timeouts.startup,
        metavar="S",
        help=f"seconds to wait for the server to come up (default {Timeouts.startup:g})",
    )
    audit = p.add_argument_group(
        "served-bytes audit",
        "check that the server serves the bytes of the version held (vLLM: its worker "
        "extension; SGLang: the asyncsync plugin's audit records, read every "
        f"{SGLANG_AUDIT_INTERVAL:g} s by default; docs/ENGINES.md); a mismatch makes /readyz "
        "503 and reloads in full. Without a server: the checkpoint's files, every tensor "
        "hashed (each audit reads the whole model from disk); a mismatch removes them and the "
        "receiver re-initialises them from the newest keyframe",
    )
    audit.add_argument(
        "--audit-interval", type=positive_float, default=None, metavar="S",
        help="audit every S seconds (default: SGLang every "
             f"{SGLANG_AUDIT_INTERVAL:g} s, vLLM and a checkpoint alone not on a schedule; "
             "a checkpoint alone reads the whole model at each audit: minutes apart, not "
             "seconds, for a large one)",
    )  # fmt: skip
    audit.add_argument(
        "--audit-after-apply", action="store_true",
        help="audit each version once it is applied (SGLang: waits up to "
             f"{SGLANG_AUDIT_WAIT:g} s for the plugin's audit pass over it)",
    )  # fmt: skip
    audit.add_argument(
        "--no-audit", action="store_true",
        help="no audit at all (SGLang audits its plugin's records every "
             f"{SGLANG_AUDIT_INTERVAL:g} s unless told otherwise)",
    )  # fmt: skip
    ops = p.add_argument_group(
        "operator endpoints (/healthz, /readyz, /status, /metrics, POST /sync)"
    )
    ops.add_argument(
        "--status-port", type=port_arg, default=None, metavar="PORT",
        help="serve the endpoints on this port (0: any free port; default: not served)",
    )  # fmt: skip
    ops.add_argument(
        "--status-host", default="127.0.0.1", metavar="HOST",
        help="address to bind (default 127.0.0.1; exposing it is an explicit decision: "
        "0.0.0.0 every IPv4 interface, :: every interface, IPv4 and IPv6)",
    )  # fmt: skip
    ops.add_argument(
        "--ready-max-lag", type=int, default=0, metavar="N",
        help="/readyz answers 200 while the engine serves a version at most N behind the "
        "newest committed one (default 0: the newest)",
    )  # fmt: skip
    ops.add_argument(
        "--control-token-file", default=None, metavar="F",
        help=f"bearer token for POST /sync, at least {MIN_TOKEN_CHARS} characters (else "
        f"${TOKEN_ENV}; none: control disabled)",
    )  # fmt: skip
    add_logging_arguments(p, default_level="INFO")
    return p


def run_async(main_fn: Callable[[], Coroutine[Any, Any, _T]]) -> _T:
    """Run a coroutine function on uvloop when it is importable, else on asyncio's loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main_fn())
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main_fn())


def _api_key(args: argparse.Namespace) -> str | None:
    """--api-key-file, else $ASYNCSYNC_API_KEY, else None (surrounding whitespace stripped)."""
    return read_secret(args.api_key_file, API_KEY_ENV, "--api-key-file")


def _make_engine(args: argparse.Namespace) -> Engine:
    engine = _server_engine(args)
    if engine is None:
        return LocalCheckpoint(
            args.checkpoint,
            sync_before_ack=args.sync_before_ack,
            redo_log=args.checkpoint_redo_log,
            compact_idle=args.checkpoint_compact_idle,
        )
    engine.checkpoint.sync_before_ack = args.sync_before_ack
    return engine


def _server_engine(args: argparse.Namespace) -> ReloadingEngine | None:
    if not (args.sglang_url or args.vllm_url):
        return None
    timeouts = Timeouts(
        update=args.engine_update_timeout,
        startup=args.engine_startup_timeout,
        silence=args.engine_silence_timeout,
    )
    common: dict[str, Any] = {
        "api_key": _api_key(args),
        "model_path": args.engine_model_path,
        "timeouts": timeouts,
        "version_offset": args.version_offset,
    }
    admin = read_secret(args.admin_api_key_file, ADMIN_API_KEY_ENV, "--admin-api-key-file")
    if args.sglang_url:
        return SGLang(
            args.sglang_url,
            args.checkpoint,
            pause_mode=args.pause_mode,
            admin_api_key=admin,
            audit_wait=SGLANG_AUDIT_WAIT if args.audit_after_apply else 0.0,
            **common,
        )
    if admin is not None:
        raise ConfigError("an admin API key is an SGLang option; vLLM takes one --api-key-file")
    return VLLM(args.vllm_url, args.checkpoint, **common)


def _make_agent(args: argparse.Namespace) -> ReceiverAgent:
    engine = _make_engine(args)
    return ReceiverAgent(
        args.root,
        engine,
        args.engine_id,
        poll_interval=args.poll_interval,
        use_inotify=False if args.force_polling else None,
        apply_group_bytes=args.apply_group_bytes,
        lease_ttl=args.lease_ttl,
        lease_settle=args.lease_settle,
        verify_deadline=args.verify_deadline,
        stream_timeout=args.stream_timeout,
    )


def agent_progress(agent: ReceiverAgent) -> Progress:
    """The agent's version in flight as a progress source (for a terminal progress bar)."""
    st = agent.status()
    if st.applying is None or st.progress is None:
        return None
    return (f"{agent.engine_id}: v{st.applying}", *st.progress)


async def _once(args: argparse.Namespace) -> int | None:
    async with _make_agent(args) as agent, ProgressWatcher(lambda: agent_progress(agent)):
        return await agent.sync_once()


async def _serve(args: argparse.Namespace) -> int | None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    installed: list[signal.Signals] = []
    for sig in sorted(stop_signals()):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
    if set(installed) & signal.sigpending():  # one held since the start (main): a stop now
        stop.set()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, installed)  # (delivered: stop.set again)
    try:
        agent, server = await open_agent(args, stop, _make_agent)
        if agent is None:
            return None
        freeze_startup_objects()  # this process runs this one agent
        async with agent, contextlib.AsyncExitStack() as stack:
            if server is not None:  # serving since before the engine opened; stopped first
                stack.push_async_callback(server.stop)
            logger.info(
                "receiver %s: root=%s checkpoint=%s holding version %s",
                args.engine_id,
                args.root,
                args.checkpoint,
                agent.version,
            )
            auditor = receiver_auditor(
                agent,
                interval=args.audit_interval,
                after_apply=args.audit_after_apply,
                enabled=not args.no_audit,
            )
            if server is not None:
                server.attach(agent, auditor)
            task = asyncio.create_task(agent.run(stop=stop), name=f"agent {args.engine_id}")
            auditing = None
            if auditor is not None:
                auditing = asyncio.create_task(auditor.run(stop=stop), name="audit")
            stopped = asyncio.create_task(stop.wait())
            async with ProgressWatcher(lambda: agent_progress(agent)):
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
            if auditing is not None:
                auditing.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await auditing
            if task.done() and not task.cancelled():
                task.result()  # re-raise what ended the agent, if anything
            return agent.version
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
        if stop.is_set():
            # stopping: a second Ctrl-C or SIGTERM is ignored until the process has exited, as
            # it is while the version in flight finishes (stop.set again); the default handlers
            # back here ended the loop's or the interpreter's teardown: status 130 (a
            # KeyboardInterrupt) or 143 (killed by SIGTERM)
            for sig in installed:
                signal.signal(sig, signal.SIG_IGN)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the receiver; returns the exit status (the console script passes it to sys.exit).

    A stop signal before the receiver's handlers are installed is held (blocked) until they
    are: it stops the receiver as one after start-up does, not killing it silently (SIGTERM,
    SIGHUP: status 143, 129) or interrupting it anywhere (Ctrl-C). With ``--once`` it is let
    through before the sync starts (Ctrl-C: status 130; SIGTERM ends it, as during the sync).
    """
    sigs = stop_signals()
    held = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    try:
        return _main(argv)
    finally:
        while signal.sigtimedwait(sigs, 0) is not None:
            pass  # exiting anyway: one that came with an error or a usage line is dropped
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    CliParser.log_format = sniff_log_format(argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.once and args.status_port is not None:
            parser.error("--status-port serves a running receiver; --once syncs and exits")
        if not (args.sglang_url or args.vllm_url) and (
            args.api_key_file
            or args.admin_api_key_file
            or args.engine_model_path
            or args.version_offset
        ):
            parser.error(
                "--api-key-file, --admin-api-key-file, --engine-model-path and "
                "--version-offset need --sglang-url or --vllm-url"
            )
        if args.ready_max_lag < 0:
            parser.error("--ready-max-lag must be >= 0")
        if args.checkpoint_redo_log and (args.sglang_url or args.vllm_url):
            parser.error(
                "--checkpoint-redo-log is for a checkpoint the receiver alone keeps: with "
                "--sglang-url or --vllm-url the server reloads from the checkpoint's files, "
                "which must hold every version (drop the option)"
            )
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    setup_logging(args.log_level, args.log_format)
    # watchfiles logs every batch of changes at INFO: noise next to the agent's own lines
    logging.getLogger("watchfiles").setLevel(max(logging.WARNING, getattr(logging, args.log_level)))
    try:
        check_paths(args)
        args.control_token = None if args.once else check_status_options(args)
        if args.once:
            try:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, stop_signals())
                version = run_async(lambda: _once(args))
            except KeyboardInterrupt:  # not done: a script must not go on as if it were
                print_error(
                    f"asyncsync-receiver {args.engine_id}",
                    "interrupted before every committed version was applied (a version in "
                    "flight is undone when the checkpoint is next opened)",
                    args.log_format,
                )
                return 130
            if version is None:
                print(printable(f"{args.engine_id}: holds no version ({args.root} has none "
                                "committed yet)"))  # fmt: skip
            else:
                print(f"{args.engine_id}: holds version {version}")
            return 0
        version = run_async(lambda: _serve(args))
        logger.info("receiver %s: stopped at version %s", args.engine_id, version)
        return 0
    except (AsyncSyncError, OSError, ValueError) as exc:
        print_error(f"asyncsync-receiver {args.engine_id}", _one_line(exc), args.log_format)
        return 1
    except KeyboardInterrupt:  # (--once: a Ctrl-C after its sync, as it exits)
        return 0
    except Exception as exc:  # bad input must never end in a traceback (it is logged at DEBUG)
        logger.debug("asyncsync-receiver %s failed", args.engine_id, exc_info=True)
        print_error(
            f"asyncsync-receiver {args.engine_id}",
            f"{type(exc).__name__}: {_one_line(exc)}",
            args.log_format,
        )
        return 1


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


if __name__ == "__main__":
    sys.exit(main())
