"""The engine side of the README, whole: keep a local checkpoint at the newest version.

    python examples/engine_receiver.py ROOT CHECKPOINT_DIR [--engine-id gpu0] [--once]

The same as ``asyncsync-receiver --root ROOT --engine-id gpu0 --checkpoint CHECKPOINT_DIR``;
Ctrl-C stops it after the version in flight.
"""

import argparse
import asyncio
import contextlib

from receiver import ReceiverAgent
from receiver.engines import LocalCheckpoint


async def main(root: str, checkpoint: str, engine_id: str, once: bool) -> None:
    async with ReceiverAgent(root, LocalCheckpoint(checkpoint), engine_id) as agent:
        if once:
            print(f"{engine_id} holds version {await agent.sync_once()}")
        else:
            await agent.run()  # until Ctrl-C


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="Keep a local checkpoint at the newest version.")
    ap.add_argument("root", help="the shared root the trainer publishes into")
    ap.add_argument("checkpoint", help="this engine's checkpoint directory")
    ap.add_argument("--engine-id", default="gpu0", help="this engine's name in acks")
    ap.add_argument("--once", action="store_true", help="apply what is committed, then exit")
    args = ap.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main(args.root, args.checkpoint, args.engine_id, args.once))
