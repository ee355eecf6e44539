"""Where a publish of device tensors and an apply into a module on the device spend their time.

For the accelerator host (``stress/device_scaling.sh gpuprof``): the seventeenth session measured
both at ~1 s per GiB on an H200, ~4x the CPU path of a 2-core machine, without a profile. This
runs the device check's round trip (``asyncsync.ops.bench.device``: a ``Publisher`` fed CUDA
tensors, a ``ReceiverAgent`` applying into a ``TorchModule`` whose buffers live on the GPU),
with the bench profile's stage timers on both sides (wall and thread-CPU per call) and one more
version under its stack sampler, then times the primitives a version is made of: device-to-host
copies into fresh pageable memory and into reused pinned buffers, the host XXH3 pass, and the
per-tensor patch on the device. ``--device cpu`` runs it here (small sizes) to check the script.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import torch

from asyncsync import codec, memory
from asyncsync.format.checksum import checksum_bytes, tensor_bytes
from asyncsync.ops.bench.device import _Params, _sync, _timed
from asyncsync.ops.bench.profile import (
    PUBLISH_STAGES,
    StackSampler,
    StageTimers,
    _sample_table,
    _stage_table,
)
from asyncsync.ops.bench.scale import make_state, step_state
from asyncsync.pipeline import parallel_map, threads
from asyncsync.publish.publisher import Publisher
from asyncsync.training.settings import parse_size
from receiver.agent import ReceiverAgent
from receiver.engines.torch_module import TorchModule

TM = "receiver.engines.torch_module"
APPLY: tuple[tuple[int, str, str], ...] = (
    (0, "sync_once (discover .. ack)", "receiver.agent:ReceiverAgent._sync"),
    (1, "apply version (begin .. commit)", "receiver.agent:ReceiverAgent._apply_version"),
    (2, "read shard", "receiver.shard_reader:read_into"),
    (2, "verify shard checksum", "receiver.shard_reader:checksum_bytes"),
    (2, "parse shard", "receiver.agent:open_shard"),
    (2, "decode group", "receiver.agent:decode_pieces"),
    (2, "engine begin", f"{TM}:TorchModule._begin"),
    (2, "engine apply group", f"{TM}:TorchModule._apply"),
    (3, "check patch", f"{TM}:check_patch"),
    (3, "apply_patch on device (H2D positions/values, save old, scatter)", f"{TM}:apply_patch"),
    (2, "engine commit", f"{TM}:TorchModule._commit"),
    (3, "entry checksum (one tensor)", f"{TM}:entry_checksum"),
    (4, "tensor bytes (device-to-host)", "asyncsync.format.checksum:tensor_bytes"),
    (1, "ack", "receiver.agent:ReceiverAgent._ack"),
)


async def _round_trip(sd: dict[str, torch.Tensor], device: torch.device, versions: int) -> None:
    sd = {k.replace(".", "_"): t for k, t in sd.items()}
    pub_t, app_t = StageTimers(PUBLISH_STAGES), StageTimers(APPLY)
    walls: dict[str, list[float]] = {"publish": [], "apply": []}
    with tempfile.TemporaryDirectory(prefix="asyncsync-devprof-") as tmp:
        module = _Params(sd).to(device)
        async with (
            Publisher(Path(tmp) / "root", keyframe_interval=0) as pub,
            ReceiverAgent(Path(tmp) / "root", TorchModule(module), "dev", use_inotify=False) as rx,
        ):
            await pub.seed(sd)
            await rx.sync_once()
            for v in range(1, versions + 2):  # the last one sampled
                cpu = {k: t.cpu() for k, t in sd.items()}
                step_state(cpu, v, 0.03, seed=11)
                for k, t in sd.items():
                    t.copy_(cpu[k])
                _sync(device)
                sampled = v == versions + 1
                samplers = [StackSampler(), StackSampler()] if sampled else []
                with pub_t.installed() if not sampled else samplers[0]:
                    t0 = time.perf_counter()
                    res = await pub.publish(sd)
                    walls["publish"].append(time.perf_counter() - t0)
                with app_t.installed() if not sampled else samplers[1]:
                    t0 = time.perf_counter()
                    assert await rx.sync_once() == res.version
                    walls["apply"].append(time.perf_counter() - t0)
                held = module.by_name()
                assert all(torch.equal(held[k].cpu(), cpu[k]) for k in sd), f"v{v} differs"
                if sampled:
                    for side, s in zip(("publish", "apply"), samplers, strict=True):
                        print(f"\n## {side}: one version under the stack sampler")
                        print("\n".join(_sample_table(s, 25)))
    for side, timers, total in (
        ("publish", pub_t, "publish (total)"),
        ("apply", app_t, "sync_once (discover .. ack)"),
    ):
        print(f"\n## {side}: walls {[round(1e3 * w) for w in walls[side]]} ms; stages per version")
        print("\n".join(_stage_table(timers, versions, total)))


def _primitives(sd: dict[str, torch.Tensor], device: torch.device) -> None:
    ts = list(sd.values())
    nbytes = sum(t.numel() * t.element_size() for t in ts)
    gb = nbytes / 1e9
    rows = []

    def row(what: str, s: float) -> None:
        rows.append(f"| {what} | {1e3 * s:,.1f} ms | {gb / s:,.1f} GB/s |")

    row(
        "`t.cpu()` each tensor (fresh pageable memory)",
        _timed(device, lambda: [t.cpu() for t in ts]),
    )
    pinned = [torch.empty_like(t, device="cpu", pin_memory=device.type == "cuda") for t in ts]

    def to_pinned() -> None:
        for b, t in zip(pinned, ts, strict=True):
            b.copy_(t, non_blocking=True)

    row("copy into reused pinned buffers (non_blocking, one sync)", _timed(device, to_pinned))
    row(
        "`tensor_bytes` each tensor (the checksum's copy)",
        _timed(device, lambda: [tensor_bytes(t) for t in ts]),
    )
    host = [b.view(torch.uint8).reshape(-1).numpy() for b in pinned]
    row(
        "XXH3 each tensor, one thread",
        _timed(device, lambda: [checksum_bytes(h.data) for h in host]),
    )
    row(
        f"XXH3 each tensor, pool of {threads()}",
        _timed(device, lambda: parallel_map(lambda h: checksum_bytes(h.data), host)),
    )
    # the receiver's per-tensor patch: positions and values from the host, old values saved
    g = torch.Generator().manual_seed(3)
    patches = []
    for t in ts:
        n = t.numel()
        k = max(1, n * 3 // 100)
        pos = torch.randperm(n, generator=g)[:k].sort().values
        flat = codec.int_view(t)
        patches.append((flat, codec.Patch("set", pos, flat[pos.to(flat.device)].cpu())))

    def patch_all() -> None:
        for flat, p in patches:
            old = torch.empty(p.values.numel(), dtype=flat.dtype, device=flat.device)
            codec.apply_patch(flat, p, old_out=old)

    row(
        f"`apply_patch` on device, {len(ts)} tensors at 3 % (host positions/values)",
        _timed(device, patch_all),
    )
    print(f"\n## primitives ({len(ts)} tensors, {gb:.2f} GB, median of 3)\n")
    print("| what | time | model GB/s |\n|---|---:|---:|")
    print("\n".join(rows))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--size", default="1GiB")
    ap.add_argument("--versions", type=int, default=3)
    args = ap.parse_args()
    device = torch.device(args.device)
    sd = {k: t.to(device) for k, t in make_state(parse_size(args.size), seed=7).items()}
    print(f"# device profile: {device}, {args.size}, {len(sd)} tensors, pool {threads()}")
    _primitives(sd, device)
    asyncio.run(_round_trip(sd, device, args.versions))
    if device.type == "cuda":
        pool = memory.pinned_pool()
        print(
            f"\npinned pool: holds {pool.held / 2**20:.0f} MiB of at most "
            f"{pool.limit / 2**20:.0f}; buffers reused {pool.reused}, plain copies "
            f"(no room) {pool.spilled}"
        )


if __name__ == "__main__":
    main()
