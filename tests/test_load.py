"""Load: 8 receivers follow 200 versions on one root; nothing lost, nothing out of order.

Half the receivers use inotify and half poll; every 25 versions the trainer waits for all acks,
in between the receivers fall behind and catch up through the chain.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from asyncsync import Publisher
from asyncsync.format import Manifest
from receiver import ReceiverAgent
from receiver.engines.torch_module import TorchModule
from tests.conftest import same_bytes

ENGINES = 8
VERSIONS = 200


class Recording(TorchModule):
    """A TorchModule that records every version it commits, in order."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__(module)
        self.history: list[int] = []

    async def commit(self) -> str:
        fp = await super().commit()
        assert self.state.version is not None
        self.history.append(self.state.version)
        return fp

    async def bump(self, manifest: Manifest) -> None:
        await super().bump(manifest)
        self.history.append(manifest.version)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64)).to(torch.bfloat16)


@pytest.mark.slow
@pytest.mark.heavy
async def test_eight_receivers_two_hundred_versions(tmp_path: Path) -> None:
    trainer = model()
    engines = [Recording(model()) for _ in range(ENGINES)]
    agents = [
        ReceiverAgent(tmp_path, e, f"engine-{i}", poll_interval=0.05, use_inotify=(i % 2 == 0))
        for i, e in enumerate(engines)
    ]
    stop = asyncio.Event()
    acked_every: list[int] = []
    async with asyncio.TaskGroup() as tg:
        async with Publisher(tmp_path, keyframe_interval=50) as pub:
            await pub.seed(trainer.state_dict())
            for a in agents:
                tg.create_task(a.run(stop=stop))
            names = [a.engine_id for a in agents]
            for v in range(1, VERSIONS + 1):
                with torch.no_grad():
                    if v % 17:  # every 17th version is a zero diff
                        for p in trainer.parameters():
                            p.add_(torch.randn_like(p) * 0.01)
                r = await pub.publish(trainer.state_dict())
                assert r.version == v
                if v % 25 == 0:  # let the receivers fall behind, then catch up
                    acks = await pub.wait_acked(v, engines=names, timeout=60)
                    acked_every.append(min(a.version for a in acks.values()))
            await pub.wait_acked(VERSIONS, engines=names, timeout=60)
        stop.set()
    assert acked_every == list(range(25, VERSIONS + 1, 25))
    final = trainer.state_dict()
    for e, a in zip(engines, agents, strict=True):
        # every version applied exactly once, in order: none lost, none out of order
        assert e.history == list(range(VERSIONS + 1)), (a.engine_id, e.history[:10])
        held = e.module.state_dict()
        assert all(same_bytes(held[k], final[k]) for k in final)
        assert a.status().failures == 0
        await a.close()
