"""Reload time on the real SGLang 0.5.23 server: the plugin's partial reload vs SGLang's full one.

    make bench-sglang                       # = python -m tests.sglang_env.bench_reload
    python -m tests.sglang_env.bench_reload --layers 16 --hidden 512 --repeats 3 --json out.json

A random-weight float32 Llama (``--layers`` x 9 tensors + 3; the default has 147 tensors,
~270 MB) is written locally, and a real Publisher plus an in-process receiver keep its
asyncsync checkpoint. For 1 %, 10 % and 100 % of the tensors changed (a few elements of each),
the next version is synced into the checkpoint and ``POST /update_weights_from_disk`` is timed
(client wall time of that call alone; the checkpoint was just written, so its pages are in the
page cache either way). The same sequence of versions runs twice: on a server with the plugin
(partial reloads) and on one started with ``ASYNCSYNC_SGLANG_PARTIAL=0`` (every reload SGLang's
own full one, through the same hook). Medians of ``--repeats`` versions per fraction.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from receiver import ReceiverAgent
from receiver.engines import LocalCheckpoint
from tests.sglang_env import build
from tests.sglang_env.chain import Trainer, base_state
from tests.sglang_env.server import SGLangServer, run_env_python

FRACTIONS = (0.01, 0.10, 1.0)


async def run_series(
    env: Path, model: Path, work: Path, *, partial: bool, repeats: int, seed: int
) -> list[dict[str, Any]]:
    kind = "partial" if partial else "full"
    d = work / kind
    d.mkdir()
    server = SGLangServer(
        env,
        model,
        d / "sglang.log",
        extra_env={} if partial else {"ASYNCSYNC_SGLANG_PARTIAL": "0"},
    )
    server.start()
    trainer = Trainer(d / "root", base_state(model))
    trainer.gen.manual_seed(seed)  # both series publish the same versions
    agent = ReceiverAgent(d / "root", LocalCheckpoint(d / "ckpt"), "bench", use_inotify=False)
    rows: list[dict[str, Any]] = []
    try:
        v = await trainer.open()
        await agent.open()
        await agent.sync_once()
        code, answer = server.update(d / "ckpt", str(v))  # the first reload is full either way
        assert code == 200, answer
        names = sorted(trainer.sd)
        pick = torch.Generator().manual_seed(seed)
        for frac in FRACTIONS:
            k = max(1, round(frac * len(names)))
            for _ in range(repeats):
                chosen = [names[i] for i in torch.randperm(len(names), generator=pick)[:k]]
                v = await trainer.step(chosen)
                assert await agent.sync_once() == v
                t0 = time.perf_counter()
                code, answer = server.update(d / "ckpt", str(v))
                dt = time.perf_counter() - t0
                assert code == 200 and answer["success"], answer
                want = "asyncsync: partial reload" if partial else "(ASYNCSYNC_SGLANG_PARTIAL=0)"
                assert want in answer["message"], answer  # the reload was of the kind timed
                rows.append(
                    {
                        "kind": kind,
                        "fraction": frac,
                        "tensors": k,
                        "of": len(names),
                        "bytes": sum(
                            trainer.sd[n].numel() * trainer.sd[n].element_size() for n in chosen
                        ),
                        "seconds": dt,
                    }
                )
                print(f"[bench] {kind:7s} {frac:5.0%} {k:4d} tensors  {dt * 1000:8.1f} ms",
                      flush=True)  # fmt: skip
    finally:
        await agent.close()
        await trainer.close()
        server.stop()
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| tensors changed | bytes changed | partial (plugin) | full (SGLang's own) | ratio |",
        "|---|---|---|---|---|",
    ]
    for frac in FRACTIONS:
        part = [r for r in rows if r["fraction"] == frac and r["kind"] == "partial"]
        full = [r for r in rows if r["fraction"] == frac and r["kind"] == "full"]
        p = statistics.median(r["seconds"] for r in part) * 1000
        f = statistics.median(r["seconds"] for r in full) * 1000
        mb = statistics.median(r["bytes"] for r in part) / 2**20
        out.append(
            f"| {frac:.0%} ({part[0]['tensors']} of {part[0]['of']}) | {mb:.1f} MiB "
            f"| {p:.0f} ms | {f:.0f} ms | {f / p:.1f}x |"
        )
    return "\n".join(out)


async def main_async(args: argparse.Namespace) -> None:
    env = build.ensure()
    build.install_plugin(env)
    with tempfile.TemporaryDirectory(prefix="asyncsync-bench-sglang-") as tmp:
        work = Path(tmp)
        model = work / "model"
        run_env_python(
            env, str(build.HERE / "make_tiny_model.py"), str(model), "llama",
            "--layers", str(args.layers), "--hidden", str(args.hidden),
            "--intermediate", str(args.hidden * 4),
        )  # fmt: skip
        size = (model / "model.safetensors").stat().st_size
        print(f"[bench] model: {args.layers} layers, hidden {args.hidden}, {size / 2**20:.0f} MiB")
        rows = []
        for partial in (True, False):
            rows += await run_series(
                env, model, work, partial=partial, repeats=args.repeats, seed=args.seed
            )
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"model_bytes": size, "rows": rows}, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=os.environ.get("BENCH_JSON"))
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
