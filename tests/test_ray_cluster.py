"""asyncsync.training.ray on a real cluster of two raylets on this host (tests/ray_cluster.py):
errors that cross to the driver, a receiver whose actor is SIGKILLed (replaced under its engine
id, its lease taken over; the slime link publishes to the live engines meanwhile), trainer
ranks placed by the caller, and a node lost for good (teardown never raises).

The tests share one cluster and run in this order; the last one kills the second node.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from asyncsync.errors import AckTimeout, ConfigError, PublishError
from asyncsync.format.lease import lease_path
from asyncsync.training.config import SyncConfig
from asyncsync.training.ray import ReceiverSpec, start_receivers, start_trainers
from asyncsync.training.session import SyncSession
from tests.conftest import mixed_state, mutate
from tests.fake_engines import FakeSGLang, ServerThread
from tests.ray_cluster import NODE_B, TwoNodes, running
from tests.test_ray import assert_holds

pytestmark = [pytest.mark.slow, pytest.mark.ray_cluster, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def nodes() -> Iterator[TwoNodes]:
    yield from running()


def _until(pred: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def _kill_worker(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)  # the actor's worker process, as the OOM killer would


# --------------------------------------------------------------------------- 4. errors


def test_ack_timeout_reaches_the_driver_as_ack_timeout(nodes: TwoNodes, tmp_path: Path) -> None:
    """A TrainerActor's publish whose ack wait times out: the driver catches AckTimeout with
    its fields (it used to arrive as Ray's UnserializableException)."""
    cfg = SyncConfig(root=tmp_path / "root", bucket_bytes=8192, ack_engines=["ghost"],
                     ack_timeout=0.5)  # fmt: skip
    with start_trainers(cfg, num_cpus=0) as trainers:
        t0 = time.monotonic()
        with pytest.raises(AckTimeout) as ei:
            trainers.publish(mixed_state(0))
        assert time.monotonic() - t0 < 20
    assert ei.value.version == 0 and ei.value.behind == {"ghost": None}, ei.value


# --------------------------------------------------------------------------- 5. a dead receiver


def test_a_dead_receiver_is_replaced_under_its_engine_id(nodes: TwoNodes, tmp_path: Path) -> None:
    root = tmp_path / "root"
    specs = [
        ReceiverSpec("e0", str(tmp_path / "ck0"), node_id=nodes.head_node, poll_interval=0.05),
        ReceiverSpec("e1", str(tmp_path / "ck1"), node_id=nodes.node_b, poll_interval=0.05),
    ]
    states = [mixed_state(1)]
    for i in range(1, 4):
        states.append(mutate(states[-1], 0.03, seed=i))
    fleet = start_receivers(root, specs)
    assert fleet.nodes["e1"]["node_id"] == nodes.node_b
    with SyncSession(SyncConfig(root=root, bucket_bytes=8192, keyframe_interval=0)) as sync:
        sync.publish(states[0])
        assert fleet.wait_for(0, timeout=60) == {"e0": 0, "e1": 0}
        dead_pid = fleet.nodes["e1"]["pid"]
        _kill_worker(dead_pid)
        st = _until(lambda: (s := fleet.statuses())["e1"]["alive"] is False and s, 60, "death")
        assert st["e1"]["stopped_by"] and st["e1"]["restarts"] == 0 and st["e0"]["running"]
        assert fleet.versions() == {"e0": 0, "e1": None}
        with pytest.raises(AckTimeout, match="e1"):
            fleet.wait_for(1, timeout=5)
        sync.publish(states[1])  # the live engine goes on meanwhile
        assert _until(lambda: fleet.versions()["e0"] == 1, 60, "e0 at v1")
        assert fleet.replace_dead() == {"e1": "replaced"}
        assert fleet.replace_dead() == {}  # the new one is starting: not replaced twice
        sync.publish(states[2])
        assert fleet.wait_for(2, timeout=120) == {"e0": 2, "e1": 2}
        st = fleet.statuses()["e1"]
        assert st["running"] and st["restarts"] == 1 and st["node"]["node_id"] == nodes.node_b
        assert st["node"]["pid"] != dead_pid
        lease = json.loads(lease_path(root, "e1").read_text())
        assert lease["pid"] == st["node"]["pid"]  # the lease was taken over
        assert fleet.verify() == {e: {"version": 2, "mismatched": []} for e in ("e0", "e1")}
        assert_holds(tmp_path / "ck1", states[2])

        # start_receivers for an engine whose actor died, without stopping the old fleet
        _kill_worker(fleet.statuses()["e0"]["node"]["pid"])
        _until(lambda: fleet.statuses()["e0"]["alive"] is False, 60, "e0's death")
        again = start_receivers(root, [specs[0]], ready_timeout=120)
        sync.publish(states[3])
        assert again.wait_for(3, timeout=120) == {"e0": 3}
        with pytest.raises(ConfigError, match="is running"):
            start_receivers(root, [specs[0]], ready_timeout=60)  # a live one is refused
        assert again.stop() == {"e0": 3}
    _kill_worker(fleet.statuses()["e1"]["node"]["pid"])
    _until(lambda: fleet.statuses()["e1"]["alive"] is False, 60, "e1's death")
    assert fleet.stop() == {"e0": None, "e1": None}  # never raises for dead receivers


class FakeSlimeEngine:
    """The part of slime's SGLangEngine actor the updater uses: ``get_url``."""

    def __init__(self, url: str) -> None:
        self.url = url

    def get_url(self) -> str:
        return self.url


def test_slime_link_publishes_to_the_live_engines_while_one_is_replaced(
    nodes: TwoNodes, tmp_path: Path
) -> None:
    """slime's updater with the Ray link, one engine per node: the receiver beside engine 1 is
    SIGKILLed; the next update_weights waits for engine 0 only and replaces the dead receiver
    (it used to raise ActorDiedError at every later step), which catches up; connecting the
    engines again replaces a dead receiver too; close() is clean with a receiver dead."""
    import ray

    from asyncsync.training.slime import RayReceivers, create_weight_updater
    from asyncsync.training.slime.engines import engine_id_of_url
    from tests.slime_stubs import megatron, rules

    fakes = [ServerThread(FakeSGLang()), ServerThread(FakeSGLang())]
    servers = [f.__enter__() for f in fakes]
    try:
        engine_cls = ray.remote(FakeSlimeEngine)
        engines = [
            engine_cls.options(num_cpus=0).remote(servers[0].url),
            engine_cls.options(num_cpus=0, resources={NODE_B: 0.01}).remote(servers[1].url),
        ]
        ns = rules.namespace(
            "gen2", update_weight_mode="delta", update_weight_transport="disk",
            update_weight_disk_dir=str(tmp_path / "disk"),
            update_weight_local_checkpoint_dir=str(tmp_path / "local"),
            update_weight_ack_timeout="120",
            asyncsync_converter="tests.slime_stubs.megatron:convert",
        )  # fmt: skip
        at = {"step": 0}
        updater = create_weight_updater(
            argparse.Namespace(**vars(ns)), None, lambda: megatron.shards(at["step"], 0, 1),
            model_name="llama", quantization_config=None,
        )  # fmt: skip
        try:
            updater.connect_rollout_engines(engines, None)
            link = updater.engine_link
            assert isinstance(link, RayReceivers) and link.fleet is not None
            fleet = link.fleet
            ids = [engine_id_of_url(s.url) for s in servers]  # engine 0 on the head, 1 on b
            assert sorted(fleet.actors) == sorted(ids)
            assert fleet.nodes[ids[1]]["node_id"] == nodes.node_b
            for at["step"] in (0, 1):
                updater.update_weights()
            assert set(updater.session.ack_policy.engines) == set(ids)
            _kill_worker(fleet.nodes[ids[1]]["pid"])
            _until(lambda: not fleet.statuses()[ids[1]]["alive"], 60, "the receiver's death")
            at["step"] = 2
            updater.update_weights()  # waits for the live engine only, replaces the dead one
            assert updater.session.ack_policy.engines == (ids[0],)
            assert fleet.restarts[ids[1]] == 1
            _until(lambda: fleet.statuses()[ids[1]]["version"] == 2, 120, "the catch-up")
            for at["step"] in (3, 4):
                updater.update_weights()
            assert set(updater.session.ack_policy.engines) == set(ids)  # waited for again
            assert fleet.wait_for(4, timeout=60) == dict.fromkeys(ids, 4)
            assert all(v["mismatched"] == [] for v in fleet.verify().values())
            # connecting the same engines again replaces a dead receiver too
            _kill_worker(fleet.statuses()[ids[0]]["node"]["pid"])
            _until(lambda: not fleet.statuses()[ids[0]]["alive"], 60, "the receiver's death")
            updater.connect_rollout_engines(engines, None)
            assert updater.engine_link.fleet is fleet and fleet.restarts[ids[0]] == 1  # type: ignore[attr-defined]
            _until(lambda: fleet.statuses()[ids[0]]["version"] == 4, 120, "the catch-up")
            _kill_worker(fleet.statuses()[ids[1]]["node"]["pid"])  # dead at close
            _until(lambda: not fleet.statuses()[ids[1]]["alive"], 60, "the receiver's death")
        finally:
            updater.close()  # never raises for a dead receiver
        assert updater.engine_link.fleet is None  # type: ignore[attr-defined]
        assert [ld.version for ld in servers[0].loads] == ["0", "1", "2", "3", "4"]
        assert servers[1].weight_version == "4"
    finally:
        for f in fakes:
            f.__exit__(None, None, None)


# ------------------------------------------------------------------ 7. placement, a node lost


def test_trainer_ranks_placed_by_the_caller_and_a_node_lost(
    nodes: TwoNodes, tmp_path: Path
) -> None:
    """Ranks go where the caller says (one per node here; Ray's SPREAD by default); when the second
    node dies its rank and receiver are reported gone, the receiver is not restarted on a dead
    node, and tearing everything down raises nothing."""
    from ray.exceptions import RayActorError

    root = tmp_path / "root"
    cfg = SyncConfig(root=root, bucket_bytes=8192, keyframe_interval=0)
    with pytest.raises(ConfigError, match="not alive"):
        start_trainers(cfg, world_size=2, num_cpus=0, placement=[nodes.head_node, "ff" * 28])
    spread = start_trainers(cfg, world_size=2, num_cpus=0)
    try:
        # Ray's SPREAD is best effort (both ranks on one node is allowed, seen under load)
        assert {n["node_id"] for n in spread.nodes} <= {nodes.head_node, nodes.node_b}
        assert len(spread.nodes) == 2
    finally:
        spread.close()
    sd = mixed_state(2)
    names = sorted(sd)
    halves = [{k: sd[k] for k in names[::2]}, {k: sd[k] for k in names[1::2]}]
    fleet = start_receivers(root, [
        ReceiverSpec("h", str(tmp_path / "ckh"), node_id=nodes.head_node, poll_interval=0.05),
        ReceiverSpec("b", str(tmp_path / "ckb"), node_id=nodes.node_b, poll_interval=0.05),
    ])  # fmt: skip
    group = start_trainers(
        cfg, world_size=2, num_cpus=0, placement=[nodes.head_node, nodes.node_b],
        rendezvous_timeout=5,
    )  # fmt: skip
    try:
        assert [n["node_id"] for n in group.nodes] == [nodes.head_node, nodes.node_b]
        assert group.job and group.placement == "nodes"
        for step in range(2):
            if step:
                halves = [mutate(h, 0.05, seed=10 + r) for r, h in enumerate(halves)]
            assert [r["version"] for r in group.publish(halves)] == [step, step]
        assert fleet.wait_for(1, timeout=60) == {"h": 1, "b": 1}
        nodes.kill_node("b")
        st = _until(lambda: (s := fleet.statuses())["b"]["alive"] is False and s, 60, "b gone")
        assert st["h"]["running"] and st["b"]["stopped_by"]
        assert fleet.replace_dead()["b"].startswith("not replaced: its node")
        with pytest.raises((RayActorError, PublishError)):  # rank 1 is gone with its node
            group.publish(halves, timeout=60)
    finally:
        group.close()  # never raises for the rank that died with its node
        assert fleet.stop()["b"] is None
    assert "closed" in repr(group)
