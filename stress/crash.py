"""Crash stress: SIGKILL publishers and receivers at random points; nothing bad may be served.

::

    python stress/crash.py publisher --trials 50 [--seed S] [--json FILE]
    python stress/crash.py receiver --trials 50 [--seed S] [--json FILE]

``publisher``: a trainer child process re-seeds and publishes a deterministic workload
(``state(v)``, :mod:`stress.states`) as fast as it can and is killed at a random point; after
each kill every committed version must be complete and exactly ``state(v)``, and the next
publisher must remove what the kill left. At the end a receiver replays the whole chain from
scratch, bit-exact. See :mod:`stress.publisher_stress`.

``receiver``: ``python -m receiver.cli --once`` applies a chain of realistic deltas into a
LocalCheckpoint and is killed at a random point of the apply; after each kill the checkpoint
must hold bit-exact whatever version its state claims (recovering first when it says
``applying``) and acks never exceed it; after the last trial a clean run must end bit-exact at
the trainer's final state. See :mod:`stress.receiver_stress`.

``--launch exec`` (default) starts every child as a fresh interpreter; ``--launch fork`` forks
them from a forkserver that imported torch once (same code, no 2-3 s start-up; the tests use
it). Prints a summary line such as ``publisher crash stress: 50 trials, 37 kills mid-publish,
0 failures`` and exits 1 on any failure, keeping its work directory for inspection.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

if __name__ == "__main__" and __package__ in (None, ""):
    # `python stress/crash.py`: import our siblings as the `stress` package, from the repo root
    # (and never let a file in stress/ shadow a standard-library module).
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from stress.publisher_stress import PublisherParams, run_publisher_stress
from stress.receiver_stress import ReceiverParams, run_receiver_stress
from stress.report import StressReport

__all__ = ["main", "run"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="stress/crash.py", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    p.add_argument("side", choices=("publisher", "receiver"), help="which process to kill")
    p.add_argument("--trials", type=int, default=50, help="kills (default 50)")
    p.add_argument("--seed", type=int, default=0, help="random seed of workload and kill points")
    p.add_argument("--json", type=Path, metavar="FILE", help="also write the report as JSON")
    p.add_argument(
        "--launch",
        choices=("exec", "fork"),
        default="exec",
        help="fresh interpreter per child (default) or fork from a preloaded forkserver",
    )
    p.add_argument("--elements", type=int, help="model size in elements (default: per side)")
    p.add_argument("--workdir", type=Path, help="keep root, checkpoint and logs here")
    p.add_argument("-q", "--quiet", action="store_true", help="print only the summary")
    return p


def run(args: argparse.Namespace) -> StressReport:
    """Run the stress ``args`` describe (see :func:`build_parser`)."""
    say = (lambda _msg: None) if args.quiet else (lambda msg: print(msg, flush=True))
    if args.trials < 1:
        raise SystemExit("--trials must be >= 1")
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
    if args.side == "publisher":
        pp = PublisherParams(trials=args.trials, seed=args.seed, launch=args.launch)
        if args.elements:
            pp = PublisherParams(**{**pp.__dict__, "elements": args.elements})
        return run_publisher_stress(pp, args.workdir, say=say)
    rp = ReceiverParams(trials=args.trials, seed=args.seed, launch=args.launch)
    if args.elements:
        rp = ReceiverParams(**{**rp.__dict__, "elements": args.elements})
    return run_receiver_stress(rp, args.workdir, say=say)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Recovery and cleanup log WARNINGs by design (that is what the stress provokes).
    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")
    rep = run(args)
    for f in rep.failures:
        print(f"FAILURE: {f}", file=sys.stderr)
    if args.json is not None:
        rep.write_json(args.json)
    print(rep.line())
    if not rep.ok:
        print(f"work directory kept: {rep.extra.get('work')}", file=sys.stderr)
    return 0 if rep.ok else 1


if __name__ == "__main__":
    sys.exit(main())
