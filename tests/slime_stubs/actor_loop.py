"""One trainer rank running slime's actor loop against asyncsync (a subprocess per rank).

    python -m tests.slime_stubs.actor_loop CONFIG.json RANK

CONFIG: ``world``, ``init`` (a file for ``init_process_group``), ``gen``, ``steps``, ``args``
(slime's namespace values), ``checkpoints`` (receiver checkpoints rank 0 compares with the
expected HF state after every update), ``out`` (a JSON file per rank). What slime's actor does:
build the updater through the factory, set ``weight_version`` (gen2), connect fake engine
handles, then ``update_weights()`` + ``pop_metrics()`` per step. ``fail_check`` = [rank, step]:
that rank's check of its engines raises at that step (a receiver died), and every rank goes on
with the next step after a failed ``update_weights`` (recorded in ``errors``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import safetensors.torch
import torch
import torch.distributed as dist

from tests.slime_stubs import megatron, rules


class FakeEngineHandle:
    """Stands in for a slime SGLangEngine Ray actor handle (sidecar mode never calls it)."""

    def __init__(self, i: int) -> None:
        self.i = i


def checkpoint_matches(directory: Path, want: dict[str, torch.Tensor]) -> list[str]:
    got: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        got.update(safetensors.torch.load_file(f))
    bad = sorted(set(want) ^ set(got))
    bad += [
        k
        for k in want
        if k in got and not torch.equal(got[k].view(torch.int16), want[k].view(torch.int16))
    ]
    return bad


def main() -> int:
    from asyncsync.training.slime import create_weight_updater

    cfg = json.loads(Path(sys.argv[1]).read_text())
    rank, world = int(sys.argv[2]), int(cfg["world"])
    dist.init_process_group(
        "gloo", init_method=f"file://{cfg['init']}", rank=rank, world_size=world
    )
    args = argparse.Namespace(**vars(rules.namespace(cfg["gen"], **cfg["args"])))
    step = 0
    updater = create_weight_updater(
        args,
        [torch.nn.Linear(1, 1)],
        weights_getter=lambda: megatron.shards(step, rank, world),
        model_name="llama",
        quantization_config=None,
    )
    report: dict = {
        "rank": rank,
        "pid": os.getpid(),
        "versions": [],
        "mismatched": [],
        "metrics": [],
        "errors": [],
    }
    fail = cfg.get("fail_check")
    if fail is not None and fail[0] == rank:
        real = updater.engine_link.check

        def check() -> None:
            if step == fail[1]:
                raise RuntimeError(f"receiver died at step {step} (injected)")
            real()

        updater.engine_link.check = check  # type: ignore[method-assign]
    try:
        updater.connect_rollout_engines(
            [FakeEngineHandle(i) for i in range(2)], None, [1, 1], [0, 1]
        )
        for step in range(cfg["steps"]):
            if fail is not None:
                try:
                    updater.update_weights()
                except Exception as exc:
                    report["errors"].append([step, f"{type(exc).__name__}: {exc}"])
                    continue
            else:
                updater.update_weights()
            report["versions"].append(updater.weight_version)
            report["metrics"].append(updater.pop_metrics())
            if rank == 0:
                want = megatron.hf_state(step)
                for c in cfg["checkpoints"]:
                    report["mismatched"].append(checkpoint_matches(Path(c), want))
    finally:
        updater.close()
        Path(cfg["out"].format(rank=rank)).write_text(json.dumps(report))
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
