"""A real SGLang 0.5.23 server (tiny float32 Qwen2, no keys) where the plugin finds nothing to
hook: ``ASYNCSYNC_SGLANG_HOOK_TARGET`` names a method this SGLang does not have, as a future
SGLang that moved it would. The plugin warns loudly at start and hooks nothing, every reload is
SGLang's own full one, no stage is ever sent, and the receiver's ``/status`` says the partial
path is off. The chain still works: the ack and both version labels name each version, and
greedy output equals what transformers computes from the checkpoint's bytes (Qwen2 has no
``/get_weights_by_name``). And a stage handed to this server anyway changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from receiver.plugins.stage import StageWriter, VersionRef
from tests.sglang_env import build
from tests.sglang_env.chain import Trainer, base_state
from tests.sglang_env.fixtures import require_env, serving
from tests.sglang_env.server import Receiver, SGLangServer, run_env_python

# a server start (in the first test's setup) takes ~15 s idle, minutes on a loaded host
pytestmark = [
    pytest.mark.sglang_real,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.timeout(600),
]

EID = "qwen2-0"
PROMPT = [24, 978, 642, 484, 20]
MISSING = "sglang.srt.model_executor.model_runner.ModelRunner.no_such_reload"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SGLangServer]:
    with serving(
        tmp_path_factory.mktemp("sglang-qwen2"),
        "qwen2",
        extra_env={"ASYNCSYNC_SGLANG_HOOK_TARGET": MISSING},
    ) as srv:
        yield srv


def greedy_reference(env: Path, server: SGLangServer, ckpt: Path) -> list[int]:
    out = run_env_python(
        env, str(build.HERE / "hf_reference.py"), str(server.model), str(ckpt), "8",
        *map(str, PROMPT),
    )  # fmt: skip
    return [int(t) for t in out.strip().strip("[]").split(",")]


async def test_no_hook_target_warns_and_status_says_partial_is_off(
    server: SGLangServer, tmp_path: Path
) -> None:
    assert "asyncsync SGLang plugin INACTIVE" in server.text()
    assert MISSING in server.text()
    trainer = Trainer(tmp_path / "root", base_state(server.model))
    receiver = Receiver(
        tmp_path / "receiver.log",
        [
            "--root", str(tmp_path / "root"), "--engine-id", EID,
            "--checkpoint", str(tmp_path / "ckpt"), "--sglang-url", server.url,
        ],
    )  # fmt: skip
    env = require_env()
    try:
        versions = [await trainer.open()]
        receiver.start()
        await trainer.wait_acked(versions[0], EID)
        for names in (["lm_head.weight", "model.layers.0.mlp.down_proj.weight"], []):
            versions.append(await trainer.step(names))
            await trainer.wait_acked(versions[-1], EID)
            v = versions[-1]
            assert trainer.ack_of(EID) == v
            assert server.model_info_version() == str(v)
            out = server.generate(PROMPT, 8)
            assert out["meta_info"]["weight_version"] == str(v)
            if names:  # (a zero diff changes no weight: one transformers run is enough)
                assert out["output_ids"] == greedy_reference(env, server, tmp_path / "ckpt")
        status = receiver.status()["engine"]
        assert status["partial_reload"]["active"] is False
        assert "no asyncsync marker" in status["partial_reload"]["why"]
        assert status["in_engine"]["stages_supported"] is False  # no stage was ever sent
        assert status["in_engine"]["in_place_applies"] == 0
        assert "engine-stage" not in server.text()
        assert server.plugin_lines() == []  # the plugin never ran
        assert "Update engine weights online from disk begin" in server.text()  # SGLang's own
    finally:
        receiver.stop()
        await trainer.close()


async def test_a_stage_reaching_sglang_without_the_plugin_changes_nothing(
    server: SGLangServer, tmp_path: Path
) -> None:
    """What the receiver guards against by sending stages only after the capability: SGLang's
    own reload, handed a stage directory, finds no weights in it, answers 400 and keeps its
    weights and its version; the server stays up."""
    before = server.model_info_version()
    out = server.generate(PROMPT, 8)["output_ids"]
    stage = tmp_path / "ckpt" / ".asyncsync" / "engine-stage" / "v000000000009"
    StageWriter(stage, target=VersionRef(9, "r", "f"), base=VersionRef(8, "r", "e"),
                algorithm="xxh3-128").commit({}, {})  # fmt: skip
    code, answer = server.update(stage, "9")
    assert code == 400 and not answer["success"]
    assert "Failed to get weights iterator" in answer["message"], answer
    assert server.model_info_version() == before
    assert server.generate(PROMPT, 8)["output_ids"] == out
