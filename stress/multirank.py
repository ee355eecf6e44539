"""Multi-rank model stress: ranks as processes, cancels and SIGKILLs at every await of the commit.

::

    python stress/multirank.py --seeds 10 --steps 40 [--first-seed S] [--world 2] [--json FILE]

Runs :func:`tests.multirank_model.run_model` for each seed (see that module: lockstep ranks
over FileRendezvous, by step on odd seeds and by count on even ones; one fault per step at a
random point of the commit path, a rank late past the timeout, a cancel during the plan, an
error on one rank or a skipped step, a second job's rank on the root, restarts of one rank or
all, a leftover ``.rendezvous/``; invariants: every committed manifest holds exactly one step's
whole model of the job and never changes once renamed, and a group all alive and calling
together commits within 2 steps). Prints one line per seed and a summary; exits 1 on the first
broken invariant, keeping its work directory.
"""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__" and __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parent.parent)  # the repo root, as in crash.py

# the model lives with the tests (its short run is one); imported by name, so that type
# checking of the packages does not wander into tests/
run_model = importlib.import_module("tests.multirank_model").run_model


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--first-seed", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=1.0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    runs, t0 = [], time.monotonic()
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        work = Path(tempfile.mkdtemp(prefix=f"asyncsync-multirank-{seed}-"))
        try:
            s = run_model(work, seed=seed, steps=args.steps, world=args.world, timeout=args.timeout)
        except AssertionError as exc:
            print(f"seed {seed}: FAILED: {exc} (work directory kept: {work})", flush=True)
            return 1
        shutil.rmtree(work, ignore_errors=True)
        runs.append(s)
        print(f"seed {seed}: {json.dumps(s)}", flush=True)
    total: dict[str, int] = {}
    for s in runs:
        for k, v in s.items():
            if k not in ("seed", "steps", "world"):
                total[k] = total.get(k, 0) + v
    print(f"multirank model stress: {len(runs)} seeds x {args.steps} steps, world {args.world}, "
          f"{time.monotonic() - t0:.0f}s, {json.dumps(total)}, 0 failures")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "total": total}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
