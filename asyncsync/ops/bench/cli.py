"""``asyncsync bench``: measure wire bytes, publish cost, end-to-end latency, overlap and memory.

::

    asyncsync bench --quick                          < 60 s on 2 cores; tables on stdout
    asyncsync bench --quick --json out.json --plot docs/bench --markdown out.md
    asyncsync bench --scale --json scale.json        the scale sweep alone: 256 MB, 1 GB, 4 GB
    asyncsync bench --profile docs/bench             publish and apply at 1 GB, by stage and sampled
    asyncsync bench                                  the full run (minutes), the sweep included

Exit status 0 whether or not the targets are met (the tables say which are missed); 1 when a
measurement fails.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncsync.console.args import int_at_least, parse_size, positive_float
from asyncsync.errors import ConfigError
from asyncsync.fsio import Throttle, check_throttle_env
from asyncsync.memory import page_cache_room
from asyncsync.ops.cli.common import human_bytes, positive_int
from asyncsync.pipeline import MAX_THREADS

if TYPE_CHECKING:
    from asyncsync.ops.bench.measure import BenchConfig

__all__ = ["cmd_bench", "config_from_args", "register"]

_THROTTLE = "200MB/s,5ms"


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The run's configuration: ``--quick`` or the full run, with the hidden overrides."""
    from asyncsync.ops.bench.measure import BenchConfig
    from asyncsync.ops.bench.scale import DEFAULT_SIZES

    overrides: dict[str, Any] = {"throttle": _throttle(args), "keep": args.keep}
    if args.threads is not None:
        overrides["threads"] = args.threads
    if args.elements is not None:
        overrides["elements"] = args.elements
        overrides["sweep_elements"] = min(args.elements, args.sweep_elements or args.elements)
    elif args.sweep_elements is not None:
        overrides["sweep_elements"] = args.sweep_elements
    if args.versions is not None:
        overrides["versions"] = args.versions
    if args.bucket_bytes is not None:
        overrides["bucket_bytes"] = args.bucket_bytes
    if args.workdir is not None:
        overrides["workdir"] = args.workdir
    if args.timeout is not None:
        if not args.timeout > 0:
            raise ConfigError(f"--timeout must be > 0 seconds, got {args.timeout}")
        overrides["timeout"] = args.timeout
    if args.elements is not None and args.elements < 1_000_000:  # plumbing checks: be brief
        overrides.update(repeats=1, full_repeats=1, name="tiny")
    if args.elements is not None:  # an experiment at one size: no sweep unless asked for
        overrides["scale_sizes"] = ()
    if args.scale_sizes is not None:
        overrides["scale_sizes"] = tuple(args.scale_sizes)
    if args.peers:
        overrides["peers_only"] = True
        overrides.setdefault("scale_sizes", (256 << 20, 1 << 30))
        overrides.setdefault("name", "peers")
        if args.versions is not None:
            overrides["scale_versions"] = args.versions
    if args.scale:
        overrides["scale_only"] = True
        overrides.setdefault("scale_sizes", DEFAULT_SIZES)
        overrides.setdefault("name", "scale")
        if args.versions is not None:
            overrides["scale_versions"] = args.versions
    if args.redo_log:
        if not args.scale:
            raise ConfigError("--redo-log is an option of --scale (its receiver's checkpoint)")
        # at least one compaction in the timed versions: two cycles by default
        overrides["redo_log"] = args.redo_log
        overrides.setdefault("scale_versions", 2 * args.redo_log)
        if overrides["scale_versions"] < args.redo_log:
            raise ConfigError(
                f"--versions {overrides['scale_versions']} < --redo-log {args.redo_log}: no "
                "compaction would fall in the timed versions; give at least N versions"
            )
    return (BenchConfig.quick if args.quick and not args.scale else BenchConfig.full)(**overrides)


def cmd_bench(args: argparse.Namespace) -> int:
    """``asyncsync bench``; a SIGTERM meanwhile stops its children as Ctrl-C does
    (:func:`_terminated`)."""
    check_throttle_env()  # read at import (a bad one: no throttle): refused before a run
    if threading.current_thread() is not threading.main_thread():
        return _cmd_bench(args)
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        return _cmd_bench(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


#: memory a run at one model size of the scale sweep, the peers or the profile takes at its
#: peak, per byte of the model: 3.3x measured at 1 GiB (the host's MemAvailable, lowest against
#: before: the floors' two states, then the publisher's ~2.1x beside the receiver's ~1.1x)
MEMORY_PER_MODEL_BYTE = 3.5


def check_memory(sizes: tuple[int, ...] | list[int]) -> None:
    """ConfigError, before any child starts, where the largest of ``sizes`` would need more
    memory than this host (or its cgroup) has available: the run would otherwise fail late in
    a child that cannot allocate, or be killed by the OOM killer midway."""
    if sizes and (
        why := memory_shortfall(max(sizes), MEMORY_PER_MODEL_BYTE, "smaller --scale-sizes")
    ):
        raise ConfigError(why)


def memory_shortfall(model: int, factor: float, fix: str) -> str | None:
    """Why a run whose peak holds ``factor`` times a model of ``model`` bytes cannot run here
    (the host's, or its cgroup's, available memory: :func:`~asyncsync.memory.page_cache_room`),
    ending with ``fix``; None where it fits or the room is unknown."""
    room = page_cache_room()
    need = int(factor * model)
    if room is None or need <= room:
        return None
    return (
        f"a model of {human_bytes(model)} needs about {human_bytes(need)} of memory at the "
        f"run's peak ({factor:g}x), and {human_bytes(room)} is available here: give {fix}"
    )


def _cmd_bench(args: argparse.Namespace) -> int:
    from asyncsync.ops.bench.measure import run_bench
    from asyncsync.ops.bench.report import markdown, plot, summarise
    from asyncsync.ops.bench.scale_report import scale_markdown, scale_plot, scale_summary

    if args.device is not None:
        return _cmd_device(args)
    if args.profile is not None:
        return _cmd_profile(args)
    cfg = config_from_args(args)
    check_memory(cfg.scale_sizes)
    t0 = time.perf_counter()

    def progress(msg: str) -> None:
        print(f"bench [{time.perf_counter() - t0:5.1f}s]: {msg}", file=sys.stderr, flush=True)

    raw = run_bench(cfg, progress=progress)
    if cfg.peers_only:
        from asyncsync.ops.bench.peers import peers_markdown, peers_summary

        peers = {"config": raw["config"], "machine": raw["machine"], "command": _command(args)}
        peers.update(peers_summary(raw["peers"]))
        print(peers_markdown(peers, cfg.throttle))
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(peers, indent=1) + "\n")
        return 0
    if cfg.scale_only:
        summary: dict[str, Any] = {"config": raw["config"], "machine": raw["machine"]}
    else:
        summary = summarise(raw)
    if raw.get("scale"):
        summary.update(scale_summary(raw["scale"], {**raw["config"], "cores": os.cpu_count()}))
    summary["command"] = _command(args)
    text = "" if cfg.scale_only else markdown(summary)
    text += scale_markdown(summary)
    print(text)
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    if args.plot:
        for path in ([] if cfg.scale_only else plot(summary, args.plot)) + scale_plot(
            summary, args.plot
        ):
            progress(f"wrote {path}")
    return 0


def _terminated(signum: int, _frame: Any) -> None:
    """SIGTERM (a CI job cancelled, ``timeout``): unwinds as Ctrl-C does, so the bench stops
    its child processes (``measure._finish``); by default it ended at once and left them
    running for 15-20 s, each on a core (attack-42). Status 128 + the signal."""
    raise SystemExit(128 + signum)


def _cmd_device(args: argparse.Namespace) -> int:
    """``--device cuda``: the accelerator paths, bit-exact and timed (``bench/device.py``)."""
    from asyncsync.ops.bench.device import device_markdown, run_device_check

    size = args.scale_sizes[0] if args.scale_sizes else 1 << 30
    result = run_device_check(args.device, size, versions=args.versions or 3)
    result["command"] = _command(args)
    text = device_markdown(result)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"device": result}, indent=1) + "\n")
    return 0


def _cmd_profile(args: argparse.Namespace) -> int:
    """``--profile DIR``: per-stage and sampled profiles of publish and apply at one size
    (``bench/profile.py``), written to DIR as ``profile_{publish,apply}_<size>.txt``."""
    from asyncsync.ops.bench.profile import main

    size = args.scale_sizes[0] if args.scale_sizes else 1 << 30
    check_memory([size])
    paths = main(
        size,
        Path(args.profile),
        versions=args.versions or 3,
        throttle=_throttle(args),
        workdir=None if args.workdir is None else Path(args.workdir),
        threads=args.threads,
    )
    for path in paths.values():
        print(path.read_text())
    return 0


def _command(args: argparse.Namespace) -> str:
    """The command line that reproduces this run (recorded in the JSON)."""
    words = ["asyncsync", "bench"]
    if args.quick and not args.scale:
        words.append("--quick")
    if args.scale:
        words.append("--scale")
    if args.peers:
        words.append("--peers")
    if args.device is not None:
        words += ["--device", args.device]
    if args.scale_sizes is not None:
        words += ["--scale-sizes", ",".join(str(x) for x in args.scale_sizes)]
    for flag in (
        "json",
        "plot",
        "markdown",
        "throttle",
        "elements",
        "sweep_elements",
        "versions",
        "bucket_bytes",
        "threads",
        "redo_log",
    ):
        value = getattr(args, flag)
        if flag == "redo_log" and not value:
            continue
        if value is not None and not (flag == "throttle" and value == _THROTTLE):
            words += [f"--{flag.replace('_', '-')}", str(value)]
    return " ".join(words)


def _sizes(text: str) -> list[int]:
    try:
        sizes = [parse_size(x) for x in text.split(",") if x.strip()]
    except (ValueError, ConfigError) as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from exc
    if not sizes or min(sizes) < (1 << 20):
        raise argparse.ArgumentTypeError(f"{text!r}: give sizes of at least 1 MiB, e.g. 1GiB")
    return sizes


def _throttle(args: argparse.Namespace) -> str:
    """``--throttle`` as the runs take it: ``""`` for ``none`` (the local filesystem)."""
    return "" if args.throttle.strip().lower() == "none" else str(args.throttle)


def _throttle_spec(text: str) -> str:
    """``--throttle``: ``none`` or what ``fsio.Throttle.parse`` reads (checked before the run)."""
    if text.strip().lower() != "none":
        try:
            Throttle.parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _writable_ancestor(path: Path) -> str | None:
    """Why files cannot be created at ``path`` (its nearest existing ancestor is not a
    writable directory), or None."""
    up = path
    while not up.exists() and up != up.parent:
        up = up.parent
    if not up.is_dir():
        return f"{up} is not a directory"
    if not os.access(up, os.W_OK | os.X_OK):
        return f"{up} is not writable"
    try:  # access() says yes to root everywhere (/proc, a read-only mount): try it
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".asyncsync-bench-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return f"{exc.filename or path}: {exc.strerror or exc}"
    return None


def _output_file(text: str) -> str:
    """``--json`` / ``--markdown``: a file the run can write (checked before the run, which
    may take minutes)."""
    p = Path(text)
    if p.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, not a file")
    if p.exists() or p.is_symlink():
        if not p.is_file():
            raise argparse.ArgumentTypeError(f"{text!r} exists and is not a regular file")
        if not os.access(p, os.W_OK):
            raise argparse.ArgumentTypeError(f"{text!r} is not writable")
    elif (why := _writable_ancestor(p.parent)) is not None:
        raise argparse.ArgumentTypeError(f"cannot create {text!r}: {why}")
    return text


def _output_dir(text: str) -> str:
    """``--plot`` / ``--profile``: a directory the run can create or write into."""
    p = Path(text)
    if (p.exists() or p.is_symlink()) and not p.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} exists and is not a directory")
    if (why := _writable_ancestor(p)) is not None:
        raise argparse.ArgumentTypeError(f"cannot write into {text!r}: {why}")
    return text


def _device(text: str) -> str:
    """``--device``: a device name torch knows (checked before the run)."""
    import torch

    try:
        torch.device(text)
    except RuntimeError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch device: {exc}") from None
    return text


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    sp = sub.add_parser(
        "bench",
        parents=[common],
        help="benchmark: wire bytes vs baselines, publish cost, latency, overlap, memory",
        description="Run the benchmark suite (see BENCHMARKS.md). Prints markdown tables.",
    )
    sp.add_argument("--quick", action="store_true", help="the < 60 s run (32M elements)")
    sp.add_argument(
        "--json",
        type=_output_file,
        metavar="FILE",
        help="write the summary (ratios, targets) as JSON",
    )
    sp.add_argument("--plot", type=_output_dir, metavar="DIR", help="write PNG plots into DIR")
    sp.add_argument(
        "--markdown", type=_output_file, metavar="FILE", help="write the tables to FILE as well"
    )
    sp.add_argument(
        "--throttle",
        default=_THROTTLE,
        type=_throttle_spec,
        metavar="SPEC",
        help="the simulated shared filesystem: bandwidth and per-file latency "
        "(default 200MB/s,5ms)",
    )
    sp.add_argument(
        "--scale",
        action="store_true",
        help="the scale sweep alone (bf16 256 MB, 1 GB, 4 GB at ~3 %%; minutes; BENCHMARKS.md)",
    )
    sp.add_argument(
        "--peers",
        action="store_true",
        help="ours end to end beside re-implementations of slime's gen-1 and gen-2 deltas and a "
        "full safetensors sync, interleaved, at --scale-sizes (default 256MiB,1GiB); "
        "--throttle none for the local filesystem (BENCHMARKS.md)",
    )
    sp.add_argument(
        "--redo-log",
        type=int_at_least(0),
        default=0,
        metavar="N",
        help="with --scale: the receiver keeps deltas as redo records merged every N versions "
        "(LocalCheckpoint redo_log; default 0: in place); runs 2N versions unless --versions",
    )
    sp.add_argument(
        "--scale-sizes",
        type=_sizes,
        metavar="N,N,...",
        help="model bytes of the scale sweep (default 256MiB,1GiB,4GiB)",
    )
    sp.add_argument(
        "--device",
        type=_device,
        metavar="DEV",
        help="check the accelerator paths on DEV (e.g. cuda) bit-exact and time the diff; "
        "the model size is the first --scale-sizes (default 1GiB)",
    )
    sp.add_argument(
        "--profile",
        type=_output_dir,
        metavar="DIR",
        help="profile publish and apply by stage and by sampling (the sweep's setup) at the "
        "first --scale-sizes (default 1GiB); write profile_{publish,apply}_<size>.txt into DIR",
    )
    sp.add_argument(
        "--threads",
        type=int_at_least(1, MAX_THREADS),
        metavar="N",
        help="CPU threads of each side (its pool and torch's; default: every core; the "
        "scale sweep, --peers and --profile); see python -m asyncsync.ops.bench.threads",
    )
    sp.add_argument("--keep", action="store_true", help="keep the work directory (logs, roots)")
    sp.add_argument(
        "--timeout",
        type=positive_float,
        metavar="S",
        help="seconds a benchmark child may run before it is stopped, its threads' stacks "
        "dumped into the error (default 300 with --quick, else 900)",
    )
    # hidden: sizes for plumbing tests and experiments
    sp.add_argument("--elements", type=positive_int, help=argparse.SUPPRESS)
    sp.add_argument("--sweep-elements", type=positive_int, help=argparse.SUPPRESS)
    sp.add_argument("--versions", type=positive_int, help=argparse.SUPPRESS)
    sp.add_argument("--bucket-bytes", type=positive_int, help=argparse.SUPPRESS)
    sp.add_argument("--workdir", help=argparse.SUPPRESS)
    sp.set_defaults(func=cmd_bench)
