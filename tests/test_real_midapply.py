"""An inference server (re)started while its receiver was killed halfway through patching the
checkpoint it loads at start (the real vLLM 0.32 and SGLang 0.5.23, CPU, tiny float32 Llama).

The receiver patches the host-local checkpoint in place. vLLM loads that directory at start
(``--model``), and so does an SGLang started with ``--model-path`` on it. A receiver killed
between two tensors of a version leaves the directory half patched (``state.json`` says
``applying``; its undo journal is there) until it is restarted and undoes it. The servers'
loaders know nothing of that: started on the directory (a supervisor restarting it, a node
reboot), vLLM loaded tensor A of v1 beside tensor B of v0, a model that no version ever was,
and served it under its launch label until a receiver came back.

Constructed deterministically: a child receiver whose engine patches the first tensor of v1 and
exits (``os._exit``) before the second; then the server is started on that directory. The
asyncsync plugins now hold the server's load until the checkpoint is clean (the restarted
receiver undoes the half-applied version) and load again if the checkpoint changed while it
was read (receiver/plugins/clean_load.py); the server comes up at one version and the
receiver brings it to v1.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from asyncsync.format.checksum import checksum_tensor
from receiver.plugins.clean_load import WAIT_LINE
from receiver.plugins.vllm_loader import ENV_PLAIN
from tests import test_sglang_real as sg
from tests import test_vllm_real as vl
from tests.sglang_env import build as sglang_build
from tests.sglang_env import fixtures as sglang_fixtures
from tests.sglang_env.chain import Trainer, base_state
from tests.sglang_env.server import Process, Receiver, SGLangServer, http, wait_for
from tests.vllm_env import build as vllm_build
from tests.vllm_env import fixtures as vllm_fixtures
from tests.vllm_env.server import VLLMServer

pytestmark = [pytest.mark.heavy, pytest.mark.asyncio, pytest.mark.timeout(1200)]

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


@dataclass
class Case:
    trainer: Trainer
    ckpt: Path
    v0: dict[str, str]
    v1: dict[str, str]


async def half_patched(d: Path, model: Path) -> Case:
    """v0 seeded into ``d/ckpt`` (with the model's side files), v1 published, and a receiver
    killed after patching A of v1, before B."""
    trainer = Trainer(d / "root", base_state(model))
    await trainer.open()
    vl.seed_checkpoint(d, model)
    v0 = {n: checksum_tensor(trainer.sd[n]) for n in (A, B)}
    await trainer.step([A, B])  # v1 changes both
    v1 = {n: checksum_tensor(trainer.sd[n]) for n in (A, B)}
    ckpt = d / "ckpt"
    out = subprocess.run(
        [sys.executable, "-c", KILLED_MIDWAY, str(d / "root"), str(ckpt), A],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 9, out.stderr[-3000:]
    state = json.loads((ckpt / ".asyncsync" / "state.json").read_text())
    assert state["status"] == "applying", state  # A patched, B not: no version's bytes
    return Case(trainer, ckpt, v0, v1)


def health(server: Process, url: str) -> int | None:
    """``GET /health``'s status; None while nothing listens."""
    try:
        return http(url + "/health", timeout=30)[0]
    except OSError:
        return None


async def never_a_mix(
    case: Case,
    server: Process,
    url: str,
    receiver: Receiver,
    served: Callable[[], dict[str, str]],
    label: Callable[[], str | None],
    engine_id: str,
) -> None:
    """Start ``server`` on the half-patched checkpoint: it must wait for it, not serve; then
    the receiver, after which it serves v1 whole."""
    try:
        server.start_healthy(lambda: None)  # started, not waited for
        seen = wait_for(
            "the server to wait for the checkpoint, or to serve",
            lambda: (
                ("waits" if WAIT_LINE in server.text() else None)
                or (health(server, url) == 200 and "serves")
            ),
            timeout=600,
        )
        if seen == "serves":
            pytest.fail(
                f"the server serves a checkpoint mid-apply: {served()}, v0 {case.v0}, v1 {case.v1}"
            )
        assert server.alive and health(server, url) != 200
        receiver.start()  # undoes the half-applied v1, then applies v1 and reloads the server
        server.wait_ok(url + "/health", "the server", 600)
        await case.trainer.wait_acked(1, engine_id, timeout=600)
        assert served() == case.v1
        assert label() == "1"
    finally:
        receiver.stop()
        server.stop()
        await case.trainer.close()


@pytest.mark.vllm_real
async def test_vllm_started_on_a_half_patched_checkpoint_never_serves_a_mix(
    tmp_path: Path,
) -> None:
    env = vllm_fixtures.require_env()
    case = await half_patched(tmp_path, vllm_build.model_dir(env))
    server = VLLMServer(env, case.ckpt, tmp_path / "vllm.log", api_key=vl.KEY,
                        extra_env={ENV_PLAIN: "1"})  # fmt: skip
    receiver = Receiver(tmp_path / "receiver.log", vl.receiver_args(tmp_path, server.url))

    def served() -> dict[str, str]:
        spec = {
            "algorithm": "xxh3-128",
            "tensors": {
                n: {"shape": list(t.shape), "dtype": "float32", "layout": None}
                for n, t in case.trainer.sd.items()
            },
        }
        [got] = server.rpc("asyncsync_served_checksums", json.dumps(spec))
        return {n: got["checksums"][n] for n in (A, B)}

    await never_a_mix(case, server, server.url, receiver, served, server.weight_version, vl.EID)


@pytest.mark.sglang_real
async def test_sglang_started_on_a_half_patched_checkpoint_never_serves_a_mix(
    tmp_path: Path,
) -> None:
    env = sglang_fixtures.require_env()
    case = await half_patched(tmp_path, sglang_build.model_dir(env, "llama"))
    server = SGLangServer(env, case.ckpt, tmp_path / "sglang.log", api_key=sg.USER_KEY,
                          admin_api_key=sg.ADMIN_KEY)  # fmt: skip
    receiver = Receiver(tmp_path / "receiver.log", sg.receiver_args(tmp_path, server))

    def served() -> dict[str, str]:
        return {
            n: checksum_tensor(torch.tensor(server.weights(n), dtype=torch.float32)) for n in (A, B)
        }

    await never_a_mix(case, server, server.url, receiver, served, server.model_info_version, sg.EID)
