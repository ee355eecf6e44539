"""The core slice's acceptance run, using only the public API.

Publishes a seed and six versions (one with no change) of a mixed-dtype state dict of about
``--elements`` elements (default 50M), applies them with a receiver agent into a LocalCheckpoint,
checks that every tensor of the checkpoint has the trainer's bytes and that the engine's ack
reaches ``wait_acked``; then flips a byte in a shard of a seventh version and checks that it is
refused and the checkpoint keeps the last good version.

    .venv/bin/python examples/acceptance.py [--elements 50000000] [--root DIR] [--keep]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
import time
from pathlib import Path

import torch

from asyncsync import ChecksumMismatch, Publisher
from asyncsync.format.store import read_manifest
from receiver import ReceiverAgent
from receiver.engines.checkpoint import LocalCheckpoint

DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float8_e4m3fn,
    torch.int8,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.uint8,
    torch.float64,
    torch.float8_e5m2,
]


def build_state(elements: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Mostly bf16 matrices (like a model), plus one tensor of every other dtype."""
    sd: dict[str, torch.Tensor] = {}
    side = 2048
    n_big = max(1, int(elements * 0.95) // (side * side))
    for i in range(n_big):
        sd[f"model.layers.{i}.mlp.weight"] = (
            torch.randn(side, side, generator=gen) * 0.02
        ).bfloat16()
    rest = max(1, (elements - n_big * side * side) // len(DTYPES))
    for dt in DTYPES:
        raw = torch.randint(
            0,
            256,
            (rest * torch.empty((), dtype=dt).element_size(),),
            dtype=torch.uint8,
            generator=gen,
        )
        sd[f"extra.{str(dt).split('.')[-1]}"] = (raw & 1 if dt == torch.bool else raw).view(dt)
    sd["extra.scalar"] = torch.tensor(3.5)
    sd["extra.empty"] = torch.zeros(0, 7, dtype=torch.bfloat16)
    return sd


def step(
    sd: dict[str, torch.Tensor], density: float, gen: torch.Generator
) -> dict[str, torch.Tensor]:
    out = {}
    for k, t in sd.items():
        t = t.clone()
        if t.numel():
            flat = t.view(-1)
            mask = torch.rand(flat.numel(), generator=gen) < density
            if t.dtype == torch.bfloat16:  # an ulp-sized change, like an Adam step after the cast
                iv = flat.view(torch.int16)
                iv[mask] += 1
            else:
                u8 = flat.view(torch.uint8).view(flat.numel(), -1)
                u8[mask, 0] ^= 1
        out[k] = t
    return out


async def main() -> int:
    ap = argparse.ArgumentParser(
        description="Publish a seed and seven versions, apply them with a receiver, check the "
        "checkpoint bit for bit and that a corrupt version is refused."
    )
    ap.add_argument(
        "--elements", type=int, default=50_000_000, metavar="N",
        help="elements of the generated state dict (default 50M: about 200 MB on disk)",
    )  # fmt: skip
    ap.add_argument(
        "--root", type=Path, metavar="DIR",
        help="working directory, kept (default: a temp directory, removed at the end)",
    )  # fmt: skip
    ap.add_argument("--keep", action="store_true", help="keep the temp directory")
    args = ap.parse_args()
    base = args.root or Path(tempfile.mkdtemp(prefix="asyncsync-acceptance-"))
    try:
        return await run(args.elements, base)
    finally:
        if args.root is None and not args.keep:
            shutil.rmtree(base, ignore_errors=True)
            print(f"removed {base} (--keep keeps it)")


async def run(elements: int, base: Path) -> int:
    args = argparse.Namespace(elements=elements)
    root, ckpt = base / "root", base / "ckpt"
    gen = torch.Generator().manual_seed(0)
    sd = build_state(args.elements, gen)
    n = sum(t.numel() for t in sd.values())
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    print(f"state dict: {len(sd)} tensors, {n / 1e6:.1f}M elements, {nbytes / 2**20:.0f} MiB")
    async with Publisher(root, keyframe_interval=0) as pub:
        agent = ReceiverAgent(root, LocalCheckpoint(ckpt), "engine-0", use_inotify=False)
        async with agent:
            t = time.perf_counter()
            r = await pub.seed(sd)
            v = await agent.sync_once()
            dt = time.perf_counter() - t
            print(f"seed v{r.version}: {r.wire_bytes / 2**20:.0f} MiB in {dt:.1f}s")
            for i in range(1, 7):
                sd = sd if i == 4 else step(sd, 0.03, gen)
                t0 = time.perf_counter()
                r = await pub.publish(sd)
                t1 = time.perf_counter()
                v = await agent.sync_once()
                acks = await pub.wait_acked(r.version, engines=["engine-0"], timeout=60)
                t2 = time.perf_counter()
                per = r.wire_bytes / max(r.changed, 1)
                print(
                    f"v{r.version} {r.kind:5s} changed={r.changed:>10,d} density={r.density:.2%} "
                    f"wire={r.wire_bytes / 2**20:7.2f} MiB ({per:.2f} B/changed) "
                    f"publish={t1 - t0:.2f}s apply+ack={t2 - t1:.2f}s "
                    f"acked={acks['engine-0'].version}"
                )
                assert v == r.version
            held = agent.engine.load_state_dict()  # type: ignore[attr-defined]
            bad = [
                k
                for k, t in sd.items()
                if not torch.equal(
                    held[k].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)
                )
            ]
            assert not bad, f"tensors differ: {bad}"
            print(f"bit-exact: all {len(sd)} tensors of the checkpoint equal the trainer's at v{v}")
            # a corrupt seventh version is refused
            r = await pub.publish(step(sd, 0.03, gen))
            m = read_manifest(root, r.version)
            shard = r.path / m.shards[0].file
            data = bytearray(shard.read_bytes())
            data[len(data) // 3] ^= 0x01
            shard.write_bytes(bytes(data))
            agent.verify_deadline = 0.5
            try:
                await agent.sync_once()
            except ChecksumMismatch as exc:
                print(f"refused v{r.version}: {exc}")
            else:
                raise AssertionError("a flipped byte was not detected")
            assert agent.version == v, agent.version
            held = agent.engine.load_state_dict()  # type: ignore[attr-defined]
            assert all(
                torch.equal(held[k].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))
                for k, t in sd.items()
            )
            print(
                f"ACCEPTANCE OK: checkpoint kept v{v} bit-exact after refusing corrupt v{r.version}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
