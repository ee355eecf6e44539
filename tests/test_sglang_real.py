"""The whole chain against the real SGLang 0.5.23 server (tiny float32 Llama, CPU).

One server for the module, started with ``--api-key`` and ``--admin-api-key``, the asyncsync
plugin installed (and the test-only fault plugin); the real ``asyncsync-receiver
--sglang-url`` CLI (both keys) fed by a real :class:`~asyncsync.Publisher`. After every
version the ack, ``/model_info`` and ``/generate``'s ``meta_info.weight_version`` name it, and
every served tensor (``/get_weights_by_name``) equals the trainer's bytes; the server's log
says which path each version took (``asyncsync: in-engine apply`` for a delta staged by the
receiver and XORed in place; a full or partial reload, and why, otherwise). The tests run in
order on one chain: seed, deltas, zero diff, keyframe, one tensor, every tensor, a changed
tensor set, greedy output vs transformers, a receiver restart (after a kill mid-pause), a
server restart with versions published while it was down (reconciled through ``/readyz``), the
audit catching a corrupted served tensor (``/readyz`` 503 until a full reload repaired it), a
damaged shard, the two keys, a version the server refuses.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio
import torch

from asyncsync.format import version_dir
from receiver.engines import SGLang
from receiver.engines.http_engine import EngineHTTPError
from tests.sglang_env import build
from tests.sglang_env.chain import Trainer, base_state, checkpoint_state
from tests.sglang_env.fixtures import require_env, serving
from tests.sglang_env.server import Receiver, SGLangServer, run_env_python, wait_for

# a server start (in the first test's setup) takes ~15 s idle, minutes on a loaded host
pytestmark = [
    pytest.mark.sglang_real,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.timeout(600),
]

USER_KEY, ADMIN_KEY = "user-key-0123456789", "admin-key-0123456789"
EID = "sglang-real-0"
PROMPT = [24, 978, 642, 484, 20]
ONE = "model.layers.1.mlp.down_proj.weight"
SOME = [
    "model.layers.0.self_attn.q_proj.weight",  # a shard of the fused qkv_proj
    "model.layers.0.mlp.up_proj.weight",  # a shard of the fused gate_up_proj
    "model.layers.1.self_attn.o_proj.weight",
    "model.norm.weight",
    "lm_head.weight",
]


@dataclass
class Stack:
    env: Path
    dir: Path
    server: SGLangServer
    trainer: Trainer
    receiver: Receiver

    @property
    def ckpt(self) -> Path:
        return self.dir / "ckpt"


def receiver_args(stack_dir: Path, server: SGLangServer, *extra: str) -> list[str]:
    (stack_dir / "user.key").write_text(USER_KEY + "\n")
    (stack_dir / "admin.key").write_text(ADMIN_KEY + "\n")
    return [
        "--root", str(stack_dir / "root"), "--engine-id", EID,
        "--checkpoint", str(stack_dir / "ckpt"), "--sglang-url", server.url,
        "--api-key-file", str(stack_dir / "user.key"),
        "--admin-api-key-file", str(stack_dir / "admin.key"),
        "--engine-startup-timeout", "600", *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SGLangServer]:
    logs = tmp_path_factory.mktemp("sglang-real")
    with serving(
        logs,
        api_key=USER_KEY,
        admin_api_key=ADMIN_KEY,
        extra_path=[FAULTS],
        extra_env={"ASYNCSYNC_TEST_CORRUPT_PARAM": str(logs / "corrupt-param")},
    ) as srv:
        yield srv


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(
    server: SGLangServer, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Stack]:
    d = tmp_path_factory.mktemp("chain")
    trainer = Trainer(d / "root", base_state(server.model))
    receiver = Receiver(d / "receiver.log", receiver_args(d, server))
    s = Stack(require_env(), d, server, trainer, receiver)
    try:
        yield s
    finally:
        receiver.stop()
        await trainer.close()


FAULTS = build.HERE / "fault_plugin"


def reloads_posted(server: SGLangServer) -> int:
    """``POST /update_weights_from_disk`` requests in the server's access log."""
    return len(re.findall(r'"POST /update_weights_from_disk HTTP', server.text()))


async def check_served(s: Stack, version: int, timeout: float = 120.0) -> None:
    """Ack, both version labels, and every served tensor equal to the trainer's bytes."""
    await s.trainer.wait_acked(version, EID, timeout=timeout)
    assert s.trainer.ack_of(EID) == version
    assert s.server.model_info_version() == str(version)
    meta = s.server.generate(PROMPT, 2)["meta_info"]
    assert meta["weight_version"] == str(version)
    for name, want in s.trainer.sd.items():
        got = torch.tensor(s.server.weights(name), dtype=want.dtype)
        assert torch.equal(got, want), f"v{version}: served {name} differs from the trainer's"


def last_plugin_line(s: Stack) -> str:
    lines = s.server.plugin_lines()
    assert lines, "the asyncsync plugin logged nothing in the server"
    return lines[-1]


def in_place(s: Stack, v: int, k: int) -> bool:
    """The last load was ``v`` applied in place from its stage, ``k`` tensors XORed."""
    line = last_plugin_line(s)
    n = len(s.trainer.sd)
    want = f"asyncsync: in-engine apply: v{v - 1} -> v{v}: {k} of {n} tensors XORed in place"
    assert line.startswith(want), line
    return True


async def test_seed_deltas_zero_diff_keyframe_one_tensor(stack: Stack) -> None:
    s = stack
    n = len(s.trainer.sd)
    v = await s.trainer.open()  # seed
    s.receiver.start()
    await check_served(s, v)
    assert last_plugin_line(s).startswith("asyncsync: full reload (first reload")

    v = await s.trainer.step(SOME)  # a delta: staged by the receiver, XORed in place
    await check_served(s, v)
    assert in_place(s, v, len(SOME))

    posted, lines = reloads_posted(s.server), len(s.server.plugin_lines())
    v = await s.trainer.step([])  # zero diff: the label moves, nothing is reloaded
    await check_served(s, v)
    assert (reloads_posted(s.server), len(s.server.plugin_lines())) == (posted, lines)
    v = await s.trainer.step(SOME[:1])  # the zero diff's content is the base: in place
    await check_served(s, v)
    assert in_place(s, v, 1)

    v = await s.trainer.step(SOME[:2], keyframe=True)  # a keyframe carries its delta too
    await check_served(s, v)
    assert in_place(s, v, 2)

    v = await s.trainer.step([ONE])  # exactly one tensor goes through the model's load_weights
    await check_served(s, v)
    assert in_place(s, v, 1)

    v = await s.trainer.step(list(s.trainer.sd))  # every tensor changed
    await check_served(s, v)
    assert in_place(s, v, n)

    status = s.receiver.status()
    assert status["version"] == v and status["engine"]["partial_reload"]["active"] is True
    assert status["engine"]["in_engine"]["stages_supported"] is True
    # 0.5.23 (its /server_info) flushes with retracted requests queued: pauses retract
    assert (status["engine"]["pause_mode"], status["engine"]["server_version"]) == (
        "retract",
        "0.5.23",
    )
    assert status["engine"]["in_engine"]["in_place_applies"] == 5
    assert s.receiver.get("/readyz")[0] == 200
    wait_for(
        f"the audit of v{v}",
        lambda: [(r["status"], r["last_ok_version"]) for r in
                 s.receiver.status()["engine"]["audit"]["ranks"]] == [("ok", v)],
    )  # fmt: skip
    # the receiver's Auditor (on by default for SGLang) reads those records: ready, audit ok
    wait_for("the receiver's audit", lambda: (s.receiver.status()["audit"]["last"] or {}).get(
        "checked") == n and s.receiver.status()["audit"]["last"]["version"] == v)  # fmt: skip
    assert s.receiver.status()["audit"]["healthy"] is True
    metrics = s.receiver.get("/metrics")[1]
    assert f'asyncsync_receiver_audit_ok{{engine_id="{EID}"}} 1.0' in metrics
    assert f'asyncsync_receiver_engine_in_place_applies{{engine_id="{EID}"}} 5.0' in metrics


async def test_a_changed_tensor_set_is_a_full_reload(stack: Stack) -> None:
    s = stack
    dropped = "model.norm.weight"
    held = s.trainer.sd.pop(dropped)
    v = await s.trainer.step(["lm_head.weight"])  # no longer published: a full version
    await check_served(s, v)
    assert last_plugin_line(s).startswith("asyncsync: full reload (the set of tensors changed)")
    served = torch.tensor(s.server.weights(dropped), dtype=held.dtype)
    assert torch.equal(served, held)  # not in the checkpoint: SGLang leaves it as it was
    s.trainer.sd[dropped] = held
    v = await s.trainer.step([])  # back to the full set: a full version again, then in place
    await check_served(s, v)
    v = await s.trainer.step([ONE])
    await check_served(s, v)
    assert in_place(s, v, 1)


async def test_greedy_output_equals_transformers_on_the_same_bytes(stack: Stack) -> None:
    s = stack
    served = s.server.generate(PROMPT, 8)["output_ids"]
    assert checkpoint_state(s.ckpt).keys() == s.trainer.sd.keys()
    ref = run_env_python(
        s.env,
        str(build.HERE / "hf_reference.py"),
        str(s.server.model),
        str(s.ckpt),
        "8",
        *map(str, PROMPT),
    )
    assert served == [int(t) for t in ref.strip().strip("[]").split(",")]


async def test_receiver_restart_after_a_kill_mid_pause(stack: Stack) -> None:
    """A receiver killed between pause and continue leaves SGLang paused; its successor
    resumes it at start and catches up."""
    s = stack
    s.receiver.stop()
    code, _ = s.server.admin("POST", "/pause_generation", {"mode": "abort"})
    assert code == 200
    v = await s.trainer.step(SOME[2:])
    s.receiver.start()
    await check_served(s, v)  # /generate answers: generation was continued


async def test_server_restart_is_reconciled_before_readiness(stack: Stack) -> None:
    """SGLang restarts with its initial weights, and versions are published while it is down:
    /readyz is 503 until the receiver reloaded the checkpoint into it (a full reload: the new
    process knows no base), then the versions it missed are staged and applied in place."""
    s = stack
    v = s.trainer.ack_of(EID)
    assert v is not None
    s.server.stop()
    wait_for("/readyz 503 with the server down", lambda: s.receiver.get("/readyz")[0] == 503)
    missed = [await s.trainer.step(SOME[i : i + 1]) for i in range(3)]
    mark = len(s.server.text())
    s.server.start()
    await check_served(s, missed[-1], timeout=400)  # acked only once the server serves it
    wait_for("/readyz 200", lambda: s.receiver.get("/readyz")[0] == 200, timeout=180)
    after = re.findall(
        r"asyncsync: (?:in-engine apply|stage not applied|partial reload|full reload)[^\n\]]*",
        s.server.text()[mark:],
    )
    # the first version the receiver committed while the server was down is reloaded in full
    # (the new process knows no base); the versions after it go in place
    assert after[0].startswith("asyncsync: full reload (first reload"), after
    assert [line.split(":")[2].strip() for line in after[1:]] == [
        f"v{x - 1} -> v{x}" for x in missed[len(missed) - len(after) + 1 :]
    ], after
    assert len(after) >= 2

    v = await s.trainer.step([ONE])  # and in place from there
    await check_served(s, v)
    assert in_place(s, v, 1)


async def test_the_audit_catches_a_corrupted_served_tensor(stack: Stack) -> None:
    """One bit of a served parameter flips inside the server (the test-only fault plugin,
    below anything asyncsync sees): the in-engine audit finds the served bytes differ from the
    trainer's, the receiver's Auditor (on by default, no flag) counts the engine not ready (its
    log; /readyz 503 meanwhile: tests/test_sglang_audit.py, tests/test_sglang_real_plugin.py)
    and repairs with a full reload; /readyz is 200 again with every served tensor equal to the
    trainer's."""
    s = stack
    victim = "model.layers.1.mlp.down_proj.weight"
    (s.server.log.parent / "corrupt-param").write_text(victim)
    v = await s.trainer.step([ONE])  # the next load_weights call (the audit's) corrupts it
    await s.trainer.wait_acked(v, EID)
    wait_for("the fault plugin's corruption",
             lambda: not (s.server.log.parent / "corrupt-param").exists(), timeout=120)  # fmt: skip
    # (an audit every 5 s, then a full reload: ~1 min quiet; a CI run beside other work passed
    # 180 s, a liveness bound, not a timing one)
    wait_for("the repair", lambda: s.receiver.status()["audit"]["repairs"] >= 1,
             timeout=480)  # fmt: skip
    wait_for("/readyz 200 after the repair", lambda: s.receiver.get("/readyz")[0] == 200)
    rlog = s.receiver.text()
    assert "in-engine audit: the audit on rank 0 (target) found the engine serving" in rlog
    said = rf"audit of v{v}: the engine serves other bytes than the manifest for 1 of \d+ "
    assert re.search(rf"{said}tensors \({victim}\); not ready, reloading in full", rlog), rlog
    log = s.server.text()
    assert re.search(rf"asyncsync audit \(rank 0\): v{v}: the engine serves other bytes than "
                     rf"the trainer's for {victim}", log), s.server.audit_lines()  # fmt: skip
    assert "full reload (the weights the server holds are not known: audit mismatch on" in log
    await check_served(s, v)
    st = s.receiver.status()["audit"]
    assert st["mismatches"] == 1 and st["repairs"] == 1 and st["healthy"] is True
    metrics = s.receiver.get("/metrics")[1]
    assert f'asyncsync_receiver_audit_mismatches_total{{engine_id="{EID}"}} 1.0' in metrics
    assert f'asyncsync_receiver_audit_repairs_total{{engine_id="{EID}"}} 1.0' in metrics


async def test_a_damaged_shard_never_reaches_the_server(stack: Stack) -> None:
    s = stack
    held = s.trainer.ack_of(EID)
    s.receiver.stop()
    v = await s.trainer.step(SOME)
    shards = sorted(
        p for p in version_dir(s.trainer.root, v).iterdir() if p.name != "manifest.json"
    )
    victim = max(shards, key=lambda p: p.stat().st_size)
    good = victim.read_bytes()
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0xFF
    victim.write_bytes(bytes(bad))
    posted = reloads_posted(s.server)
    s.receiver.start()
    wait_for(
        "the receiver to refuse the damaged shard",
        lambda: "checksum" in (s.receiver.status()["last_error"] or "").lower(),
        timeout=120,
    )
    assert s.trainer.ack_of(EID) == held
    assert reloads_posted(s.server) == posted  # the server was never asked
    assert s.server.model_info_version() == str(held)
    assert s.server.user("GET", "/health")[0] == 200
    victim.write_bytes(good)
    await check_served(s, v)


async def test_both_keys_are_needed_and_each_where_it_belongs(stack: Stack) -> None:
    s = stack
    assert s.server.user("POST", "/pause_generation", {"mode": "abort"})[0] == 401
    assert s.server.admin("GET", "/model_info")[0] == 401
    running = s.receiver.proc is not None
    s.receiver.stop()  # it holds the server (one receiver per server: ServerLock)
    try:
        engine = SGLang(s.server.url, s.dir / "user-only", api_key=USER_KEY)
        with pytest.raises(EngineHTTPError) as ei:
            await engine.open()  # /continue_generation needs the admin key
        assert ei.value.status == 401 and "API key" in str(ei.value)
    finally:
        if running:
            s.receiver.start()


async def test_a_refused_version_is_not_acked_and_is_retried(stack: Stack) -> None:
    """The server cannot open the path it is given (a mount not there yet): 400, nothing acked;
    once the path exists the receiver retries (backoff) and the version is acknowledged.

    SGLang takes a path that is no directory for a Hugging Face repo id and locks its download
    with ``<tempdir>/<sha256 of the name><the path, "/" as "-">.lock`` (its
    ``weight_utils.get_lock``), a file it never removes: the test removes it."""
    s = stack
    s.receiver.stop()
    d = s.dir / "refused"
    d.mkdir()
    seen_by_server = d / "mount" / "ckpt"
    trainer = Trainer(d / "root", base_state(s.server.model))
    receiver = Receiver(
        d / "receiver.log",
        receiver_args(d, s.server, "--engine-model-path", str(seen_by_server)),
    )
    try:
        v = await trainer.open()
        receiver.start()
        wait_for(
            "the server to refuse the version",
            lambda: (
                "refused" in (receiver.status()["last_error"] or "")
                or "HTTP 400" in (receiver.status()["last_error"] or "")
            ),
            timeout=120,
        )
        assert trainer.ack_of(EID) is None
        assert "Failed to get weights iterator" in receiver.status()["last_error"]
        seen_by_server.parent.mkdir()
        os.symlink(d / "ckpt", seen_by_server)
        await trainer.wait_acked(v, EID)
        assert s.server.model_info_version() == str(v)
        for name, want in trainer.sd.items():
            got = torch.tensor(s.server.weights(name), dtype=want.dtype)
            assert torch.equal(got, want), name
    finally:
        receiver.stop()
        await trainer.close()
        await asyncio.sleep(0)
        name = str(seen_by_server).replace("/", "-")  # the server's temp dir is ours (its env)
        lock = f"{hashlib.sha256(name.encode()).hexdigest()}{name}.lock"
        (Path(tempfile.gettempdir()) / lock).unlink(missing_ok=True)
