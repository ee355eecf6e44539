"""The slime updater in one process: versions, acks from real receivers, full-mode weight_v
views, failures and their metrics; per slime revision, the hook's timing and Future, the
actor's connect call, gen1's engine reload, gen2a's pre-read hook, engines on several hosts."""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from torch import nn

from asyncsync import AckTimeout, ConfigError, Publisher, PublishError
from asyncsync.errors import shown
from asyncsync.format.store import list_versions, read_manifest
from asyncsync.training.slime import (
    AsyncSyncWeightUpdater,
    HostReceivers,
    NoEngines,
    RayReceivers,
    create_weight_updater,
    sync_config_from_args,
)
from asyncsync.training.slime import reload as slime_reload
from asyncsync.training.slime.reload import engine_hosts
from receiver import ReceiverAgent
from receiver.engines import TorchModule
from tests.conftest import same_bytes
from tests.slime_stubs import rules
from tests.slime_stubs.fake_slime import EngineCore, LocalHandle


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for key in list(os.environ):
        if key.startswith("ASYNCSYNC_"):
            monkeypatch.delenv(key)


def slime_args(tmp_path: Path, gen: str = "gen2", **values: Any) -> argparse.Namespace:
    base = {
        "update_weight_transport": "disk",
        "update_weight_disk_dir": str(tmp_path / "root"),
        "update_weight_ack_timeout": "30",
        "asyncsync_receivers": "sidecar",
    }
    return argparse.Namespace(**vars(rules.namespace(gen, **{**base, **values})))


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)).to(torch.bfloat16)


class FakeProvider:
    """The trainer's side of slime's ``weights_getter``: bf16 weights that change a little."""

    def __init__(self) -> None:
        self.model = make_model(0)
        self.gen = torch.Generator().manual_seed(1)
        self.calls = 0

    def step(self, density: float = 0.03) -> None:
        with torch.no_grad():
            for p in self.model.parameters():
                flat = p.view(-1).view(torch.int16)
                mask = torch.rand(flat.numel(), generator=self.gen) < density
                flat[mask] += 1  # an ulp, like an Adam step after the bf16 cast

    def state_dict(self) -> dict[str, torch.Tensor]:
        self.calls += 1
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def pairs(self) -> Iterator[tuple[str, torch.Tensor]]:
        self.calls += 1
        for k, v in self.model.state_dict().items():
            yield k, v.detach().clone()


# ---------------------------------------------------------------------- the updater
@pytest.fixture
async def engines(tmp_path: Path) -> AsyncIterator[dict[str, nn.Module]]:
    """Two receiver agents with TorchModule engines, running on the test's loop."""
    models = {f"e{i}": make_model(10 + i) for i in range(2)}
    stop = asyncio.Event()
    agents = [
        ReceiverAgent(tmp_path / "root", TorchModule(m), e, poll_interval=0.02, use_inotify=False)
        for e, m in models.items()
    ]
    tasks = [asyncio.create_task(a.run(stop=stop)) for a in agents]
    try:
        yield models
    finally:
        stop.set()
        await asyncio.gather(*tasks)
        for a in agents:
            await a.close()


async def test_delta_updater_with_sidecars(tmp_path: Path, engines: dict[str, nn.Module]) -> None:
    provider = FakeProvider()
    args = slime_args(
        tmp_path,
        update_weight_mode="delta",
        update_weight_local_checkpoint_dir="/l",
        update_weight_start_version=7,
        asyncsync_engine_ids="e0,e1",
    )
    model = [object()]
    updater = create_weight_updater(
        args, model, provider.pairs, model_name="tiny", quantization_config={"q": 1}
    )
    assert isinstance(updater, AsyncSyncWeightUpdater)
    assert updater.args is args and updater.model is model and updater.weight_version == 7
    with updater:
        updater.connect_rollout_engines([object(), object()], object(), [1, 1], [0, 1])
        assert updater.session.ack_policy.engines == ("e0", "e1")
        await asyncio.to_thread(updater.update_weights)  # the seed: weight_version unchanged
        assert updater.weight_version == 7
        seed = updater.pop_metrics()
        assert seed["perf/update_weights_version"] == 0 and seed["perf/update_weights_density"] == 1
        for expected in (8, 9):
            provider.step()
            await asyncio.to_thread(updater.update_weights)
            assert updater.weight_version == expected
            m = updater.pop_metrics()
            assert updater.pop_metrics() == {}
            assert 0.01 < m["perf/update_weights_density"] < 0.06
            assert m["perf/update_weights_staleness"] == 0
            for e, engine_model in engines.items():
                got = engine_model.state_dict()
                assert all(same_bytes(got[k], t) for k, t in provider.model.state_dict().items()), e
    assert provider.calls == 3
    manifest = read_manifest(tmp_path / "root", 2)
    assert manifest.kind == "delta" and manifest.producer["model_name"] == "tiny"
    async with Publisher(tmp_path / "root"):  # close() released the root's lock
        pass
    with pytest.raises(PublishError, match="closed"):
        updater.update_weights()


def test_full_mode_versions_and_weight_v_views(tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"not copied")
    provider = FakeProvider()
    args = slime_args(tmp_path, update_weight_mode="full", asyncsync_receivers="none")
    args.hf_checkpoint = str(hf)
    with create_weight_updater(
        args, None, provider.state_dict, model_name="m", quantization_config=None
    ) as updater:
        for expected in (1, 2, 3):  # slime: +1 on every call, the first included
            updater.update_weights()
            assert updater.weight_version == expected
            view = tmp_path / "root" / f"weight_v{expected:06d}"
            index = json.loads((view / "model.safetensors.index.json").read_text())
            assert set(index["weight_map"]) == set(provider.model.state_dict())
            assert (view / "config.json").exists() and not (view / "model.safetensors").exists()
            got: dict[str, torch.Tensor] = {}
            for f in sorted(view.glob("model-*.safetensors")):
                got.update(safetensors.torch.load_file(f))
            assert all(same_bytes(got[k], t) for k, t in provider.model.state_dict().items())
            provider.step()
    root = tmp_path / "root"
    assert sorted(p.name for p in root.glob("weight_v*")) == ["weight_v000003"]  # as slime deletes
    assert list_versions(root)[-1] == 2 and read_manifest(root, 2).kind == "full"


def test_megatron_names_are_refused_without_a_converter(tmp_path: Path) -> None:
    def getter() -> dict[str, torch.Tensor]:
        return {"module.module.decoder.layers.0.self_attention.linear_qkv.weight": torch.zeros(2)}

    args = slime_args(tmp_path, asyncsync_receivers="none")
    u = create_weight_updater(args, None, getter, model_name="m", quantization_config=None)
    with u, pytest.raises(ConfigError, match="Megatron-named shards"):
        u.update_weights()


def test_ack_timeout_still_advances_the_version_and_leaves_metrics(tmp_path: Path) -> None:
    provider = FakeProvider()
    args = slime_args(
        tmp_path,
        update_weight_mode="delta",
        update_weight_local_checkpoint_dir="/l",
        asyncsync_engine_ids="ghost",
        update_weight_ack_timeout="0.2",
    )
    with create_weight_updater(
        args, None, provider.state_dict, model_name="m", quantization_config=None
    ) as updater:
        updater.connect_rollout_engines([object()], None)
        with pytest.raises(AckTimeout, match="ghost at no ack"):
            updater.update_weights()
        m = updater.pop_metrics()
        assert m["perf/update_weights_failed"] == 1 and m["perf/update_weights_version"] == 0
        with pytest.raises(AckTimeout):
            updater.update_weights()  # a zero-diff version: committed all the same
        assert (
            updater.weight_version == 1
            and updater.pop_metrics()["perf/update_weights_zero_diff"] == 1
        )
    assert read_manifest(tmp_path / "root", 1).totals.changed == 0


# ------------------------------------------------------ per revision (issue 25: 1, 4, 6)


@pytest.mark.parametrize("mode", ["full", "delta"])
@pytest.mark.parametrize("gen", rules.GENS)
def test_hook_runs_once_every_file_of_the_version_is_written(
    tmp_path: Path, gen: str, mode: str
) -> None:
    """slime calls its hook after every file of the version is written, with the directory
    the engines read, where its updater of that mode calls it; a Future is waited on."""
    contract = rules.HOOKS[gen]
    provider = FakeProvider()
    log = tmp_path / "hooks.jsonl"
    extra = {"update_weight_local_checkpoint_dir": "/l"} if mode == "delta" else {}
    hook = "tests.slime_stubs.hooks." + ("deferred" if contract["future"] else "record")
    args = slime_args(tmp_path, gen, update_weight_mode=mode, **{contract["flag"]: hook}, **extra)
    args.hook_log = str(log)
    with create_weight_updater(
        args, None, provider.state_dict, model_name="m", quantization_config=None,
        engine_link=NoEngines(),
    ) as updater:  # fmt: skip
        updater.connect_rollout_engines(["a", "b"], None)
        for _ in range(3):
            updater.update_weights()
            provider.step()
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    if mode not in contract["modes"]:
        assert calls == []  # as slime: that mode's updater never calls it
        return
    want = []
    for v in range(3):  # every version, the seed included (it is a version here)
        want.append((f"v{v:012d}", True, 2))
        if mode == "full":
            want.append((f"weight_v{v + 1:06d}", True, 2))
    assert [(c["version_dir"], c["committed"], c["engines"]) for c in calls] == want
    assert all("manifest.json" in c["files"] for c in calls if c["version_dir"][0] == "v")


def test_slime_hook_and_pre_commit_hook_may_both_be_set(tmp_path: Path) -> None:
    args = slime_args(
        tmp_path,
        "gen1",
        update_weight_mode="delta",
        update_weight_local_checkpoint_dir="/l",
        custom_delta_pre_push_path="tests.slime_stubs.hooks.record",
    )
    args.hook_log = str(tmp_path / "hooks.jsonl")
    env = {"ASYNCSYNC_PRE_COMMIT_HOOK": "os.path:exists"}
    with AsyncSyncWeightUpdater(
        args, None, dict, model_name="m", quantization_config=None,
        config=sync_config_from_args(args, environ=env), engine_link=NoEngines(),
    ) as updater:  # fmt: skip
        assert updater.config.pre_commit_hook == "os.path:exists"


@pytest.mark.parametrize("gen", rules.GENS)
def test_connect_takes_what_each_revision_passes(tmp_path: Path, gen: str) -> None:
    values = {
        "engine_gpu_counts": [1, 1],
        "engine_gpu_offsets": [0, 1],
        "all_engine_actors": ["a", "b"],
        "engine_parallel_configs": [{}, {}],
    }
    args = slime_args(tmp_path, gen, update_weight_start_version=4)
    with create_weight_updater(
        args, None, dict, model_name="m", quantization_config=None
    ) as updater:
        # slime's actor: build, (gen2a/gen2) set the start version, connect with its keywords
        if rules.ACTOR_SETS_START_VERSION[gen]:
            updater.weight_version = args.update_weight_start_version
        updater.connect_rollout_engines(
            ["a", "b"], None, **{k: values[k] for k in rules.CONNECT_KWARGS[gen]}
        )
        assert updater.weight_version == 4 and updater.rollout_engines == ["a", "b"]


def test_gen1_full_with_slimes_own_flags_reloads_the_engines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """slime 90c212b5c's full disk updater reloads the engines from weight_v itself: with
    slime's flags only, asyncsync does the same through the engines' handles."""
    monkeypatch.setattr(slime_reload, "_get", list)  # in-process handles (Ray: test_slime_actor)
    root = tmp_path / "root"
    args = argparse.Namespace(
        **vars(
            rules.namespace(
                "gen1", update_weight_transport="disk", update_weight_disk_dir=str(root)
            )
        )
    )
    provider = FakeProvider()
    cores = [EngineCore(), EngineCore()]
    with create_weight_updater(
        args, None, provider.state_dict, model_name="m", quantization_config=None
    ) as updater:
        updater.connect_rollout_engines([LocalHandle(c) for c in cores], None, [1, 1], [0, 1])
        for version in (1, 2):
            updater.update_weights()
            assert updater.weight_version == version
            view = root / f"weight_v{version:06d}"
            for core in cores:
                calls = core.recorded()[-4:]
                assert [name for name, _ in calls] == [
                    *rules.FULL_RELOAD_CALLS, "continue_generation",
                ]  # fmt: skip
                assert calls[2][1] == {"model_path": str(view), "weight_version": str(version)}
                loaded = core.loaded()
                assert all(same_bytes(loaded[k], t) for k, t in provider.model.state_dict().items())
            assert not view.exists()  # slime removes it once the engines reloaded it
            assert updater.pop_metrics()["perf/update_weights_reload_ms"] > 0
            provider.step()


def test_gen2a_pre_read_hook_runs_on_every_engine_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(slime_reload, "_get", list)
    provider = FakeProvider()
    args = slime_args(
        tmp_path,
        "gen2a",
        update_weight_mode="delta",
        update_weight_local_checkpoint_dir="/l",
        custom_delta_pre_read_path="tests.slime_stubs.hooks.pre_read",
        update_weight_start_version=3,
    )
    hosts = [LocalHandle(EngineCore()), LocalHandle(EngineCore())]
    with create_weight_updater(
        args, None, provider.state_dict, model_name="m", quantization_config=None,
        engine_link=NoEngines(),
    ) as updater:  # fmt: skip
        updater.connect_rollout_engines(hosts, None, [1, 1], [0, 1], all_engine_actors=hosts)
        for _ in range(3):
            updater.update_weights()
            provider.step()
    log = Path(str(tmp_path / "root") + ".pre_read.jsonl")
    versions = [json.loads(line)["target_version"] for line in log.read_text().splitlines()]
    assert versions == [3, 3, 4, 4, 5, 5]  # slime's weight_version, once per host


def test_engines_on_several_hosts_are_never_half_updated(tmp_path: Path) -> None:
    """slime passes node-0 handles only (except gen2a's all_engine_actors): an engine that
    spans hosts needs a receiver on each, and a reload only once all hold the version."""
    args = slime_args(
        tmp_path, "gen2", update_weight_mode="delta", update_weight_local_checkpoint_dir="/l"
    )
    args.num_gpus_per_node = 8
    for receivers, why in (("sidecar", "reload their server"), ("ray", "only its node-0 actor")):
        args.asyncsync_receivers = receivers
        u = create_weight_updater(args, None, dict, model_name="m", quantization_config=None)
        with u, pytest.raises(ConfigError, match=f"engine 1 spans several hosts .*{why}"):
            u.connect_rollout_engines(["e0", "e1"], None, [8, 16], [0, 8])
    hosts = engine_hosts(
        ["a", "b"], gpu_counts=[8, 16], gpus_per_node=8, all_engine_actors=["a", "b", "b1"]
    )
    assert hosts == [["a"], ["b", "b1"]]
    assert engine_hosts(["a"], gpu_counts=None, gpus_per_node=8, all_engine_actors=None) == [["a"]]
    uniform = engine_hosts(["a", "b"], gpu_counts=None, gpus_per_node=8, all_engine_actors="aAbB")
    assert uniform == [["a", "A"], ["b", "B"]]
    for counts, actors in (([8, 8], ["a", "b", "b1"]), (None, ["a", "b", "b1"])):
        with pytest.raises(ConfigError, match="cannot be told"):
            engine_hosts(["a", "b"], gpu_counts=counts, gpus_per_node=8, all_engine_actors=actors)


def boom(args: Any, version_dir: str, rollout_engines: list[Any]) -> None:
    raise OSError("the object store is down")


def test_a_failing_hook_fails_the_call_and_the_committed_version_counts(tmp_path: Path) -> None:
    provider = FakeProvider()
    args = slime_args(
        tmp_path,
        "gen2",
        update_weight_mode="full",
        custom_update_weight_post_write_path="tests.test_slime_integration.boom",
    )
    with create_weight_updater(
        args, None, provider.state_dict, model_name="m", quantization_config=None,
        engine_link=NoEngines(),
    ) as updater:  # fmt: skip
        with pytest.raises(OSError, match="object store is down"):
            updater.update_weights()
        assert updater.weight_version == 1  # v0 is committed: slime's counter advanced too
        m = updater.pop_metrics()
        assert m["perf/update_weights_failed"] == 1 and m["perf/update_weights_version"] == 0


@pytest.mark.parametrize("value", [float("nan"), -1, True, 10**400, 1e300, "5"], ids=shown)
def test_a_ready_timeout_no_wait_can_take_is_refused_at_once(tmp_path: Path, value: Any) -> None:
    """The ray link's ``ready_timeout`` went to Ray unchecked when the engines connected
    (``ray.wait`` overflowed, or a bool waited a second); None does not wait, inf waits
    without a limit."""
    for link in (RayReceivers, HostReceivers):
        with pytest.raises(ConfigError, match="ready_timeout"):
            link(str(tmp_path / "root"), str(tmp_path / "ckpt"), ready_timeout=value)
    for fine in (None, float("inf"), 0, 600.0):
        assert RayReceivers("/r", "/c", ready_timeout=fine).ready_timeout == fine


def test_updater_misuse_is_a_config_error_and_leaves_the_root_free(tmp_path: Path) -> None:
    """A rank outside the world, settings with receivers 'ray' and no local checkpoint
    directory (an AssertionError raised after the session had opened: the root's lock stayed
    held by a stranded loop thread, every retry in the process refused with LockHeld naming
    its own pid) and one engine id given as a string (waited for as engines 'e' and '0') are
    ConfigErrors, and the root stays free."""
    import dataclasses
    import threading

    from asyncsync.training.slime import slime_settings

    provider = FakeProvider()
    args = slime_args(
        tmp_path,
        update_weight_mode="delta",
        update_weight_local_checkpoint_dir="/l",
        asyncsync_engine_ids="e0",
    )
    no_local = dataclasses.replace(slime_settings(args), receivers="ray", local_checkpoint_dir=None)
    for kw, needle in [
        ({"settings": no_local}, "local checkpoint directory"),
        ({"rank": 5, "world_size": 2}, "rank must be an int in 0..1"),
        ({"rank": 0, "world_size": 0}, "world_size must be an int >= 1"),
        ({"rank": 1, "world_size": 2}, "needs torch.distributed initialised"),
    ]:
        with pytest.raises(ConfigError, match=needle):
            AsyncSyncWeightUpdater(
                args, None, provider.state_dict, model_name="m", quantization_config=None, **kw
            )
    assert not [t for t in threading.enumerate() if t.name == "asyncsync-root"]
    with create_weight_updater(
        args, None, lambda: None, model_name="m", quantization_config=None
    ) as updater:  # the root's lock is free
        with pytest.raises(ConfigError, match="got NoneType"):
            updater.update_weights()
        updater.connect_rollout_engines([object()], engine_ids="e0")
        assert updater.session.ack_policy.engines == ("e0",)
