"""The served-bytes audit (receiver/audit.py) on engines in this process: a live module changed
behind the receiver's back is found, /readyz turns 503 with the reason, /status and /metrics
say so, a repair that restores the bytes makes it ready again, one that does not keeps it
503; the audit waits for an apply in progress; engines that cannot audit say so. Also the
vLLM worker extension's read-back (receiver/plugins/vllm_worker.py) on a model shaped like
vLLM's CPU build: fused parameters, a packed linear layer whose parameter was emptied.
The same audit against the real vLLM server: tests/test_vllm_real.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
import torch

from asyncsync import Manifest, Publisher
from asyncsync.codec import raw_clone, raw_view
from asyncsync.format.checksum import checksum_tensor
from receiver import ReceiverAgent
from receiver.audit import Auditor
from receiver.engines import TorchModule
from receiver.engines.base import AuditReport
from receiver.engines.checkpoint import LocalCheckpoint
from receiver.plugins.vllm_worker import canonical_zeros, served_tensors
from receiver.server import StatusServer
from tests.conftest import Holder, mixed_state, mutate


class Restoring(TorchModule):
    """A TorchModule whose repair puts back bytes kept aside (a stand-in for a full reload)."""

    good: dict[str, torch.Tensor] | None = None
    repairs = 0

    async def repair(self) -> None:
        self.repairs += 1
        if self.good is not None:
            for name, t in self.tensors().items():
                raw_view(t).copy_(raw_view(self.good[name]))  # a bool's bytes, not 0/1


@dataclass
class Setup:
    pub: Publisher
    agent: ReceiverAgent
    engine: Restoring
    sd: dict[str, torch.Tensor]


@pytest.fixture
async def setup(tmp_path: Path) -> AsyncIterator[Setup]:
    sd = mixed_state(0)
    engine = Restoring(Holder(sd))
    async with Publisher(tmp_path / "root", keyframe_interval=0) as pub:
        await pub.seed(sd)
        agent = ReceiverAgent(tmp_path / "root", engine, "gpu0", use_inotify=False)
        async with agent:
            await agent.sync_once()
            yield Setup(pub, agent, engine, sd)


def tamper(engine: TorchModule, name: str) -> None:
    flat = engine.tensors()[name].view(-1).view(torch.uint8)
    flat[0] ^= 0x40


async def test_a_mismatch_makes_readyz_503_until_a_repair_restores_the_bytes(
    setup: Setup,
) -> None:
    s = setup
    auditor = Auditor(s.agent, interval=None, after_apply=True)
    report = await auditor.audit_once()
    assert report is not None and report.ok and report.checked == len(s.sd)
    assert auditor.healthy and auditor.stats.audits == 1

    name = "model.layers.2.weight"
    s.engine.good = {n: raw_clone(t) for n, t in s.engine.tensors().items()}
    tamper(s.engine, name)
    s.engine.good = None  # the first repair restores nothing: still different
    async with StatusServer(s.agent, auditor=auditor) as server, aiohttp.ClientSession() as h:
        report = await auditor.audit_once()
        assert report is not None and report.mismatched == (name,)
        assert not auditor.healthy and s.engine.repairs == 1
        assert auditor.stats.mismatches == 2  # before and after the repair that did not help
        async with h.get(f"{server.url}/readyz") as r:
            body = await r.json()
            assert r.status == 503 and "audit" in body["why"], body
        async with h.get(f"{server.url}/status") as r:
            audit = (await r.json())["audit"]
        assert audit["healthy"] is False and audit["failing"] == [name]
        assert audit["last"]["mismatched"] == [name] and audit["repairs"] == 1
        async with h.get(f"{server.url}/metrics") as r:
            text = await r.text()
        assert 'asyncsync_receiver_audit_ok{engine_id="gpu0"} 0.0' in text
        assert 'asyncsync_receiver_audit_mismatched_tensors{engine_id="gpu0"} 1.0' in text
        assert 'asyncsync_receiver_audit_repairs_total{engine_id="gpu0"} 1.0' in text

        s.engine.good = {n: raw_clone(t) for n, t in s.sd.items()}  # now the repair works
        tamper(s.engine, "model.layers.5.weight")  # another one: this repair restores it
        report = await auditor.audit_once()
        assert report is not None and report.ok and auditor.healthy
        assert s.engine.repairs == 2
        async with h.get(f"{server.url}/readyz") as r:
            assert r.status == 200
        async with h.get(f"{server.url}/metrics") as r:
            assert 'asyncsync_receiver_audit_ok{engine_id="gpu0"} 1.0' in await r.text()


async def test_the_audit_runs_after_each_apply_and_never_during_one(setup: Setup) -> None:
    s = setup
    auditor = Auditor(s.agent, after_apply=True)
    stop = asyncio.Event()
    task = asyncio.create_task(auditor.run(stop=stop, tick=0.01))
    try:
        await _until(lambda: auditor.last is not None and auditor.last.version == 0)
        async with s.agent.exclusive():  # an apply in progress
            await s.pub.publish(mutate(s.sd, 0.1, seed=1))
            await asyncio.sleep(0.1)
            assert auditor.last.version == 0  # waits for the lock: nothing audited meanwhile
        await s.agent.sync_once()
        await _until(lambda: auditor.last is not None and auditor.last.version == 1)
        assert auditor.healthy and auditor.stats.audits == 2
    finally:
        stop.set()
        await task


class _Blind(LocalCheckpoint):
    """An engine that cannot audit (the Engine default; every engine shipped audits)."""

    async def audit(self, manifest: Manifest) -> AuditReport | None:
        return None


async def test_an_engine_that_cannot_audit_says_so(tmp_path: Path) -> None:
    async with Publisher(tmp_path / "root") as pub:
        await pub.seed(mixed_state(0))
        agent = ReceiverAgent(tmp_path / "root", _Blind(tmp_path / "c"), "e", use_inotify=False)
        async with agent:
            await agent.sync_once()
            auditor = Auditor(agent, interval=5)
            assert await auditor.audit_once() is None
            assert auditor.supported is False and auditor.healthy
            assert auditor.status()["supported"] is False


def test_an_interval_must_be_positive(tmp_path: Path) -> None:
    agent = ReceiverAgent(tmp_path, LocalCheckpoint(tmp_path / "c"), "e")
    with pytest.raises(ValueError, match="interval must be > 0"):
        Auditor(agent, interval=0)


async def _until(cond, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        assert loop.time() < end, "timed out"
        await asyncio.sleep(0.01)


# -- the vLLM worker extension's read-back, on a model shaped like vLLM's CPU build -----------


class _Packed(torch.nn.Module):
    """A linear layer as vLLM's CPU build leaves it: the weight packed away (here: kept in a
    closure), the parameter emptied, ``cpu_linear`` the kernel."""

    def __init__(self, w: torch.Tensor):
        super().__init__()
        kept = w.clone()
        self.weight = torch.nn.Parameter(torch.empty(0, dtype=w.dtype), requires_grad=False)
        self.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, kept, bias)


class _Model(torch.nn.Module):
    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, norm: torch.Tensor):
        super().__init__()
        self.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
        self.attn = torch.nn.Module()
        self.attn.qkv_proj = _Packed(torch.cat([q, k, v]))
        self.norm = torch.nn.Module()
        self.norm.weight = torch.nn.Parameter(norm.clone(), requires_grad=False)


def test_the_read_back_maps_fused_blocks_and_unpacks_through_the_kernel() -> None:
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(r, 8, generator=g) for r in (8, 4, 4))
    v[0, 0] = -0.0  # the kernel's read-back loses a zero's sign
    norm = torch.randn(8, generator=g)
    model = _Model(q, k, v, norm)
    spec = {
        "attn.q_proj.weight": ([8, 8], "float32"),
        "attn.k_proj.weight": ([4, 8], "float32"),
        "attn.v_proj.weight": ([4, 8], "float32"),
        "norm.weight": ([8], "float32"),
        "norm.bias": ([8], "float32"),
    }
    got, zero_sign, unmapped = served_tensors(model, spec)
    assert torch.equal(got["attn.q_proj.weight"], q) and torch.equal(got["attn.k_proj.weight"], k)
    assert torch.equal(got["norm.weight"], norm)
    assert zero_sign == ["attn.k_proj.weight", "attn.q_proj.weight", "attn.v_proj.weight"]
    assert checksum_tensor(got["attn.v_proj.weight"]) != checksum_tensor(v)  # the sign is lost
    assert checksum_tensor(canonical_zeros(got["attn.v_proj.weight"])) == checksum_tensor(
        canonical_zeros(v)
    )
    assert set(unmapped) == {"norm.bias"}

    del spec["attn.k_proj.weight"]  # a fused block whose siblings are not all published
    spec["norm.weight"] = ([8], "bfloat16")
    _, _, unmapped = served_tensors(model, spec)
    assert "not all of them are published" in unmapped["attn.q_proj.weight"]
    assert "served as torch.float32" in unmapped["norm.weight"]


def test_the_read_back_in_blocks_of_identity_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer wider than one block of identity rows is read back block by block, exactly."""
    from receiver.plugins import vllm_worker

    monkeypatch.setattr(vllm_worker, "_ROWS", 3)
    g = torch.Generator().manual_seed(4)
    w = torch.randn(5, 8, generator=g)
    layer = _Packed(w)
    got = vllm_worker._read_back(layer, layer.weight, (5, 8))
    assert got is not None and torch.equal(got, w)
