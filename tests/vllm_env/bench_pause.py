"""The pause a client sees while the receiver applies a version to the real vLLM 0.32 (CPU):
the in-engine apply against vLLM's own ``reload_weights``, and what plain weights cost
generation.

    make bench-vllm                          # = python -m tests.vllm_env.bench_pause
    python -m tests.vllm_env.bench_pause --layers 16 --hidden 512 --repeats 4 --json out.json

A random-weight float32 Llama (``--layers``, ``--hidden``, intermediate 4x; the default is
244 MiB, 147 tensors) is published by a real Publisher, seeded into an asyncsync checkpoint,
and served by vLLM started on that checkpoint with the asyncsync worker extension. For 1 %,
3 % and 10 % of the elements of **every** tensor changed (what RL training produces),
``--repeats`` versions each (after one warm-up version) are applied by an in-process
:class:`~receiver.engines.VLLM` engine (the code of ``asyncsync-receiver --vllm-url``) while a
client process sends 1-token greedy completions back to back. Three series, the same seeded
versions each:

* ``in-engine``: vLLM started with ``ASYNCSYNC_VLLM_INPLACE=1`` (plain CPU weights); the
  receiver stages each delta before the pause, the workers XOR it in place;
* ``reload (plain)``: the same server, every version vLLM's ``reload_weights``
  (``in_engine=False, partial_loads=False``);
* ``reload (packed)``: vLLM as it starts by default (linear weights packed for oneDNN), every
  version ``reload_weights`` (what the receiver did before the in-engine apply).

Per version: the longest gap between two completed requests that overlaps the receiver's sync
(discovery, decoding, checkpoint patch, stage, pause, apply, resume), i.e. the pause as a
client sees it; the server part (pause to resume, the receiver's view); the sync. The floor is
the median gap outside the syncs. Generation speed on both servers: ``--gen-seconds`` of
greedy 64-token completions, one request at a time and 8 at once, in tokens/s. Medians with
min-max. Run it under ``/work/bin/quiet``: it measures wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import multiprocessing as mp
import os
import shutil
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from receiver import ReceiverAgent
from receiver.engines import VLLM
from receiver.engines.checkpoint import LocalCheckpoint
from receiver.plugins.vllm_loader import ENV_PLAIN
from tests.sglang_env.bench_reload import _med, floor_gap, pauses
from tests.sglang_env.chain import Trainer, base_state
from tests.sglang_env.server import http, run_env_python
from tests.vllm_env import build
from tests.vllm_env.server import VLLMServer

FRACTIONS = (0.01, 0.03, 0.10)
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
PROMPT = [24, 978, 642, 484, 20]


def client(url: str, model: str, out: str, stop: Any) -> None:
    """Back-to-back 1-token completions; one line per answer: ``<monotonic> <finish>``."""
    body = json.dumps(
        {"model": model, "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "ignore_eos": True}
    ).encode()
    with open(out, "w") as f:
        while not stop.is_set():
            req = urllib.request.Request(
                url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
            )
            try:
                with urllib.request.urlopen(req, timeout=120) as resp:
                    finish = str(json.loads(resp.read())["choices"][0]["finish_reason"])
            except Exception as exc:  # an aborted request, a refused connection
                finish = type(exc).__name__
            f.write(f"{time.monotonic():.6f} {finish}\n")
            f.flush()


def generation(server: VLLMServer, seconds: float, streams: int) -> float:
    """Tokens/s of greedy 64-token completions, ``streams`` requests at once."""
    body = {"model": str(server.model), "prompt": PROMPT, "max_tokens": 64,
            "temperature": 0, "ignore_eos": True}  # fmt: skip

    def one() -> int:
        code, out = http(server.url + "/v1/completions", "POST", body, timeout=300)
        assert code == 200, out
        return int(out["usage"]["completion_tokens"])

    tokens, t0 = 0, time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        while time.monotonic() - t0 < seconds:
            tokens += sum(pool.map(lambda _: one(), range(streams)))
    return tokens / (time.monotonic() - t0)


def seeded_checkpoint(model: Path, d: Path, seed: int) -> Trainer:
    trainer = Trainer(d / "root", base_state(model))
    trainer.gen.manual_seed(seed)  # every series publishes the same versions
    return trainer


async def run_series(
    server: VLLMServer, trainer: Trainer, d: Path, *, kind: str, repeats: int
) -> dict[str, Any]:
    in_engine = kind == "in-engine"
    engine = VLLM(server.url, d / "ckpt", in_engine=in_engine, partial_loads=in_engine)
    agent = ReceiverAgent(d / "root", engine, "bench", use_inotify=False)
    names = sorted(trainer.sd)
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    log = d / f"client-{kind.replace(' ', '-')}.log"
    proc = ctx.Process(target=client, args=(server.url, str(server.model), str(log), stop))
    rows: list[dict[str, Any]] = []
    windows: list[tuple[float, float]] = []
    try:
        await agent.open()
        await agent.sync_once()
        proc.start()
        await asyncio.sleep(3.0)
        plan = [(0.03, True)] + [(f, False) for f in FRACTIONS for _ in range(repeats)]
        for frac, warmup in plan:
            trainer.change(names, frac)
            v = (await trainer.pub.publish(trainer.sd)).version
            await asyncio.sleep(0.5)  # the client settles between versions
            t0 = time.monotonic()
            assert await agent.sync_once() == v
            t1 = time.monotonic()
            messages = (engine.last_reload or {}).get("messages") or [""]
            if in_engine:
                assert "asyncsync: in-engine apply" in messages[0], messages
            if not warmup:
                windows.append((t0, t1))
                rows.append({"kind": kind, "fraction": frac, "version": v, "sync": t1 - t0,
                             "server_pause": engine.last_pause_seconds,
                             "message": messages[0][:300]})  # fmt: skip
            print(f"[bench] {kind:15s} {frac:4.0%} v{v} sync {t1 - t0:6.3f}s server paused "
                  f"{engine.last_pause_seconds:6.3f}s {'(warm-up)' if warmup else ''}",
                  flush=True)  # fmt: skip
        await asyncio.sleep(1.0)
    finally:
        stop.set()
        proc.join(30)
        await agent.close()
    answers = [line.split() for line in log.read_text().splitlines() if line.strip()]
    done = [float(t) for t, finish in answers if finish == "length"]
    for row, gap in zip(rows, pauses(done, windows), strict=True):
        row["client_pause"] = gap
    return {"kind": kind, "rows": rows, "floor": floor_gap(done, windows),
            "answers": len(answers), "completed": len(done)}  # fmt: skip


async def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    env = build.ensure()
    build.sglang_build.install_plugin(env, build.PLUGIN_DIR, label="vLLM")
    model = work / "model"
    run_env_python(
        env, str(build.MAKE_TINY_MODEL), str(model), "llama",
        "--layers", str(args.layers), "--hidden", str(args.hidden),
        "--intermediate", str(args.hidden * 4),
        environ=build.server_env(env),
    )  # fmt: skip
    size = (model / "model.safetensors").stat().st_size
    print(f"[bench] model: {args.layers} layers, hidden {args.hidden}, {size / 2**20:.0f} MiB")
    series: list[dict[str, Any]] = []
    speed: dict[str, dict[str, float]] = {}
    for weights in ("plain", "packed"):
        d = work / weights
        trainer = seeded_checkpoint(model, d, args.seed)
        await trainer.open()
        seed = ReceiverAgent(d / "root", LocalCheckpoint(d / "ckpt"), "seed", use_inotify=False)
        async with seed:
            await seed.sync_once()
        for name in SIDE_FILES:
            shutil.copy2(model / name, d / "ckpt" / name)
        extra = {ENV_PLAIN: "1"} if weights == "plain" else {}
        server = VLLMServer(env, d / "ckpt", d / "vllm.log", threads=None, extra_env=extra)
        server.start()
        try:
            speed[weights] = {f"{n} stream(s)": generation(server, args.gen_seconds, n)
                              for n in (1, 8)}  # fmt: skip
            print(f"[bench] generation, {weights} weights: {speed[weights]}", flush=True)
            kinds = ("in-engine", "reload (plain)") if weights == "plain" else ("reload (packed)",)
            for kind in kinds:
                trainer.gen.manual_seed(args.seed)
                series.append(await run_series(server, trainer, d, kind=kind,
                                               repeats=args.repeats))  # fmt: skip
        finally:
            await trainer.close()
            server.stop()
    return {"model_bytes": size, "series": series, "generation": speed}


def table(result: dict[str, Any]) -> str:
    by = {s["kind"]: s for s in result["series"]}
    kinds = list(by)
    out = [
        "| changed (every tensor) | " + " | ".join(f"client-seen pause, {k}" for k in kinds)
        + " | ratio in-engine / reload (plain) | server paused, in-engine / reload (plain) |",
        "|---|" + "---|" * (len(kinds) + 2),
    ]  # fmt: skip
    for frac in FRACTIONS:
        rows = {k: [r for r in by[k]["rows"] if r["fraction"] == frac] for k in kinds}
        p = {k: [r["client_pause"] for r in rows[k]] for k in kinds}
        ratio = statistics.median(p["in-engine"]) / statistics.median(p["reload (plain)"])
        sp = {k: [r["server_pause"] for r in rows[k]] for k in kinds}
        out.append(
            f"| {frac:.0%} | " + " | ".join(_med(p[k]) for k in kinds)
            + f" | {ratio:.2f}x | {_med(sp['in-engine'])} / {_med(sp['reload (plain)'])} |"
        )  # fmt: skip
    floors = ", ".join(f"{k} {by[k]['floor'] * 1000:.0f} ms" for k in kinds)
    out.append(f"\nclient gap outside syncs (floor): {floors}; medians of the versions (min-max)")
    gen = result["generation"]
    for w, speeds in gen.items():
        out.append(f"generation, {w} weights: " + ", ".join(
            f"{k} {v:.1f} tokens/s" for k, v in speeds.items()))  # fmt: skip
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gen-seconds", type=float, default=12.0)
    p.add_argument("--json", default=os.environ.get("BENCH_JSON"))
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="asyncsync-bench-vllm-") as tmp:
        result = asyncio.run(run(args, Path(tmp)))
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
