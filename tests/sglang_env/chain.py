"""A trainer publishing versions of a tiny model's real state dict, for the real-server tests."""

from __future__ import annotations

import math
from pathlib import Path

import safetensors.torch
import torch

from asyncsync import Publisher
from asyncsync.format.acks import read_acks
from receiver.engines import LocalCheckpoint


def base_state(model_dir: Path) -> dict[str, torch.Tensor]:
    """The tiny model's own weights, HF-named (what a trainer's state_dict() holds)."""
    return dict(safetensors.torch.load_file(model_dir / "model.safetensors"))


class Trainer:
    """A real Publisher on ``root``, stepping a copy of ``state``.

    ``step(names)`` changes a few elements of each named tensor (by a seeded generator, so
    every run publishes the same bytes) and publishes the next version."""

    def __init__(self, root: Path, state: dict[str, torch.Tensor]):
        self.root = root
        self.sd = {k: v.clone() for k, v in state.items()}
        self.pub = Publisher(root, keyframe_interval=0)
        self.gen = torch.Generator().manual_seed(1234)

    async def open(self) -> int:
        await self.pub.open()
        return (await self.pub.seed(self.sd)).version

    async def close(self) -> None:
        await self.pub.close()

    def change(self, names: list[str], fraction: float = 0.05) -> None:
        """Adds noise to about ``fraction`` of the elements of each tensor in ``names``: that
        many distinct positions in expectation, drawn with replacement (``-n ln(1 - f)``
        draws), not a permutation of every element: on this 2-core host a permutation of a
        196 MiB model took seconds of CPU between versions, beside the server being measured."""
        for n in names:
            t = self.sd[n].clone()
            flat = t.view(-1)
            size = flat.numel()
            draws = max(1, round(-size * math.log1p(-min(fraction, 0.999))))
            idx = torch.randint(size, (draws,), generator=self.gen).unique()
            flat[idx] += torch.randn(idx.numel(), generator=self.gen, dtype=flat.dtype) * 0.05
            self.sd[n] = t

    async def step(self, names: list[str], *, keyframe: bool = False) -> int:
        self.change(names)
        return (await self.pub.publish(self.sd, keyframe=keyframe)).version

    async def wait_acked(self, version: int, engine_id: str, timeout: float = 120.0) -> None:
        await self.pub.wait_acked(version, engines=[engine_id], timeout=timeout)

    def ack_of(self, engine_id: str) -> int | None:
        rec = read_acks(self.root).get(engine_id)
        return None if rec is None else rec.version


def checkpoint_state(ckpt: Path) -> dict[str, torch.Tensor]:
    return LocalCheckpoint(ckpt).load_state_dict()
