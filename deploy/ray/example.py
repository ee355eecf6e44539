"""Trainer ranks and receivers on a Ray cluster: publish versions, wait for them, verify them.

On a cluster (see deploy/ray/cluster.yaml: engine nodes offer the ``asyncsync_engine``
resource, one unit per engine; /shared is the same shared filesystem on every node)::

    ray up deploy/ray/cluster.yaml
    ray submit deploy/ray/cluster.yaml deploy/ray/example.py -- \\
        --address auto --root /shared/weights/example --checkpoint-dir /local/asyncsync

On one machine (a throwaway local Ray cluster, root and checkpoints in a temporary directory)::

    python deploy/ray/example.py --local --versions 3 --elements 200000

Each trainer rank is an actor that keeps its own toy model (asyncsync.ops.workload, an Adam-like
step that changes ~2 % of the bf16 elements) and publishes its share of the tensors; rank 0
commits each version. One receiver actor per engine keeps a local checkpoint on its node. The
example waits for every engine to hold each version, then checks each checkpoint bit for bit
on its node and prints one JSON line: ``{"versions": {...}, "verified": {...}, "ok": true}``.
Exit status 0 when every checkpoint holds the last version bit for bit.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from asyncsync import SyncConfig
from asyncsync.ops.workload import Workload
from asyncsync.training.ray import (
    DEFAULT_RESOURCE,
    ReceiverSpec,
    TrainerActor,
    engine_nodes,
    import_ray,
    start_receivers,
    start_trainers,
)

logger = logging.getLogger("asyncsync.example")


class ToyTrainer(TrainerActor):
    """A trainer rank that keeps its model in the actor and publishes its share of it."""

    def __init__(self, config: SyncConfig, *, elements: int, **kw: Any) -> None:
        super().__init__(config, **kw)
        self.workload = Workload.for_elements(elements, seed=0)  # the same model on every rank

    def train_step(self) -> None:
        self.workload.step()

    def state_dict(self) -> Mapping[str, torch.Tensor]:
        sd = self.workload.state_dict()
        names = sorted(sd)[self.rank :: self.world_size]  # this rank's tensors
        return {k: sd[k] for k in names}


def engine_units(resource: str) -> int:
    """How many engines the cluster offers: the sum of ``resource`` over alive nodes."""
    ray = import_ray()
    return int(sum(n["Resources"].get(resource, 0) for n in ray.nodes() if n.get("Alive")))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--address", help="a running Ray cluster (auto, or ray://head:10001)")
    where.add_argument("--local", action="store_true", help="start a throwaway local cluster")
    p.add_argument("--root", help="the shared root (default with --local: a temporary dir)")
    p.add_argument("--checkpoint-dir", help="node-local directory for the engines' checkpoints")
    p.add_argument("--engines", type=int, default=2, help="receivers (default 2)")
    p.add_argument("--ranks", type=int, default=2, help="trainer ranks (default 2)")
    p.add_argument("--versions", type=int, default=4, help="versions after the seed")
    p.add_argument("--elements", type=int, default=1_000_000, help="model size (elements)")
    p.add_argument("--placement", choices=("resource", "node"), default="resource")
    p.add_argument("--resource", default=DEFAULT_RESOURCE, help="engine nodes' custom resource")
    p.add_argument("--sglang-url", help="each engine node's SGLang server (default: none)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait per version")
    args = p.parse_args(argv)
    if not args.local and not (args.root and args.checkpoint_dir):
        p.error("--address needs --root (shared by all nodes) and --checkpoint-dir")
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start everything, publish ``args.versions`` versions after a seed, verify, stop."""
    root = Path(args.root)
    nodes: list[str | None] = [None] * args.engines  # placement "resource": Ray decides
    if args.placement == "node":  # one engine per node (those offering the resource)
        nodes = list(engine_nodes(args.resource)[: args.engines])
        if len(nodes) < args.engines:
            raise SystemExit(f"--engines {args.engines}: only {len(nodes)} engine node(s)")
    specs = [
        ReceiverSpec(
            f"engine{i}",
            f"{args.checkpoint_dir}/engine{i}",
            engine="sglang" if args.sglang_url else "checkpoint",
            url=args.sglang_url,
            node_id=node,
            poll_interval=0.1,
            force_polling=not args.local,  # network filesystems: inotify misses remote writes
        )
        for i, node in enumerate(nodes)
    ]
    ids = [s.engine_id for s in specs]
    config = SyncConfig(root=root, ack_engines=ids, max_staleness=1, ack_timeout=args.timeout)
    t0 = time.monotonic()
    fleet = start_receivers(root, specs, placement=args.placement, resource=args.resource)
    try:
        with start_trainers(
            config,
            world_size=args.ranks,
            actor_cls=ToyTrainer,
            num_cpus=0 if args.local else 1,
            elements=args.elements,
        ) as trainers:
            for step in range(args.versions + 1):
                if step:
                    trainers.call("train_step")
                res = trainers.publish()[0]  # every rank reports the version it committed
                logger.info(
                    "v%d %s: %d changed of %d elements, %d wire bytes, %.2fs",
                    res["version"],
                    res["kind"],
                    res["changed"],
                    res["total"],
                    res["wire_bytes"],
                    res["seconds"].get("total", 0.0),
                )
            last = res["version"]
            versions = fleet.wait_for(last, timeout=args.timeout)
        verified = fleet.verify()
    finally:
        fleet.stop()
    ok = all(v["version"] == last and not v["mismatched"] for v in verified.values())
    return {
        "last": last,
        "versions": versions,
        "verified": verified,
        "seconds": round(time.monotonic() - t0, 2),
        "ok": ok,
    }


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    ray = import_ray()
    scratch = None
    if args.local:
        scratch = Path(tempfile.mkdtemp(prefix="asyncsync-ray-"))
        args.root = args.root or str(scratch / "root")
        args.checkpoint_dir = args.checkpoint_dir or str(scratch / "ckpt")
        ray.init(
            num_cpus=2,
            resources={args.resource: args.engines},
            include_dashboard=False,
            log_to_driver=False,
        )
    else:
        ray.init(address=args.address)
        offered = engine_units(args.resource)
        if args.placement == "resource" and offered < args.engines:
            print(f"the cluster offers {offered} {args.resource} unit(s), fewer than --engines")
            return 2
    try:
        summary = run(args)
    finally:
        ray.shutdown()
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    print(json.dumps(summary, sort_keys=True))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
