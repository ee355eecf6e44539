"""The in-engine audit (receiver.plugins.audit) and the receiver's view of it
(receiver.engines.audit_view), on the toy SGLang-like model at tensor-parallel size 2: what
the engine serves is compared with the trainer's bytes; a deliberately corrupted parameter is
found, the base forgotten, the record says so and the receiver counts the engine not ready
until a full reload repaired it."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from asyncsync.format.store import read_manifest
from receiver.engines.audit_view import AuditWatch
from receiver.engines.base import EngineState
from receiver.plugins.audit import Auditor, read_records, record_path
from tests.sglang_toy import Rig, hf_state, step


def state_of(rig: Rig) -> EngineState:
    return rig.engine.checkpoint.state


def auditors(rig: Rig) -> list[Auditor]:
    return [Auditor(loader, rank=r, tp_size=rig.tp) for r, loader in enumerate(rig.loaders)]


async def test_audit_passes_after_full_loads_and_in_place_applies(tmp_path: Path) -> None:
    async with Rig(tmp_path, tp=2) as rig:
        auds = auditors(rig)
        await rig.publish(hf_state(0))
        rig.load_all()
        assert [a.run_pass() for a in auds] == ["ok", "ok"]
        v = await rig.publish(step(rig.sd, list(rig.sd), 1))
        rig.apply_all(v)
        for a in auds:
            assert a.run_pass() == "ok"
            rec = a.record
            # every tensor but lm_head (skipped by the tied loader: no write to compare) checked
            assert rec.checked == rec.total == len(rig.sd) and rec.skipped == 0
            assert rec.held == {"version": v, "run_id": rig.pub.run_id,
                                "fingerprint": rig.loaders[0].held.version.fingerprint}  # type: ignore[union-attr]  # fmt: skip
            assert rec.last_ok_version == v and rec.passes == 2
        recs = read_records(rig.ckpt)
        assert [(r.rank, r.status, r.held_version) for r in recs] == [(0, "ok", v), (1, "ok", v)]


async def test_a_corrupted_served_tensor_is_found_and_repaired(tmp_path: Path) -> None:
    async with Rig(tmp_path, tp=2) as rig:
        auds = auditors(rig)
        await rig.publish(hf_state(2))
        rig.load_all()
        v = await rig.publish(step(rig.sd, list(rig.sd), 3))
        rig.apply_all(v)
        # bit rot in rank 1's slice of the fused gate_up_proj (as an XOR onto the wrong base
        # would leave it): the served bytes no longer equal the trainer's
        p = rig.models[1].model.layers[0].mlp.gate_up_proj.weight
        p.data.view(-1)[3] += 1
        assert auds[0].run_pass() == "ok"
        assert auds[1].run_pass() == "mismatch"
        rec = auds[1].record
        assert rec.mismatches[0]["name"] in ("model.layers.0.mlp.gate_proj.weight",
                                             "model.layers.0.mlp.up_proj.weight")  # fmt: skip
        assert "model.layers.0.mlp.gate_up_proj.weight" in rec.mismatches[0]["detail"]
        assert rig.loaders[1].held is None  # the base is forgotten: never XOR onto it

        watch = AuditWatch(rig.ckpt)
        problem = await watch.check(state_of(rig))
        assert problem is not None and "rank 1" in problem and watch.mismatches_seen == 1
        manifest = read_manifest(rig.root, v)
        report = await watch.report(manifest, state_of(rig), plugin=True)  # SGLang.audit's
        assert report is not None and report.mismatched == (rec.mismatches[0]["name"],)
        assert report.checked == len(rig.sd)

        # the next stage is not applied onto it: rank 1 goes through the checkpoint, in full
        v2 = await rig.publish(step(rig.sd, list(rig.sd)[:3], 4))
        msgs = rig.apply_all(v2)
        assert "XORed in place" in msgs[0]
        assert "not known" in msgs[1] and "full reload" in msgs[1]
        rig.check()
        assert auds[1].record.status == "pending"  # the full load rewrote the record
        started = time.time()
        assert auds[1].run_pass() == "ok" and auds[0].run_pass() == "ok"
        assert await watch.check(state_of(rig)) is None
        await watch.repaired(started)
        assert watch.repairs == 1
        report = await watch.report(read_manifest(rig.root, v2), state_of(rig), plugin=True)
        assert report is not None and report.ok and report.checked == len(rig.sd)


async def test_a_checkpoint_that_moved_on_is_skipped_not_blamed(tmp_path: Path) -> None:
    async with Rig(tmp_path, tp=1) as rig:
        [aud] = auditors(rig)
        await rig.publish(hf_state(5))
        rig.load_all()
        names = list(rig.sd)
        # the receiver patches the checkpoint to the next version while the engine serves v0
        await rig.publish(step(rig.sd, names[2:6], 6))
        assert aud.run_pass() == "ok"
        assert aud.record.skipped == 4 and aud.record.checked == len(names) - 4
        assert rig.loaders[0].held is not None


async def test_a_tensor_the_engine_transforms_is_taken_off_after_one_repair(
    tmp_path: Path,
) -> None:
    """A loader that post-processes a parameter after loading (unknown to the guard) differs
    from its checkpoint bytes right after a full load: the first time that is a mismatch (the
    receiver repairs with a full reload), the second time it is known for what it is."""
    async with Rig(tmp_path, tp=1) as rig:
        [aud] = auditors(rig)
        await rig.publish(hf_state(7))
        model = rig.models[0]

        def load_then_postprocess() -> None:
            rig.load_all()
            model.model.norm.weight.data.mul_(2)  # e.g. a scale folded in after loading

        rig.loaders[0].forget("test")
        load_then_postprocess()
        assert aud.run_pass() == "mismatch" and rig.loaders[0].held is None
        load_then_postprocess()  # the repair: a full reload
        assert aud.run_pass() == "ok"
        assert "model.norm.weight" in aud.record.not_auditable
        assert "model.norm.weight" in rig.loaders[0].not_xor


async def test_the_audit_thread_follows_changes(tmp_path: Path) -> None:
    async with Rig(tmp_path, tp=1) as rig:
        aud = Auditor(rig.loaders[0], bytes_per_s=1e12, interval=3600)
        aud.start()
        try:
            await rig.publish(hf_state(8))
            rig.load_all()
            path = record_path(rig.ckpt, 0)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not (
                path.exists() and read_records(rig.ckpt)[0].status == "ok"
            ):
                time.sleep(0.05)
            assert read_records(rig.ckpt)[0].status == "ok"
        finally:
            aud.stop()


async def test_a_rank_left_behind_is_not_ready(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank that reports another version than the one the receiver loaded (it refused while
    rank 0 answered) counts as not serving it, once its record is newer than the load."""
    import receiver.engines.audit_view as av

    async with Rig(tmp_path, tp=2) as rig:
        auds = auditors(rig)
        await rig.publish(hf_state(9))
        rig.load_all()
        for a in auds:
            a.run_pass()
        watch = AuditWatch(rig.ckpt)
        monkeypatch.setattr(av, "GRACE_SECONDS", 0.0)
        watch.loaded_at = time.time() - 1
        v = await rig.publish(step(rig.sd, list(rig.sd)[:2], 10))
        rig.loaders[0].apply_stage(rig.engine.stages[v], rig.full_of(0))  # rank 1 never does
        for a in auds:
            a.run_pass()
        problem = await watch.check(state_of(rig))
        assert problem is not None and "rank 1" in problem and f"loaded v{v}" in problem
        assert "rank 0" not in problem


@pytest.mark.parametrize("value", ["abc", "1e400", "nan", "-1", "inf"])
async def test_a_bad_audit_setting_in_the_environment_is_a_warning_and_the_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, value: str
) -> None:
    """The auditor is built while the engine loads its model (the SGLang plugin): a setting in
    the environment that is no usable number failed the load ("abc": ValueError) or ended the
    audit's thread later (1e400: OverflowError in its wait). It is a warning naming it, and the
    default; an argument given in code is a ConfigError."""
    for env in ("ASYNCSYNC_AUDIT_INTERVAL", "ASYNCSYNC_AUDIT_DELAY", "ASYNCSYNC_AUDIT_BYTES_PER_S"):
        monkeypatch.setenv(env, value)
    async with Rig(tmp_path, tp=1) as rig:
        aud = Auditor(rig.loaders[0])
        assert (aud.interval, aud.delay, aud.bytes_per_s) == (300.0, 2.0, float(256 << 20))
        said = " ".join(r.getMessage() for r in caplog.records if r.levelname == "WARNING")
        assert "$ASYNCSYNC_AUDIT_INTERVAL" in said and "$ASYNCSYNC_AUDIT_DELAY" in said, said
        with pytest.raises(ValueError, match="Auditor: interval"):
            Auditor(rig.loaders[0], interval=float("nan"))
