"""The passes of publish and apply in isolation, before and after issue 26 (BENCHMARKS.md).

``python -m asyncsync.ops.bench.passes [ELEMENTS]`` (default 128 Mi bf16 elements, 256 MiB; run
it under /work/bin/quiet): one thread, ~3 % changed, min / median of 7 interleaved repetitions,
wall ms and the thread's CPU ms, of

* publish: the diff kernel alone, XXH3 of the new bytes alone, the scatter that advanced the
  snapshot alone, those three one after another (before), and the diff kernel with the hash
  and the advance folded into its pass (after);
* apply: patch + checksum as a Python loop over 256 KiB chunks (before) and as one C call
  (after), and the byte planes as strided copies (before) and in C (after);
* the diff's 8-byte word loop against the AVX2 runs (where the CPU has AVX2), and the undo
  journal's old values gathered, written and then patched (two passes over the pages) against
  the progressive journal's one pass (``journal_patch_hash``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import types
from collections.abc import Callable
from functools import partial

import numpy as np
import torch
import xxhash

from asyncsync.codec import delta, ef, native, patch_hash
from asyncsync.codec.patch import Patch

__all__ = ["main"]

Timing = tuple[float, float]


def _t(fn: Callable[[], object]) -> Timing:
    w0, c0 = time.perf_counter(), time.thread_time()
    fn()
    return time.perf_counter() - w0, time.thread_time() - c0


def _print(title: str, res: dict[str, list[Timing]]) -> None:
    print(title)
    for k, r in res.items():
        w = sorted(a for a, _ in r)
        c = sorted(b for _, b in r)
        mid = len(w) // 2
        print(f"  {k:36s} {1e3 * w[0]:7.1f} / {1e3 * w[mid]:7.1f}   "
              f"({1e3 * c[0]:7.1f} / {1e3 * c[mid]:7.1f})")  # fmt: skip


def publish_passes(n: int, reps: int = 7) -> dict[str, list[Timing]]:
    k = native.kernels
    rng = np.random.default_rng(0)
    old0 = rng.integers(-30000, 30000, n, dtype=np.int16)
    new = old0.copy()
    idx = rng.choice(n, n // 33, replace=False)
    new[idx] ^= 1
    cap = n // 16
    pos, v, x = np.empty(cap, np.int64), np.empty(cap, np.int16), np.empty(cap, np.int16)
    names = ("diff word loop", "diff", "hash", "scatter", "separate", "diff+hash",
             "diff+hash+advance")  # fmt: skip
    res: dict[str, list[Timing]] = {name: [] for name in names}
    simd = k.simd() if hasattr(k, "simd") else False
    for _ in range(reps):
        o = old0.copy()
        if simd:  # the 8-byte word loop, then (below) the AVX2 runs this CPU takes
            k.simd(False)
            res["diff word loop"].append(_t(partial(k.diff_extract, o, new, 2, 0, pos, v, x)))
            k.simd(True)
        a = _t(partial(k.diff_extract, o, new, 2, 0, pos, v, x))
        b = _t(lambda: xxhash.xxh3_128(new.data).hexdigest())
        c = _t(partial(k.set_patch, o, 2, pos[: len(idx)], v[: len(idx)], None))
        res["diff"].append(a)
        res["hash"].append(b)
        res["scatter"].append(c)
        res["separate"].append((a[0] + b[0] + c[0], a[1] + b[1] + c[1]))
        o = old0.copy()
        res["diff+hash"].append(
            _t(partial(k.diff_extract, o, new, 2, 0, pos, v, x, k.Xxh3(), False))
        )
        res["diff+hash+advance"].append(
            _t(partial(k.diff_extract, o, new, 2, 0, pos, v, x, k.Xxh3(), True))
        )
        assert (o == new).all()
    return {k: r for k, r in res.items() if r}


def apply_passes(n: int, reps: int = 7) -> dict[str, list[Timing]]:
    real = native.kernels
    rng = np.random.default_rng(0)
    base = torch.from_numpy(rng.integers(-30000, 30000, n, dtype=np.int16))
    pos = torch.from_numpy(np.sort(rng.choice(n, n // 33, replace=False)).astype(np.int64))
    vals = torch.from_numpy(rng.integers(1, 3, pos.numel(), dtype=np.int16))
    p = Patch.of_xef("xor", pos, vals, ef.encode(pos.numpy(), n)[0])  # as the decoder makes it
    new_ones = ("patch_hash", "planes", "unplanes")
    before = types.SimpleNamespace(
        **{a: getattr(real, a) for a in dir(real) if not a.startswith("_") and a not in new_ones}
    )
    names = ("patch+hash python chunks", "patch+hash C", "journal: gather, write, patch+hash",
             "journal in the patch pass", "planes strided", "planes C", "unplanes strided",
             "unplanes C")  # fmt: skip
    res: dict[str, list[Timing]] = {name: [] for name in names}
    xor = vals.repeat(16)
    raw = bytes(delta._planes(xor))
    journal_file = tempfile.TemporaryFile()  # noqa: SIM115 (closed in the finally below)
    fd = journal_file.fileno()
    try:
        for _ in range(reps):
            flat, flat2 = base.clone(), base.clone()
            native.kernels = before
            res["patch+hash python chunks"].append(
                _t(partial(patch_hash.patch_and_checksum, flat, p, "xxh3-128"))
            )
            res["planes strided"].append(_t(lambda: delta._planes(xor)))
            res["unplanes strided"].append(_t(lambda: delta._unplanes(raw, xor.numel(), 2)))
            native.kernels = real
            res["patch+hash C"].append(
                _t(partial(patch_hash.patch_and_checksum, flat2, p, "xxh3-128"))
            )
            assert torch.equal(flat, flat2)
            if hasattr(real, "journal_patch_hash"):  # the undo journal's old values, two ways
                res["journal: gather, write, patch+hash"].append(
                    _t(partial(_journal_two_passes, base.clone(), p, fd))
                )
                res["journal in the patch pass"].append(
                    _t(partial(patch_hash.patch_and_checksum, base.clone(), p, "xxh3-128",
                               journal=(fd, 64, 0)))
                )  # fmt: skip
            res["planes C"].append(_t(lambda: delta._planes(xor)))
            res["unplanes C"].append(_t(lambda: delta._unplanes(raw, xor.numel(), 2)))
    finally:
        native.kernels = real
        journal_file.close()
    return {k: r for k, r in res.items() if r}


def _elements(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if not 1000 <= n <= 1 << 32:
        raise argparse.ArgumentTypeError(f"{n} elements: use 1000 to 4294967296")
    return n


def _journal_two_passes(flat: torch.Tensor, p: Patch, fd: int) -> None:
    """The durable journal's passes (no fsync here): gather the old values, write them, then
    patch and hash."""
    assert p.positions is not None
    old = np.empty(p.positions.numel(), np.int16)
    native.take(flat.numpy(), p.positions.numpy(), old)
    os.pwrite(fd, old.data, 64)
    patch_hash.patch_and_checksum(flat, p, "xxh3-128")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m asyncsync.ops.bench.passes",
        description="The passes of publish and apply in isolation (one thread, min / median).",
    )
    ap.add_argument(
        "elements", nargs="?", type=_elements, default=128 << 20,
        help="bf16 elements of the tensor (default 134217728: 256 MiB)",
    )  # fmt: skip
    n = ap.parse_args(argv).elements
    if native.kernels is None or not hasattr(native.kernels, "patch_hash"):
        print("the C kernels are not built", file=sys.stderr)
        return 1
    mib = n * 2 / 2**20
    _print(f"publish passes, {mib:.0f} MiB bf16, 3 % changed; min / median, wall ms (thread CPU "
           "ms)", publish_passes(n))  # fmt: skip
    _print(f"apply passes, {mib:.0f} MiB bf16, 3 % changed (the planes: {mib / 2:.0f} MiB of "
           "values)", apply_passes(n))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
