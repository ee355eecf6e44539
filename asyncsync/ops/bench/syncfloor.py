"""The floor of a verified in-place delta sync on this machine: its memory-bound passes alone.

``python -m asyncsync.ops.bench.syncfloor [--size 1GiB] [--repeats 5]``: on the scale bench's
state (:func:`~asyncsync.ops.bench.scale.make_state`, one version of ~3 % changed elements
later), the two passes over the model that any sync which diffs bytewise, keeps its own
snapshot and verifies every tensor must make, through the C kernels alone (none of the
project's glue: no encode, no files, no Python per element):

* the trainer's: the diff kernel over each pair (positions, values, XORs), XXH3 of the new
  tensor and the snapshot advanced, in one pass (``diff_extract`` with a hasher and advance);
* the engine's: the XORs patched into its copy of the base and XXH3 of the result, in one
  pass (``patch_hash``);

each on one thread, the trainer's also on two (the tensors dealt out by bytes: how far a second
core speeds a memory-bound pass here), and both at once (a thread each: the two sides of the
bench's end to end on one machine), beside the bench's trainer floor (one ``torch.ne`` pass,
the faster of all threads and one). Interleaved repetitions, medians with their range. Every
pass is checked: the snapshot and the engine equal the new state, and the engine's digests
the trainer's.

Why: the bench's ratios divide by the ``torch.ne`` floor, a read of two copies of the model.
These passes also write (the snapshot, the engine) and hash, and where one thread nearly
fills the memory bus a second adds little: their time at once says how much of a ratio is
left to everything else (BENCHMARKS.md, forty-first session).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from asyncsync.codec import int_view, native
from asyncsync.console.args import parse_size
from asyncsync.ops.bench.cli import memory_shortfall
from asyncsync.ops.bench.scale import make_state, ne_passes, step_state

__all__ = ["Floors", "main", "measure"]

#: the bench's density (``asyncsync bench --scale``)
DENSITY = 0.03
#: bytes of memory a run holds per byte of model: the base, the new state, the snapshot, the
#: engine's copy (4), two sets of outputs with room for 10 % changed (1.2), the floor's mask
#: (0.5), and some slack
MEMORY_PER_BYTE = 6
_ALGORITHM = "xxh3-128"


@dataclass(frozen=True)
class Floors:
    """Seconds of each repetition: ``ne`` the trainer floor, ``trainer`` and ``engine`` each
    side's pass on one thread, ``trainer2`` the trainer's on two, ``both`` the two sides at
    once on a thread each."""

    ne: list[float]
    trainer: list[float]
    trainer2: list[float]
    engine: list[float]
    both: list[float]


class _Passes:
    """The arrays of one run: the base, the new state, the trainer's snapshot, the engine's
    copy, and two sets of diff outputs (the engine applies one while the trainer fills the
    other)."""

    def __init__(self, size: int, seed: int = 0) -> None:
        state = make_state(size, seed)
        self.old = {n: t.clone() for n, t in state.items()}
        step_state(state, 1, DENSITY, seed)
        self.new = state
        self.base = [int_view(t).numpy() for t in self.old.values()]
        self.news = [int_view(t).numpy() for t in state.values()]
        self.snap = [a.copy() for a in self.base]
        self.engine = [a.copy() for a in self.base]
        caps = [max(1024, a.size // 10) for a in self.base]  # room for 10 % changed
        self.outs = [[_outputs(c, a.dtype) for c, a in zip(caps, self.base, strict=True)]
                     for _ in range(2)]  # fmt: skip
        self.counts = [[0] * len(self.base) for _ in range(2)]
        self.digests: list[list[str]] = [[""] * len(self.base) for _ in range(2)]

    def reset(self) -> None:
        for snap, eng, base in zip(self.snap, self.engine, self.base, strict=True):
            np.copyto(snap, base)
            np.copyto(eng, base)

    def trainer(self, k: int, which: list[int] | None = None) -> None:
        """Diff, hash and advance every pair (or those ``which`` names) into output set ``k``."""
        kernels = native.kernels
        for i in range(len(self.snap)) if which is None else which:
            snap, new = self.snap[i], self.news[i]
            h = native.hasher(_ALGORITHM)
            got, end = kernels.diff_extract(snap, new, snap.itemsize, 0, *self.outs[k][i], h, True)
            if end != snap.size:
                raise RuntimeError(f"tensor {i}: more than 10 % of its elements changed")
            self.counts[k][i], self.digests[k][i] = got, h.hexdigest()

    def engine_pass(self, k: int) -> list[str]:
        """Patch the XORs of output set ``k`` into the engine's copy and hash each tensor."""
        kernels = native.kernels
        out = []
        for i, eng in enumerate(self.engine):
            pos, _, xor = self.outs[k][i]
            n = self.counts[k][i]
            h = native.hasher(_ALGORITHM)
            kernels.patch_hash(eng, eng.itemsize, pos[:n], xor[:n], True, 0, eng.size, h, None)
            out.append(h.hexdigest())
        return out

    def check(self, k: int, engine_digests: list[str]) -> None:
        """The snapshot and the engine hold the new state; the engine's digests are the
        trainer's (set ``k``)."""
        for i, new in enumerate(self.news):
            if not (np.array_equal(self.snap[i], new) and np.array_equal(self.engine[i], new)):
                raise AssertionError(f"tensor {i}: a pass left other bytes than the new state")
        if engine_digests != self.digests[k]:
            raise AssertionError("the engine's digests differ from the trainer's")


def _outputs(cap: int, dtype: Any) -> list[NDArray[Any]]:
    return [np.empty(cap, np.int64), np.empty(cap, dtype), np.empty(cap, dtype)]


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _at_once(*fns: Callable[[], object]) -> float:
    """Seconds until every ``fn``, each on a thread of its own, has returned; RuntimeError if
    one raised (its thread printed why)."""
    failed: list[BaseException] = []

    def run(fn: Callable[[], object]) -> None:
        try:
            fn()
        except BaseException as exc:
            failed.append(exc)
            raise

    threads = [threading.Thread(target=run, args=(fn,), name="syncfloor") for fn in fns]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if failed:
        raise RuntimeError(f"a pass failed: {failed[0]!r}")
    return wall


def _halves(sizes: list[int]) -> tuple[list[int], list[int]]:
    """The indices of ``sizes`` dealt into two lists of about equal total, largest first."""
    out: tuple[list[int], list[int]] = ([], [])
    totals = [0, 0]
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        j = 0 if totals[0] <= totals[1] else 1
        out[j].append(i)
        totals[j] += sizes[i]
    return out


def measure(size: int, repeats: int = 5, seed: int = 0) -> Floors:
    """The floors at a model of about ``size`` bytes, ``repeats`` interleaved repetitions."""
    if native.kernels is None or not hasattr(native.kernels, "patch_hash"):
        raise RuntimeError("the C kernels are not built (pip install -e .)")
    if why := memory_shortfall(size, MEMORY_PER_BYTE, "a smaller --size"):
        raise RuntimeError(why)
    p = _Passes(size, seed)
    floors = Floors([], [], [], [], [])
    halves = _halves([a.nbytes for a in p.base])
    p.trainer(0)  # a warm-up round: every page and output touched once
    p.engine_pass(0)
    got: list[str] = []  # the engine's digests of the latest pass
    for _ in range(repeats):
        floors.ne.append(min(wall for wall, _ in ne_passes(p.old, p.new)))
        p.reset()
        floors.trainer.append(_timed(lambda: p.trainer(0)))
        got.clear()
        floors.engine.append(_timed(lambda: got.extend(p.engine_pass(0))))
        p.check(0, got)
        p.reset()  # the trainer's pass on two threads, into set 1
        floors.trainer2.append(_at_once(*(lambda h=h: p.trainer(1, h) for h in halves)))
        if p.digests[1] != p.digests[0]:
            raise AssertionError("the trainer's digests differ between two passes")
        # at once: the engine applies set 0 (the version before) while the trainer diffs into
        # set 1
        p.reset()
        got.clear()
        floors.both.append(_at_once(lambda: p.trainer(1), lambda: got.extend(p.engine_pass(0))))
        p.check(0, got)
        if p.digests[1] != p.digests[0]:
            raise AssertionError("the trainer's digests differ between two passes")
    return floors


def report(size: int, floors: Floors) -> str:
    """The floors as text: medians (min-max) in ms, and the median of each repetition's ratio
    to the ``torch.ne`` floor of the same repetition (a drift of the machine cancels)."""
    lines = [
        f"sync floor at {size / 2**30:.2f} GiB bf16, ~{DENSITY:.0%} changed, {len(floors.ne)} "
        "interleaved repetitions; median (min-max) ms; the median of each repetition's ratio to "
        "its ne floor"
    ]
    rows = (
        ("trainer floor (torch.ne)", floors.ne),
        ("trainer pass (diff+XXH3+advance, 1 thread)", floors.trainer),
        ("trainer pass on 2 threads", floors.trainer2),
        ("engine pass (patch+XXH3, 1 thread)", floors.engine),
        ("both passes at once (a thread each)", floors.both),
    )
    for name, values in rows:
        med = statistics.median(values)
        ratio = statistics.median(v / ne for v, ne in zip(values, floors.ne, strict=True))
        lines.append(f"  {name:44s} {1e3 * med:7.1f} ({1e3 * min(values):.1f}-"
                     f"{1e3 * max(values):.1f})  {ratio:5.2f}x")  # fmt: skip
    return "\n".join(lines)


def _size(text: str) -> int:
    try:
        n = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not 1 << 20 <= n <= 1 << 36:
        raise argparse.ArgumentTypeError(f"{text}: use 1MiB to 64GiB")
    return n


def _repeats(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 100:
        raise argparse.ArgumentTypeError(f"{text!r}: use a whole number from 1 to 100")
    return int(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m asyncsync.ops.bench.syncfloor",
        description="The memory-bound passes of a verified in-place delta sync, alone.",
    )
    ap.add_argument("--size", type=_size, default=1 << 30, help="model bytes (default 1GiB)")
    ap.add_argument("--repeats", type=_repeats, default=5, help="repetitions (default 5)")
    args = ap.parse_args(argv)
    try:
        floors = measure(args.size, args.repeats)
    except RuntimeError as exc:
        print(f"syncfloor: {exc}", file=sys.stderr)
        return 1
    print(report(args.size, floors))
    return 0


if __name__ == "__main__":
    sys.exit(main())
