"""``asyncsync bench --device cuda``: the accelerator paths, checked bit-exact and timed.

For a machine with a GPU (CI and these development machines have none). In a few minutes it
runs, on ``device``:

1. the diff (``codec.diff_tensors`` / ``changed_positions``) on device tensors, compared with
   the CPU path on copies of the same bytes (positions, new values, XORs: equal or it fails);
2. ``apply_patch`` with ``old_out`` on device, compared with the CPU result;
3. a ``Publisher`` fed device tensors (pinned CPU snapshot, device-to-host of positions and
   values only) and a receiver applying to a :class:`~receiver.engines.TorchModule` whose
   parameters live on the device, and one applying to a ``LocalCheckpoint``: both bit-exact
   with the trainer after every version;
4. timings: one ``torch.ne`` pass on the device and the diff, as GB/s of both versions read.

``--device cpu`` runs the same code on the CPU, which is how the tests keep it working here.
"""

from __future__ import annotations

import asyncio
import math
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from asyncsync import codec
from asyncsync.errors import ConfigError
from asyncsync.ops.bench.scale import make_state, step_state
from asyncsync.publish.publisher import Publisher
from receiver.agent import ReceiverAgent
from receiver.engines.checkpoint import LocalCheckpoint
from receiver.engines.torch_module import TorchModule

__all__ = ["device_markdown", "run_device_check"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(device: torch.device, fn: Any, repeats: int = 3) -> float:
    """The median seconds of ``fn()`` on ``device`` (synchronised), after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


class _Params(torch.nn.Module):
    """A module whose buffers are a flat state dict (names without dots)."""

    def __init__(self, sd: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for name, t in sd.items():
            self.register_buffer(name, t.clone())

    def by_name(self) -> dict[str, torch.Tensor]:
        return dict(self.named_buffers())


def run_device_check(device_name: str, model_bytes: int, versions: int = 3) -> dict[str, Any]:
    """Run the checks of the module docstring; raise AssertionError on any difference."""
    device = torch.device(device_name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: torch sees no CUDA device on this machine")
    cpu0 = make_state(model_bytes, seed=7)
    cpu1 = {k: t.clone() for k, t in cpu0.items()}
    step_state(cpu1, 1, 0.03, seed=7)
    dev0 = {k: t.to(device) for k, t in cpu0.items()}
    dev1 = {k: t.to(device) for k, t in cpu1.items()}
    names = list(cpu0)
    out: dict[str, Any] = {"device": str(device), "model_bytes": model_bytes}
    if device.type == "cuda":
        out["device_name"] = torch.cuda.get_device_name(device)

    # 1. the diff, bit-exact against the CPU path
    got = codec.diff_tensors([dev0[k] for k in names], [dev1[k] for k in names])
    ref = codec.diff_tensors([cpu0[k] for k in names], [cpu1[k] for k in names])
    for name, g, r in zip(names, got, ref, strict=True):
        for what in ("positions", "values", "xor"):
            a, b = getattr(g, what).cpu(), getattr(r, what)
            assert torch.equal(a, b), f"diff of {name}: {what} differ between {device} and cpu"
    out["changed"] = sum(int(r.positions.numel()) for r in ref)

    # 2. apply_patch with old_out on the device
    name = max(names, key=lambda k: cpu0[k].numel())
    change = ref[names.index(name)]
    flat = codec.int_view(dev0[name]).clone()
    old = torch.empty_like(change.xor, device=device)
    on_device = codec.Patch("xor", change.positions.to(device), change.xor)
    codec.apply_patch(flat, on_device, old_out=old)
    assert torch.equal(flat.cpu(), codec.int_view(cpu1[name])), "apply_patch on device differs"
    assert torch.equal(old.cpu(), codec.int_view(cpu0[name])[change.positions]), "old_out differs"

    # 3. timings
    views = [(codec.int_view(dev0[k]), codec.int_view(dev1[k])) for k in names]
    mask = torch.empty(sum(a.numel() for a, _ in views), dtype=torch.bool, device=device)

    def ne() -> None:
        start = 0
        for a, b in views:
            torch.ne(a, b, out=mask[start : start + a.numel()])
            start += a.numel()

    read = 2 * model_bytes
    out["ne_pass_s"] = _timed(device, ne, 5)
    out["changed_positions_s"] = _timed(
        device, lambda: codec.changed_positions(*zip(*views, strict=True)), 5
    )
    out["diff_s"] = _timed(device, lambda: codec.diff_tensors(*zip(*views, strict=True)), 3)
    out["ne_pass_gb_per_s"] = read / out["ne_pass_s"] / 1e9
    out["diff_gb_per_s"] = read / out["diff_s"] / 1e9

    # 4. publish device tensors; receivers on the device and into a local checkpoint
    out.update(asyncio.run(_round_trip(dev0, device, versions)))
    return out


async def _round_trip(
    sd: dict[str, torch.Tensor], device: torch.device, versions: int
) -> dict[str, Any]:
    publishes, applies = [], []
    sd = {k.replace(".", "_"): t for k, t in sd.items()}  # module attribute names
    with tempfile.TemporaryDirectory(prefix="asyncsync-device-") as tmp:
        root = Path(tmp) / "root"
        module = _Params(sd).to(device)
        engine = TorchModule(module)
        ckpt = LocalCheckpoint(Path(tmp) / "ckpt")
        async with (
            Publisher(root, keyframe_interval=0) as pub,
            ReceiverAgent(root, engine, "device", use_inotify=False) as on_device,
            ReceiverAgent(root, ckpt, "checkpoint", use_inotify=False) as on_disk,
        ):
            await pub.seed(sd)
            await on_device.sync_once()
            await on_disk.sync_once()
            for v in range(1, versions + 1):
                cpu = {k: t.cpu() for k, t in sd.items()}
                step_state(cpu, v, 0.03, seed=11)
                for k, t in sd.items():
                    t.copy_(cpu[k])
                _sync(device)
                t0 = time.perf_counter()
                res = await pub.publish(sd)
                publishes.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                assert await on_device.sync_once() == res.version
                applies.append(time.perf_counter() - t0)
                assert await on_disk.sync_once() == res.version
                held = module.by_name()
                for k, t in cpu.items():
                    assert torch.equal(held[k].cpu(), t), f"v{v}: {k} differs on {device}"
                on_disk_sd = ckpt.load_state_dict()
                for k, t in cpu.items():
                    assert torch.equal(on_disk_sd[k], t), f"v{v}: {k} differs in the checkpoint"
    publishes.sort()
    applies.sort()
    return {
        "versions": versions,
        "publish_s": publishes[len(publishes) // 2],
        "apply_on_device_s": applies[len(applies) // 2],
        "bit_exact": True,
    }


def device_markdown(r: dict[str, Any]) -> str:
    def ms(x: float) -> str:
        return "n/a" if not math.isfinite(x) else f"{1000 * x:,.1f} ms"

    name = r.get("device_name", r["device"])
    return "\n".join(
        [
            f"### Accelerator paths on {name} ({r['model_bytes'] / 1e9:.2f} GB bf16, ~3 %)",
            "",
            "| check | result |",
            "|---|---|",
            "| diff, apply_patch, publish and both receivers | bit-exact with the CPU |",
            f"| one `torch.ne` pass | {ms(r['ne_pass_s'])} ({r['ne_pass_gb_per_s']:.0f} GB/s) |",
            f"| `changed_positions` | {ms(r['changed_positions_s'])} |",
            f"| `diff_tensors` (positions, values, xor) | {ms(r['diff_s'])} "
            f"({r['diff_gb_per_s']:.0f} GB/s) |",
            f"| publish (device tensors, {r['versions']} versions, median) | "
            f"{ms(r['publish_s'])} |",
            f"| apply to a TorchModule on the device (median) | {ms(r['apply_on_device_s'])} |",
            "",
        ]
    )
