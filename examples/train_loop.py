"""A plain PyTorch training loop that publishes its weights after every optimizer step.

    .venv/bin/python examples/train_loop.py [--steps 20] [--engines 2] [--sync-max-staleness 1]
                                            [--sync-mode delta|full] [--sync-root DIR] ...

Trainer: a small next-token MLP language model with fp32 master weights and AdamW. After each
``optimizer.step()`` it hands the bf16 view of its weights to ``SyncSession.publish``, which
returns once version N is committed in the shared directory *and* the engines acknowledged
version N - max_staleness: with the default max staleness of 1 the trainer publishes N while
the engines may still be applying N-1, and never runs further ahead than that.

Engines: ``--engines`` receiver agents (``receiver.ReceiverAgent``), each keeping its own bf16
copy of the model current through a ``receiver.engines.TorchModule``. For a self-contained
example they run in this process, on one event loop in a background thread; in production each
is a separate process on an inference host, and the shared directory is the only link.

Every ``--sync-*`` option of ``SyncConfig.add_arguments`` (and ``ASYNCSYNC_*`` variables) is
accepted. At the end the example waits for the last version and checks that every engine holds
exactly the trainer's bf16 bytes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from asyncsync import SyncConfig
from asyncsync.training.session import SyncSession
from receiver import ReceiverAgent
from receiver.engines import TorchModule


class TinyLM(nn.Module):
    """Embedding -> ``layers`` residual MLP blocks -> norm -> tied-free output head."""

    def __init__(self, vocab: int, hidden: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(hidden),
                nn.Linear(hidden, 4 * hidden),
                nn.GELU(),
                nn.Linear(4 * hidden, hidden),
            )
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block(x)
        logits: torch.Tensor = self.head(self.norm(x))
        return logits


def bf16_view(model: nn.Module) -> dict[str, torch.Tensor]:
    """What the trainer publishes: fresh bf16 copies (the fp32 master keeps training)."""
    return {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN payloads and -0.0 included), which is what lossless means."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


class Engines:
    """Receiver agents with TorchModule engines, run on an event loop in a background thread."""

    def __init__(self, root: Path, models: Mapping[str, nn.Module], poll_interval: float) -> None:
        self.root, self.models, self.poll_interval = root, models, poll_interval
        self.agents: list[ReceiverAgent] = []
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=asyncio.run, args=(self._main(),), daemon=True)

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        self.agents = [
            ReceiverAgent(self.root, TorchModule(m), eid, poll_interval=self.poll_interval)
            for eid, m in self.models.items()
        ]
        for agent in self.agents:
            await agent.open()
        self._ready.set()
        try:
            async with asyncio.TaskGroup() as tg:
                for agent in self.agents:
                    tg.create_task(agent.run(stop=self._stop))
        finally:
            for agent in self.agents:
                await agent.close()

    def __enter__(self) -> Engines:
        self._thread.start()
        self._ready.wait()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=20, help="optimizer steps (default 20)")
    p.add_argument("--engines", type=int, default=2, help="receiver agents (default 2)")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=5e-6, help="AdamW learning rate (default 5e-6)")
    p.add_argument("--poll-interval", type=float, default=0.05, help="receivers' poll (s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="print only the summary")
    SyncConfig.add_arguments(p)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    engine_ids = [f"engine{i}" for i in range(args.engines)]
    tmp = None
    if args.sync_root is None and not os.environ.get("ASYNCSYNC_ROOT"):
        tmp = tempfile.TemporaryDirectory(prefix="asyncsync_train_loop_")
        args.sync_root = tmp.name
    # the example's defaults: wait for every engine, run at most one version ahead of them
    if args.sync_max_staleness is None:
        args.sync_max_staleness = "1"
    if args.sync_ack_engines is None and args.sync_ack_quorum is None:
        args.sync_ack_engines = ",".join(engine_ids)
    config = SyncConfig.from_args(args)

    model = TinyLM(args.vocab, args.hidden, args.layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    # engines start from unrelated weights and receive everything through the root
    engine_models = {e: TinyLM(args.vocab, args.hidden, args.layers).bfloat16() for e in engine_ids}
    n_params = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(args.seed)
    print(
        f"model: {n_params / 1e6:.2f}M parameters, bf16 view {2 * n_params / 2**20:.1f} MiB; "
        f"mode={config.mode} encoding={config.encoding} engines={args.engines} "
        f"max_staleness={config.max_staleness} root={config.root}"
    )
    if not args.quiet:
        print(
            f"{'step':>4} {'loss':>7} {'ver':>4} {'kind':>5} {'changed':>8} {'wire KiB':>9} "
            f"{'publish ms':>10} {'waited for':>10} {'engines at':>10} {'wait ms':>8}"
        )
    rows: list[dict[str, Any]] = []
    t_train = t_sync = t_wait = 0.0
    t_start = time.perf_counter()
    with Engines(config.root, engine_models, args.poll_interval), SyncSession(config) as sync:
        sync.publish(bf16_view(model))  # the seed: version 0, a full keyframe
        for step in range(1, args.steps + 1):
            t0 = time.perf_counter()
            tokens = torch.randint(0, args.vocab, (args.batch, 33), generator=gen)
            targets = (tokens[:, :-1] * 7 + 3) % args.vocab  # a rule the model can learn
            logits = model(tokens[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, args.vocab), targets.flatten())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            t1 = time.perf_counter()
            s = sync.publish(bf16_view(model))  # commit version N, wait for N - max_staleness
            t2 = time.perf_counter()
            t_train += t1 - t0
            t_sync += t2 - t1
            t_wait += s.ack.seconds
            at = sorted({a.version for a in s.ack.acks.values()})
            at_s = "-" if not at else (f"{at[0]}" if len(at) == 1 else f"{at[0]}..{at[-1]}")
            r = s.result
            row = {
                "step": step,
                "loss": loss.item(),
                "version": r.version,
                "kind": r.kind,
                "density": r.density,
                "wire_bytes": r.wire_bytes,
                "publish_s": r.seconds["total"],
                "waited_for": s.ack.target,
                "staleness": s.ack.staleness,
                "wait_s": s.ack.seconds,
            }
            rows.append(row)
            if not args.quiet:
                print(
                    f"{step:>4} {row['loss']:>7.3f} {r.version:>4} {r.kind:>5} "
                    f"{100 * r.density:>7.2f}% {r.wire_bytes / 1024:>9.1f} "
                    f"{1000 * r.seconds['total']:>10.1f} {s.ack.target!s:>10} {at_s:>10} "
                    f"{1000 * s.ack.seconds:>8.1f}"
                )
        final = sync.wait_acked()  # every engine holds the last version
        last = sync.version
        stats = sync.statistics()
    elapsed = time.perf_counter() - t_start
    trainer = bf16_view(model)
    exact = all(
        same_bytes(t, trainer[k]) for m in engine_models.values() for k, t in m.state_dict().items()
    )
    full_bytes = sum(t.numel() * t.element_size() for t in trainer.values())
    deltas = [r for r in rows if r["kind"] == "delta"]  # keyframes carry full data too
    wire = sum(r["wire_bytes"] for r in rows)
    summary = {
        "steps": args.steps,
        "last_version": last,
        "engines_at": {e: a.version for e, a in final.acks.items()},
        "bit_exact": exact,
        "mean_density": sum(r["density"] for r in rows) / max(len(rows), 1),
        "wire_bytes": wire,
        "full_bytes_per_version": full_bytes,
        "wire_vs_full": wire / max(full_bytes * len(rows), 1),
        "mean_delta_wire_bytes": sum(r["wire_bytes"] for r in deltas) / max(len(deltas), 1),
        "max_staleness_seen": max((r["staleness"] or 0 for r in rows), default=0),
        "train_s": t_train,
        "sync_s": t_sync,
        "ack_wait_s": t_wait,
        "elapsed_s": elapsed,
        "keyframes": stats.keyframes,
    }
    print(
        f"\n{args.steps} steps in {elapsed:.2f}s: train {t_train:.2f}s, publish+wait "
        f"{t_sync:.2f}s (of which waiting for acks {t_wait:.2f}s)\n"
        f"published versions 1..{last} ({stats.keyframes} with full data incl. the seed); "
        f"mean changed {100 * summary['mean_density']:.2f}% of elements; "
        f"wire {wire / 2**20:.2f} MiB = {100 * summary['wire_vs_full']:.1f}% of sending the "
        f"full bf16 model ({full_bytes / 2**20:.1f} MiB) every step"
        + (
            f"; a delta-only version averaged {summary['mean_delta_wire_bytes'] / 1024:.1f} KiB "
            f"({100 * summary['mean_delta_wire_bytes'] / full_bytes:.1f}% of the model)"
            if deltas
            else ""
        )
        + "\n"
        f"max staleness seen: {summary['max_staleness_seen']} version(s) "
        f"(allowed {config.max_staleness}); engines at {summary['engines_at']}; "
        f"bit-exact with the trainer: {exact}"
    )
    if tmp is not None:
        tmp.cleanup()
    return summary


if __name__ == "__main__":
    main()
