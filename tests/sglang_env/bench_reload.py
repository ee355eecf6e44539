"""The engine's pause as a client sees it, on the real SGLang 0.5.23 server: in-engine apply vs
SGLang's own full reload.

    make bench-sglang                       # = python -m tests.sglang_env.bench_reload
    python -m tests.sglang_env.bench_reload --layers 16 --hidden 512 --repeats 4 --json out.json

A random-weight float32 Llama (default 16 layers, hidden 512, intermediate 1536: 147
tensors, 196 MiB) is written locally. A real Publisher publishes versions in which a fraction
(1 %, 3 %, 10 %) of the elements of **every** tensor changed, as RL training does; an
in-process receiver (``ReceiverAgent`` + the ``SGLang`` engine, the same code as
``asyncsync-receiver --sglang-url``) keeps the server at the newest version. Meanwhile a client
process sends 1-token generations back to back and records when each completes.

For each version: the **pause** is the longest gap between two consecutive completed
generations that overlaps the receiver's sync of that version (its discovery, reading,
decoding, checkpoint patch, stage, the server's pause, apply and resume: on this host the
receiver's work shares the cores that generate); the **pause over the server's pause** is the
longest gap that overlaps the server's pause alone (from the receiver's pause request to the
answer of its resume); the client's gap outside any sync is the floor. The same versions
(seeded) run against two servers, one after the other:

* ``in-engine``: the asyncsync plugin installed; the receiver stages each delta before it
  pauses the server, which XORs it into its parameters in place;
* ``full``: SGLang without the plugin; every version is SGLang's own
  ``update_weights_from_disk`` of the receiver's checkpoint.

Medians of ``--repeats`` versions per fraction, with their spread (min-max); a warm-up
version first (the in-engine path probes every tensor's routing once). The pause mode is the
receiver's default unless ``--pause-mode`` says otherwise. Run it under ``/work/bin/quiet``
(or on an otherwise idle host): it measures wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import multiprocessing as mp
import os
import re
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from receiver import ReceiverAgent
from receiver.engines import SGLang
from tests.sglang_env import build
from tests.sglang_env.chain import Trainer, base_state
from tests.sglang_env.server import SGLangServer, run_env_python

FRACTIONS = (0.01, 0.03, 0.10)
PROMPT = [24, 978, 642, 484, 20]
#: seconds of serving with nothing else running (the client's floor), before the versions
IDLE_SECONDS = 4.0


def client(url: str, out: str, stop: Any) -> None:
    """Back-to-back 1-token generations; one line per answer: ``<monotonic> <finish>``."""
    body = json.dumps(
        {"input_ids": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 1}}
    ).encode()
    with open(out, "w") as f:
        while not stop.is_set():
            req = urllib.request.Request(
                url + "/generate", data=body, headers={"Content-Type": "application/json"}
            )
            try:
                with urllib.request.urlopen(req, timeout=120) as resp:
                    answer = json.loads(resp.read())
                finish = str((answer.get("meta_info") or {}).get("finish_reason", {}).get("type"))
            except Exception as exc:  # an aborted request, a refused connection
                finish = type(exc).__name__
            f.write(f"{time.monotonic():.6f} {finish}\n")
            f.flush()


def pauses(completions: list[float], windows: list[tuple[float, float]]) -> list[float]:
    """Per window: the longest gap between consecutive completions that overlaps it."""
    out = []
    for t0, t1 in windows:
        gaps = [b - a for a, b in itertools.pairwise(completions) if b >= t0 and a <= t1]
        out.append(max(gaps) if gaps else float("nan"))
    return out


def floor_gap(completions: list[float], windows: list[tuple[float, float]]) -> float:
    """The median gap between completions outside every sync (what serving costs anyway)."""
    gaps = [
        b - a
        for a, b in itertools.pairwise(completions)
        if not any(b >= t0 and a <= t1 for t0, t1 in windows)
    ]
    return statistics.median(gaps) if gaps else float("nan")


async def run_series(
    env: Path, model: Path, work: Path, *, kind: str, repeats: int, seed: int, pause_mode: str
) -> dict[str, Any]:
    d = work / kind
    d.mkdir()
    server = SGLangServer(env, model, d / "sglang.log", plugin=kind == "in-engine")
    server.start(timeout=900)
    trainer = Trainer(d / "root", base_state(model))
    trainer.gen.manual_seed(seed)  # both series publish the same versions
    engine = SGLang(
        server.url,
        d / "ckpt",
        in_engine=kind == "in-engine",
        pause_mode=pause_mode,  # type: ignore[arg-type]
    )
    agent = ReceiverAgent(d / "root", engine, "bench", use_inotify=False)
    names = sorted(trainer.sd)
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    log = d / "client.log"
    proc = ctx.Process(target=client, args=(server.url, str(log), stop), daemon=True)
    rows: list[dict[str, Any]] = []
    windows: list[tuple[float, float]] = []
    paused: list[tuple[float, float]] = []  # the server's pause (request to resume's answer)
    try:
        await trainer.open()
        await agent.open()
        await agent.sync_once()  # the seed: a full load either way
        proc.start()
        await asyncio.sleep(IDLE_SECONDS)  # the client starts; then serving alone: the floor
        idle = (time.monotonic(), time.monotonic() + IDLE_SECONDS)
        await asyncio.sleep(IDLE_SECONDS)
        plan = [(0.03, True)] + [(f, False) for f in FRACTIONS for _ in range(repeats)]
        for frac, warmup in plan:
            tc = time.monotonic()
            trainer.change(names, frac)
            tp = time.monotonic()
            v = (await trainer.pub.publish(trainer.sd)).version
            print(f"[bench] {kind:9s} v{v}: change {tp - tc:6.3f}s publish "
                  f"{time.monotonic() - tp:6.3f}s", flush=True)  # fmt: skip
            await asyncio.sleep(0.5)  # the client settles between versions
            t0 = time.monotonic()
            assert await agent.sync_once() == v
            t1 = time.monotonic()
            message = (engine.last_reload or {}).get("message") or ""
            if kind == "in-engine":
                assert "asyncsync: in-engine apply" in message, message
            if not warmup:
                windows.append((t0, t1))
                assert engine.last_pause_window is not None
                paused.append(engine.last_pause_window)
                row = {"kind": kind, "fraction": frac, "version": v, "sync": t1 - t0}
                row.update(server_pause=engine.last_pause_seconds, message=message,
                           apply_ms=applied_ms(message))  # fmt: skip
                rows.append(row)
            print(f"[bench] {kind:9s} {frac:4.0%} v{v} sync {t1 - t0:6.3f}s server paused "
                  f"{engine.last_pause_seconds:6.3f}s {'(warm-up)' if warmup else ''}",
                  flush=True)  # fmt: skip
        await asyncio.sleep(1.0)
    finally:
        stop.set()
        proc.join(30)
        await agent.close()
        await trainer.close()
        server.stop()
    answers = [line.split() for line in log.read_text().splitlines() if line.strip()]
    done = [float(t) for t, finish in answers if finish == "length"]
    for row, gap, in_pause in zip(rows, pauses(done, windows), pauses(done, paused),
                                  strict=True):  # fmt: skip
        row["client_pause"] = gap
        row["client_pause_server_paused"] = in_pause
    inside = [b - a for a, b in itertools.pairwise(done) if a >= idle[0] and b <= idle[1]]
    return {"kind": kind, "rows": rows, "floor": floor_gap(done, windows),
            "floor_idle": statistics.median(inside) if inside else float("nan"),
            "answers": len(answers), "completed": len(done), "completions": done,
            "windows": windows, "paused": paused}  # fmt: skip


def applied_ms(message: str) -> float | None:
    """The plugin's own time for the apply inside the server ("... in 12.3 ms ..."), if said."""
    m = re.search(r" in ([0-9.]+) ms \(stage read", message)
    return None if m is None else float(m.group(1))


def _med(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1000:.0f} ms ({min(xs) * 1000:.0f}-{max(xs) * 1000:.0f})"


def table(series: list[dict[str, Any]]) -> str:
    by = {s["kind"]: s for s in series}
    ie, full = by["in-engine"], by["full"]
    out = [
        "| changed (every tensor) | pause over the sync, in-engine | same, SGLang full reload "
        "| ratio | pause over the server's pause, in-engine / full | ratio "
        "| server paused (receiver's view), in-engine / full | apply inside the server "
        "| lowest ratio possible |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for frac in FRACTIONS:
        a = [r for r in ie["rows"] if r["fraction"] == frac]
        b = [r for r in full["rows"] if r["fraction"] == frac]
        pa, pb = [r["client_pause"] for r in a], [r["client_pause"] for r in b]
        qa = [r["client_pause_server_paused"] for r in a]
        qb = [r["client_pause_server_paused"] for r in b]
        ratio = statistics.median(pa) / statistics.median(pb)
        ratio_q = statistics.median(qa) / statistics.median(qb)
        inside = [r["apply_ms"] / 1000 for r in a if r.get("apply_ms") is not None]
        out.append(
            f"| {frac:.0%} | {_med(pa)} | {_med(pb)} | {ratio:.2f}x "
            f"| {_med(qa)} / {_med(qb)} | {ratio_q:.2f}x "
            f"| {_med([r['server_pause'] for r in a])} / {_med([r['server_pause'] for r in b])} "
            f"| {_med(inside) if inside else '-'} "
            f"| {ie['floor_idle'] / statistics.median(pb):.2f}x |"
        )
    out.append(
        f"\nclient gap, serving alone before the versions (floor): in-engine "
        f"{ie['floor_idle'] * 1000:.0f} ms, full {full['floor_idle'] * 1000:.0f} ms; outside "
        f"syncs (beside the trainer's work): in-engine {ie['floor'] * 1000:.0f} ms, full "
        f"{full['floor'] * 1000:.0f} ms; medians of the versions per row (min-max). Lowest "
        "ratio possible: the in-engine server's floor over the full reload's pause (a gap "
        "between two completions holds at least one generation, whatever the apply costs)"
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
            "--intermediate", str(args.intermediate),
        )  # fmt: skip
        size = (model / "model.safetensors").stat().st_size
        print(f"[bench] model: {args.layers} layers, hidden {args.hidden}, "
              f"{size / 2**20:.0f} MiB", flush=True)  # fmt: skip
        series = []
        for kind in ("full", "in-engine") if args.full_first else ("in-engine", "full"):
            series.append(
                await run_series(
                    env,
                    model,
                    work,
                    kind=kind,
                    repeats=args.repeats,
                    seed=args.seed,
                    pause_mode=args.pause_mode,
                )
            )
    print(table(series))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"model_bytes": size, "pause_mode": args.pause_mode, "series": series}, indent=1
            )
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pause-mode", default="auto", choices=("auto", "abort", "retract", "in_place"))
    p.add_argument("--full-first", action="store_true", help="run the full-reload server first")
    p.add_argument("--json", default=os.environ.get("BENCH_JSON"))
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
