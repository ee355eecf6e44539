"""slime's actor loop, simulated: trainer ranks as processes, receivers beside fake SGLang servers.

* sidecar switch: two tensor-parallel trainer ranks (gloo) run slime's calls on a getter that
  yields Megatron-named TP shards; the converter gathers and renames them; both ranks publish
  one version together; two ``asyncsync-receiver --sglang-url`` processes keep local
  checkpoints and reload fake SGLang servers; rank 0 checks both checkpoints bit for bit
  after every ``update_weights`` (it returns when the servers serve the version);
* Ray switch: the updater starts a receiver actor beside each fake slime engine actor (on its
  node, at its ``get_url``), and the servers are told slime's ``weight_version``;
* an engine on two hosts (slime c74877886's ``all_engine_actors``): a checkpoint receiver on
  each, the engine reloaded through its node-0 actor once both hold the version, the pre-read
  hook inside each host's actor;
* slime 90c212b5c's own flags in full mode: the engines reloaded through their Ray handles.

The engine actors are :class:`tests.slime_stubs.fake_slime.EngineCore` (slime's engine actor
drives a GPU SGLang server, which this machine cannot run); Ray and the receivers are real.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncsync.training.slime import HostReceivers
from tests.fake_engines import FakeSGLang, ServerThread
from tests.slime_stubs import megatron, rules
from tests.slime_stubs.actor_loop import checkpoint_matches
from tests.slime_stubs.fake_slime import EngineCore

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(REPO), "ASYNCSYNC_LOG_LEVEL": "WARNING"}


async def _run(*cmd: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        *cmd, cwd=REPO, env=ENV, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )


@pytest.mark.slow
@pytest.mark.timeout(280)
async def test_two_tp_ranks_publish_one_version_sidecars_reload(tmp_path: Path) -> None:
    root, hook_log = tmp_path / "disk", tmp_path / "hooks.jsonl"
    servers = [FakeSGLang(), FakeSGLang()]
    for s in servers:
        await s.start()
    ckpts = [tmp_path / f"ckpt{i}" for i in range(2)]
    receivers = [
        await _run(
            sys.executable,
            "-m",
            "receiver.cli",
            "--root",
            str(root),
            "--engine-id",
            f"e{i}",
            "--checkpoint",
            str(ckpts[i]),
            "--sglang-url",
            servers[i].url,
            "--poll-interval",
            "0.05",
            "--force-polling",
            "--engine-startup-timeout",
            "30",
        )
        for i in range(2)
    ]
    steps = 4
    cfg = {
        "world": 2,
        "init": str(tmp_path / "pg-init"),
        "gen": "gen2",
        "steps": steps,
        "checkpoints": [str(c) for c in ckpts],
        "out": str(tmp_path / "rank{rank}.json"),
        "args": {
            "update_weight_mode": "delta",
            "update_weight_transport": "disk",
            "update_weight_disk_dir": str(root),
            "update_weight_local_checkpoint_dir": "/local/nvme",
            "custom_update_weight_post_write_path": "tests.slime_stubs.hooks.record",
            "hook_log": str(hook_log),
            "asyncsync_receivers": "sidecar",
            "asyncsync_engine_ids": "e0,e1",
            "asyncsync_converter": "tests.slime_stubs.megatron:convert",
            "update_weight_ack_timeout": "120",
        },
    }
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    try:
        ranks = [
            await _run(
                sys.executable,
                "-m",
                "tests.slime_stubs.actor_loop",
                str(tmp_path / "cfg.json"),
                str(r),
            )
            for r in range(2)
        ]
        try:
            outs = await asyncio.wait_for(asyncio.gather(*(p.communicate() for p in ranks)), 200)
        except TimeoutError:
            for p in ranks:
                p.kill()
            raise
        for p, (out, _) in zip(ranks, outs, strict=True):
            assert p.returncode == 0, out.decode()[-4000:]
    finally:
        for p in receivers:
            p.terminate()
        logs = await asyncio.gather(*(p.communicate() for p in receivers))
        for s in servers:
            await s.stop()
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    # delta: the first call seeds (weight_version stays 0), every later one adds 1, on every rank
    assert reports[0]["versions"] == reports[1]["versions"] == list(range(steps))
    assert reports[0]["mismatched"] == [[], []] * steps, logs[0][0].decode()[-3000:]
    assert (
        len(reports[0]["metrics"]) == steps
        and reports[0]["metrics"][1]["perf/update_weights_density"] < 0.2
    )
    for s in servers:  # each server was told slime's weight_version, and serves the last one
        assert [ld.version for ld in s.loads] == [str(v) for v in range(steps)]
        assert s.weight_version == str(steps - 1)
    # the post-write hook ran on both ranks for every version once all that rank's files were
    # written: rank 1 (shards only) before the commit, rank 0 after it (the manifest is its last)
    calls = [json.loads(line) for line in hook_log.read_text().splitlines()]
    assert len(calls) == 2 * steps and all(c["engines"] == 2 for c in calls)
    for r in reports:
        mine = [c for c in calls if c["pid"] == r["pid"]]
        assert [c["version_dir"] for c in mine] == [f"v{v:012d}" for v in range(steps)]
        assert all(c["committed"] is (r["rank"] == 0) for c in mine)
        assert all(any(f.startswith(f"r{r['rank']:04d}") for f in c["files"]) for c in mine)
    # one version per step, with tensors from both ranks
    m = json.loads((root / "v000000000003" / "manifest.json").read_text())
    assert {s["file"][:5] for s in m["shards"]} == {"r0000", "r0001"}
    assert {t["name"] for t in m["tensors"]} == set(megatron.hf_state(0))


# --------------------------------------------------------------------------- the Ray switch


class FakeSlimeEngine:
    """The part of slime's SGLangEngine actor the updater uses: ``get_url``."""

    def __init__(self, url: str) -> None:
        self.url = url

    def get_url(self) -> str:
        return self.url


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(280)
def test_ray_receivers_beside_engines_are_told_slime_versions(cluster: Any, tmp_path: Path) -> None:
    from asyncsync.training.slime import RayReceivers

    ray = cluster
    fakes = [ServerThread(FakeSGLang()), ServerThread(FakeSGLang())]
    servers = [f.__enter__() for f in fakes]
    try:
        engines = [ray.remote(FakeSlimeEngine).remote(s.url) for s in servers]
        ns = rules.namespace(
            "gen1",
            update_weight_mode="full",
            update_weight_transport="disk",
            update_weight_disk_dir=str(tmp_path / "disk"),
            update_weight_local_checkpoint_dir=str(tmp_path / "local"),
            update_weight_start_version=5,
            update_weight_ack_timeout="120",
            asyncsync_converter="tests.slime_stubs.megatron:convert",
        )
        step = 0
        updater = _llama_updater(ns, lambda: step)
        with updater:
            assert isinstance(updater.engine_link, RayReceivers)
            assert updater.weight_version == 5
            updater.connect_rollout_engines(engines, None)
            fleet = updater.engine_link.fleet  # type: ignore[attr-defined]
            assert fleet is not None and len(fleet.actors) == 2
            node = ray.get_runtime_context().get_node_id()
            assert {n["node_id"] for n in fleet.nodes.values()} == {node}
            for step in range(3):
                updater.update_weights()
                assert updater.weight_version == 6 + step  # full: +1 on every call, first included
                assert all(v["mismatched"] == [] for v in fleet.verify().values())
                view = tmp_path / "disk" / f"weight_v{updater.weight_version:06d}"
                assert (view / "model.safetensors.index.json").exists()
            assert sorted(p.name for p in (tmp_path / "disk").glob("weight_v*")) == [
                "weight_v000008"
            ]
        for s in servers:
            assert [ld.version for ld in s.loads] == ["6", "7", "8"] and s.weight_version == "8"
    finally:
        for f in fakes:
            f.__exit__(None, None, None)


def _llama_updater(ns: Any, step: Callable[[], int], **kw: Any) -> Any:
    """slime's factory on ``ns``, its getter yielding the tiny Llama's shards at ``step()``."""
    from asyncsync.training.slime import create_weight_updater

    return create_weight_updater(
        argparse.Namespace(**vars(ns)),
        None,
        lambda: megatron.shards(step(), 0, 1),
        model_name="llama",
        quantization_config=None,
        **kw,
    )


class _PerHostDirs(HostReceivers):
    """Both "hosts" of the test's engine are this machine: give each its own directory, as
    each host has its own disk in a cluster (the engine's node-0 path is the one it loads)."""

    def host_checkpoint(self, engine_id: str, host: int) -> str:
        return f"{self.local_checkpoint_dir}/host{host}/{engine_id}"


@pytest.mark.slow
@pytest.mark.timeout(280)
def test_engine_on_two_hosts_is_reloaded_once_both_hold_the_version(
    cluster: Any, tmp_path: Path
) -> None:
    """slime c74877886 passes every host's engine actor (all_engine_actors): a receiver on each
    host, and rank 0 reloads the engine through its node-0 actor once both acknowledged; the
    pre-read hook runs inside each host's actor first (real Ray actors, slime's calls)."""

    ray = cluster
    root, local = tmp_path / "disk", tmp_path / "local"
    host0 = ray.remote(EngineCore).remote("http://127.0.0.1:1", 0)
    host1 = ray.remote(EngineCore).remote("http://127.0.0.1:1", 1)
    ns = rules.namespace(
        "gen2a",
        update_weight_mode="delta",
        update_weight_transport="disk",
        update_weight_disk_dir=str(root),
        update_weight_local_checkpoint_dir=str(local),
        custom_delta_pre_read_path="tests.slime_stubs.hooks.pre_read",
        update_weight_ack_timeout="120",
        asyncsync_receivers="ray",
        asyncsync_converter="tests.slime_stubs.megatron:convert",
        num_gpus_per_node=8,
    )
    step = 0
    link = _PerHostDirs(str(root), str(local))
    updater = _llama_updater(ns, lambda: step, engine_link=link)
    with updater:
        updater.connect_rollout_engines([host0], None, [16], [0], all_engine_actors=[host0, host1])
        assert link.fleet is not None
        eid = "sglang-127.0.0.1-1"
        assert sorted(link.fleet.actors) == [f"{eid}.host0", f"{eid}.host1"]
        for step in range(3):
            updater.update_weights()
            assert updater.weight_version == step  # delta: the first call seeds
            want = megatron.hf_state(step)
            for k in (0, 1):
                assert checkpoint_matches(local / f"host{k}" / eid, want) == []
            calls = ray.get(host0.recorded.remote())
            assert [c for c in calls if c[0] == "update_weights_from_disk"][-1][1] == {
                "model_path": f"{local}/host0/{eid}",
                "weight_version": str(step),
            }
            loaded = ray.get(host0.loaded.remote())
            assert checkpoint_matches(local / "host0" / eid, loaded) == []
        assert ray.get(host1.recorded.remote()) == []  # only node 0 is told to reload
    log = Path(str(root) + ".pre_read.jsonl")
    reads = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["target_version"] for r in reads] == [0, 0, 1, 1, 2, 2]
    assert len({r["pid"] for r in reads}) == 2  # inside each host's actor


@pytest.mark.slow
@pytest.mark.timeout(280)
def test_gen1_engines_reloaded_through_their_ray_handles(cluster: Any, tmp_path: Path) -> None:

    ray = cluster
    root = tmp_path / "disk"
    engines = [ray.remote(EngineCore).remote(f"http://127.0.0.1:{i + 1}") for i in range(2)]
    ns = rules.namespace(
        "gen1",
        update_weight_transport="disk",
        update_weight_disk_dir=str(root),
        asyncsync_converter="tests.slime_stubs.megatron:convert",
    )  # slime 90c212b5c's own flags (and the converter this test's model needs)
    step = 0
    with _llama_updater(ns, lambda: step) as updater:
        updater.connect_rollout_engines(engines, None, [1, 1], [0, 1])
        for step in range(2):
            updater.update_weights()
            for e in engines:
                calls = ray.get(e.recorded.remote())[-4:]
                assert [c[0] for c in calls] == [*rules.FULL_RELOAD_CALLS, "continue_generation"]
                assert calls[2][1]["weight_version"] == str(step + 1)
                loaded = ray.get(e.loaded.remote())
                want = megatron.hf_state(step)
                assert set(loaded) == set(want)
                assert all(
                    torch.equal(loaded[k].view(torch.int16), want[k].view(torch.int16))
                    for k in want
                )
    assert not list(root.glob("weight_v*"))  # removed after each reload, as slime does
