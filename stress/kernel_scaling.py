"""Which layer stops the thread scaling: each kernel stage of a delta, timed at 1..N threads.

The 16-core host's `asyncsync bench --scale` scaled publish from 2.3 to only 3.2-3.4 GB/s at
2-16 threads (BENCHMARKS.md, "Thread scaling"). This times the stages apart, on one bucket's
worth of tensors and on the whole model at once, so a flat row points at its stage:

* ``diff``: :func:`asyncsync.codec.diff_tensors` (the fused C pass: positions, values, XORs,
  XXH3, snapshot advance) over the tensors, on the pool, as the publisher's diff stage;
* ``encode``: :func:`asyncsync.codec.encode_delta` (Elias-Fano, byte planes, zstd) of each;
* ``decode``: :func:`asyncsync.codec.decode_delta` of each, as a receiver's decode;
* ``patch``: :func:`asyncsync.codec.patch_hash.patch_and_checksum` of each decoded patch into an
  in-memory copy of the old tensors (the receiver's pass without a file behind it).

``bucket``: tensors of ``--tensor-mib`` in lots of ``--bucket-mib`` (each lot one pool call, as
the publisher's 32 MiB buckets); ``model``: all of them in one pool call. Medians of
``--reps``, wall and process CPU (ms), and GB/s of model bytes.

    python stress/kernel_scaling.py --threads 1,2,4,8,16 --model-mib 1024
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from asyncsync import codec, pipeline
from asyncsync.codec import patch_hash, scratch


def _state(model_mib: int, tensor_mib: int, seed: int) -> tuple[list[torch.Tensor], ...]:
    g = torch.Generator().manual_seed(seed)
    n = (tensor_mib << 20) // 2
    olds, news = [], []
    for _ in range(max(1, model_mib // tensor_mib)):
        old = torch.randn(n, generator=g).to(torch.bfloat16)
        new = old.clone()
        idx = torch.randperm(n, generator=g)[: n * 3 // 100]
        new[idx] = (new[idx].float() * 1.01 + 1e-3).to(torch.bfloat16)
        olds.append(old)
        news.append(new)
    return olds, news


def _check(what: str, got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    """The timed work really happened: ``got`` holds ``want``'s bytes after the last run."""
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if not torch.equal(codec.int_view(g), codec.int_view(w)):
            raise AssertionError(f"{what}: tensor {i} does not hold the new bytes")


def _lots(items: list[Any], per_lot: int) -> list[list[Any]]:
    return [items[i : i + per_lot] for i in range(0, len(items), per_lot)]


def _time(fn: Callable[[], Any], reps: int, setup: Callable[[], Any] = lambda: None) -> tuple:
    walls, cpus = [], []
    for _ in range(reps):
        setup()
        c, w = time.process_time(), time.perf_counter()
        fn()
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    return statistics.median(walls), statistics.median(cpus)


def run(threads: list[int], model_mib: int, tensor_mib: int, bucket_mib: int, reps: int) -> list:
    olds, news = _state(model_mib, tensor_mib, 0)
    nbytes = sum(t.nbytes for t in news)
    scratch.fit(nbytes)
    per_lot = max(1, bucket_mib // tensor_mib)
    work = [olds[i].clone() for i in range(len(olds))]
    changes = codec.diff_tensors([w.clone() for w in olds], news)
    encs = [
        codec.encode_delta(codec.int_view(o), codec.int_view(n), c.positions, values=c.values,
                           xor=c.xor)
        for o, n, c in zip(olds, news, changes, strict=True)
    ]  # fmt: skip

    def decode(e: codec.EncodedDelta) -> codec.Patch:
        return codec.decode_delta(e.encoding, e.mode, e.positions, e.values, changed=e.changed,
                                  numel=news[0].numel(), dtype=torch.int16)  # fmt: skip

    patches = [decode(e) for e in encs]

    def reset() -> None:
        for w, o in zip(work, olds, strict=True):
            w.copy_(o)

    def stage(name: str, fn: Callable[[int], Any], setup: Callable[[], Any] = lambda: None) -> dict:
        def cost(i: int) -> int:
            return news[i].nbytes

        rows = {}
        for how, lots in (("bucket", _lots(list(range(len(news))), per_lot)),
                          ("model", [list(range(len(news)))])):  # fmt: skip

            def calls(lots: list[list[int]] = lots) -> None:
                for lot in lots:
                    pipeline.run_all(fn, lot, cost=cost)

            wall, cpu = _time(calls, reps, setup)
            rows[how] = {"wall_ms": wall * 1e3, "cpu_ms": cpu * 1e3, "gb_s": nbytes / wall / 1e9}
        return {"stage": name, **rows}

    out = []
    snaps = [o.clone() for o in olds]  # the publisher's snapshot: advanced by each diff
    for n in threads:
        pipeline.set_threads(n)

        def diff(i: int) -> Any:
            return codec.diff_tensors([snaps[i]], [news[i]], algorithm="xxh3-128", advance=True)

        def undo() -> None:
            for s, o in zip(snaps, olds, strict=True):
                s.copy_(o)

        def encode(i: int) -> Any:
            c = changes[i]
            return codec.encode_delta(codec.int_view(olds[i]), codec.int_view(news[i]),
                                      c.positions, values=c.values, xor=c.xor)  # fmt: skip

        def patch(i: int) -> str:
            return patch_hash.patch_and_checksum(codec.int_view(work[i]), patches[i], "xxh3-128")

        rows = [stage("diff", diff, undo)]
        _check("diff (the snapshot advanced)", snaps, news)
        rows += [stage("encode", encode), stage("decode", lambda i: decode(encs[i])),
                 stage("patch", patch, reset)]  # fmt: skip
        _check("patch", work, news)
        for r in rows:
            r["threads"] = n
            print(
                f"threads {n:2d} {r['stage']:6s}  bucket {r['bucket']['wall_ms']:8.1f} ms "
                f"({r['bucket']['gb_s']:5.1f} GB/s, CPU {r['bucket']['cpu_ms']:7.1f})  "
                f"model {r['model']['wall_ms']:8.1f} ms ({r['model']['gb_s']:5.1f} GB/s, "
                f"CPU {r['model']['cpu_ms']:7.1f})",
                flush=True,
            )
        out += rows
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2", help="thread counts, e.g. 1,2,4,8,16")
    ap.add_argument("--model-mib", type=int, default=256)
    ap.add_argument("--tensor-mib", type=int, default=4)
    ap.add_argument("--bucket-mib", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args(argv)
    rows = run([int(x) for x in a.threads.split(",")], a.model_mib, a.tensor_mib, a.bucket_mib,
               a.reps)  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
