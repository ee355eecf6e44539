"""The in-place apply on an accelerator: bit-exact, its GB/s, its time for a parameter set.

    python -m tests.sglang_env.bench_device_apply --device cuda --gib 1 --density 0.03
    python -m tests.sglang_env.bench_device_apply --device cpu --gib 0.01   # what the tests run

A prepared script for a machine with a GPU (CI and these development machines have none; no
GPU was lent to the issue that wrote it, so its CUDA numbers are still to be measured). It
builds, on ``--device``, a model with SGLang's loader conventions (fused ``qkv_proj`` /
``gate_up_proj``, a padded vocab-parallel embedding tied to ``lm_head``: ``tests/sglang_toy.py``
scaled up) holding ``--gib`` GiB of ``--dtype`` parameters, and a new version in which
``--density`` of the elements of every tensor changed. Then:

1. **the plugin's path**: per tensor, positions and XOR values copied to the device once, then
   the tensor's sparse plan (its routing through ``load_weights`` probed once, before any
   version: :func:`receiver.plugins.scatter.make_plan`) XORs the values into the parameter
   views at their mapped positions (:func:`~receiver.plugins.scatter.apply_plan`), what
   :class:`receiver.plugins.inplace.InEngineLoader` runs in the pause; the parameters must then
   equal a model loaded from the new state dict, bit for bit;
2. **the routed dense XOR** (the plugin's path for a tensor without a plan): the dense XOR
   built on the device and routed through ``load_weights``
   (:func:`receiver.plugins.routing.route`), executed as XORs of integer views
   (:func:`~receiver.plugins.routing.apply_xor`); bit-exact the same way;
3. **the kernel alone**: ``flat.view(int)[positions] ^= values`` on the device for the same
   positions (the lower bound of a sparse apply, without routing);

and prints, as medians of ``--repeats`` (each timed between device synchronisations): the
time of each for the whole parameter set, the changed bytes per second and the parameter
bytes per second (what a dense XOR of every resident byte reads and writes), and the
host-to-device copy of positions and values. The parameter set is applied and undone
alternately (XOR is its own inverse), so every repeat starts from the same bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from asyncsync.codec import int_view
from receiver.plugins.routing import ModelParams, apply_xor, route
from receiver.plugins.scatter import Plan, apply_plan, make_plan
from tests import sglang_toy
from tests.sglang_toy import ToyForCausalLM


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn: Callable[[], Any], repeats: int) -> list[float]:
    fn()  # warm-up
    out = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - t0)
    return out


_DIMS = ("HIDDEN", "HEADS", "KV_HEADS", "HEAD_DIM", "INTER", "VOCAB", "LAYERS", "BF16")


@contextlib.contextmanager
def scaled_toy(gib: float, dtype: torch.dtype) -> Iterator[None]:
    """The toy model's dimensions grown so its parameters hold about ``gib`` GiB of
    ``dtype`` (restored afterwards: the tests share the module)."""
    saved = {k: getattr(sglang_toy, k) for k in _DIMS}
    per_layer = lambda h: 16 * h * h  # noqa: E731 - attention 4h^2 + mlp 3 * h * 4h
    h, layers = 64, 2
    while layers * per_layer(h * 2) * dtype.itemsize <= gib * 2**30:
        h *= 2
    dims = {"HIDDEN": h, "HEADS": 8, "KV_HEADS": 8, "HEAD_DIM": h // 8, "INTER": 4 * h,
            "VOCAB": 4 * h, "LAYERS": max(1, int(gib * 2**30 / (per_layer(h) * dtype.itemsize))),
            "BF16": dtype}  # fmt: skip
    try:
        for k, v in dims.items():
            setattr(sglang_toy, k, v)
        yield
    finally:
        for k, v in saved.items():
            setattr(sglang_toy, k, v)


def run(args: argparse.Namespace) -> dict[str, Any]:
    dtype = getattr(torch, args.dtype)
    with scaled_toy(args.gib, dtype):
        return _run(args, torch.device(args.device), dtype)


def _run(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    old = sglang_toy.hf_state(0)  # norms float32, the rest ``dtype``
    new: dict[str, torch.Tensor] = {}
    staged: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, t in old.items():
        flat = int_view(t).clone()
        k = max(1, int(flat.numel() * args.density))
        pos = torch.randperm(flat.numel(), generator=g)[:k].sort().values
        x = torch.randint(1, 2**15 - 1, (k,), generator=g).to(flat.dtype)
        flat[pos] ^= x
        new[name] = flat.view(t.dtype).view(t.shape)
        staged[name] = (pos.to(torch.int32), x)
    new["lm_head.weight"] = new["model.embed_tokens.weight"].clone()
    staged["lm_head.weight"] = staged["model.embed_tokens.weight"]

    model = ToyForCausalLM(0, 1).to(device)
    model.load_weights((n, t.to(device)) for n, t in old.items())
    ref = ToyForCausalLM(0, 1).to(device)
    ref.load_weights((n, t.to(device)) for n, t in new.items())
    params = ModelParams(model)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    changed = sum(int(p.numel()) for p, _ in staged.values())
    elem = dtype.itemsize

    pinned = {n: (p.pin_memory(), x.pin_memory()) if device.type == "cuda" else (p, x)
              for n, (p, x) in staged.items()}  # fmt: skip
    on_dev: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def h2d() -> None:
        for n, (p, x) in pinned.items():
            on_dev[n] = (p.to(device, non_blocking=True), x.to(device, non_blocking=True))

    def dense(name: str) -> torch.Tensor:
        t = old[name]
        p, x = on_dev[name]
        flat = torch.zeros(t.numel(), dtype=x.dtype, device=device)
        flat[p.long()] = x
        return flat.view(t.dtype).view(t.shape)

    def dense_path() -> None:
        for name in old:
            r = route(model.load_weights, name, dense(name), params)
            assert r.ok, r.problem
            apply_xor(r)

    plans: dict[str, Plan] = {}
    for name, t in old.items():  # probed once, as the plugin does before its first apply
        routed = torch.empty(t.shape, dtype=t.dtype, device=device)
        r = route(model.load_weights, name, routed, params)
        plan = make_plan(r, routed) if r.ok and not r.altered else None
        if plan is None:
            raise SystemExit(f"{name}: no sparse plan ({r.problem or 'a write takes a copy'})")
        plans[name] = plan

    def plugin_path() -> None:
        for name, plan in plans.items():
            apply_plan(plan, *on_dev[name])

    flats = {n: int_view(p.data) for n, p in model.named_parameters()}

    def kernel_alone() -> None:  # the same number of positions, into the fused parameters
        for name, (p, x) in on_dev.items():
            target = flats[_param_of(name)]
            idx = p.long() % target.numel()
            target[idx] ^= x

    h2d_t = timed(device, h2d, args.repeats)
    exact = {}
    for label, path in (("plugin", plugin_path), ("dense", dense_path)):
        path()  # v0 -> v1
        pairs = zip(model.state_dict().values(), ref.state_dict().values(), strict=True)
        exact[label] = all(torch.equal(int_view(a), int_view(b)) for a, b in pairs)
        path()  # back to v0
    plug_t = timed(device, plugin_path, 2 * (args.repeats // 2) or 2)
    dense_t = timed(device, dense_path, 2 * (args.repeats // 2) or 2)
    kern_t = timed(device, kernel_alone, 2 * (args.repeats // 2) or 2)
    med = statistics.median
    result = {
        "device": str(device) if device.type != "cuda" else torch.cuda.get_device_name(device),
        "dtype": args.dtype,
        "parameter_bytes": nbytes,
        "tensors": len(old),
        "density": args.density,
        "changed_elements": changed,
        "bit_exact": all(exact.values()),
        "bit_exact_per_path": exact,
        "h2d_positions_values_s": med(h2d_t),
        "plugin_path_s": med(plug_t),
        "plugin_path_spread_s": [min(plug_t), max(plug_t)],
        "plugin_param_GBps": nbytes / med(plug_t) / 1e9,
        "plugin_changed_GBps": changed * elem / med(plug_t) / 1e9,
        "dense_path_s": med(dense_t),
        "dense_path_spread_s": [min(dense_t), max(dense_t)],
        "kernel_alone_s": med(kern_t),
        "kernel_changed_GBps": changed * elem / med(kern_t) / 1e9,
    }
    if not all(exact.values()):
        raise SystemExit(f"NOT bit-exact after the in-place apply: {json.dumps(result)}")
    return result


def _param_of(hf_name: str) -> str:
    for param, shard, _ in ToyForCausalLM.stacked_params_mapping:
        if shard in hf_name:
            return hf_name.replace(shard, param)
    return "model.embed_tokens.weight" if hf_name == "lm_head.weight" else hf_name


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--density", type=float, default=0.03)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--repeats", type=int, default=6)
    args = p.parse_args(argv)
    result = run(args)
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
