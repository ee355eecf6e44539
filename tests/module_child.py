"""A receiver process whose TorchModule outlives it: the weights live in a shared file and
the version in a state directory (the child that ``tests/test_protocol_model.py`` kills).

``python -m tests.module_child ROOT ENGINE_ID STATE_DIR MEMFILE LAYOUT_JSON`` syncs once.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch

from receiver import ReceiverAgent
from receiver.engines.torch_module import TorchModule

Layout = list[tuple[str, str, list[int]]]  # name, dtype name, shape


def layout_of(sd: dict[str, torch.Tensor]) -> Layout:
    return [(k, str(t.dtype).removeprefix("torch."), list(t.shape)) for k, t in sd.items()]


class SharedHolder(torch.nn.Module):
    """A module whose buffers are views of one file mapped shared (``torch.from_file``): what
    a process writes into them is in the file, and still there after a ``kill -9``."""

    def __init__(self, path: Path, layout: Layout):
        super().__init__()
        sizes = [math.prod(s) * getattr(torch, dt).itemsize for _, dt, s in layout]
        total = max(sum(-(-n // 8) * 8 for n in sizes), 8)
        if not path.exists():
            with open(path, "wb") as f:
                f.truncate(total)
        mem = torch.from_file(str(path), shared=True, size=total, dtype=torch.uint8)
        off = 0
        for i, ((_, dt, shape), n) in enumerate(zip(layout, sizes, strict=True)):
            self.register_buffer(f"b{i}", mem[off : off + n].view(getattr(torch, dt)).view(shape))
            off += -(-n // 8) * 8
        self._names = [name for name, _, _ in layout]

    def state_dict(self, *a: Any, **k: Any) -> dict[str, Any]:  # type: ignore[override]
        return {n: getattr(self, f"b{i}") for i, n in enumerate(self._names)}


async def main(root: str, engine_id: str, state_dir: str, mem: str, layout: str) -> None:
    module = SharedHolder(Path(mem), [tuple(x) for x in json.loads(layout)])  # type: ignore[misc]
    engine = TorchModule(module, state_dir=state_dir)
    agent = ReceiverAgent(root, engine, engine_id, use_inotify=False, apply_group_bytes=2048)
    async with agent:
        print("ready", flush=True)  # the parent's delay starts here
        await agent.sync_once()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:6]))
