"""Tied weights (one storage under two names) on the engine side: a TorchModule whose module
ties ``lm_head`` to the embedding, fed by a trainer that unties them (attack-58)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncsync import ChecksumMismatch, Publisher
from receiver import ReceiverAgent
from receiver.engines import TorchModule
from tests.test_publish_misuse import raw_bytes


class TiedLM(torch.nn.Module):
    """An embedding and an ``lm_head`` sharing one weight (HF's ``tie_word_embeddings``)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(40, 8)
        self.lm_head = torch.nn.Linear(8, 40, bias=False)
        self.lm_head.weight = self.embed.weight
        self.norm = torch.nn.Parameter(torch.ones(8))


@pytest.mark.parametrize("which", ["lm_head.weight", "embed.weight"])
async def test_a_version_a_tied_module_cannot_hold_is_never_acked(
    tmp_path: Path, which: str
) -> None:
    """The trainer unties its ``lm_head`` and changes only one of the two names: the engine
    patched the shared storage for that name, and kept the other name's checksum as it was
    (its tensor had no change in the version), so it committed and acknowledged a version
    whose other tensor it no longer held: ``embed.weight`` silently held ``lm_head``'s bytes.
    A tensor whose memory a patch of the version wrote is hashed at commit: the version is
    refused and the engine stays at the one before, bytes intact."""
    module, root = TiedLM(), tmp_path / "root"
    e = torch.randn(40, 8)
    sd = {"embed.weight": e, "lm_head.weight": e, "norm": torch.ones(8)}
    async with Publisher(root) as pub, ReceiverAgent(root, TorchModule(module), "e0") as agent:
        await pub.seed(sd)
        assert await agent.sync_once() == 0
        untied = {**sd, which: e + 1}  # the other name keeps v0's bytes
        await pub.publish(untied)
        with pytest.raises(ChecksumMismatch):
            await agent.sync_once()
        assert agent.engine.state.version == 0
        for k, v in sd.items():
            assert torch.equal(raw_bytes(module.state_dict()[k]), raw_bytes(v)), k
