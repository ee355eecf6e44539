"""The asyncsync loader plugin inside the real SGLang 0.5.23 server (tiny float32 Llama, CPU).

The checkpoint is kept by an in-process receiver (``ReceiverAgent`` + a ``LocalCheckpoint``
that also stages every delta, as the SGLang engine does) fed by a real Publisher; each test
then sends ``POST /update_weights_from_disk`` itself (the checkpoint, or a stage), so it can
also hand the server what the receiver never would (a tampered tensor, a checkpoint mid-apply,
a damaged stage, a stage onto another base).
What the plugin did is read from the server's side: its log line per reload (``asyncsync:
partial reload: loaded K of N tensors (checkpoint vV): names`` / ``asyncsync: full reload
(why)`` / ``asyncsync: refused ...``), and the served weights (``/get_weights_by_name``).

``ASYNCSYNC_SGLANG_BATCH_BYTES=1`` makes each tensor its own ``load_weights`` call, so an error
midway leaves the model half-updated; ``fault_plugin/`` (a second, test-only SGLang plugin)
makes ``load_weights`` fail once on demand, or flips a bit of a served parameter.

The last test runs the receiver's own SGLang engine and its Auditor (receiver/audit.py) with
``after_apply`` against the same server: a flipped bit is found through ``SGLang.audit`` (the
plugin's records), ``/readyz`` is 503, and the Auditor's repair (a full reload) fixes it.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import safetensors.torch
import torch

from receiver import ReceiverAgent
from receiver.audit import Auditor
from receiver.engines import SGLang
from receiver.plugins.stage import DATA_NAME, STAGE_NAME
from receiver.server import StatusServer
from tests.sglang_env import build
from tests.sglang_env.chain import Trainer, base_state
from tests.sglang_env.fixtures import serving
from tests.sglang_env.server import SGLangServer, wait_for
from tests.sglang_toy import StagedCheckpoint

# a server start (in the first test's setup) takes ~15 s idle, minutes on a loaded host
pytestmark = [
    pytest.mark.sglang_real,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.timeout(600),
]

FAULTS = build.HERE / "fault_plugin"
ONE = "model.layers.0.mlp.gate_proj.weight"
THREE = ["model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.up_proj.weight", ONE]


@dataclass
class Chain:
    dir: Path
    server: SGLangServer
    trainer: Trainer
    agent: ReceiverAgent
    marker: Path
    engine: StagedCheckpoint

    @property
    def ckpt(self) -> Path:
        return self.dir / "ckpt"

    @property
    def n(self) -> int:
        return len(self.trainer.sd)

    async def next(self, names: list[str]) -> int:
        v = await self.trainer.step(names)
        assert await self.agent.sync_once() == v
        return v

    def reload(self, version: int, path: Path | None = None) -> tuple[int, Any, list[str]]:
        """POST the reload; returns (status, answer, the plugin lines it logged)."""
        before = len(self.server.plugin_lines())
        code, answer = self.server.update(path or self.ckpt, str(version))
        return code, answer, self.server.plugin_lines()[before:]

    def stage(self, version: int) -> Path:
        return self.engine.stages[version]

    def served(self) -> dict[str, torch.Tensor]:
        return {
            n: torch.tensor(self.server.weights(n), dtype=t.dtype)
            for n, t in self.trainer.sd.items()
        }

    def assert_serves(self, want: dict[str, torch.Tensor], version: int) -> None:
        assert self.server.model_info_version() == str(version)
        got = self.served()
        for name, t in want.items():
            assert torch.equal(got[name], t), f"served {name} differs"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SGLangServer]:
    d = tmp_path_factory.mktemp("sglang-plugin")
    with serving(
        d,
        extra_path=[FAULTS],
        extra_env={
            "ASYNCSYNC_SGLANG_BATCH_BYTES": "1",
            "ASYNCSYNC_TEST_FAIL_LOAD_WEIGHTS": str(d / "fail-load-weights"),
            "ASYNCSYNC_TEST_CORRUPT_PARAM": str(d / "corrupt-param"),
        },
    ) as srv:
        yield srv


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def chain(
    server: SGLangServer, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Chain]:
    d = tmp_path_factory.mktemp("plugin-chain")
    trainer = Trainer(d / "root", base_state(server.model))
    engine = StagedCheckpoint(d / "ckpt")
    agent = ReceiverAgent(d / "root", engine, "plugin-0", use_inotify=False)
    marker = Path(server.env["ASYNCSYNC_TEST_FAIL_LOAD_WEIGHTS"])
    c = Chain(d, server, trainer, agent, marker, engine)
    v = await trainer.open()
    await agent.open()
    assert await agent.sync_once() == v
    try:
        yield c
    finally:
        await agent.close()
        await trainer.close()


async def test_registered_without_a_failed_hook(chain: Chain) -> None:
    """SGLang logs a warning for a hook it cannot apply (what 0.5.23 said about the old
    ModelRunner target); the next test proves the hook runs (INFO lines of plugin
    registration come before SGLang configures its logging, so they are not in the log)."""
    log = chain.server.text()
    assert "Failed to apply hooks" not in log and "plugin INACTIVE" not in log


async def test_first_reload_is_full(chain: Chain) -> None:
    code, answer, lines = chain.reload(0)
    assert code == 200 and answer["success"], answer
    assert lines == [
        "asyncsync: full reload (first reload: the weights the server holds are not known): "
        "Succeeded to update model weights."
    ]
    assert "[asyncsync: full reload (first reload" in answer["message"]
    chain.assert_serves(chain.trainer.sd, 0)


async def test_one_tensor_loads_exactly_that_tensor(chain: Chain) -> None:
    v = await chain.next([ONE])
    code, answer, lines = chain.reload(v)
    assert code == 200 and answer["success"], answer
    assert lines == [
        f"asyncsync: partial reload: loaded 1 of {chain.n} tensors (checkpoint v{v}): {ONE}"
    ]
    chain.assert_serves(chain.trainer.sd, v)


async def test_a_changed_tensor_set_is_a_full_reload(chain: Chain) -> None:
    dropped = "model.norm.weight"
    held = chain.trainer.sd[dropped].clone()
    full = dict(chain.trainer.sd)
    del chain.trainer.sd[dropped]  # the trainer stops publishing one tensor: a full version
    chain.trainer.change(["lm_head.weight"])
    v = await chain.trainer.pub.publish(chain.trainer.sd)
    assert await chain.agent.sync_once() == v.version
    code, answer, lines = chain.reload(v.version)
    assert code == 200 and answer["success"], answer
    assert lines[0].startswith("asyncsync: full reload (the set of tensors changed)")
    chain.assert_serves(chain.trainer.sd, v.version)
    served = torch.tensor(chain.server.weights(dropped), dtype=held.dtype)
    assert torch.equal(served, held)  # not in the checkpoint: SGLang leaves it as it was

    chain.trainer.sd[dropped] = full[dropped]  # back to the full set: full again, then partial
    v2 = await chain.next(["lm_head.weight"])
    assert chain.reload(v2)[2][0].startswith("asyncsync: full reload (the set of tensors changed)")
    v3 = await chain.next([ONE])
    assert chain.reload(v3)[2][0].startswith("asyncsync: partial reload: loaded 1 of")
    chain.assert_serves(chain.trainer.sd, v3)


async def test_a_checksum_mismatch_is_refused_and_nothing_is_loaded(chain: Chain) -> None:
    held, held_version = dict(chain.trainer.sd), int(chain.server.model_info_version())
    v = await chain.next(THREE[:2])
    index = json.loads((chain.ckpt / "model.safetensors.index.json").read_text())
    victim = chain.ckpt / index["weight_map"][THREE[1]]
    good = victim.read_bytes()
    tensors = safetensors.torch.load_file(victim)
    tensors[THREE[1]] = tensors[THREE[1]].clone()
    tensors[THREE[1]].view(-1)[0] += 1  # bit rot, or another writer: shape and header intact
    safetensors.torch.save_file(tensors, victim, metadata={"format": "pt"})
    try:
        code, answer, lines = chain.reload(v)
    finally:
        victim.write_bytes(good)
    assert code == 400 and not answer["success"]
    assert answer["message"].startswith("asyncsync: refused to load:")
    assert "checksum" in answer["message"] and THREE[1] in answer["message"]
    assert lines and all(line.startswith("asyncsync: refused to load:") for line in lines)
    assert chain.server.user("GET", "/health")[0] == 200  # SGLang stays up
    chain.assert_serves(held, held_version)  # not even the verified tensor was loaded

    code, answer, lines = chain.reload(v)  # the bytes are back: partial from the old base
    assert code == 200 and lines[0].startswith("asyncsync: partial reload: loaded 2 of")
    chain.assert_serves(chain.trainer.sd, v)


async def test_an_error_midway_is_a_full_reload(chain: Chain) -> None:
    v = await chain.next(THREE)
    # The plugin's audit calls load_weights too, at any moment: the fault plugin counts only
    # the calls of other threads (an audit pass once took the injected failure in a full CI
    # run, which then failed this test and the two audits below).
    chain.marker.write_text("2")  # the second load_weights call (the second tensor) fails
    code, answer, lines = chain.reload(v)
    assert not chain.marker.exists(), "the fault plugin did not run"
    assert code == 200 and answer["success"], answer
    assert lines[0] == (
        f"asyncsync: partial reload of v{v} failed midway (injected failure in load_weights "
        "(asyncsync test fault plugin))"
    )
    assert lines[1].startswith(
        "asyncsync: full reload (partial reload failed midway: injected failure in load_weights"
    )
    chain.assert_serves(chain.trainer.sd, v)  # the half-updated model was reloaded whole
    v2 = await chain.next([ONE])  # the full reload's files were verified: partial again
    assert chain.reload(v2)[2][0].startswith("asyncsync: partial reload: loaded 1 of")
    chain.assert_serves(chain.trainer.sd, v2)


async def test_a_checkpoint_mid_apply_is_refused(chain: Chain) -> None:
    held_version = chain.server.model_info_version()
    copy = chain.dir / "mid-apply"
    # a flush after the last ack may be renaming state.json into place: skip its temp file
    shutil.copytree(chain.ckpt, copy, ignore=shutil.ignore_patterns(".tmp.*"))
    state_file = copy / ".asyncsync" / "state.json"
    state = json.loads(state_file.read_text())
    state.update(status="applying", target_version=state["version"] + 1, mode="delta")
    state_file.write_text(json.dumps(state))
    code, answer, lines = chain.reload(999, copy)
    assert code == 400 and "a version is being applied" in answer["message"]
    assert lines[0].startswith("asyncsync: refused to load:")
    assert chain.server.model_info_version() == held_version
    assert chain.server.user("GET", "/health")[0] == 200


# --------------------------------------------------------------------------- stages


async def test_a_stage_is_applied_in_place(chain: Chain) -> None:
    """The model holds the checkpoint's version (the last reload above): the next version's
    stage is XORed into the resident parameters, one load_weights routing per tensor, and
    the audit then finds every served tensor equal to the trainer's bytes."""
    v = await chain.next(THREE)
    code, answer, lines = chain.reload(v, chain.stage(v))
    assert code == 200 and answer["success"], answer
    assert len(lines) == 1 and lines[0].startswith(
        f"asyncsync: in-engine apply: v{v - 1} -> v{v}: 3 of {chain.n} tensors XORed in place"
    ), lines
    assert "[asyncsync-stage/1]" in answer["message"]
    chain.assert_serves(chain.trainer.sd, v)
    want = f"asyncsync audit (rank 0): v{v}: {chain.n} of {chain.n} tensors match"
    wait_for("the audit pass", lambda: any(want in line for line in chain.server.audit_lines()))


async def test_the_served_model_name_survives_reloads(chain: Chain) -> None:
    """SGLang 0.5.23 renames its served model to every reload's ``model_path``
    (``TokenizerManager._update_model_path_info``): ``/v1/models`` then listed the stage (a
    directory removed once applied), and a client that names the model it was started with
    got 404 (``/v1/models/<name>``; ``/v1/responses`` refuses unknown models the same way).
    The plugin keeps the name for asyncsync paths, and ``model_path`` names the checkpoint,
    never a stage."""
    launch = str(chain.server.model)

    def assert_named() -> None:
        status, models = chain.server.user("GET", "/v1/models")
        assert status == 200 and [m["id"] for m in models["data"]] == [launch], models
        assert chain.server.user("GET", "/v1/models/" + launch)[0] == 200
        status, info = chain.server.user("GET", "/model_info")
        assert info["served_model_name"] == launch, info
        assert info["model_path"] == str(chain.ckpt), info

    v = await chain.next([ONE])
    code, answer, _ = chain.reload(v, chain.stage(v))
    assert code == 200 and answer["success"], answer
    assert_named()
    code, answer, _ = chain.reload(v)  # the checkpoint too (a reconcile, a repair)
    assert code == 200 and answer["success"], answer
    assert_named()


async def test_a_stage_gone_before_sglang_reads_it_is_refused(chain: Chain) -> None:
    """The receiver removed the stage before SGLang came to it (its update call timed out on a
    slow server, or a new receiver started): the path is not handed to SGLang as a model (it
    would take it for a hub repo id), nothing is loaded, and the model keeps its base: the next
    stage is applied in place."""
    v = chain.trainer.pub.version
    gone = chain.ckpt / ".asyncsync" / "engine-stage" / f"v{v + 1:012d}"
    assert not gone.exists()
    code, answer, lines = chain.reload(v + 1, gone)
    assert not answer["success"], answer
    assert lines[0].startswith(f"asyncsync: refused to load: the stage {gone} is gone"), lines
    assert "Repo id" not in answer["message"], answer
    assert chain.server.model_info_version() == str(v)
    v = await chain.next([ONE])
    code, answer, lines = chain.reload(v, chain.stage(v))
    assert code == 200, answer
    assert lines[0].startswith(f"asyncsync: in-engine apply: v{v - 1} -> v{v}"), lines
    chain.assert_serves(chain.trainer.sd, v)


async def test_a_damaged_stage_goes_through_the_checkpoint(chain: Chain) -> None:
    """The stage is rewritten (a new record) with damaged data: whether the plugin's prefetch
    thread reads it ahead (and finds it damaged) or the apply reads it, it does not verify, and
    the checkpoint is loaded instead. (A copy read ahead of the *old* record is never used for
    the new one: tests/test_prefetch.py.)"""
    v = await chain.next([ONE])
    data = chain.stage(v) / DATA_NAME
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0x40
    data.write_bytes(bytes(raw))
    record = chain.stage(v) / STAGE_NAME
    doc = json.loads(record.read_text())
    doc["created_at"] += 1
    (record.parent / "tmp").write_text(json.dumps(doc))
    (record.parent / "tmp").replace(record)
    code, answer, lines = chain.reload(v, chain.stage(v))
    assert code == 200 and answer["success"], answer
    assert lines[0].startswith("asyncsync: stage not applied in place (the stage does not verify")
    assert lines[-1].endswith(f"asyncsync: partial reload: loaded 1 of {chain.n} tensors "
                              f"(checkpoint v{v}): {ONE}")  # fmt: skip
    chain.assert_serves(chain.trainer.sd, v)


async def test_a_stage_onto_another_base_goes_through_the_checkpoint(chain: Chain) -> None:
    """The server missed a version (never XOR onto other bytes): the stage of the next one is
    not applied; the checkpoint (which holds it) is, tensors that changed since the model's
    version whole."""
    await chain.next([ONE])
    v = await chain.next(THREE[:1])
    code, answer, lines = chain.reload(v, chain.stage(v))
    assert code == 200 and answer["success"], answer
    assert lines[0].startswith(f"asyncsync: stage not applied in place (the model holds v{v - 2} ")
    assert f"the stage applies to v{v - 1} " in lines[0]
    assert f"partial reload: loaded 2 of {chain.n} tensors (checkpoint v{v}): " in lines[-1]
    assert THREE[0] in lines[-1] and ONE in lines[-1]
    chain.assert_serves(chain.trainer.sd, v)
    v = await chain.next([ONE])  # in place again from there
    assert chain.reload(v, chain.stage(v))[2][0].startswith("asyncsync: in-engine apply:")
    chain.assert_serves(chain.trainer.sd, v)


async def test_an_error_midway_through_an_in_place_apply_is_a_full_reload(chain: Chain) -> None:
    """The in-place apply fails on the second tensor (its plan's apply raises, the test-only
    fault plugin): that tensor may be half-written, so the version is SGLang's full reload of
    the checkpoint in the same call, and every served tensor is the trainer's."""
    v = await chain.next(THREE)
    chain.marker.write_text("2")
    code, answer, lines = chain.reload(v, chain.stage(v))
    assert not chain.marker.exists(), "the fault plugin did not run"
    assert code == 200 and answer["success"], answer
    assert lines[0].startswith("asyncsync: full reload (tensor "), lines
    assert "the sparse apply failed: injected failure in apply_plan" in lines[0], lines
    chain.assert_serves(chain.trainer.sd, v)
    v = await chain.next(THREE)  # a raised error says nothing of the loader: in place again
    assert chain.reload(v, chain.stage(v))[2][0].startswith(
        f"asyncsync: in-engine apply: v{v - 1} -> v{v}: 3 of"
    )
    chain.assert_serves(chain.trainer.sd, v)


# --------------------------------------------------------------------------- the receiver's audit


async def test_the_receivers_auditor_finds_a_flipped_bit_and_repairs(chain: Chain) -> None:
    """The receiver's SGLang engine (its own checkpoint: the server loads it in full) and the
    receiver's Auditor with ``after_apply``: each audit waits for the plugin's pass over the
    version and reads it back as an AuditReport. A bit of a served parameter flips inside the
    server (the fault plugin, below anything asyncsync sees, at the plugin audit's next
    ``load_weights``): the audit after the next version names it, ``/readyz`` is 503, the
    Auditor's repair reloads in full, the audit after it passes, and every served tensor is the
    trainer's again. Last in the module: it leaves the server on another checkpoint."""
    victim = "model.layers.1.mlp.down_proj.weight"
    corrupt = chain.server.log.parent / "corrupt-param"
    await chain.agent.close()  # it holds the server (one receiver per server: ServerLock)
    engine = SGLang(chain.server.url, chain.dir / "audited", audit_wait=120.0)
    agent = ReceiverAgent(chain.dir / "root", engine, "audited-0", use_inotify=False)
    auditor = Auditor(agent, after_apply=True, repair=False)
    async with agent, StatusServer(agent, auditor=auditor) as status:
        assert await agent.sync_once() == chain.trainer.pub.version
        report = await auditor.audit_once()
        assert report is not None and report.ok, report
        assert report.checked == chain.n and "in-engine audit" in report.how
        assert auditor.supported is True

        corrupt.write_text(victim)
        v = await chain.trainer.step([ONE])
        assert await agent.sync_once() == v
        report = await auditor.audit_once()
        assert not corrupt.exists(), "the fault plugin did not run"
        assert report is not None and report.mismatched == (victim,), report
        assert not auditor.healthy
        async with aiohttp.ClientSession() as http, http.get(status.url + "/readyz") as r:
            assert r.status == 503 and "audit" in (await r.json())["why"]
        log = chain.server.text()
        found = rf"asyncsync audit \(rank 0\): v{v}: the engine serves other bytes than the "
        assert re.search(rf"{found}trainer's for {victim}", log), chain.server.audit_lines()

        auditor.repair = True
        report = await auditor.audit_once()  # the record still says mismatch: repair
        assert report is not None and report.ok and report.checked == chain.n, report
        assert auditor.healthy and auditor.stats.repairs == 1
        lines = chain.server.plugin_lines()
        assert any("full reload (the weights the server holds are not known: audit mismatch on"
                   in line for line in lines[-3:]), lines[-3:]  # fmt: skip
        async with aiohttp.ClientSession() as http, http.get(status.url + "/readyz") as r:
            assert r.status == 200, await r.json()
        chain.assert_serves(chain.trainer.sd, v)
