"""The in-engine SGLang loader plugin, against a small torch model that follows SGLang's loader
conventions: ``stacked_params_mapping`` (q/k/v -> ``qkv_proj`` with shard ids "q"/"k"/"v",
gate/up -> ``gate_up_proj`` with shard ids 0/1), per-rank slicing (``tp_rank``/``tp_size``:
column-parallel rows, row-parallel columns, a vocab-parallel embedding) and tied embeddings
(``lm_head`` shares the embedding and ``load_weights`` skips ``lm_head.weight``).

Versions come from a real Publisher and a ReceiverAgent keeping a LocalCheckpoint; after each,
the plugin reloads the model and every parameter must equal, bit for bit, a model loaded from
the full new state dict. No SGLang runs here (see docs/ENGINES.md).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pkgutil
import sys
import types
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import torch

from receiver.engines import LocalCheckpoint
from receiver.plugins import sglang_loader
from receiver.plugins.sglang_loader import (
    HOOK_TARGET,
    HOOK_TARGETS,
    read_snapshot,
    update_weights_from_disk_hook,
)
from tests.sglang_toy import (
    Rig,
    ToyForCausalLM,
    assert_same_params,
    corrupt_tensor,
    hf_state,
    reference,
    step,
)


@pytest.fixture(autouse=True)
def _no_audit_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hook starts an auditor thread per model; these tests count load_weights calls."""
    monkeypatch.setenv("ASYNCSYNC_AUDIT", "0")


# --------------------------------------------------------------------------- harness


class Harness(Rig):
    """A publisher, a receiver keeping ``ckpt``, and two TP ranks of the toy model, each with
    the plugin's per-model loader, reloading from the checkpoint."""

    def __init__(self, tmp_path: Path, tp_size: int = 2):
        super().__init__(tmp_path, tp=tp_size)
        self.reloaders = self.loaders

    def full_reload(self, rank: int) -> Callable[[], tuple[bool, str]]:
        """What SGLang's own reload of the checkpoint does: every tensor."""
        full = self.full_of(rank)
        return lambda: full(str(self.ckpt))

    def reload_all(self) -> list[list[str]]:
        """Reload every rank; returns the names each rank's load_weights received."""
        seen = []
        for r, (model, reloader) in enumerate(zip(self.models, self.reloaders, strict=True)):
            model.loaded_names.clear()
            ok, msg = reloader.reload_checkpoint(self.ckpt, self.full_reload(r))
            assert ok, msg
            seen.append(list(model.loaded_names))
            assert_same_params(model, reference(self.sd, r, self.tp))
        return seen


# --------------------------------------------------------------------------- tests


async def test_changed_tensors_only_bit_exact_across_tp_ranks(tmp_path: Path) -> None:
    async with Harness(tmp_path) as h:
        sd = hf_state(0)
        await h.publish(sd)
        h.reload_all()  # first reload: the plugin does not know what the model holds
        assert h.full_reloads == 2

        changed = [
            "model.layers.0.self_attn.k_proj.weight",  # one shard of a fused qkv_proj
            "model.layers.1.mlp.up_proj.weight",  # one shard of a fused gate_up_proj
            "model.layers.1.self_attn.o_proj.weight",  # row-parallel
            "model.embed_tokens.weight",  # vocab-parallel and tied to lm_head
            "model.norm.weight",  # replicated, fp32
        ]
        await h.publish(step(sd, changed, seed=1))
        seen = h.reload_all()
        assert h.full_reloads == 2  # no full reload this time
        expect = sorted([*changed, "lm_head.weight"])  # the checkpoint's lm_head changed too
        assert [sorted(s) for s in seen] == [expect, expect]  # unchanged tensors are not read
        for m in h.models:  # the tie holds: lm_head is the (new) embedding
            assert m.get_parameter("lm_head.weight") is m.get_parameter("model.embed_tokens.weight")

        await h.publish(h.sd)  # zero diff: nothing to load
        assert h.reload_all() == [[], []]


async def test_versions_skipped_between_reloads_are_all_loaded(tmp_path: Path) -> None:
    async with Harness(tmp_path) as h:
        sd = hf_state(1)
        await h.publish(sd)
        h.reload_all()
        names = list(sd)
        sd2 = step(sd, names[1:3], seed=2)
        await h.publish(sd2)
        sd3 = step(sd2, names[5:7], seed=3)
        await h.publish(sd3)  # the server missed v2's reload: v3 must carry both changes
        seen = h.reload_all()
        assert set(seen[0]) == set(names[1:3]) | set(names[5:7])
        assert h.full_reloads == 2


async def test_fallbacks_to_a_full_reload(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    async with Harness(tmp_path, tp_size=1) as h:
        sd = hf_state(2)
        await h.publish(sd)
        h.reload_all()
        assert h.full_reloads == 1

        # load_weights fails midway: the model may be half-updated, so reload all of it
        await h.publish(step(sd, ["model.layers.0.mlp.gate_proj.weight"], seed=4))
        model = h.models[0]
        real = model.load_weights
        calls = {"n": 0}

        def flaky(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("CUDA out of memory")
            real(weights)

        model.load_weights = flaky  # type: ignore[method-assign]
        ok, _ = h.reloaders[0].reload_checkpoint(h.ckpt, h.full_reload(0))
        model.load_weights = real  # type: ignore[method-assign]
        assert ok and h.full_reloads == 2 and "partial reload failed" in caplog.text
        assert_same_params(model, reference(h.sd, 0, 1))

        # the checkpoint's bytes disagree with state.json: refused, neither partial nor full
        # (a checkpoint SGLang cannot load kills it); nothing was loaded
        before = dict(h.sd)
        await h.publish(step(h.sd, ["model.layers.1.mlp.down_proj.weight"], seed=5))
        corrupt_tensor(h.ckpt, "model.layers.1.mlp.down_proj.weight")
        ok, msg = h.reloaders[0].reload_checkpoint(h.ckpt, h.full_reload(0))
        assert not ok and "refused" in msg and "checksum" in msg and h.full_reloads == 2
        assert_same_params(model, reference(before, 0, 1))
        assert h.reloaders[0].held is not None  # still what the model holds

        # a version being applied is not verified: refused as well
        state_file = h.ckpt / ".asyncsync" / "state.json"
        clean = state_file.read_bytes()
        applying = {"status": "applying", "target_version": 99, "mode": "delta"}
        state_file.write_text(json.dumps({**json.loads(clean), **applying}))
        ok, msg = h.reloaders[0].reload_checkpoint(h.ckpt, h.full_reload(0))
        assert not ok and "being applied" in msg and h.full_reloads == 2
        state_file.write_bytes(clean)

        # not an asyncsync checkpoint: full reload, base forgotten
        ok, msg = h.reloaders[0].reload_checkpoint(tmp_path, h.full_reload(0))
        assert ok and h.full_reloads == 3 and h.reloaders[0].held is None
        assert "[asyncsync: full reload (not an asyncsync checkpoint)]" in msg


async def test_a_mismatch_after_the_first_batch_is_an_error_midway(tmp_path: Path) -> None:
    """Changed tensors larger than one batch are verified, then read again batch by batch; a
    tensor that changes on disk in between fails midway: a full reload, base forgotten."""
    async with Harness(tmp_path, tp_size=1) as h:
        sd = hf_state(6)
        await h.publish(sd)
        h.reload_all()
        names = ["model.layers.0.mlp.gate_proj.weight", "model.layers.1.mlp.down_proj.weight"]
        await h.publish(step(sd, names, seed=9))
        model, reloader = h.models[0], h.reloaders[0]
        reloader.batch_bytes = 1  # one tensor per load_weights call
        real = model.load_weights

        def damage_after_first(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            real(weights)
            if len(model.loaded_names) == 1:
                corrupt_tensor(h.ckpt, names[1])

        model.loaded_names.clear()
        model.load_weights = damage_after_first  # type: ignore[method-assign]
        ok, msg = reloader.reload_checkpoint(h.ckpt, h.full_reload(0))
        model.load_weights = real  # type: ignore[method-assign]
        assert ok and "partial reload failed midway" in msg and h.full_reloads == 2
        assert reloader.held is None  # the files no longer match state.json


async def test_snapshot_of_a_checkpoint(tmp_path: Path) -> None:
    async with Harness(tmp_path, tp_size=1) as h:
        assert read_snapshot(h.ckpt) is None  # no version yet
        await h.publish(hf_state(3))
        snap = read_snapshot(h.ckpt)
        assert snap is not None and snap.version == 0 and set(snap.checksums) == set(h.sd)
        assert snap.algorithm == "xxh3-128"
    assert read_snapshot(tmp_path / "missing") is None


# --------------------------------------------------------------------------- SGLang glue


class FakeModelConfig:
    def __init__(self, quantization: str | None = None):
        self.quantization = quantization
        self.model_path = "/models/base"


class FakeRunner:
    """What the hook uses of SGLang's ModelRunner: ``model`` and ``model_config``."""

    def __init__(self, model: ToyForCausalLM, quantization: str | None = None):
        self.model = model
        self.model_config = FakeModelConfig(quantization)
        self.original_calls: list[tuple[str, Any, dict[str, Any]]] = []


def original_update(h: Harness) -> Callable[..., tuple[bool, str]]:
    def update_weights_from_disk(
        runner: FakeRunner, model_path: str, load_format: Any, **kw: Any
    ) -> tuple[bool, str]:
        runner.original_calls.append((model_path, load_format, kw))
        sd = LocalCheckpoint(model_path).load_state_dict()
        if kw.get("weight_name_filter") is not None:
            sd = {k: v for k, v in sd.items() if kw["weight_name_filter"](k)}
        runner.model.load_weights(sd.items())
        return True, "Succeeded to update model weights."

    return update_weights_from_disk


async def test_hook_partial_after_the_first_reload(tmp_path: Path) -> None:
    async with Harness(tmp_path, tp_size=1) as h:
        runner = FakeRunner(h.models[0])
        orig = original_update(h)
        await h.publish(hf_state(4))
        assert update_weights_from_disk_hook(orig, runner, str(h.ckpt), None)[0]
        assert len(runner.original_calls) == 1
        await h.publish(step(h.sd, ["model.layers.0.self_attn.q_proj.weight"], seed=6))
        runner.model.loaded_names.clear()
        ok, msg = update_weights_from_disk_hook(orig, runner, str(h.ckpt), None)
        assert ok and "partial reload: loaded 1 of" in msg and len(runner.original_calls) == 1
        assert runner.original_calls[0][2] == {}  # no keyword an older SGLang would refuse
        assert runner.model.loaded_names == ["model.layers.0.self_attn.q_proj.weight"]
        assert runner.model_config.model_path == str(h.ckpt)
        assert_same_params(runner.model, reference(h.sd, 0, 1))

        # EPLB-style filtered reloads pass through and leave the known base alone
        only_norms = lambda n: n.endswith("norm.weight")  # noqa: E731
        update_weights_from_disk_hook(orig, runner, str(h.ckpt), None, only_norms)
        assert runner.original_calls[-1][2]["weight_name_filter"] is only_norms
        assert sglang_loader.loader_for(runner.model).held is not None


@pytest.mark.parametrize(
    ("quantization", "load_format", "env"),
    [("fp8", None, None), (None, "dummy", None), (None, None, "0")],
)
async def test_hook_full_reload_when_partial_is_not_safe(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    quantization: str | None,
    load_format: str | None,
    env: str | None,
) -> None:
    if env is not None:
        monkeypatch.setenv(sglang_loader.ENV_PARTIAL, env)
    async with Harness(tmp_path, tp_size=1) as h:
        runner = FakeRunner(h.models[0], quantization)
        orig = original_update(h)
        await h.publish(hf_state(5))
        for seed in (7, 8):
            update_weights_from_disk_hook(orig, runner, str(h.ckpt), load_format)
            await h.publish(step(h.sd, ["model.norm.weight"], seed=seed))
        assert len(runner.original_calls) == 2


def _fake_sglang(monkeypatch: pytest.MonkeyPatch, *, owners: dict[str, str]) -> list[Any]:
    """A stand-in SGLang: the plugin registry, and ``owners`` {module: class} that have an
    ``update_weights_from_disk``."""
    registered: list[tuple[str, Any, Any]] = []

    class HookType:
        AROUND = "around"

    class HookRegistry:
        @classmethod
        def register(cls, target: str, hook: Any, hook_type: Any) -> None:
            registered.append((target, hook, hook_type))

    fake = types.ModuleType("sglang.srt.plugins.hook_registry")
    fake.HookRegistry = HookRegistry  # type: ignore[attr-defined]
    fake.HookType = HookType  # type: ignore[attr-defined]
    for name in ("sglang", "sglang.srt", "sglang.srt.plugins"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.plugins.hook_registry", fake)
    for module, cls in owners.items():
        parts = module.split(".")
        for i in range(3, len(parts)):
            monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(parts[i - 1]))
        mod = types.ModuleType(module)
        setattr(mod, cls, type(cls, (), {"update_weights_from_disk": lambda self: None}))
        monkeypatch.setitem(sys.modules, module, mod)
    return registered


def test_register_hooks_what_this_sglang_has(monkeypatch: pytest.MonkeyPatch) -> None:
    """0.5.23's WeightUpdater first; the older ModelRunner method where only that exists."""
    wu = "sglang.srt.model_executor.model_runner_components.weight_updater"
    mr = "sglang.srt.model_executor.model_runner"
    registered = _fake_sglang(monkeypatch, owners={wu: "WeightUpdater", mr: "ModelRunner"})
    entry_point = pkgutil.resolve_name("receiver.plugins.sglang_loader:register")
    entry_point()
    assert registered == [(HOOK_TARGET, update_weights_from_disk_hook, "around")]
    assert f"{wu}.WeightUpdater.update_weights_from_disk" == HOOK_TARGET

    monkeypatch.delitem(sys.modules, wu)
    registered.clear()
    entry_point()
    assert registered == [(HOOK_TARGETS[1], update_weights_from_disk_hook, "around")]


def test_register_without_a_target_warns_and_hooks_nothing(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    registered = _fake_sglang(monkeypatch, owners={})
    sglang_loader.register()
    assert registered == [] and "plugin INACTIVE" in caplog.text and "OFF" in caplog.text


async def test_hook_on_a_weight_updater(tmp_path: Path) -> None:
    """0.5.23 calls the hook with a WeightUpdater: a frozen, slotted dataclass (no weak
    reference, no hash) that reaches the model through ``get_model()``."""

    @dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
    class WeightUpdater:
        model_config: FakeModelConfig
        get_model: Callable[[], Any]

    async with Harness(tmp_path, tp_size=1) as h:
        model = h.models[0]
        owner = WeightUpdater(model_config=FakeModelConfig(), get_model=lambda: model)
        calls: list[str] = []

        def orig(o: Any, path: str, load_format: Any, **kw: Any) -> tuple[bool, str]:
            calls.append(path)
            model.load_weights(LocalCheckpoint(path).load_state_dict().items())
            return True, "Succeeded to update model weights."

        await h.publish(hf_state(7))
        ok, msg = update_weights_from_disk_hook(orig, owner, str(h.ckpt), None)
        assert ok and "full reload (first reload" in msg and calls == [str(h.ckpt)]
        await h.publish(step(h.sd, ["model.norm.weight"], seed=11))
        ok, msg = update_weights_from_disk_hook(orig, owner, str(h.ckpt), None)
        assert ok and "loaded 1 of" in msg and "model.norm.weight" in msg and len(calls) == 1
        assert owner.model_config.model_path == str(h.ckpt)
        assert_same_params(model, reference(h.sd, 0, 1))


def test_imports_and_registers_without_sglang(caplog: pytest.LogCaptureFixture) -> None:
    assert "sglang" not in sys.modules
    sglang_loader.register()  # no SGLang here: a warning, no exception
    assert "plugin inactive" in caplog.text
