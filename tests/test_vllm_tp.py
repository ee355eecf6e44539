"""The vLLM in-engine apply through vLLM 0.32's own Llama and weight loaders at
tensor-parallel size 2 (both ranks in one process of the cached vLLM environment:
tests/vllm_env/tp_worker.py), bit-exact against a full load of each version.

A real Publisher publishes versions of the tiny vLLM test model's weights; a ReceiverAgent
patches the host-local checkpoint and stages every delta (tests/sglang_toy.StagedCheckpoint,
what the VLLM engine does before its pause); each rank applies the stage with the worker
extension's code (``receiver.plugins.vllm_loader.apply_stage``), whose XOR goes through vLLM's
``QKVParallelLinear`` (q/k/v blocks of each rank's fused rows), ``MergedColumnParallelLinear``
(gate/up), ``RowParallelLinear`` (column slices) and ``VocabParallelEmbedding``/
``ParallelLMHead`` (vocabulary rows) loaders. After each version every parameter of each rank
equals, bit for bit, that rank's parameters after a full load of the trainer's state dict.
(A vLLM server at TP=2 on this 2-core host is not started: too slow to be part of make test.)
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

from asyncsync import Publisher
from receiver import ReceiverAgent
from tests.sglang_env.chain import base_state
from tests.sglang_toy import StagedCheckpoint
from tests.vllm_env import build
from tests.vllm_env.fixtures import require_env

pytestmark = [pytest.mark.vllm_real, pytest.mark.timeout(600)]


class Ranks:
    """tests/vllm_env/tp_worker.py: one JSON command per line, one JSON answer per line."""

    def __init__(self, env: Path, log: Path):
        self.log = open(log, "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [str(build.python_of(env)), str(build.HERE / "tp_worker.py"),
             str(build.model_dir(env))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
            env=build.server_env(env, [build.PLUGIN_DIR]), text=True,
        )  # fmt: skip
        self.ready = self.read()

    def read(self) -> dict[str, Any]:
        """The next answer: a line holding a JSON object (vLLM may log to stdout as well)."""
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if not line:
                self.proc.wait(10)
                raise AssertionError(
                    f"tp_worker exited {self.proc.returncode}: see {self.log.name}"
                )
            if line.startswith("{"):
                return dict(json.loads(line))

    def __call__(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.log.close()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ranks]:
    env = require_env()
    r = Ranks(env, tmp_path_factory.mktemp("vllm-tp") / "tp_worker.log")
    try:
        yield r
    finally:
        r.close()


def change(sd: dict[str, torch.Tensor], names: list[str], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = dict(sd)
    for n in names:
        t = sd[n].clone()
        mask = torch.rand(t.shape, generator=g) < 0.03
        mask.view(-1)[0] = True
        t[mask] += torch.randn(int(mask.sum()), generator=g) * 0.01
        out[n] = t
    return out


async def test_stages_apply_in_place_through_vllms_loaders_at_tp2(
    ranks: Ranks, tmp_path: Path
) -> None:
    shapes = ranks.ready["shapes"]
    assert shapes["model.layers.0.self_attn.qkv_proj.weight"] == [256, 256]  # (4+2+2)*64 / 2
    assert shapes["model.embed_tokens.weight"] == [512, 256]  # half the vocabulary
    sd = base_state(build.model_dir(require_env()))
    engine = StagedCheckpoint(tmp_path / "ckpt")
    pub = Publisher(tmp_path / "root", bucket_bytes=1 << 16, keyframe_interval=0)

    def check(what: str) -> None:
        path = tmp_path / "want.safetensors"
        safetensors.torch.save_file(sd, path)
        assert ranks(op="check", file=str(path))["differ"] == [], what

    n = len(sd)
    async with pub, ReceiverAgent(pub.root, engine, "tp", use_inotify=False) as agent:
        await pub.seed(sd)
        await agent.sync_once()
        got = ranks(op="load", dir=str(engine.checkpoint.directory))
        assert got["ok"] == [True, True] and all("full reload" in m for m in got["messages"])
        check("v0")
        layer = "model.layers.1."
        steps: list[list[str]] = [
            list(sd),  # every tensor
            [layer + "self_attn.k_proj.weight"],  # the k block of each rank's qkv_proj rows
            [layer + "mlp.up_proj.weight", "model.embed_tokens.weight"],  # gate_up; vocab rows
            [layer + "self_attn.o_proj.weight", "lm_head.weight", "model.norm.weight"],
        ]
        for seed, names in enumerate(steps, start=1):
            sd = change(sd, names, seed)
            v = (await pub.publish(sd)).version
            await agent.sync_once()
            got = ranks(op="apply", stage=str(engine.stages[v]))
            assert got["ok"] == [True, True], got
            for m in got["messages"]:
                assert f"v{v - 1} -> v{v}: {len(names)} of {n} tensors XORed in place" in m, m
                assert "0 loaded whole" in m, m
            check(f"v{v}: {names}")

        # the same stage again: its base is no longer what the ranks hold, so it is not XORed
        # a second time; the ranks load the version from the checkpoint (nothing differs)
        got = ranks(op="apply", stage=str(engine.stages[v]))
        for m in got["messages"]:
            assert "stage not applied in place (the model holds" in m, m
            assert "partial reload: loaded 0 of" in m, m
        check("a stage applied twice")
