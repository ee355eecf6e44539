"""The vLLM in-engine apply (receiver.plugins.vllm_loader, the worker extension's methods, the
VLLM engine's stage calls) on what the real server cannot be made to do on demand: two
tensor-parallel ranks (a toy model with SGLang's loader conventions: fused, sliced, tied
parameters), one rank refusing, packed or quantized layers on one rank, the extension gone
after a restart, an apply that fails midway, and the general plugin's dispatch patch against
a stand-in of vLLM's module. The real vLLM server's in-engine path: tests/test_vllm_real.py;
vLLM's real weight loaders at tensor-parallel size 2: tests/test_vllm_tp.py.

The fake vLLM server (tests/fake_engines.py) speaks vLLM's HTTP protocol; its
``/collective_rpc`` runs the real ``AsyncSyncWorkerExtension`` methods in one worker object per
rank, each holding a toy model.
"""

from __future__ import annotations

import json
import sys
import types
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncsync import ApplyFailed, Publisher
from receiver import ReceiverAgent
from receiver.engines import VLLM, EngineHTTPError, LocalCheckpoint, tied
from receiver.plugins import vllm_loader
from receiver.plugins.vllm_worker import AsyncSyncWorkerExtension
from tests.fake_engines import FAST, FAST_RETRY, FakeVLLM
from tests.sglang_toy import ToyForCausalLM, assert_same_params, hf_state, reference, step

TP = 2


class Runner:
    def __init__(self, model: ToyForCausalLM):
        self.model = model

    def get_model(self) -> ToyForCausalLM:
        return self.model


class Worker(AsyncSyncWorkerExtension):
    """What vLLM's worker offers the extension: its model, rank, and ``reload_weights``."""

    def __init__(self, rank: int, tp: int):
        self.rank = rank
        self.parallel_config = types.SimpleNamespace(tensor_parallel_size=tp)
        self.model = ToyForCausalLM(rank, tp)
        self.model_runner = Runner(self.model)
        self.full_reloads = 0
        self.fail_reload: str | None = None

    def reload_weights(self, weights_path: str | None = None) -> None:  # vLLM's, in full
        self.full_reloads += 1
        if self.fail_reload:
            raise KeyError(self.fail_reload)
        assert weights_path is not None
        self.model.load_weights(LocalCheckpoint(weights_path).load_state_dict().items())


class Workers:
    """The ``/collective_rpc`` side: each method runs in every worker, one answer each."""

    def __init__(self, tp: int = TP):
        self.ranks = [Worker(r, tp) for r in range(tp)]
        self.calls: list[str] = []
        self.refuse: dict[int, int] = {}  # rank -> how many more asyncsync calls it refuses
        self.gone = False  # restarted without the extension

    def __call__(self, method: str, args: list[Any]) -> list[Any]:
        self.calls.append(method)
        if self.gone or not method.startswith("asyncsync_"):
            raise AttributeError(method)
        out = []
        for w in self.ranks:
            if method != "asyncsync_capabilities" and self.refuse.get(w.rank, 0) > 0:
                self.refuse[w.rank] -= 1
                out.append({"ok": False, "message": "asyncsync: refused to load: test"})
                continue
            out.append(getattr(w, method)(*args))
        return out

    def check(self, sd: dict[str, torch.Tensor]) -> None:
        for w in self.ranks:
            assert_same_params(w.model, reference(sd, w.rank, len(self.ranks)))


class Rig:
    def __init__(self, tmp_path: Path, workers: Workers):
        self.ckpt = tmp_path / "ckpt"
        self.root = tmp_path / "root"
        self.pub = Publisher(self.root, bucket_bytes=4096, keyframe_interval=0)
        self.workers = workers
        self.srv = FakeVLLM(str(self.ckpt.absolute()), extension=workers)
        self.sd: dict[str, torch.Tensor] = {}
        self.seed = 0

    async def publish(self, names: list[str] | None = None, **kw: Any) -> int:
        if not self.sd:
            self.sd = hf_state(0)
            return (await self.pub.seed(self.sd)).version
        self.seed += 1
        self.sd = step(self.sd, [n for n in self.sd if n != "lm_head.weight"] if names is None
                       else names, self.seed)  # fmt: skip
        return (await self.pub.publish(self.sd, **kw)).version

    def messages(self) -> list[str]:
        last = self.engine.last_reload
        assert last is not None
        return list(last["messages"])

    @property
    def engine(self) -> VLLM:
        e = self.agent.engine
        assert isinstance(e, VLLM)
        return e


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    r = Rig(tmp_path, Workers())
    async with r.pub, r.srv:
        await r.publish()
        engine = VLLM(r.srv.url, r.ckpt, retry=FAST_RETRY, timeouts=FAST,
                      failure_backoff=(0.0, 0.0))  # fmt: skip
        r.agent = ReceiverAgent(r.root, engine, "v1", use_inotify=False, verify_deadline=0.2)
        async with r.agent:
            assert await r.agent.sync_once() == 0
            yield r


async def test_deltas_are_applied_in_place_on_every_rank(rig: Rig) -> None:
    r = rig
    e = r.engine
    assert e.stages_supported is True and e.in_place_why_not is None
    assert [w["rank"] for w in e.workers or []] == [0, 1]
    assert all("full reload (first reload" in m for m in r.messages())
    r.workers.check(r.sd)
    n = len(r.sd)
    for _ in range(3):
        v = await r.publish()
        assert await r.agent.sync_once() == v
        for m in r.messages():  # lm_head.weight: skipped by the tied toy's loader
            assert f"in-engine apply: v{v - 1} -> v{v}: {n - 1} of {n} tensors XORed" in m, m
        r.workers.check(r.sd)
    assert e.in_place_applies == 3
    v = await r.publish(keyframe=True)  # a keyframe after its base: staged as a delta too
    assert await r.agent.sync_once() == v
    assert all(f"in-engine apply: v{v - 1} -> v{v}" in m for m in r.messages()), r.messages()
    r.workers.check(r.sd)
    assert sum(w.full_reloads for w in r.workers.ranks) == TP  # only the first load


async def test_a_rank_that_refuses_leaves_the_version_unacked_until_a_reload(rig: Rig) -> None:
    """One rank applies the stage, the other refuses: the version is not acknowledged and the
    server counts as not ready (what it serves is unknown). The next sync stages nothing and
    loads the checkpoint on every rank: the rank that applied loads nothing, the other its
    changed tensors; both then equal a full load."""
    r = rig
    v = await r.publish()
    r.workers.refuse = {1: 1}
    with pytest.raises(EngineHTTPError, match="1 of 2 worker"):
        await r.agent.sync_once()
    assert await r.engine.serving_version() is None
    assert r.engine.info()["weights_unknown"]
    assert await r.agent.sync_once() == v
    msgs = r.messages()
    assert r.engine.last_reload is not None
    assert r.engine.last_reload["method"] == "asyncsync_load"
    assert "partial reload: loaded 0 of" in msgs[0] and "partial reload: loaded 21 of" in msgs[1]
    r.workers.check(r.sd)
    assert await r.engine.serving_version() == v
    v = await r.publish()  # and in place again
    assert await r.agent.sync_once() == v
    assert all("in-engine apply" in m for m in r.messages())
    r.workers.check(r.sd)


async def test_packed_weights_on_one_rank_mean_no_stages(rig: Rig) -> None:
    """A rank whose linear weights are packed (vLLM's CPU dispatch without the opt-in): the
    receiver learns it at reconnect and stages nothing; every version is vLLM's
    ``reload_weights`` on that rank, and says why (the plain rank loads its changed tensors).
    A stage sent anyway to packed weights: tests/test_vllm_real.py."""
    r = rig
    qkv = r.workers.ranks[1].model.model.layers[0].self_attn.qkv_proj
    qkv.cpu_linear = lambda x, w, b: torch.nn.functional.linear(x, w, b)  # vLLM's packed-style
    caps = r.workers.ranks[1].asyncsync_capabilities()
    assert caps["in_place"] is False and vllm_loader.ENV_PLAIN in caps["why_not"]
    assert "model.layers.0.self_attn.qkv_proj" in caps["why_not"]
    r.engine.standing.lost = True  # as after a server restart: the receiver asks again
    await r.engine.reconcile()
    assert r.engine.stages_supported is False
    assert "packed" in (r.engine.info()["in_engine"]["why_not"] or "")
    before = sum(w.full_reloads for w in r.workers.ranks)
    v = await r.publish()
    assert await r.agent.sync_once() == v
    assert "asyncsync_apply_stage" not in r.workers.calls[-2:]
    msgs = r.messages()
    assert "asyncsync: partial reload: loaded 21 of 21" in msgs[0], msgs
    assert "full reload (model.layers.0.self_attn.qkv_proj: its weight is packed" in msgs[1]
    assert sum(w.full_reloads for w in r.workers.ranks) > before
    r.workers.check(r.sd)


def test_quantized_layers_are_named() -> None:
    m = ToyForCausalLM(0, 1)
    m.model.layers[1].mlp.down_proj.quant_method = type("Fp8LinearMethod", (), {})()
    why = vllm_loader.packed(m)
    assert why is not None and why.startswith("model.layers.1.mlp.down_proj: Fp8LinearMethod")
    m.model.layers[1].mlp.down_proj.quant_method = type("UnquantizedLinearMethod", (), {})()
    assert vllm_loader.packed(m) is None


async def test_an_extension_gone_after_a_restart_reloads_in_the_same_pause(rig: Rig) -> None:
    """The server lost its extension (restarted without it) while the receiver still sends
    stages: the stage call fails with "no method", nothing changed, and the same pause
    reloads with vLLM's own ``reload_weights``; stages stop."""
    r = rig
    r.workers.gone = True
    v = await r.publish()
    pauses = r.srv.endpoints().count("POST /pause")
    assert await r.agent.sync_once() == v
    assert r.srv.endpoints().count("POST /pause") == pauses + 1
    assert r.srv.loads and r.srv.loads[-1].checkpoint_version == v  # reload_weights
    assert r.engine.stages_supported is False and r.engine.workers is None


async def test_an_apply_that_fails_midway_forgets_the_base(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error inside the XOR (not a refusal the loader foresaw): the worker no longer knows
    what it holds, says so, and the next load of the checkpoint is vLLM's full reload."""
    r = rig
    calls = {"n": 0}
    real = vllm_loader.InEngineLoader.apply_stage

    def boom(self: Any, *a: Any, **kw: Any) -> Any:
        calls["n"] += 1
        raise RuntimeError("device lost")

    monkeypatch.setattr(vllm_loader.InEngineLoader, "apply_stage", boom)
    v = await r.publish()
    with pytest.raises(EngineHTTPError, match=r"apply failed \(RuntimeError: device lost"):
        await r.agent.sync_once()
    assert calls["n"] == TP
    monkeypatch.setattr(vllm_loader.InEngineLoader, "apply_stage", real)
    assert all(vllm_loader.loader_for(w.model).held is None for w in r.workers.ranks)
    assert await r.agent.sync_once() == v
    assert all("full reload (the weights the server holds are not known" in m
               for m in r.messages())  # fmt: skip
    r.workers.check(r.sd)


async def test_a_full_reload_that_fails_is_not_adopted(rig: Rig) -> None:
    """vLLM's reload_weights raising (a tensor it has no parameter for) is an answer with
    ok false naming vLLM's error; the worker forgets its base."""
    r = rig
    for w in r.workers.ranks:
        w.fail_reload = "model.layers.0.mlp.extra_proj.weight"
    v = await r.publish()
    with pytest.raises(EngineHTTPError):
        await r.engine._reload_server(0, full=True)
    assert "extra_proj" in (r.engine.info()["weights_unknown"] or "")
    assert all(vllm_loader.loader_for(w.model).held is None for w in r.workers.ranks)
    for w in r.workers.ranks:
        w.fail_reload = None
    assert await r.agent.sync_once() == v
    r.workers.check(r.sd)


@pytest.mark.parametrize("changed", ["lm_head.weight", "model.embed_tokens.weight"])
async def test_a_trainer_that_unties_lm_head_is_refused_not_served_wrong(
    rig: Rig, changed: str
) -> None:
    """The served model ties ``lm_head`` to the embedding (``tie_word_embeddings`` in the
    checkpoint's config.json: its loader skips ``lm_head.weight``, as vLLM's and SGLang's do),
    and the trainer unties them: a version changes one of the two. The server cannot hold it
    (it serves the embedding's bytes under both names, in place and after vLLM's own reload
    alike), yet the version was applied, confirmed and acknowledged. It is refused before
    anything is written, saying why; the server keeps serving the version before."""
    r = rig
    (r.ckpt / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    v = await r.publish()  # still tied: in place as ever
    assert await r.agent.sync_once() == v
    good = r.sd
    r.seed += 1
    untied = step(good, ["model.embed_tokens.weight"], r.seed)  # both names (step re-ties)
    other = "model.embed_tokens.weight" if changed == "lm_head.weight" else "lm_head.weight"
    untied[other] = good[other]  # untied: the other one keeps its bytes
    await r.pub.publish(untied)
    with pytest.raises(ApplyFailed, match=r"lm_head.weight.*tie_word_embeddings"):
        await r.agent.sync_once()
    assert r.agent.engine.state.version == v
    r.workers.check(good)
    for w in r.workers.ranks:
        assert w.model.lm_head.weight is w.model.model.embed_tokens.weight  # still tied


@pytest.mark.parametrize(
    ("config", "ties"),
    [
        ({"tie_word_embeddings": True}, True),
        ({"tie_word_embeddings": False, "text_config": {"tie_word_embeddings": True}}, False),
        ({"text_config": {"tie_word_embeddings": True}}, True),  # a multimodal model's
        ({}, False),
        ([], False),
        (None, False),  # no config.json: cannot tell, nothing refused
    ],
)
def test_which_configs_tie_the_embeddings(tmp_path: Path, config: Any, ties: bool) -> None:
    if config is not None:
        (tmp_path / "config.json").write_text(json.dumps(config))
    assert tied.ties_embeddings(tmp_path) is ties


# ----------------------------------------------------------------------- the general plugin
@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    """A stand-in of ``vllm.model_executor.layers.utils`` with the dispatch it patches."""
    utils = types.ModuleType("vllm.model_executor.layers.utils")
    seen: list[Any] = []

    def dispatch_cpu_unquantized_gemm(layer: Any, remove_weight: bool) -> None:
        seen.append(layer)
        layer.cpu_linear = lambda x, w, b: x  # "packed"
        if remove_weight:
            layer.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)

    utils.dispatch_cpu_unquantized_gemm = dispatch_cpu_unquantized_gemm  # type: ignore[attr-defined]
    utils.seen = seen  # type: ignore[attr-defined]
    for name in ("vllm", "vllm.model_executor", "vllm.model_executor.layers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.model_executor.layers.utils", utils)
    yield utils


def test_the_plugin_keeps_plain_weights_only_when_opted_in(
    fake_vllm: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = fake_vllm.dispatch_cpu_unquantized_gemm
    monkeypatch.delenv(vllm_loader.ENV_PLAIN, raising=False)
    vllm_loader.register()
    assert fake_vllm.dispatch_cpu_unquantized_gemm is original  # not opted in: untouched

    monkeypatch.setenv(vllm_loader.ENV_PLAIN, "1")
    vllm_loader.register()
    vllm_loader.register()  # vLLM may load plugins again: not wrapped twice
    patched = fake_vllm.dispatch_cpu_unquantized_gemm
    assert patched is not original and getattr(patched, "_asyncsync_plain", False)
    layer = torch.nn.Linear(4, 3, bias=False)
    w = layer.weight
    patched(layer, True)
    assert layer.weight is w and layer.cpu_linear is torch.nn.functional.linear
    assert vllm_loader.vllm_guard("weight", layer) is None
    conv = torch.nn.Module()
    conv.weight = torch.nn.Parameter(torch.zeros(8, 1, 4), requires_grad=False)
    patched(conv, True)  # not a 2-D linear weight: vLLM's own dispatch
    assert fake_vllm.seen == [conv]
    assert vllm_loader.vllm_guard("weight", conv) is not None


def test_the_plugin_says_so_when_vllm_has_no_dispatch_to_patch(
    fake_vllm: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    del fake_vllm.dispatch_cpu_unquantized_gemm
    monkeypatch.setenv(vllm_loader.ENV_PLAIN, "1")
    vllm_loader.register()
    assert "does not exist in this vLLM" in caplog.text
