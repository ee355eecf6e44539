"""The trainer side of the README, whole: publish a model's weights after each training step.

    python examples/trainer_loop.py ROOT [--steps 5] [--engine gpu0 ...]

With ``--engine``, each version waits until those receivers acknowledge it (run
examples/engine_receiver.py beside it). The model and its "training" are stand-ins: a small bf16 MLP
whose step changes about 2 % of the weights, as an optimizer step does.
"""

import argparse
import asyncio

import torch

from asyncsync import Publisher, RetentionPolicy


def train_step(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_((torch.rand_like(p, dtype=torch.float32) < 0.02).to(p.dtype) * 0.01)


async def main(root: str, steps: int, engines: list[str]) -> None:
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 64)
    )
    model = model.to(torch.bfloat16)
    policy = RetentionPolicy(keep_versions=10)
    async with Publisher(root, keyframe_interval=20, retention=policy) as pub:
        await pub.seed(model.state_dict())  # version 0: a full keyframe
        # or: await pub.seed("/models/my-hf-checkpoint")  (registered, not rewritten)
        for _ in range(steps):
            train_step(model)
            res = await pub.publish(model.state_dict())
            print(f"v{res.version}: {res.kind}, {res.changed} changed, {res.wire_bytes} bytes")
            if engines:
                await pub.wait_acked(res.version, engines=engines, timeout=60)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="Publish a model's weights after each step.")
    ap.add_argument("root", help="the shared root (created if missing)")
    ap.add_argument("--steps", type=int, default=5, help="training steps (default 5)")
    ap.add_argument("--engine", action="append", default=[], help="wait for this engine's ack")
    args = ap.parse_args()
    asyncio.run(main(args.root, args.steps, args.engine))
