"""The pause a client sees while the receiver applies a version to the real vLLM 0.32 (CPU).

    make bench-vllm                          # = python -m tests.vllm_env.bench_pause
    python -m tests.vllm_env.bench_pause --layers 16 --hidden 512 --repeats 4 --json out.json

A random-weight float32 Llama (``--layers``, ``--hidden``, intermediate 4x; the default is
~256 MiB) is published by a real Publisher, seeded into an asyncsync checkpoint, and served by
vLLM started on that checkpoint. For 1 %, 3 % and 10 % of the elements of **every** tensor
changed (what RL training produces), ``--repeats`` versions each are applied by an in-process
:class:`~receiver.engines.VLLM` engine (patch the checkpoint, then pause, ``reload_weights``,
relabel, resume) while a client thread sends 1-token greedy completions back to back. Per
version: the longest gap between two completed requests that overlaps the apply (the pause as
a client sees it), the server part alone (pause to resume, the engine's log), and the whole
apply; the floor is the longest gap over the same number of requests with no apply. Medians
with min-max. This is vLLM's own full reload (``reload_weights``): the in-engine apply of
docs/ENGINES.md is not possible on vLLM's CPU build (packed linear weights).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from receiver import ReceiverAgent
from receiver.engines import VLLM
from receiver.engines.checkpoint import LocalCheckpoint
from tests.sglang_env.chain import Trainer, base_state
from tests.sglang_env.server import run_env_python
from tests.vllm_env import build
from tests.vllm_env.server import VLLMServer

FRACTIONS = (0.01, 0.03, 0.10)
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


class Client(threading.Thread):
    """1-token completions back to back; records when each successful one completed."""

    def __init__(self, server: VLLMServer):
        super().__init__(daemon=True)
        self.server = server
        self.done: list[float] = []
        self.halt = threading.Event()

    def run(self) -> None:
        body = {
            "model": str(self.server.model),
            "prompt": [24, 978, 642],
            "max_tokens": 1,
            "temperature": 0,
            "ignore_eos": True,
        }
        while not self.halt.is_set():
            try:
                code, out = self.server.call("POST", "/v1/completions", body)
            except OSError:
                continue
            if code == 200 and out["choices"][0]["finish_reason"] == "length":
                self.done.append(time.perf_counter())  # aborted ones are not completions


def longest_gap(done: list[float], t0: float, t1: float) -> float:
    """The longest interval between consecutive completions that overlaps [t0, t1]."""
    gaps = [b - a for a, b in itertools.pairwise(done) if b >= t0 and a <= t1]
    return max(gaps, default=float("nan"))


def change_every_tensor(trainer: Trainer, fraction: float) -> None:
    for name, t in trainer.sd.items():
        flat = t.clone().view(-1)
        k = max(1, int(flat.numel() * fraction))
        idx = torch.randperm(flat.numel(), generator=trainer.gen)[:k]
        flat[idx] += torch.randn(k, generator=trainer.gen) * 0.01
        trainer.sd[name] = flat.view(t.shape)


async def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    env = build.ensure()
    model = work / "model"
    run_env_python(
        env, str(build.MAKE_TINY_MODEL), str(model), "llama",
        "--layers", str(args.layers), "--hidden", str(args.hidden),
        "--intermediate", str(args.hidden * 4),
        environ=build.server_env(env),
    )  # fmt: skip
    size = (model / "model.safetensors").stat().st_size
    print(f"[bench] model: {args.layers} layers, hidden {args.hidden}, {size / 2**20:.0f} MiB")
    trainer = Trainer(work / "root", base_state(model))
    await trainer.open()
    seed = ReceiverAgent(work / "root", LocalCheckpoint(work / "ckpt"), "seed", use_inotify=False)
    async with seed:
        await seed.sync_once()
    for name in SIDE_FILES:
        shutil.copy2(model / name, work / "ckpt" / name)
    server = VLLMServer(env, work / "ckpt", work / "vllm.log", extension=False, threads=None)
    server.start()
    engine = VLLM(server.url, work / "ckpt")
    agent = ReceiverAgent(work / "root", engine, "bench", use_inotify=False)
    rows: list[dict[str, Any]] = []
    client = Client(server)
    try:
        await agent.open()
        await agent.sync_once()
        client.start()
        await asyncio.sleep(3)
        n0 = len(client.done)
        await asyncio.sleep(args.floor_seconds)
        floor_done = client.done[n0:]
        floor = max((b - a for a, b in itertools.pairwise(floor_done)), default=0)
        print(f"[bench] floor: {len(floor_done)} requests, longest gap {floor * 1000:.0f} ms")
        for frac in FRACTIONS:
            for _ in range(args.repeats):
                change_every_tensor(trainer, frac)
                v = (await trainer.pub.publish(trainer.sd)).version
                await asyncio.sleep(1.0)  # requests complete before the apply starts
                t0 = time.perf_counter()
                assert await agent.sync_once() == v
                t1 = time.perf_counter()
                await asyncio.sleep(1.0)  # and after it
                gap = longest_gap(client.done, t0, t1)
                rows.append({"fraction": frac, "version": v, "pause": gap, "apply": t1 - t0})
                print(f"[bench] {frac:4.0%} v{v}: client gap {gap * 1000:7.0f} ms, "
                      f"apply {(t1 - t0) * 1000:7.0f} ms", flush=True)  # fmt: skip
    finally:
        client.halt.set()
        await agent.close()
        await trainer.close()
        server.stop()
    return {"model_bytes": size, "floor": floor, "rows": rows}


def table(result: dict[str, Any]) -> str:
    out = [
        "| elements changed (every tensor) | client-seen pause, median (min-max) | whole apply |",
        "|---|---|---|",
    ]
    for frac in FRACTIONS:
        rows = [r for r in result["rows"] if r["fraction"] == frac]
        p = [r["pause"] * 1000 for r in rows]
        a = [r["apply"] * 1000 for r in rows]
        out.append(
            f"| {frac:.0%} | {statistics.median(p):.0f} ms ({min(p):.0f}-{max(p):.0f}) "
            f"| {statistics.median(a):.0f} ms ({min(a):.0f}-{max(a):.0f}) |"
        )
    out.append(f"| none (floor) | {result['floor'] * 1000:.0f} ms | - |")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--floor-seconds", type=float, default=10.0)
    p.add_argument("--json", default=os.environ.get("BENCH_JSON"))
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="asyncsync-bench-vllm-") as tmp:
        result = asyncio.run(run(args, Path(tmp)))
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
