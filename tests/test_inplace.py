"""The in-engine apply (receiver.plugins.inplace) on a toy model with SGLang's loader
conventions at tensor-parallel size 2: fused ``qkv_proj``/``gate_up_proj`` shards, per-rank
row and column slices, a padded vocab-parallel embedding tied to ``lm_head``.

Versions come from a real Publisher and a ReceiverAgent whose engine stages every delta
(receiver.engines.stage_builder, as the SGLang engine does); each rank's loader applies the
stage in place, and every parameter must equal, bit for bit, a model loaded from the full new
state dict. Then each fallback, one test each: the result is always bit-exact, and the message
says which path was taken and why.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch
from torch import nn

from receiver.plugins.held import Held
from receiver.plugins.inplace import InEngineLoader
from receiver.plugins.stage import DATA_NAME
from tests.sglang_toy import (
    HIDDEN,
    Rig,
    ToyForCausalLM,
    assert_same_params,
    corrupt_tensor,
    hf_state,
    reference,
    step,
)


@pytest.mark.parametrize("encoding", ["xef", "deltas_zstd", "indices"])
async def test_stages_apply_in_place_bit_exact_across_tp_ranks(
    tmp_path: Path, encoding: str
) -> None:
    """Every tensor changes (~3 % of its elements) every version; xef stages its XOR as it
    is, the other encodings' new values are XORed with the checkpoint's old bytes."""
    async with Rig(tmp_path, tp=2, encoding=encoding) as rig:
        await rig.publish(hf_state(0))
        rig.load_all()  # the first load is SGLang's own, full
        assert rig.full_reloads == 2
        rig.check()
        names = [n for n in rig.sd if n != "lm_head.weight"]
        for seed in range(1, 4):
            v = await rig.publish(step(rig.sd, names, seed))
            msgs = rig.apply_all(v)
            n = len(rig.sd)
            for msg in msgs:
                # lm_head.weight is skipped by the tied model's loader: nothing to write
                assert msg.startswith(f"asyncsync: in-engine apply: v{v - 1} -> v{v}: ")
                assert f"{n - 1} of {n} tensors XORed in place" in msg and "0 loaded whole" in msg
            rig.check()
        assert rig.full_reloads == 2
        for loader in rig.loaders:
            assert loader.held is not None and loader.held.version.version == 3
            assert loader.held.source == "stage"
            # SGLang's loaders take views: every tensor goes through a sparse plan
            assert all(p.plan is not None for p in loader._probes.values() if p.footprint)


@pytest.mark.parametrize("kernels", ["native", "torch"])
@pytest.mark.parametrize("threads", [1, 3])
async def test_the_sparse_apply_is_the_same_on_every_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernels: str, threads: int
) -> None:
    """The C kernels (int32 positions XORed at a shift, the stage's positions checked in one
    pass) and the torch fallback, one thread or a pool: the same bytes."""
    from asyncsync import pipeline
    from asyncsync.codec import native

    if kernels == "torch":
        monkeypatch.setattr(native, "kernels", None)
    elif native.kernels is None:
        pytest.skip("the C kernels are not built")
    monkeypatch.setattr(pipeline, "_threads", threads)
    async with Rig(tmp_path, tp=2) as rig:
        await rig.publish(hf_state(4))
        rig.load_all()
        names = [n for n in rig.sd if n != "lm_head.weight"]
        for seed in (11, 12):
            v = await rig.publish(step(rig.sd, names, seed))
            for msg in rig.apply_all(v):
                assert "0 loaded whole" in msg, msg
            rig.check()
        assert rig.full_reloads == 2


async def test_a_sparse_apply_failing_on_the_pool_is_a_full_reload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One tensor's apply raises while the others run on the pool: the model may be
    half-written, so the same call reloads it whole (bit-exact after)."""
    from asyncsync import pipeline
    from receiver.plugins import inplace

    monkeypatch.setattr(pipeline, "_threads", 2)
    real = inplace.apply_plan

    def failing(plan: object, positions: torch.Tensor, values: torch.Tensor) -> int:
        if getattr(plan, "name", "") == "model.layers.0.mlp.down_proj.weight":
            raise RuntimeError("injected")
        return real(plan, positions, values)  # type: ignore[arg-type]

    async with Rig(tmp_path, tp=2) as rig:
        await rig.publish(hf_state(5))
        rig.load_all()
        v = await rig.publish(step(rig.sd, [n for n in rig.sd if n != "lm_head.weight"], 13))
        monkeypatch.setattr(inplace, "apply_plan", failing)
        for msg in rig.apply_all(v):
            assert "full reload" in msg and "injected" in msg, msg
        rig.check()
        assert rig.full_reloads == 4


async def test_zero_diff_and_a_single_tensor(tmp_path: Path) -> None:
    async with Rig(tmp_path, tp=2) as rig:
        await rig.publish(hf_state(1))
        rig.load_all()
        v = await rig.publish(step(rig.sd, ["model.layers.1.self_attn.v_proj.weight"], 5))
        for msg in rig.apply_all(v):
            assert "1 of" in msg and "XORed in place" in msg
        rig.check()
        v = await rig.publish(rig.sd)  # zero diff: no stage (the receiver only relabels)
        assert v not in rig.engine.stages
        v = await rig.publish(step(rig.sd, ["model.norm.weight"], 6))  # base: the zero diff
        for loader, msg in zip(rig.loaders, rig.apply_all(v), strict=True):
            assert "XORed in place" in msg, msg
            assert loader.held is not None and loader.held.version.version == v
        rig.check()


async def test_an_undone_apply_leaves_the_base_bit_exact(tmp_path: Path) -> None:
    async with Rig(tmp_path, tp=2) as rig:
        await rig.publish(hf_state(2))
        rig.load_all()
        base = dict(rig.sd)
        v = await rig.publish(step(rig.sd, list(rig.sd), 7))
        for loader in rig.loaders:
            from receiver.plugins.stage import read_stage

            stage = read_stage(rig.engine.stages[v])
            loader.probe(rig.ckpt, loader.held)  # type: ignore[arg-type]
            done = []
            for t in stage.tensors[:5]:
                loader._xor(t)
                done.append(t)
            assert loader._undo(done)
        for r, m in enumerate(rig.models):
            assert_same_params(m, reference(base, r, 2))


# --------------------------------------------------------------------------- fallbacks


async def test_fallback_another_base_goes_through_the_checkpoint(tmp_path: Path) -> None:
    """The model missed a version (it holds v1, the stage makes v3 from v2): never XORed."""
    async with Rig(tmp_path, tp=2) as rig:
        await rig.publish(hf_state(3))
        rig.load_all()
        names = list(rig.sd)
        await rig.publish(step(rig.sd, names[:4], 8))
        v = await rig.publish(step(rig.sd, names[4:8], 9))
        for r, loader in enumerate(rig.loaders):
            ok, msg = loader.apply_stage(rig.engine.stages[v], rig.full_of(r))
            assert ok and msg.startswith("asyncsync: stage not applied in place (the model "
                                         "holds v0")  # fmt: skip
            assert "asyncsync: partial reload: loaded" in msg
        rig.check()
        assert rig.full_reloads == 2  # the changed tensors whole, not a full reload


async def test_fallback_a_damaged_stage_goes_through_the_checkpoint(tmp_path: Path) -> None:
    async with Rig(tmp_path, tp=1) as rig:
        await rig.publish(hf_state(4))
        rig.load_all()
        names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight",
                 "model.norm.weight"]  # fmt: skip
        v = await rig.publish(step(rig.sd, names, 10))
        data = rig.engine.stages[v] / DATA_NAME
        b = bytearray(data.read_bytes())
        b[-1] ^= 0x10
        data.write_bytes(bytes(b))
        ok, msg = rig.loaders[0].apply_stage(rig.engine.stages[v], rig.full_of(0))
        assert ok and "stage not applied in place (the stage does not verify" in msg
        assert "partial reload: loaded 3 of" in msg
        rig.check()


async def test_fallback_first_load_is_full(tmp_path: Path) -> None:
    async with Rig(tmp_path, tp=1) as rig:
        await rig.publish(hf_state(5))
        rig.load_all()
        v = await rig.publish(step(rig.sd, list(rig.sd)[:2], 11))
        fresh = InEngineLoader(rig.models[0])  # a restarted server: nothing known
        ok, msg = fresh.apply_stage(rig.engine.stages[v], rig.full_of(0))
        assert ok and "not known" in msg and "[asyncsync: full reload (first reload" in msg
        rig.check()
        assert fresh.held is not None and fresh.held.version.version == v


async def test_fallback_in_place_off(tmp_path: Path) -> None:
    async with Rig(tmp_path, tp=1) as rig:
        await rig.publish(hf_state(6))
        rig.load_all()
        rig.loaders[0].in_place = False
        v = await rig.publish(step(rig.sd, list(rig.sd)[:2], 12))
        ok, msg = rig.loaders[0].apply_stage(rig.engine.stages[v], rig.full_of(0))
        assert ok and "ASYNCSYNC_IN_PLACE=0" in msg and "partial reload" in msg
        rig.check()


async def test_fallback_one_element_parameter_loads_whole(tmp_path: Path) -> None:
    """SGLang's default_weight_loader fills a one-element parameter from ``.item()``: that
    tensor is read whole from the checkpoint (verified), the others XORed."""
    async with Rig(tmp_path, tp=2, scale=True) as rig:
        await rig.publish(hf_state(7, scale=True))
        rig.load_all()
        v = await rig.publish(step(rig.sd, ["model.scale", "model.norm.weight"], 13))
        for msg in rig.apply_all(v):
            assert "1 of" in msg and "XORed in place" in msg and "1 loaded whole" in msg
            assert (
                "model.scale: parameter model.scale: torch.Tensor.fill_ of a value that left "
                "torch (torch.Tensor.item)" in msg
            )
        rig.check()


async def test_fallback_a_guarded_parameter_loads_whole(tmp_path: Path) -> None:
    async with Rig(tmp_path, tp=1) as rig:
        rig.loaders[0].guard = lambda p, m: "packed after loading" if "down_proj" in p else None
        await rig.publish(hf_state(8))
        rig.load_all()
        v = await rig.publish(step(rig.sd, list(rig.sd), 14))
        [msg] = rig.apply_all(v)
        assert "2 loaded whole" in msg and "packed after loading" in msg
        rig.check()


class Converting(ToyForCausalLM):
    """Norm weights arrive in bfloat16 and are stored in float32: ``copy_`` converts."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(
            (n, t.to(torch.bfloat16) if n == "model.norm.weight" and t.dtype == torch.float32
             else t) for n, t in weights
        )  # fmt: skip


async def test_fallback_a_converting_loader_loads_whole(tmp_path: Path) -> None:
    async with Rig(tmp_path, tp=1) as rig:
        rig.models = [Converting(0, 1)]
        rig.loaders = [InEngineLoader(rig.models[0])]
        await rig.publish(hf_state(9))
        rig.load_all()
        v = await rig.publish(
            step(rig.sd, ["model.norm.weight", "model.layers.0.mlp.up_proj.weight"], 15)
        )
        [msg] = rig.apply_all(v)
        assert "1 loaded whole (model.norm.weight:" in msg
        ref = Converting(0, 1)
        ref.load_weights(rig.sd.items())
        assert_same_params(rig.models[0], ref)


class BothTied(ToyForCausalLM):
    """A model whose loader does not skip the tied ``lm_head.weight``: two HF tensors write
    the same parameter bytes, and only a full load's order decides them."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for n, t in weights:
            if n == "lm_head.weight":
                p = self.lm_head.weight
                p[: p.shape[0] - 4].data.copy_(t.narrow(0, 0, p.shape[0] - 4))
            else:
                super().load_weights([(n, t)])


async def test_fallback_names_writing_the_same_bytes_go_through_the_checkpoint(
    tmp_path: Path,
) -> None:
    async with Rig(tmp_path, tp=1) as rig:
        rig.models = [BothTied(0, 1)]
        rig.loaders = [InEngineLoader(rig.models[0])]
        await rig.publish(hf_state(10))
        rig.load_all()
        v = await rig.publish(step(rig.sd, ["model.embed_tokens.weight"], 16))
        [msg] = rig.apply_all(v)
        assert "write the same bytes of model.embed_tokens.weight" in msg
        assert "partial reload" in msg


class Alternating(ToyForCausalLM):
    """A loader with state of its own: every other call writes only part of the norm, through
    a copy (``flip`` twice: no view, so no sparse plan; the dense XOR is routed at each apply).
    Its route then differs from its probe: the apply stops, undoes, goes through the
    checkpoint."""

    calls = 0

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for n, t in weights:
            if n == "model.norm.weight":
                self.calls += 1
                rows = HIDDEN if self.calls % 2 else 4
                self.model.norm.weight.data[:rows].copy_(t.flip(0).flip(0)[:rows])
            else:
                super().load_weights([(n, t)])


async def test_fallback_a_route_unlike_its_probe_is_undone(tmp_path: Path) -> None:
    async with Rig(tmp_path, tp=1) as rig:
        rig.models = [Alternating(0, 1)]
        rig.loaders = [InEngineLoader(rig.models[0])]
        await rig.publish(hf_state(11))
        rig.load_all()
        rig.models[0].calls = 0  # the probe is the next (odd) call, the real route even
        # sorted names: model.layers.* (XORed first) come before model.norm.weight
        v = await rig.publish(step(rig.sd, ["model.layers.0.mlp.up_proj.weight",
                                            "model.norm.weight"], 17))  # fmt: skip
        [msg] = rig.apply_all(v)
        assert "model.norm.weight: it routes differently than its probe" in msg
        assert "partial reload: loaded 2 of" in msg
        assert rig.loaders[0]._probes["model.layers.0.mlp.up_proj.weight"].plan is not None
        assert rig.loaders[0]._probes["model.norm.weight"].plan is None
        ref = Alternating(0, 1)
        ref.load_weights(rig.sd.items())
        assert_same_params(rig.models[0], ref)
        assert "model.norm.weight" in rig.loaders[0].not_xor
        v = await rig.publish(step(rig.sd, ["model.norm.weight"], 18))
        [msg] = rig.apply_all(v)  # known now: whole, no undo
        assert "0 of" in msg and "1 loaded whole (model.norm.weight" in msg


async def test_fallback_whole_tensor_fails_verification_nothing_written(tmp_path: Path) -> None:
    async with Rig(tmp_path, tp=1, scale=True) as rig:
        await rig.publish(hf_state(12, scale=True))
        rig.load_all()
        before = dict(rig.sd)
        v = await rig.publish(step(rig.sd, ["model.scale", "model.norm.weight"], 19))
        corrupt_tensor(rig.ckpt, "model.scale")
        ok, msg = rig.loaders[0].apply_stage(rig.engine.stages[v], rig.full_of(0))
        assert not ok and msg.startswith("asyncsync: refused to load:") and "checksum" in msg
        assert_same_params(rig.models[0], reference(before, 0, 1))  # not even the XORs
        assert rig.loaders[0].held is not None and rig.loaders[0].held.version.version == v - 1


async def test_fallback_whole_load_failing_midway_is_a_full_reload(tmp_path: Path) -> None:
    async with Rig(tmp_path, tp=1, scale=True) as rig:
        await rig.publish(hf_state(13, scale=True))
        rig.load_all()
        v = await rig.publish(step(rig.sd, ["model.scale", "model.norm.weight"], 20))
        model = rig.models[0]
        real = model.load_weights

        armed = []

        def flaky(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            batch = list(weights)
            if armed and [n for n, _ in batch] == ["model.scale"]:
                armed.clear()
                raise RuntimeError("device lost")
            real(batch)

        rig.loaders[0].probe(rig.ckpt, rig.loaders[0].held)  # type: ignore[arg-type]
        armed.append(True)  # the whole load (the probe is done) fails
        model.load_weights = flaky  # type: ignore[method-assign]
        ok, msg = rig.loaders[0].apply_stage(rig.engine.stages[v], rig.full_of(0))
        model.load_weights = real  # type: ignore[method-assign]
        assert ok and "[asyncsync: full reload (loading whole tensors failed midway" in msg
        rig.check()


async def test_fallback_checkpoint_not_at_the_stage_version_is_refused(tmp_path: Path) -> None:
    async with Rig(tmp_path, tp=1) as rig:
        await rig.publish(hf_state(14))
        rig.load_all()
        names = list(rig.sd)
        v2 = await rig.publish(step(rig.sd, names[:2], 21))
        kept = rig.ckpt.parent / "kept-stage"
        shutil.copytree(rig.engine.stages[v2], kept)
        await rig.publish(step(rig.sd, names[2:4], 22))  # the checkpoint moves to v3
        stage = rig.engine.stages[v2]
        shutil.rmtree(stage, ignore_errors=True)
        shutil.copytree(kept, stage)
        rig.loaders[0].forget("test")  # so the stage cannot be applied in place
        ok, msg = rig.loaders[0].apply_stage(stage, rig.full_of(0))
        assert not ok and "the checkpoint" in msg and f"holds v{v2 + 1}" in msg


async def test_a_stage_outside_a_checkpoint_is_refused(tmp_path: Path) -> None:
    async with Rig(tmp_path, tp=1) as rig:
        await rig.publish(hf_state(15))
        rig.load_all()
        v = await rig.publish(step(rig.sd, list(rig.sd)[:1], 23))
        moved = tmp_path / "elsewhere"
        shutil.copytree(rig.engine.stages[v], moved)
        ok, msg = rig.loaders[0].apply_stage(moved, rig.full_of(0))
        assert not ok and "not a stage of an asyncsync checkpoint" in msg


async def test_a_loader_that_rebinds_a_parameter_forgets_the_base(tmp_path: Path) -> None:
    class Rebinding(ToyForCausalLM):
        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            for n, t in weights:
                if n == "model.norm.weight" and getattr(self, "armed", False):
                    self.model.norm._parameters["weight"] = nn.Parameter(
                        t.clone(), requires_grad=False
                    )
                else:
                    super().load_weights([(n, t)])

    async with Rig(tmp_path, tp=1) as rig:
        rig.models = [Rebinding(0, 1)]
        rig.loaders = [InEngineLoader(rig.models[0])]
        await rig.publish(hf_state(16))
        rig.load_all()
        rig.models[0].armed = True  # type: ignore[attr-defined]
        v = await rig.publish(step(rig.sd, ["model.norm.weight"], 24))
        ok, msg = rig.loaders[0].apply_stage(rig.engine.stages[v], rig.full_of(0))
        rig.models[0].armed = False  # type: ignore[attr-defined]
        # probing changed the model: forgotten, and the checkpoint path is a full reload
        assert ok and "changed the model" in msg and "full reload" in msg
        rig.check()


def test_held_base_checks() -> None:
    from receiver.plugins.stage import Stage, VersionRef

    held = Held(Path("/c"), VersionRef(3, "r", "f3"), "xxh3-128", {"a": "1"}, {}, {"a": "m"})
    stage = Stage(Path("/c/.asyncsync/engine-stage/v4"), VersionRef(4, "r", "f4"),
                  VersionRef(3, "r", "f3"), "xxh3-128", (), {"a": "2"}, {}, 0)  # fmt: skip
    assert held.why_not_base_of(stage, Path("/c")) is None
    assert "loaded from" in str(held.why_not_base_of(stage, Path("/d")))
    other = Stage(stage.directory, stage.target, VersionRef(3, "r", "other"), "xxh3-128", (),
                  {"a": "2"}, {}, 0)  # fmt: skip
    assert "applies to" in str(held.why_not_base_of(other, Path("/c")))  # same number, other bytes
    run = Stage(stage.directory, stage.target, VersionRef(3, "r2", "f3"), "xxh3-128", (),
                {"a": "2"}, {}, 0)  # fmt: skip
    assert "applies to" in str(held.why_not_base_of(run, Path("/c")))
    names = Stage(stage.directory, stage.target, stage.base, "xxh3-128", (), {"b": "2"}, {}, 0)
    assert "set of tensors" in str(held.why_not_base_of(names, Path("/c")))
    advanced = held.advanced(stage)
    assert advanced.version.version == 4 and advanced.checksums == {"a": "2"}


def test_the_device_script_runs_bit_exact_on_cpu() -> None:
    """tests/sglang_env/bench_device_apply.py is for a GPU; on the CPU, small, it must still
    run and stay bit-exact (what keeps it working until a GPU runs it)."""
    from tests.sglang_env import bench_device_apply

    out = bench_device_apply.main(["--device", "cpu", "--gib", "0.002", "--repeats", "2"])
    assert out["bit_exact_per_path"] == {"plugin": True, "dense": True}
    assert out["changed_elements"] > 0 and out["plugin_path_s"] > 0 and out["dense_path_s"] > 0
