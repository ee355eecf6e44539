"""A vLLM server (re)started while its receiver was killed halfway through patching the
checkpoint in place (the real vLLM 0.32, CPU build, tiny float32 Llama).

The receiver patches the host-local checkpoint that vLLM loads at start (``--model``). A
receiver killed between two tensors of a version leaves the directory half patched (``state.json``
says ``applying``; its undo journal is there) until it is restarted and undoes it. vLLM knows
nothing of that: started on the directory (its supervisor restarting it, a node reboot), it
loaded tensor A of v1 beside tensor B of v0, a model that no version ever was, and served it
under its launch label until a receiver came back.

Constructed deterministically: a child receiver whose engine patches the first tensor of v1 and
exits (``os._exit``) before the second; then vLLM is started on that directory. The asyncsync
vLLM plugin now holds vLLM's load until the checkpoint is clean (the restarted receiver undoes
the half-applied version) and loads again if the checkpoint changed while it read it; the
server then comes up at one version and the receiver brings it to v1.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from asyncsync.format.checksum import checksum_tensor
from receiver.plugins.vllm_loader import ENV_PLAIN, WAIT_LINE
from tests.sglang_env.chain import Trainer, base_state
from tests.sglang_env.server import Receiver, http, wait_for
from tests.test_vllm_real import EID, KEY, receiver_args, seed_checkpoint
from tests.vllm_env import build
from tests.vllm_env.fixtures import require_env
from tests.vllm_env.server import VLLMServer

pytestmark = [
    pytest.mark.vllm_real,
    pytest.mark.heavy,
    pytest.mark.asyncio,
    pytest.mark.timeout(1200),
]

A = "model.layers.0.mlp.down_proj.weight"
B = "model.layers.1.mlp.down_proj.weight"

#: a receiver whose engine patches the first tensor of the version, then dies (no commit)
KILLED_MIDWAY = textwrap.dedent(
    """
    import asyncio, os, sys
    from receiver import ReceiverAgent
    from receiver.engines import LocalCheckpoint

    class Killed(LocalCheckpoint):
        async def apply(self, updates):
            mine = [u for u in updates if u.entry.name == sys.argv[3]]
            await super().apply(mine)
            if mine:
                os._exit(9)

    async def main():
        agent = ReceiverAgent(sys.argv[1], Killed(sys.argv[2]), "killed", use_inotify=False)
        await agent.open()
        await agent.sync_once()

    asyncio.run(main())
    """
)


def served(server: VLLMServer, sd: dict[str, torch.Tensor]) -> dict[str, str]:
    spec = {
        "algorithm": "xxh3-128",
        "tensors": {
            n: {"shape": list(t.shape), "dtype": "float32", "layout": None} for n, t in sd.items()
        },
    }
    [got] = server.rpc("asyncsync_served_checksums", json.dumps(spec))
    return {n: got["checksums"][n] for n in (A, B)}


def health(server: VLLMServer) -> int | None:
    """``GET /health``'s status; None while nothing listens."""
    try:
        return http(server.url + "/health", timeout=30)[0]
    except OSError:
        return None


async def test_vllm_started_on_a_half_patched_checkpoint_never_serves_a_mix(
    tmp_path: Path,
) -> None:
    env = require_env()
    model = build.model_dir(env)
    trainer = Trainer(tmp_path / "root", base_state(model))
    await trainer.open()
    try:
        seed_checkpoint(tmp_path, model)
        v0 = {n: checksum_tensor(trainer.sd[n]) for n in (A, B)}
        await trainer.step([A, B])  # v1 changes both
        v1 = {n: checksum_tensor(trainer.sd[n]) for n in (A, B)}
        ckpt = tmp_path / "ckpt"
        out = subprocess.run(
            [sys.executable, "-c", KILLED_MIDWAY, str(tmp_path / "root"), str(ckpt), A],
            capture_output=True,
            text=True,
            check=False,
        )
        assert out.returncode == 9, out.stderr[-3000:]
        state = json.loads((ckpt / ".asyncsync" / "state.json").read_text())
        assert state["status"] == "applying", state  # A patched, B not: no version's bytes

        server = VLLMServer(env, ckpt, tmp_path / "vllm.log", api_key=KEY,
                            extra_env={ENV_PLAIN: "1"})  # fmt: skip
        receiver = Receiver(tmp_path / "receiver.log", receiver_args(tmp_path, server.url))
        try:
            server.start_healthy(lambda: None)  # started, not waited for
            healthy = wait_for(
                "vLLM to wait for the checkpoint, or to serve",
                lambda: (
                    ("waits" if WAIT_LINE in server.text() else None)
                    or (health(server) == 200 and "serves")
                ),
                timeout=600,
            )
            if healthy == "serves":
                got = served(server, trainer.sd)
                pytest.fail(f"vLLM serves a checkpoint mid-apply: {got}, v0 {v0}, v1 {v1}")
            assert server.alive and health(server) != 200
            receiver.start()  # undoes the half-applied v1, then applies v1 and reloads vLLM
            server.wait_healthy()
            await trainer.wait_acked(1, EID, timeout=600)
            assert served(server, trainer.sd) == v1
            assert server.weight_version() == "1"
        finally:
            receiver.stop()
            server.stop()
    finally:
        await trainer.close()
