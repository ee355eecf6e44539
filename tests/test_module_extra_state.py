"""A live module whose state dict holds more than tensors: a layer's extra state
(``get_extra_state``, as TransformerEngine's layers keep their FP8 metadata), which no version
carries (the publisher refuses a state dict entry that is not a tensor) (attack-89)."""

from __future__ import annotations

from pathlib import Path

import torch

from asyncsync import Publisher
from receiver import ReceiverAgent
from receiver.engines.torch_module import TorchModule
from tests.conftest import assert_holds


class _WithExtraState(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 8)

    def get_extra_state(self) -> dict[str, int]:
        return {"amax_history_len": 16}

    def set_extra_state(self, state: object) -> None:
        pass


async def test_a_module_with_extra_state_takes_its_tensors_versions(tmp_path: Path) -> None:
    """Before: ``AttributeError: 'dict' object has no attribute 'detach'`` out of the first
    sync, an error of no asyncsync type."""
    trainer, served = _WithExtraState(), _WithExtraState()
    weights = {k: v.detach() for k, v in trainer.lin.state_dict().items()}
    v0 = {f"lin.{k}": v.clone() for k, v in weights.items()}
    async with Publisher(tmp_path / "root", keyframe_interval=0) as pub:
        await pub.seed(v0)
        async with ReceiverAgent(tmp_path / "root", TorchModule(served), "m1") as a:
            assert await a.sync_once() == 0
            v1 = {k: v + 1 for k, v in v0.items()}
            await pub.publish(v1)
            assert await a.sync_once() == 1
    assert_holds({k: v for k, v in served.state_dict().items() if k != "_extra_state"}, v1)
