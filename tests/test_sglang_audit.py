"""SGLang's served-bytes audit through the receiver's Auditor (receiver/audit.py), against a
fake SGLang server with the asyncsync plugin's answers and audit records written by the test
(the faults the real server cannot produce on demand: a rank's mismatch record, a rank left
behind, a pass that has not finished, the audit off, a server without the plugin).

``SGLang.audit`` turns the plugin's per-rank records into an AuditReport; the Auditor decides:
``/readyz`` 503, a repair by a full reload, ``/status`` ``audit``, the
``asyncsync_receiver_audit_*`` metrics. The receiver runs that Auditor for SGLang by default
(``receiver_auditor``), so the plugin's audit keeps guarding readiness with no flag. The same
on the real server: tests/test_sglang_real_plugin.py and tests/test_sglang_real.py."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from asyncsync.format.acks import read_acks
from asyncsync.format.store import read_manifest
from receiver import ReceiverAgent
from receiver.audit import Auditor, receiver_auditor
from receiver.engines import SGLang
from receiver.engines.checkpoint import LocalCheckpoint
from receiver.plugins.audit import AuditRecord, record_path
from receiver.server import StatusServer
from tests import test_sglang_stage as stage
from tests.fake_engines import Chain
from tests.test_sglang_stage import FakePluginSGLang, agent_for, engine_for, loaded

chain, srv = stage.chain, stage.srv  # the fixtures


@dataclass
class Synced:
    """An SGLang engine on the fake server that took the chain's first version."""

    ckpt: Path
    engine: SGLang
    agent: ReceiverAgent
    version: int

    @property
    def names(self) -> list[str]:
        return [t.name for t in read_manifest(self.agent.root, self.version).tensors]


@pytest.fixture
async def synced(chain: Chain, srv: FakePluginSGLang, tmp_path: Path) -> AsyncIterator[Synced]:
    ckpt = tmp_path / "ckpt"
    engine = engine_for(srv, ckpt)
    async with agent_for(chain, engine) as agent:
        v = await chain.next()
        await agent.sync_once()
        yield Synced(ckpt, engine, agent, v)


def write_record(ckpt: Path, engine: SGLang, status: str, rank: int = 0, **kw: Any) -> None:
    """Rank ``rank``'s record as the plugin writes it, holding what ``engine`` holds unless
    ``held`` is given."""
    s = engine.state
    mine = {"version": s.version, "run_id": s.run_id, "fingerprint": s.fingerprint}
    held = kw.pop("held", mine)
    rec = AuditRecord(rank, 2, "target", 4242, status, held, **kw)
    rec.updated_at = kw.get("updated_at") or time.time()
    path = record_path(ckpt, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rec.__dict__))


def mismatch(ckpt: Path, engine: SGLang, name: str, rank: int = 0) -> None:
    m = {"name": name, "detail": "1 element(s) differ", "version": engine.state.version,
         "at": time.time()}  # fmt: skip
    write_record(ckpt, engine, "mismatch", rank, mismatches=[m])


async def report(agent: ReceiverAgent) -> Any:
    engine = agent.engine
    assert isinstance(engine, SGLang) and engine.state.version is not None
    return await engine.audit(read_manifest(agent.root, engine.state.version))


async def until(cond: Any, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        await asyncio.sleep(0.02)


async def test_a_ranks_mismatch_record_makes_the_auditor_unhealthy_until_repaired(
    chain: Chain, srv: FakePluginSGLang, tmp_path: Path
) -> None:
    """The Auditor the receiver runs by default (no flag) reads the plugin's records: rank 1's
    mismatch turns /readyz 503 with the audit's reason, a repair that fails keeps it so (and
    withdraws the ack: the server does not serve the version as published), a
    full reload repairs it (the stale record of a rank that no plugin rewrites is dropped),
    and /readyz is 200 again; /status and /metrics say so through the Auditor."""
    ckpt = tmp_path / "ckpt"
    engine = engine_for(srv, ckpt)
    agent = agent_for(chain, engine)
    engine.audit_interval = 0.05  # (5 s by default)
    auditor = receiver_auditor(agent)
    assert auditor is not None and auditor.interval == 0.05 and not auditor.after_apply
    server = StatusServer(agent, auditor=auditor)
    async with agent, server as status, aiohttp.ClientSession() as http:

        async def get(path: str) -> tuple[int, Any]:
            async with http.get(status.url + path) as r:
                return r.status, (await r.json() if path != "/metrics" else await r.text())

        v = await chain.next()
        await agent.sync_once()
        names = [t.name for t in read_manifest(chain.root, v).tensors]
        write_record(ckpt, engine, "ok", 0, checked=len(names), total=len(names))
        write_record(ckpt, engine, "ok", 1, checked=len(names), total=len(names))
        stop = asyncio.Event()
        task = asyncio.create_task(auditor.run(stop=stop, tick=0.01))
        try:
            await until(lambda: auditor.last is not None)
            assert auditor.last is not None and auditor.last.ok
            assert auditor.last.checked == len(names) and auditor.supported is True
            assert (await get("/readyz"))[0] == 200

            srv.inject("/update_weights_from_disk", status=500, times=1)  # the 1st repair fails
            mismatch(ckpt, engine, names[2], rank=1)
            await until(lambda: auditor.stats.errors >= 1)
            code, body = await get("/readyz")
            # the repair failed: the server does not serve v as published, the ack is withdrawn
            assert code == 503 and body["serving"] is None
            assert "e1" not in read_acks(chain.root)
            st = (await get("/status"))[1]["audit"]
            assert st["healthy"] is False and st["failing"] == [names[2]]
            metrics = (await get("/metrics"))[1]
            assert 'asyncsync_receiver_audit_ok{engine_id="e1"} 0.0' in metrics

            await until(lambda: auditor.healthy, timeout=30)  # retried: the repair worked
            assert loaded(srv)[-1] == "checkpoint"
            assert not record_path(ckpt, 1).exists()  # stale: no plugin rewrote it
            assert auditor.stats.repairs == 2 and auditor.stats.mismatches >= 2
            assert (await get("/readyz"))[0] == 200
            metrics = (await get("/metrics"))[1]
            assert 'asyncsync_receiver_audit_ok{engine_id="e1"} 1.0' in metrics
            assert 'asyncsync_receiver_audit_repairs_total{engine_id="e1"} 2.0' in metrics
            assert "asyncsync_receiver_engine_audit_ok" not in metrics  # one path: the Auditor's
        finally:
            stop.set()
            await task
        await chain.next()  # the next version is staged again (the audit is clean)
        await agent.sync_once()
        assert loaded(srv)[-1] == "stage"


async def test_the_report_says_per_tensor_what_was_compared_and_why_not(
    synced: Synced, srv: FakePluginSGLang
) -> None:
    ckpt, engine, agent, v = synced.ckpt, synced.engine, synced.agent, synced.version
    names = synced.names
    n, calls = len(names), len(srv.endpoints())
    write_record(ckpt, engine, "ok", 0, checked=n - 2, total=n, skipped=1,
                 skipped_names=[names[0]],
                 not_auditable={names[1]: "a scale folded in"})  # fmt: skip
    write_record(ckpt, engine, "ok", 1, checked=n, total=n)
    r = await report(agent)
    assert r.ok and r.version == v and r.checked == n - 2
    assert "moved on to the next version" in r.skipped[names[0]]
    assert r.skipped[names[1]] == "rank 0 (target): not auditable: a scale folded in"
    assert "in-engine audit" in r.how

    write_record(ckpt, engine, "running", 1, checked=3, total=n)  # rank 1's pass goes on
    r = await report(agent)
    assert r.ok and r.checked == 0 and len(r.skipped) == n
    want = f"rank 1 (target): its audit pass over v{v} is running (3 of {n} compared)"
    assert r.skipped[names[5]] == want

    async def finish() -> None:
        await asyncio.sleep(0.3)
        write_record(ckpt, engine, "ok", 1, checked=n, total=n)

    engine.audit_wait = 10.0  # --audit-after-apply: wait for the pass
    waiter = asyncio.create_task(finish())
    t0 = time.monotonic()
    r = await report(agent)
    await waiter
    assert r.checked == n - 2 and time.monotonic() - t0 >= 0.3
    engine.audit_wait = 0.0

    mismatch(ckpt, engine, names[3], rank=0)
    r = await report(agent)
    assert r.mismatched == (names[3],) and not r.ok
    assert srv.endpoints()[calls:] == []  # records only: the server is not even asked


async def test_a_rank_left_behind_is_a_mismatch_after_the_grace(
    synced: Synced, chain: Chain
) -> None:
    import receiver.engines.audit_view as av

    ckpt, engine, agent = synced.ckpt, synced.engine, synced.agent
    v = await chain.next()
    await agent.sync_once()
    old = {"version": v - 1, "run_id": engine.state.run_id, "fingerprint": "f" * 16}
    write_record(ckpt, engine, "ok", 1, held=old)  # rank 1 refused the last load
    write_record(ckpt, engine, "ok", 0)
    r = await report(agent)  # within the grace: not reported yet, not blamed
    assert r.ok and "has not reported holding" in next(iter(r.skipped.values()))
    engine.audit_watch.loaded_at -= av.GRACE_SECONDS + 1
    write_record(ckpt, engine, "ok", 1, held=old)
    r = await report(agent)
    assert r.mismatched == (f"<rank 1 (target) holds v{v - 1}, not v{v}>",)


async def test_a_damaged_or_missing_rank_record_vouches_for_nothing(synced: Synced) -> None:
    """Rank 1's record is damaged (bad JSON, a field of the wrong type, a FIFO) or absent: its
    slices are not compared as far as the receiver can tell, so nothing counts as checked on
    every rank; rank 0's mismatch still counts."""
    import os

    ckpt, engine, agent, n = synced.ckpt, synced.engine, synced.agent, len(synced.names)
    write_record(ckpt, engine, "ok", 0, checked=n, total=n)
    path = record_path(ckpt, 1)
    fields = {"format": "asyncsync-audit", "rank": 1, "status": "ok", "role": "target",
              "tp_size": 2, "pid": 1, "held": None}  # fmt: skip
    short = {k: fields[k] for k in ("format", "rank", "status")}  # fields missing
    for damage in ("{not json", json.dumps({**fields, "mismatches": "x"}),
                   json.dumps({**fields, "tp_size": 10**12}), json.dumps(short),
                   None, "fifo"):  # fmt: skip
        path.unlink(missing_ok=True)
        if damage == "fifo":
            os.mkfifo(path)
        elif damage is not None:
            path.write_text(damage)
        r = await report(agent)
        assert r.ok and r.checked == 0, damage
        assert set(r.skipped.values()) == {"rank 1 (target) has no readable audit record"}
    path.unlink()
    mismatch(ckpt, engine, "model.layers.0.weight", rank=0)
    r = await report(agent)
    assert r.mismatched == ("model.layers.0.weight",)


async def test_no_plugin_or_the_audit_off_cannot_tell(
    synced: Synced, chain: Chain, srv: FakePluginSGLang
) -> None:
    ckpt, engine, agent = synced.ckpt, synced.engine, synced.agent
    r = await report(agent)  # the plugin answered but wrote no record yet: nothing vouched
    assert r is not None and r.ok and r.checked == 0
    assert "no rank of the plugin has written" in next(iter(r.skipped.values()))
    write_record(ckpt, engine, "off", 0)  # ASYNCSYNC_AUDIT=0 in the server
    assert await report(agent) is None

    mismatch(ckpt, engine, "x", rank=0)
    srv.plugin = False  # restarted without the plugin: its old records vouch for nothing
    await chain.next()
    await agent.sync_once()
    assert await report(agent) is None
    auditor = Auditor(agent)
    assert await auditor.audit_once() is None and auditor.supported is False
    assert auditor.healthy


async def test_the_receivers_auditor_by_engine(chain: Chain, tmp_path: Path) -> None:
    agent = ReceiverAgent(chain.root, LocalCheckpoint(tmp_path / "c"), "e", use_inotify=False)
    assert receiver_auditor(agent) is None  # serves nothing: nothing to audit unless asked
    a = receiver_auditor(agent, after_apply=True)
    assert a is not None and a.after_apply and a.interval is None
    sg = SGLang("http://127.0.0.1:1", tmp_path / "s")
    agent = ReceiverAgent(chain.root, sg, "e", use_inotify=False)
    a = receiver_auditor(agent)
    assert a is not None and a.interval == 5.0 and not a.after_apply
    a = receiver_auditor(agent, interval=60, after_apply=True)
    assert a is not None and (a.interval, a.after_apply) == (60, True)
    assert receiver_auditor(agent, enabled=False) is None
