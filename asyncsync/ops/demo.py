"""``python -m asyncsync.ops.demo`` (``make demo``): a trainer and receivers, end to end.

What it shows, on one machine with a temp directory as the "shared filesystem":

* this process is the trainer: a :class:`~asyncsync.ops.workload.Workload` (fp32 master weights,
  Adam steps, a bf16 publish view with a few other dtypes) published with a
  :class:`~asyncsync.Publisher`: version 0 is a full keyframe, then one sparse delta per step,
  and one deliberately zero-diff version (published without a training step);
* K receivers, each a separate ``python -m receiver.cli`` process applying every version to its
  own safetensors checkpoint directory (:class:`receiver.engines.checkpoint.LocalCheckpoint`);
* after each publish the trainer waits until every receiver has acknowledged the version, and
  prints the version's density, wire bytes and ack latency;
* at the end the receivers are stopped and every checkpoint is checked against the final
  manifest's checksums *and* byte for byte against the trainer's own state dict.

The last line is ``DEMO OK: ...`` (exit 0) or ``DEMO FAILED: ...`` (exit 1).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from asyncsync.codec import raw_view
from asyncsync.errors import AsyncSyncError
from asyncsync.format.acks import read_acks
from asyncsync.format.store import read_manifest
from asyncsync.ops.cli import human_bytes, verify_checkpoint_dir
from asyncsync.ops.cli.common import int_at_least, positive_float
from asyncsync.ops.workload import Workload
from asyncsync.publish.publisher import Publisher, PublishResult

__all__ = ["DemoFailed", "main", "run_demo"]

logger = logging.getLogger(__name__)

_RECEIVER_START_TIMEOUT = 120.0  # a cold start imports torch; slow CI disks take a while


class DemoFailed(Exception):
    """The demo could not show what it set out to; the message says what went wrong."""


@dataclass
class _Receiver:
    engine_id: str
    checkpoint: Path
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise DemoFailed(
                f"receiver {self.engine_id} exited with status {self.proc.returncode}; "
                f"see its log {self.log}: {_last_line(self.log)}"
            )


@dataclass
class _Row:
    result: PublishResult
    ack_seconds: float


@dataclass
class _Run:
    rows: list[_Row] = field(default_factory=list)
    final: dict[str, torch.Tensor] = field(default_factory=dict)


def _last_line(path: Path) -> str:
    with contextlib.suppress(OSError):
        lines = path.read_text(errors="replace").strip().splitlines()
        if lines:
            return lines[-1][-300:]
    return "(empty log)"


def _start_receivers(shared: Path, receivers: list[_Receiver], poll_interval: float) -> None:
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    for r in receivers:
        cmd = [
            sys.executable, "-m", "receiver.cli",
            "--root", str(shared),
            "--engine-id", r.engine_id,
            "--checkpoint", str(r.checkpoint),
            "--poll-interval", str(poll_interval),
            "--log-level", "INFO",
        ]  # fmt: skip
        with open(r.log, "wb") as log:
            r.proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env
            )
        logger.info("started receiver %s (pid %d)", r.engine_id, r.proc.pid)


def _stop_receivers(receivers: list[_Receiver], timeout: float = 30.0) -> list[str]:
    """SIGTERM each receiver, wait, SIGKILL stragglers; return problems (non-zero exits)."""
    problems = []
    for r in receivers:
        if r.proc is not None and r.proc.poll() is None:
            r.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for r in receivers:
        if r.proc is None:
            continue
        try:
            r.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            r.proc.kill()
            r.proc.wait()
            problems.append(f"receiver {r.engine_id} did not stop on SIGTERM (killed)")
            continue
        if r.proc.returncode != 0:
            problems.append(
                f"receiver {r.engine_id} exited with status {r.proc.returncode} "
                f"({_last_line(r.log)})"
            )
    return problems


async def _wait_all_acked(
    pub: Publisher, version: int, receivers: list[_Receiver], timeout: float
) -> float:
    """Seconds until every receiver acknowledged ``version``; fails fast if one dies."""
    t0 = time.perf_counter()
    wait = asyncio.create_task(
        pub.wait_acked(version, engines=[r.engine_id for r in receivers], timeout=timeout)
    )
    try:
        while not wait.done():
            for r in receivers:
                r.check_alive()
            await asyncio.wait({wait}, timeout=0.2)
        wait.result()
    finally:
        wait.cancel()
    return time.perf_counter() - t0


def _progress(row: _Row, note: str = "") -> str:
    r = row.result
    kind = "zero-diff" if r.zero_diff else r.kind
    return (
        f"v{r.version:<3d} {kind:<9} {100 * r.density:7.3f}%  changed {r.changed:>9,}  "
        f"wire {human_bytes(r.wire_bytes):>9}  publish {r.seconds['total']:.3f}s  "
        f"acked {row.ack_seconds:.3f}s{note}"
    )


async def _train_and_publish(
    shared: Path,
    workload: Workload,
    receivers: list[_Receiver],
    versions: int,
    ack_timeout: float,
) -> _Run:
    run = _Run()
    zero_at = max(1, versions // 2)
    async with Publisher(shared, producer={"demo": True}) as pub:
        sd = workload.state_dict()
        res = await pub.seed(sd)
        # the first ack also waits for the receivers to start (a cold torch import)
        ack = await _wait_all_acked(pub, res.version, receivers, _RECEIVER_START_TIMEOUT)
        run.rows.append(_Row(res, ack))
        print(
            _progress(run.rows[-1], "  (keyframe; the ack waits for receiver start-up)"), flush=True
        )
        for v in range(1, versions):
            note = ""
            if v == zero_at:
                note = "  (no training step)"
            else:
                workload.step()
                sd = workload.state_dict()
            res = await pub.publish(sd)
            ack = await _wait_all_acked(pub, res.version, receivers, ack_timeout)
            run.rows.append(_Row(res, ack))
            print(_progress(run.rows[-1], note), flush=True)
        run.final = sd
    return run


def _check_engines(
    shared: Path, receivers: list[_Receiver], final_version: int, final: dict[str, torch.Tensor]
) -> list[str]:
    """Everything that is wrong with the engines at the end ([] = all bit-exact)."""
    from receiver.engines.checkpoint import LocalCheckpoint

    problems = []
    manifest = read_manifest(shared, final_version)
    acks = read_acks(shared)
    for r in receivers:
        ack = acks.get(r.engine_id)
        if ack is None or ack.version != final_version or ack.fingerprint != manifest.fingerprint:
            problems.append(f"{r.engine_id}: its ack does not name version {final_version}")
        report = verify_checkpoint_dir(shared, r.checkpoint, final_version)
        print(f"  {r.engine_id}: {report.describe()}")
        if not report.ok:
            problems.append(f"{r.engine_id}: {len(report.mismatched)} tensors differ")
            continue
        held = LocalCheckpoint(r.checkpoint).load_state_dict()
        differ = [n for n, t in final.items() if n not in held or not _same_bytes(t, held[n])]
        if differ or set(held) != set(final):
            problems.append(f"{r.engine_id}: bytes differ from the trainer's: {differ[:5]}")
        else:
            print(f"  {r.engine_id}: every byte equals the trainer's state dict")
    return problems


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    # copied as ints: a non-contiguous bool's own copy (contiguous) writes 0/1
    ua = raw_view(a).contiguous().reshape(-1).view(torch.uint8)
    ub = raw_view(b).contiguous().reshape(-1).view(torch.uint8)
    return bool(torch.equal(ua, ub))


def _summary(run: _Run) -> list[str]:
    seed, deltas = run.rows[0].result, run.rows[1:]
    model_bytes = sum(t.numel() * t.element_size() for t in run.final.values())
    lines = [
        f"model: {seed.total:,} elements in {len(run.final)} tensors "
        f"({human_bytes(model_bytes)} per full checkpoint)",
    ]
    if deltas:
        wire = sum(r.result.wire_bytes for r in deltas)
        full = model_bytes * len(deltas)
        dens = sum(r.result.density for r in deltas) / len(deltas)
        acks = sorted(r.ack_seconds for r in deltas)
        ratio = f"{full / wire:.1f}x less" if wire else "nothing sent"
        lines += [
            f"deltas: {len(deltas)} versions, mean density {100 * dens:.2f}% (zero-diff included), "
            f"{human_bytes(wire)} on the wire vs {human_bytes(full)} as full checkpoints "
            f"({ratio}; {human_bytes(wire / len(deltas))} per version)",
            f"ack latency after publish: median {acks[len(acks) // 2]:.3f}s, max {acks[-1]:.3f}s",
        ]
    return lines


def run_demo(
    workdir: Path, *, versions: int, elements: int, engines: int, ack_timeout: float
) -> int:
    """Run the demo in ``workdir`` (must be empty or missing); returns the final version."""
    shared = workdir / "shared"
    shared.mkdir(parents=True)
    receivers = [
        _Receiver(f"engine-{i}", workdir / f"engine-{i}", workdir / f"engine-{i}.log")
        for i in range(engines)
    ]
    print(f"shared root : {shared}")
    for r in receivers:
        print(f"{r.engine_id:<12}: checkpoint {r.checkpoint}, log {r.log}")
    print(flush=True)
    _start_receivers(shared, receivers, poll_interval=0.25)
    try:
        t0 = time.perf_counter()
        workload = Workload.for_elements(elements, seed=0)
        logger.info("workload %r built in %.2fs", workload, time.perf_counter() - t0)
        run = asyncio.run(_train_and_publish(shared, workload, receivers, versions, ack_timeout))
    finally:
        stop_problems = _stop_receivers(receivers)
    final_version = run.rows[-1].result.version
    print()
    for line in _summary(run):
        print(line)
    print(f"verifying {engines} checkpoints against version {final_version}:")
    problems = stop_problems + _check_engines(shared, receivers, final_version, run.final)
    if problems:
        raise DemoFailed("; ".join(problems))
    return final_version


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m asyncsync.ops.demo",
        description="Publish versions of a simulated RL model to receivers in other processes "
        "and check that every engine ends bit-exact.",
    )
    p.add_argument(
        "--root",
        metavar="DIR",
        help="working directory (empty or missing; kept). Default: a temp dir, removed at the end",
    )
    p.add_argument("--keep", action="store_true", help="keep the temp directory")
    p.add_argument(
        "--versions",
        type=int_at_least(2),
        default=12,
        metavar="N",
        help="versions to publish, the keyframe included (default 12)",
    )
    p.add_argument(
        "--elements",
        type=int_at_least(10_000),
        default=3_000_000,
        metavar="N",
        help="model size in elements (default 3,000,000)",
    )
    p.add_argument(
        "--engines",
        type=int_at_least(1),
        default=2,
        metavar="K",
        help="receiver processes (default 2)",
    )
    p.add_argument(
        "--ack-timeout",
        type=positive_float,
        default=60.0,
        metavar="S",
        help="seconds to wait for every engine to acknowledge a version (default 60)",
    )
    p.add_argument("--log-level", default="WARNING", type=str.upper,
                   choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                   help="logging level of the trainer on stderr (default WARNING)")  # fmt: skip
    return p


def _interrupt(_signum: int, _frame: object) -> None:
    """SIGTERM or SIGHUP: a KeyboardInterrupt, so that the receivers are stopped (killed at
    once, the demo left them running for good); a second one meanwhile is ignored."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
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
    if args.root:
        workdir = Path(args.root)
        if workdir.exists() and (not workdir.is_dir() or any(workdir.iterdir())):
            print(f"DEMO FAILED: --root {workdir} must be an empty or missing directory")
            return 1
        temp = False
    else:
        workdir = Path(tempfile.mkdtemp(prefix="asyncsync-demo-"))
        temp = True
    t0 = time.perf_counter()
    ok, message = False, ""
    for sig in (signal.SIGTERM, signal.SIGHUP):  # stop the receivers, as on Ctrl-C
        signal.signal(sig, _interrupt)
    try:
        version = run_demo(
            workdir,
            versions=args.versions,
            elements=args.elements,
            engines=args.engines,
            ack_timeout=args.ack_timeout,
        )
        ok = True
        message = (
            f"DEMO OK: every engine is bit-exact at version {version} ({args.engines} engines)"
        )
    except (DemoFailed, AsyncSyncError, OSError) as exc:
        message = f"DEMO FAILED: {exc}"
    except KeyboardInterrupt:
        message = "DEMO FAILED: interrupted"
    print(f"done in {time.perf_counter() - t0:.1f}s")
    if temp and ok and not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
        print(f"removed {workdir} (keep it with --keep: `make demo DEMO_ARGS=--keep`)")
    else:
        print(f"kept {workdir}: inspect it with `asyncsync inspect {workdir / 'shared'}`")
    print(message, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
