"""The whole chain against the real vLLM 0.32 server (CPU build, tiny float32 Llama).

One server for the module, started the documented way: a real
:class:`~asyncsync.Publisher` seeds the root, ``asyncsync-receiver --once`` seeds the
host-local checkpoint, the model's config and tokenizer are copied in, and vLLM is started
with ``--model`` on that checkpoint (its ``reload_weights`` re-reads the directory it started
from), ``--api-key``, the asyncsync worker extension and ``ASYNCSYNC_VLLM_INPLACE=1`` (plain CPU
weights: versions are applied in place). The real ``asyncsync-receiver --vllm-url`` CLI keeps
it current, with the served-bytes audit on.

After every version: the ack and ``/weight_info`` name it, the bytes every HF tensor is served
from equal the trainer's (read back by the worker extension's ``asyncsync_served_checksums``
through ``/collective_rpc`` and compared here with checksums of the trainer's own tensors),
and the server's log says how the version got there (``asyncsync: in-engine apply: vA -> vB:
N of M tensors XORed in place``, a partial reload, or a full reload and why); the greedy
tokens served are recorded and compared with transformers' on the same bytes. The tests run
in order on one chain: seed, deltas, zero diff, keyframe, a changed tensor set, greedy output,
stages on the wrong base or damaged (the worker's fallback through the checkpoint), the audit
finding and repairing weights changed behind the receiver's back, a receiver restart after a
kill mid-pause, a damaged shard, a version the server refuses, then a server restart while
versions are published, into a server WITHOUT the opt-in (packed weights: every version is
vLLM's ``reload_weights``, and a stage sent anyway is not applied in place), where vLLM's own
``/weight_checker`` is shown blind (see
:func:`test_weight_checker_is_blind_to_packed_cpu_linear_layers`), and the API key.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import pytest_asyncio
import safetensors.torch
import torch

from asyncsync.format import version_dir
from asyncsync.format.checksum import checksum_tensor
from receiver.engines import VLLM
from receiver.engines.http_engine import EngineHTTPError
from receiver.plugins.held import read_snapshot
from receiver.plugins.stage import DATA_NAME, StageWriter, VersionRef
from receiver.plugins.vllm_loader import ENV_PLAIN
from receiver.plugins.vllm_worker import canonical_zeros
from tests.sglang_env.chain import Trainer, base_state
from tests.sglang_env.server import Receiver, http, run_env_python, wait_for
from tests.vllm_env import build
from tests.vllm_env.fixtures import require_env
from tests.vllm_env.server import VLLMServer

pytestmark = [
    pytest.mark.vllm_real,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.timeout(900),
]

KEY = "vllm-key-0123456789"
EID = "vllm-real-0"
PROMPT = [24, 978, 642, 484, 20]
TOKENS = 8
ONE = "model.layers.1.mlp.down_proj.weight"
SOME = [
    "model.layers.0.self_attn.q_proj.weight",  # a block of the fused qkv_proj
    "model.layers.0.self_attn.v_proj.weight",
    "model.layers.0.mlp.up_proj.weight",  # a block of the fused gate_up_proj
    "model.layers.1.self_attn.o_proj.weight",
    "model.norm.weight",
    "lm_head.weight",
]
PAUSE = '"POST /pause?mode=abort HTTP'
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


@dataclass
class Stack:
    env: Path
    dir: Path
    server: VLLMServer
    trainer: Trainer
    receiver: Receiver
    served: dict[int, list[int]] = field(default_factory=dict)  # version -> greedy tokens

    @property
    def ckpt(self) -> Path:
        return self.dir / "ckpt"


def receiver_args(d: Path, url: str, *extra: str) -> list[str]:
    (d / "api.key").write_text(KEY + "\n")
    return [
        "--root", str(d / "root"), "--engine-id", EID, "--checkpoint", str(d / "ckpt"),
        "--vllm-url", url, "--api-key-file", str(d / "api.key"),
        "--engine-startup-timeout", "900", *extra,
    ]  # fmt: skip


def seed_checkpoint(d: Path, model: Path) -> None:
    """``asyncsync-receiver --once`` (no server yet, an engine id of its own: its ack must not
    claim a version for vLLM), then the model's side files copied in: the documented way to
    give vLLM a directory to start from (docs/ENGINES.md)."""
    exe = Path(sys.executable).with_name("asyncsync-receiver")
    args = [
        "--root",
        str(d / "root"),
        "--engine-id",
        f"{EID}-seed",
        "--checkpoint",
        str(d / "ckpt"),
    ]
    out = subprocess.run([str(exe), *args, "--once"], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    for name in SIDE_FILES:
        shutil.copy2(model / name, d / "ckpt" / name)


@pytest.fixture(scope="module")
def env() -> Path:
    return require_env()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(env: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    d = tmp_path_factory.mktemp("vllm-chain")
    model = build.model_dir(env)
    trainer = Trainer(d / "root", base_state(model))
    await trainer.open()  # v0, the seed
    seed_checkpoint(d, model)
    server = VLLMServer(env, d / "ckpt", d / "vllm.log", api_key=KEY, extra_env={ENV_PLAIN: "1"})
    receiver = Receiver(
        d / "receiver.log",
        receiver_args(d, server.url, "--audit-after-apply", "--audit-interval", "2"),
    )
    s = Stack(env, d, server, trainer, receiver)
    try:
        server.start()
        yield s
    finally:
        receiver.stop()
        s.server.stop()  # the one running now (a test restarts it)
        await trainer.close()


def served_checksums(server: VLLMServer, sd: dict[str, torch.Tensor]) -> dict[str, str]:
    """What the worker serves each tensor from (the extension's read-back), by checksum."""
    spec = {
        "algorithm": "xxh3-128",
        "tensors": {
            n: {
                "shape": list(t.shape),
                "dtype": str(t.dtype).removeprefix("torch."),
                "layout": None,
            }
            for n, t in sd.items()
        },
    }
    [got] = server.rpc("asyncsync_served_checksums", json.dumps(spec))
    assert got["unmapped"] == {}, got["unmapped"]
    sums = dict(got["checksums"])
    for n in got["zero_sign_canonical"]:  # read back through the kernel: zero signs are lost
        sums[n] = (sums[n], "canonical")  # type: ignore[assignment]
    return sums


def assert_serves(server: VLLMServer, sd: dict[str, torch.Tensor], what: str) -> None:
    sums = served_checksums(server, sd)
    assert sums.keys() == sd.keys()
    for name, want in sd.items():
        got = sums[name]
        if isinstance(got, tuple):
            ok = got[0] == checksum_tensor(canonical_zeros(want))
        else:
            ok = got == checksum_tensor(want)
        assert ok, f"{what}: the served {name} is not the trainer's"


async def check_served(s: Stack, version: int) -> None:
    """Ack, the server's label, every served tensor equal to the trainer's bytes; records the
    greedy tokens served (compared with transformers' in a later test)."""
    wait_for(
        f"vLLM to be labelled v{version}",
        lambda: s.server.weight_version() == str(version),
        timeout=300,
    )
    await s.trainer.wait_acked(version, EID, timeout=60)
    assert s.trainer.ack_of(EID) == version
    assert_serves(s.server, s.trainer.sd, f"v{version}")
    s.served[version] = s.server.complete(PROMPT, TOKENS)
    safetensors.torch.save_file(s.trainer.sd, s.dir / f"trainer-v{version}.safetensors")


def server_said(s: Stack, needle: str, timeout: float = 30.0) -> str:
    """The first line of the server's log (since the last start) holding ``needle``."""

    def find() -> str | None:
        text = s.server.text()
        tail = text[text.rfind("===== start") :]
        return next((line for line in tail.splitlines() if needle in line), None)

    return str(wait_for(f"the vLLM log to say {needle!r}", find, timeout=timeout))


def in_place(s: Stack, base: int, version: int, changed: int) -> None:
    """The server's log: ``version`` was XORed in place onto ``base``, nothing loaded whole."""
    n = len(s.trainer.sd)
    line = server_said(s, f"asyncsync: in-engine apply: v{base} -> v{version}: ")
    assert f"{changed} of {n} tensors XORed in place" in line and "0 loaded whole" in line, line
    engine = s.receiver.status()["engine"]
    assert engine["last_reload"]["method"] == "asyncsync_apply_stage", engine["last_reload"]


async def test_seed_deltas_zero_diff_keyframe_changed_tensor_set(stack: Stack) -> None:
    s = stack
    s.receiver.start()
    await check_served(s, 0)  # the seed: vLLM started on it; the receiver relabels it
    # the first load through the extension: the worker does not know its base yet
    server_said(s, "asyncsync: full reload (first reload")
    engine = s.receiver.status()["engine"]
    assert engine["in_engine"]["stages_supported"] is True, engine
    assert engine["workers"][0]["in_place"] is True and engine["workers"][0]["tp_size"] == 1

    v = await s.trainer.step(SOME)  # a delta
    await check_served(s, v)
    in_place(s, v - 1, v, len(SOME))

    pauses = s.server.count(PAUSE)
    v = await s.trainer.step([])  # zero diff: the label moves, the server is not paused
    await check_served(s, v)
    assert s.server.count(PAUSE) == pauses
    v = await s.trainer.step(SOME[2:4])  # its base is the zero diff (the same fingerprint)
    await check_served(s, v)
    in_place(s, v - 1, v, 2)

    v = await s.trainer.step(SOME[:2], keyframe=True)  # after its base: applied as a delta
    await check_served(s, v)
    in_place(s, v - 1, v, 2)

    v = await s.trainer.step([ONE])  # another set of tensors changed
    await check_served(s, v)
    in_place(s, v - 1, v, 1)
    v = await s.trainer.step(list(s.trainer.sd))  # every tensor changed
    await check_served(s, v)
    in_place(s, v - 1, v, len(s.trainer.sd))

    assert s.receiver.get("/readyz")[0] == 200
    audit = s.receiver.status()["audit"]
    assert audit["supported"] is True and audit["healthy"] is True, audit
    assert audit["last"]["checked"] == len(s.trainer.sd) and audit["last"]["skipped"] == {}


async def test_greedy_output_equals_transformers_on_the_same_bytes(stack: Stack) -> None:
    s = stack
    versions = sorted(s.served)
    assert len(versions) >= 6
    out = run_env_python(
        s.env,
        str(build.HERE / "hf_reference.py"),
        str(build.model_dir(s.env)),
        str(TOKENS),
        ",".join(map(str, PROMPT)),
        *(str(s.dir / f"trainer-v{v}.safetensors") for v in versions),
        environ=build.server_env(s.env),
    )
    ref = json.loads(out)
    assert {v: s.served[v] for v in versions} == dict(zip(versions, ref, strict=True))
    assert len({tuple(t) for t in ref}) > 1  # the versions do serve different outputs


def forged_stage(s: Stack, name: str, base: VersionRef | None = None) -> Path:
    """A stage under the checkpoint's stage folder that XORs ``ONE``'s first element, whose
    target is what the checkpoint holds; ``base``: the version it claims to apply to (default:
    the version before, under another fingerprint: not what the worker holds)."""
    snap = read_snapshot(s.ckpt)
    assert snap is not None
    target = VersionRef(snap.version, snap.run_id, snap.fingerprint)
    base = base or VersionRef(snap.version - 1, snap.run_id, "0" * 32)
    w = StageWriter(
        s.ckpt / ".asyncsync" / "engine-stage" / name,
        target=target,
        base=base,
        algorithm=snap.algorithm,
    )
    t = s.trainer.sd[ONE]
    w.add(ONE, t.dtype, t.shape, torch.tensor([0]), torch.tensor([0x40000000], dtype=torch.int32))
    return w.commit(snap.checksums, snap.parts)


async def test_a_stage_on_another_base_or_damaged_goes_through_the_checkpoint(
    stack: Stack,
) -> None:
    """The base check, on the real worker: a stage that claims another base than the weights
    the worker holds is never XORed; the worker loads the version from the checkpoint instead
    (nothing differs: nothing loaded). A stage whose data does not verify: the same. Served
    bytes stay the trainer's; the answer and the server's log say why."""
    s = stack
    v = s.trainer.ack_of(EID)
    stage = forged_stage(s, "wrong-base")
    [got] = s.server.rpc("asyncsync_apply_stage", str(stage))
    assert got["ok"] is True, got
    msg = got["message"]
    assert "stage not applied in place (the model holds" in msg and "the stage applies to" in msg
    assert "partial reload: loaded 0 of" in msg, msg
    server_said(s, "stage not applied in place (the model holds")
    assert_serves(s.server, s.trainer.sd, "after a stage on another base")

    snap = read_snapshot(s.ckpt)
    assert snap is not None
    held = VersionRef(snap.version, snap.run_id, snap.fingerprint)
    stage = forged_stage(s, "damaged", base=held)  # the right base, but damaged on disk
    data = bytearray((stage / DATA_NAME).read_bytes())
    data[-1] ^= 0x01
    (stage / DATA_NAME).write_bytes(bytes(data))
    [got] = s.server.rpc("asyncsync_apply_stage", str(stage))
    assert got["ok"] is True and "the stage does not verify" in got["message"], got
    assert_serves(s.server, s.trainer.sd, "after a damaged stage")
    shutil.rmtree(s.ckpt / ".asyncsync" / "engine-stage" / "wrong-base")
    shutil.rmtree(stage)

    v = await s.trainer.step([ONE])  # and the next real delta is applied in place
    await check_served(s, v)
    in_place(s, v - 1, v, 1)


async def test_the_audit_finds_weights_changed_behind_its_back_and_repairs(stack: Stack) -> None:
    """``/weight_checker {"action": "reset"}`` zeroes what vLLM serves (a real server changing
    its weights without the receiver): the audit finds it, reloads in full, and the trainer's
    bytes are served again; the ack, withdrawn from the repair's start (the server did not
    serve the version as published), names the same version again once it is repaired."""
    s = stack
    before = s.receiver.status()["audit"]
    held = s.trainer.ack_of(EID)
    code, _ = s.server.call("POST", "/weight_checker", {"action": "reset"})
    assert code == 200
    wait_for(
        "the audit to find the zeroed weights and repair them",
        lambda: (
            s.receiver.status()["audit"]["repairs"] > before["repairs"]
            and s.receiver.status()["audit"]["healthy"]
        ),
        timeout=180,
    )
    audit = s.receiver.status()["audit"]
    assert audit["mismatches"] > before["mismatches"]
    assert held is not None
    wait_for("the ack back", lambda: s.trainer.ack_of(EID) == held)
    assert_serves(s.server, s.trainer.sd, "after the repair")
    metrics = s.receiver.get("/metrics")[1]
    assert "asyncsync_receiver_audit_repairs_total" in metrics
    assert s.receiver.get("/readyz")[0] == 200
    # the repair is a full reload through the worker, which then knows its base again
    server_said(s, "full reload (the weights the server holds are not known: a full reload")
    v = await s.trainer.step(SOME[:1])
    await check_served(s, v)
    in_place(s, v - 1, v, 1)


async def test_receiver_restart_after_a_kill_mid_pause(stack: Stack) -> None:
    """A receiver killed between pause and resume leaves vLLM paused with the right label:
    its successor resumes it at start (nothing else would), then catches up."""
    s = stack
    held = s.trainer.ack_of(EID)
    s.receiver.stop(sig=9)
    code, _ = s.server.call("POST", "/pause?mode=abort")
    assert code == 200
    assert s.server.call("GET", "/is_paused")[1]["is_paused"] is True
    s.receiver.start()
    wait_for(
        "the new receiver to resume vLLM",
        lambda: s.server.call("GET", "/is_paused")[1]["is_paused"] is False,
        timeout=300,
    )
    assert held is not None
    await check_served(s, held)
    v = await s.trainer.step(SOME[2:])
    await check_served(s, v)
    in_place(s, v - 1, v, len(SOME[2:]))


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
    pauses = s.server.count(PAUSE)
    s.receiver.start()
    wait_for(
        "the receiver to refuse the damaged shard",
        lambda: "checksum" in (s.receiver.status()["last_error"] or "").lower(),
        timeout=180,
    )
    assert s.trainer.ack_of(EID) == held
    assert s.server.count(PAUSE) == pauses  # the server was never paused, let alone reloaded
    assert s.server.weight_version() == str(held)
    victim.write_bytes(good)
    await check_served(s, v)


async def test_the_api_key(stack: Stack) -> None:
    """vLLM's ``--api-key`` guards ``/v1`` (the receiver reads ``/v1/models`` at open: a wrong
    key is a 401 naming the key); its dev-mode weight endpoints take no key at all
    (``GUARDED_PREFIX`` is /v1, /v2, /inference, /cohere): only the network protects them."""
    s = stack
    assert http(s.server.url + "/v1/models")[0] == 401
    assert http(s.server.url + "/v1/models", key="wrong-key-0123456789")[0] == 401
    assert http(s.server.url + "/weight_info")[0] == 200  # unguarded, documented
    running = s.receiver.proc is not None
    s.receiver.stop()  # it holds the server (one receiver per server: ServerLock)
    try:
        engine = VLLM(s.server.url, s.dir / "wrong-key", api_key="wrong-key-0123456789")
        with pytest.raises(EngineHTTPError) as ei:
            await engine.open()
        assert ei.value.status == 401 and "API key" in str(ei.value)
    finally:
        if running:
            s.receiver.start()


async def test_a_method_the_workers_lack_is_named_in_the_error(stack: Stack) -> None:
    """How the receiver tells a server without (this version of) the worker extension: vLLM
    answers a ``/collective_rpc`` of a method its workers lack with an error naming it."""
    s = stack
    engine = VLLM(s.server.url, s.dir / "probe-ckpt", api_key=KEY)
    try:
        with pytest.raises(EngineHTTPError) as ei:
            await engine._rpc("asyncsync_no_such_method")
        assert ei.value.status is not None and ei.value.status >= 400, ei.value
        assert engine._missing(ei.value, "asyncsync_no_such_method"), ei.value.server_message
    finally:
        await engine.close()


async def test_a_version_the_server_refuses_is_not_acked_nor_served_as_ready(
    stack: Stack,
) -> None:
    """A version with a tensor the served model has no parameter for: vLLM's reload refuses
    it (HTTP 500 from /collective_rpc) and, seen on 0.32, leaves its layers on the meta device
    while still reporting the old label. Nothing is acknowledged and /readyz is 503 (what it
    serves is unknown); the ack of the version before is withdrawn too (it stayed: the server
    no longer serves that version either, the rule of a restarted server, docs/ENGINES.md).
    The keyframe after it (the tensor gone again) is taken without retrying the refused
    version first, makes the server whole and ready, and is acknowledged (check_served)."""
    s = stack
    held = s.trainer.ack_of(EID)
    extra = "model.layers.0.mlp.extra_proj.weight"
    s.trainer.sd[extra] = torch.ones(4, 4)
    refused = await s.trainer.step([])  # a new tensor set: published as a full version
    wait_for(
        "vLLM to refuse the version",
        lambda: "extra_proj" in (s.receiver.status()["engine"]["weights_unknown"] or ""),
        timeout=300,
    )
    wait_for("the ack withdrawn", lambda: s.trainer.ack_of(EID) is None)  # was: == held
    assert s.server.weight_version() == str(held)  # the label vLLM still reports
    code, why = s.receiver.get("/readyz")
    assert code == 503, why
    del s.trainer.sd[extra]
    v = await s.trainer.step([])  # the tensor set changes back: a full version
    assert v == refused + 1
    await check_served(s, v)
    assert s.receiver.get("/readyz")[0] == 200
    assert s.receiver.status()["engine"]["weights_unknown"] is None
    assert s.server.count("the engine refused v") == 0  # (that line is the receiver's)
    log = (s.dir / "receiver.log").read_text()
    assert f"v{refused} was refused by the engine: going on from keyframe v{v}" in log


async def test_server_restart_without_the_opt_in_while_versions_are_published(
    stack: Stack,
) -> None:
    """vLLM stops; two versions are published while it is down; it restarts (unlabelled)
    WITHOUT ``ASYNCSYNC_VLLM_INPLACE`` (its CPU linear weights packed): /readyz is 503 until
    the receiver has loaded the newest version into it (vLLM's ``reload_weights``: the worker
    says why) and labelled it. The receiver learns at reconnect that the workers cannot apply
    in place and stages nothing: the next delta is ``reload_weights`` too. A stage sent anyway
    is not XORed (the worker detects the packing) and the version comes from the checkpoint."""
    s = stack
    s.server.stop()
    wait_for("/readyz 503 with the server down", lambda: s.receiver.get("/readyz")[0] == 503)
    await s.trainer.step(SOME[:3])
    v = await s.trainer.step([ONE])
    s.server = VLLMServer(s.env, s.ckpt, s.dir / "vllm-packed.log", api_key=KEY, port=s.server.port)
    s.server.start()
    wait_for("/readyz 200", lambda: s.receiver.get("/readyz")[0] == 200, timeout=300)
    await check_served(s, v)
    line = server_said(s, "asyncsync: full reload (")
    assert "packed for vLLM's CPU GEMM kernel" in line and "reload_weights" in line, line
    engine = s.receiver.status()["engine"]
    assert engine["in_engine"]["stages_supported"] is False, engine
    assert ENV_PLAIN in engine["in_engine"]["why_not"], engine

    n = s.server.count("asyncsync: full reload (")
    v = await s.trainer.step(SOME[:2])
    await check_served(s, v)
    assert s.server.count("asyncsync: full reload (") == n + 1
    assert s.server.count("in-engine apply") == 0
    assert s.receiver.status()["engine"]["last_reload"]["method"] == "asyncsync_load"

    snap = read_snapshot(s.ckpt)
    assert snap is not None
    held = VersionRef(snap.version, snap.run_id, snap.fingerprint)
    stage = forged_stage(s, "to-packed", base=held)
    [got] = s.server.rpc("asyncsync_apply_stage", str(stage))
    assert got["ok"] is True, got
    assert "stage not applied in place (" in got["message"] and "packed" in got["message"]
    assert_serves(s.server, s.trainer.sd, "after a stage sent to packed weights")
    shutil.rmtree(stage)


async def test_weight_checker_is_blind_to_packed_cpu_linear_layers(stack: Stack) -> None:
    """Why the audit does not use vLLM's own ``/weight_checker`` on its CPU build: every
    linear layer's parameter is emptied once its weight is packed for oneDNN, and the
    checker hashes the empty parameter (SHA-256 of no bytes), whatever the layer serves."""
    empty = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    sums = stack.server.checksums()
    qkv = [k for k in sums if k.endswith("layers.0.self_attn.qkv_proj.weight")]
    assert qkv and sums[qkv[0]] == empty
    assert sums[next(k for k in sums if k.endswith("embed_tokens.weight"))] != empty
