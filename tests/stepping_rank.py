"""One rank of a trainer that keeps stepping while it publishes, run in its own process by
tests/test_multirank_stepping.py.

Rank ``r`` owns the tensors ``rank{r}.*`` (every dtype the format carries, 0-d and
non-contiguous ones). It seeds step 0, then publishes steps ``1..steps`` as keyframes
(``publish(keyframe=True, step=s)``). Each publish's tensors change while it runs, as an
optimizer step in another thread changes them: once the diff stage has read a bucket and before
its encode stage serialises the bucket's full shard, every tensor of the state dict gets new
bytes. What each call returned goes to ``out/rank{r}.json``: the version, or the error; a
failed step is retried up to ``retries`` times, with the same tensors changed the same way.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import torch

from asyncsync import Publisher, PublishError
from asyncsync.codec import raw_view
from asyncsync.publish import publisher as publisher_mod
from asyncsync.publish.rendezvous import FileRendezvous
from tests.conftest import mutate
from tests.test_dtypes import every_dtype_state


def state(step: int, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s tensors at ``step`` (what a version of that step must hold)."""
    sd = {f"rank{rank}.{k}": v for k, v in every_dtype_state(100 + rank).items()}
    for s in range(1, step + 1):
        sd = mutate(sd, 0.05, seed=1000 * rank + s)
    return sd


def scramble(sd: dict[str, torch.Tensor]) -> None:
    """Every element of every tensor of ``sd`` given new bytes, in place."""
    for t in sd.values():
        raw_view(t).bitwise_xor_(1)  # (a bool's bytes: 0/1 -> 1/0)


def main(cfg: dict[str, Any]) -> None:
    asyncio.run(_run(cfg))


async def _run(cfg: dict[str, Any]) -> None:
    rank, world, root = cfg["rank"], cfg["world"], Path(cfg["root"])
    coord = FileRendezvous(root, rank, world, timeout=30.0)
    live: dict[str, torch.Tensor] = {}
    armed = [False]
    real_encode = publisher_mod.encode_bucket

    def encode_after_a_step(*a: Any, **k: Any) -> Any:
        if armed[0]:
            armed[0] = False
            scramble(live)
        return real_encode(*a, **k)

    publisher_mod.encode_bucket = encode_after_a_step  # type: ignore[assignment]
    log: list[dict[str, Any]] = []
    async with Publisher(root, coordinator=coord, bucket_bytes=1 << 20, keyframe_interval=0) as pub:
        await pub.seed(state(0, rank), step=0)
        for step in range(1, cfg["steps"] + 1):
            for _ in range(cfg["retries"] + 1):
                live.clear()
                live.update(state(step, rank))
                armed[0] = True
                try:
                    res = await pub.publish(live, keyframe=True, step=step)
                except PublishError as exc:
                    log.append({"step": step, "error": str(exc)})
                    continue
                log.append({"step": step, "version": res.version, "stale": pub.stale})
                break
    (Path(cfg["out"]) / f"rank{rank}.json").write_text(json.dumps(log))
