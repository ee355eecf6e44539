"""asyncsync.training.ray on a local Ray cluster started here: receiver actors placed by node and by
resource, trainer actors publishing, versions, bit-exact checkpoints, errors, stopping."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import pickle
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

from asyncsync import ConfigError, LockHeld
from asyncsync.errors import AckTimeout, shown
from asyncsync.training.config import SyncConfig
from asyncsync.training.ray import (
    ReceiverActor,
    ReceiverFleet,
    ReceiverSpec,
    TrainerActor,
    engine_nodes,
    pack_state_dict,
    start_receivers,
    start_trainers,
    unpack_state_dict,
)
from asyncsync.training.ray.base import import_ray, placement_options, plain
from tests.conftest import mixed_state, mutate, same_bytes
from tests.test_dtypes import every_dtype_state

ENGINE_RESOURCE = "asyncsync_engine"


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    ray = pytest.importorskip("ray")
    ray.init(
        num_cpus=2,
        resources={ENGINE_RESOURCE: 2},
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
    try:
        yield ray
    finally:
        ray.shutdown()


def read_checkpoint(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("model*.safetensors")):
        out.update(safetensors.torch.load_file(f))
    return out


def assert_holds(directory: Path, sd: dict[str, torch.Tensor]) -> None:
    got = read_checkpoint(directory)
    assert set(got) == set(sd)
    for k, v in sd.items():
        assert same_bytes(got[k], v), k


# --------------------------------------------------------------------------- without a cluster


def test_importing_asyncsync_never_imports_ray() -> None:
    code = "import sys, asyncsync, asyncsync.training.ray; assert 'ray' not in sys.modules, 'ray'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_missing_ray_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # makes `import ray` raise ImportError
    with pytest.raises(ImportError, match=r"pip install 'ray>=2\.40'"):
        import_ray()
    with pytest.raises(ImportError, match="needs Ray"):
        start_receivers("/r", [ReceiverSpec("e0", "/ckpt")])


def test_receiver_spec_validation() -> None:
    spec = ReceiverSpec("e0", "/ckpt", engine="sglang", url="http://127.0.0.1:30000")
    assert spec.checkpoint == "/ckpt"
    with pytest.raises(ConfigError, match="invalid engine id"):
        ReceiverSpec("../x", "/ckpt")
    with pytest.raises(ConfigError, match="needs the server's url"):
        ReceiverSpec("e0", "/ckpt", engine="vllm")
    with pytest.raises(ConfigError, match="takes no url"):
        ReceiverSpec("e0", "/ckpt", url="http://127.0.0.1:1")
    with pytest.raises(ConfigError, match="need a server url"):
        ReceiverSpec("e0", "/ckpt", api_key_file="/k")
    with pytest.raises(ConfigError, match="engine must be one of"):
        ReceiverSpec("e0", "/ckpt", engine="tgi", url="http://x")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="poll_interval"):
        ReceiverSpec("e0", "/ckpt", poll_interval=0)
    with pytest.raises(ConfigError, match="status_port"):
        ReceiverSpec("e0", "/ckpt", status_port=70000)
    assert plain({"p": Path("/a"), "t": (1, 2), "s": spec})["s"]["checkpoint"] == "/ckpt"


# a duration no wait can take: refused at the call, naming the argument, before Ray is touched
# (each was an OverflowError or TypeError from inside ray.wait or asyncio, or a silent wrong wait)
BAD_SECONDS = [float("nan"), -1, True, 10**400, 1e300, "5"]


def _ray_duration_calls(tmp_path: Path) -> dict[str, tuple[Any, bool]]:
    """What each call names in its error -> (the call, whether ``inf`` means no limit there)."""
    root, ckpt = str(tmp_path / "root"), str(tmp_path / "ckpt")
    spec = ReceiverSpec("e0", ckpt)
    fleet = ReceiverFleet(root, {}, {})
    actor = ReceiverActor(root, spec)
    return {
        "poll_interval": (lambda v: ReceiverSpec("e0", ckpt, poll_interval=v), False),
        "ReceiverActor: take_over": (lambda v: ReceiverActor(root, spec, take_over=v), False),
        "ReceiverActor.stop: grace": (lambda v: asyncio.run(actor.stop(v)), False),
        "ReceiverFleet.stop: grace": (lambda v: fleet.stop(grace=v), False),
        "ReceiverFleet.statuses: timeout": (lambda v: fleet.statuses(timeout=v), False),
        "ReceiverFleet.sync_now: timeout": (lambda v: fleet.sync_now(timeout=v), True),
        "ReceiverFleet.verify: timeout": (lambda v: fleet.verify(timeout=v), True),
        "ReceiverFleet.wait_for: timeout": (lambda v: fleet.wait_for(1, timeout=v), True),
        "ReceiverFleet.wait_for: poll_interval": (
            lambda v: fleet.wait_for(1, poll_interval=v),
            False,
        ),
        "ReceiverFleet.replace_dead: take_over": (lambda v: fleet.replace_dead(take_over=v), False),
        "start_receivers: ready_timeout": (
            lambda v: start_receivers(root, [spec], ready_timeout=v),
            True,
        ),
    }


@pytest.mark.parametrize("value", [*BAD_SECONDS, float("inf")], ids=shown)
def test_ray_durations_are_checked_at_the_call(tmp_path: Path, value: Any) -> None:
    for what, (call, forever) in _ray_duration_calls(tmp_path).items():
        if forever and value == float("inf"):
            continue  # inf waits without a limit there, as None does
        with pytest.raises(ConfigError, match=what) as info:
            call(value)
        assert info.value.__context__ is None, what  # refused before any wait started


def test_float8_tensors_cross_pickle_packed() -> None:
    sd = mixed_state(2)
    with pytest.raises(AttributeError):  # torch cannot unpickle float8 tensors itself
        pickle.loads(pickle.dumps(sd["model.layers.4.weight"]))
    got = unpack_state_dict(pickle.loads(pickle.dumps(pack_state_dict(sd))))
    assert set(got) == set(sd) and all(same_bytes(got[k], v) for k, v in sd.items())


def test_every_carried_dtype_crosses_pickle_packed() -> None:
    """uint16/32/64 and float8_e8m0fnu tensors do not unpickle either (helper-68); 0-d and
    non-contiguous ones of every dtype cross too."""
    sd = every_dtype_state(3)
    got = unpack_state_dict(pickle.loads(pickle.dumps(pack_state_dict(sd))))
    assert set(got) == set(sd) and all(same_bytes(got[k], v) for k, v in sd.items())


async def test_actor_bodies_in_process(tmp_path: Path) -> None:
    """ReceiverActor and TrainerActor are plain classes: their logic runs here without Ray."""
    root, ckpt = tmp_path / "root", tmp_path / "ckpt"
    trainer = TrainerActor(SyncConfig(root=root, bucket_bytes=8192), rank=0, world_size=1)
    assert (await trainer.open())["node_id"] is None  # not in a Ray worker
    with pytest.raises(ConfigError, match="override state_dict"):
        await trainer.publish()
    receiver = ReceiverActor(str(root), ReceiverSpec("e0", str(ckpt), poll_interval=0.02))
    with pytest.raises(RuntimeError, match="not started"):
        await receiver.wait_ready()
    await receiver.start()
    assert await receiver.wait_ready() is None and receiver.version() is None
    states = [mixed_state(3)]
    states.append(mutate(states[0], 0.05, seed=4))
    res = await trainer.publish(pack_state_dict(states[0]))  # float8 tensors packed
    assert (res["version"], res["kind"], res["ack"]["target"]) == (0, "full", None)
    assert await receiver.sync_now() == 0
    assert (await trainer.publish(states[1]))["kind"] == "delta"
    for _ in range(500):  # the agent's run loop picks version 1 up by itself
        if receiver.version() == 1:
            break
        await asyncio.sleep(0.01)
    assert await receiver.verify() == {"version": 1, "mismatched": []}
    assert_holds(ckpt, states[1])
    st = receiver.status()
    assert st["running"] and st["version"] == 1 and st["stopped_by"] is None
    assert (await trainer.wait_acked(engines=["e0"], timeout=5))["e0"]["version"] == 1
    assert trainer.version() == 1 and trainer.statistics()["published"] == 2

    # a second receiver on the same checkpoint: wait_ready raises why its loop ended
    other = ReceiverActor(str(root), ReceiverSpec("e1", str(ckpt)))
    await other.start()
    with pytest.raises(LockHeld):
        await other.wait_ready()
    assert other.status()["stopped_by"].startswith("LockHeld") and not other.status()["running"]
    assert await receiver.stop(grace=30) == 1 and not receiver.status()["running"]
    await trainer.close()


async def test_status_port_answers_while_the_receiver_waits_to_take_over(tmp_path: Path) -> None:
    """A Ray receiver started its status server only once its engine was open: while it waited
    to take a held checkpoint over (or for a slow engine) the port refused connections, so a
    probe could not tell it from one that is not there. It serves from the start now, as
    ``asyncsync-receiver`` does: ``/readyz`` 503 saying why, ``/healthz`` 200, ``/status``
    ``starting``; once open, the opened agent's state."""
    import aiohttp

    root, ckpt = tmp_path / "root", tmp_path / "ckpt"
    holder = ReceiverActor(str(root), ReceiverSpec("e0", str(ckpt), poll_interval=0.02))
    await holder.start()
    await holder.wait_ready()
    spec = ReceiverSpec("e1", str(ckpt), status_port=0, agent_options={"lease_ttl": 0.3})
    waiter = ReceiverActor(str(root), spec, take_over=120)
    await waiter.start()
    try:
        for _ in range(1000):
            st = waiter.status()
            if st["waiting"] is not None or not st["running"]:
                break
            await asyncio.sleep(0.01)
        assert st["waiting"] is not None and st["waiting"].startswith("LockHeld"), st
        assert st["status_url"] is not None, st  # (it was None: no server yet)
        url = st["status_url"]
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "/readyz") as r:
                body = await r.json()
                assert r.status == 503 and body["ready"] is False, body
                assert body["why"].startswith("starting: waiting to take over (LockHeld"), body
            async with http.get(url + "/healthz") as r:
                body = await r.json()
                assert r.status == 200 and body["starting"].startswith("waiting to take"), body
            async with http.get(url + "/status") as r:
                assert (await r.json())["starting"].startswith("waiting to take over"), url
            await holder.stop(grace=30)  # frees the checkpoint: the waiter takes it over
            assert await waiter.wait_ready() is None and waiter.status()["status_url"] == url
            async with http.get(url + "/healthz") as r:
                body = await r.json()
                assert r.status == 200 and "starting" not in body, body
            async with http.get(url + "/status") as r:
                assert (await r.json())["starting"] is None
    finally:
        await holder.stop(grace=30)
        await waiter.stop(grace=30)
    assert not waiter.status()["running"] and waiter.status()["status_url"] is None


@pytest.mark.parametrize(
    ("host", "node_ip", "want"),
    [
        ("0.0.0.0", None, "{ip}"),  # the address Ray gives this node
        ("::", None, "{ip}"),
        ("::", "2001:db8::5", "[2001:db8::5]"),  # an IPv6 node: bracketed
        ("0.0.0.0", "2001:db8::5", "127.0.0.1"),  # not served over IPv6: the loopback stays
    ],
)
async def test_status_url_bound_to_every_interface_names_the_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, host: str, node_ip: str | None, want: str
) -> None:
    """A Ray receiver whose status server is bound to every interface reported
    ``http://127.0.0.1:PORT``: right on its node, useless to a driver on another one. It reports
    the node's address as Ray knows it (``ray.util.get_node_ip_address``), when the server
    serves that address's family; the real one answers."""
    ray_util = pytest.importorskip("ray.util")
    import aiohttp

    if node_ip is not None:  # (a node address of another family than this host's)
        monkeypatch.setattr(ray_util, "get_node_ip_address", lambda: node_ip)
    spec = ReceiverSpec("e0", str(tmp_path / "ckpt"), status_port=0, status_host=host)
    actor = ReceiverActor(str(tmp_path / "root"), spec)
    await actor.start()
    try:
        await actor.wait_ready()
        url = actor.status()["status_url"]
        port = url.rsplit(":", 1)[1]
        assert url == f"http://{want.format(ip=ray_util.get_node_ip_address())}:{port}", url
        if node_ip is None:
            async with aiohttp.ClientSession() as http, http.get(url + "/healthz") as r:
                assert r.status == 200, await r.text()
    finally:
        await actor.stop(grace=30)


async def test_status_url_of_an_ipv6_only_every_interface_on_an_ipv4_node_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """(attack-72) ``::`` on a system that refuses dual-stack sockets is served IPv6 only; on a
    node Ray knows by an IPv4 address the status URL stays the loopback (``[::1]``: the node's
    IPv4 address would not answer), which a driver on another node cannot use: it said nothing.
    A WARNING says so now, and what to give instead; the loopback URL answers on the node."""
    import socket

    ray_util = pytest.importorskip("ray.util")
    import aiohttp

    monkeypatch.setattr(ray_util, "get_node_ip_address", lambda: "10.0.0.7")
    real = socket.socket.setsockopt

    def no_dual_stack(sock: socket.socket, level: int, opt: int, value: Any) -> None:
        if (level, opt, value) == (socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0):
            real(sock, level, opt, 1)  # its IPv6 sockets are IPv6 only, always
            raise OSError(95, "Operation not supported")  # as such a system says
        real(sock, level, opt, value)

    monkeypatch.setattr(socket.socket, "setsockopt", no_dual_stack)
    spec = ReceiverSpec("e0", str(tmp_path / "ckpt"), status_port=0, status_host="::")
    actor = ReceiverActor(str(tmp_path / "root"), spec)
    await actor.start()
    try:
        await actor.wait_ready()
        url = actor.status()["status_url"]
        assert url.startswith("http://[::1]:"), url
        said = [m for r in caplog.records if "on this node only" in (m := r.getMessage())]
        assert len(said) == 1 and "10.0.0.7" in said[0] and "0.0.0.0" in said[0], said
        async with aiohttp.ClientSession() as http, http.get(url + "/healthz") as r:
            assert r.status == 200, await r.text()
    finally:
        await actor.stop(grace=30)


# --------------------------------------------------------------------------- on the cluster


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_placement_errors(cluster: Any) -> None:
    (node,) = engine_nodes()
    assert engine_nodes(ENGINE_RESOURCE) == [node] and engine_nodes("no_such") == []
    a, b = ReceiverSpec("a", "/ca"), ReceiverSpec("b", "/cb")
    (opt,) = placement_options([a], "node", ENGINE_RESOURCE)
    assert opt["scheduling_strategy"].node_id == node  # the one free node
    with pytest.raises(ConfigError, match="only 1 alive node"):
        placement_options([a, b], "node", ENGINE_RESOURCE)  # one engine node each
    with pytest.raises(ConfigError, match="not an alive Ray node"):
        placement_options([ReceiverSpec("a", "/ca", node_id="ff" * 28)], "node", ENGINE_RESOURCE)
    with pytest.raises(ConfigError, match=r"ray start --resources="):
        placement_options([a], "resource", "gpu_engine")
    assert (
        placement_options([a, b], "resource", ENGINE_RESOURCE)
        == [{"resources": {ENGINE_RESOURCE: 1.0}}] * 2
    )
    with pytest.raises(ConfigError, match="placement must be"):
        placement_options([a], "zone", ENGINE_RESOURCE)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="unique"):
        start_receivers("/r", [a, ReceiverSpec("a", "/cb")])


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_trainer_and_receivers_by_node(cluster: Any, tmp_path: Path) -> None:
    """2 receivers pinned to the node, one trainer actor, 4 versions, bit-exact checkpoints."""
    root = tmp_path / "root"
    (node,) = engine_nodes()
    specs = [
        ReceiverSpec(f"e{i}", str(tmp_path / f"ckpt{i}"), node_id=node, poll_interval=0.05)
        for i in range(2)
    ]  # e1 serves its status on every interface, at the node's address
    specs[1] = dataclasses.replace(specs[1], status_port=0, status_host="0.0.0.0")
    states = [mixed_state(0)]
    for i in range(1, 4):
        states.append(mutate(states[-1], 0.03, seed=i))
    config = SyncConfig(root=root, bucket_bytes=8192, keyframe_interval=0, ack_engines=["e0"])
    with start_receivers(root, specs) as fleet:
        assert fleet.versions() == {"e0": None, "e1": None}
        assert {n["node_id"] for n in fleet.nodes.values()} == {node}
        with start_trainers(config, num_cpus=0) as trainers:
            for i, sd in enumerate(states):
                (res,) = trainers.publish(sd)
                assert res["version"] == i and res["kind"] == ("full" if i == 0 else "delta")
                assert res["ack"]["target"] == i and res["ack"]["engines"]["e0"] >= i
                assert fleet.wait_for(i, timeout=60) == {"e0": i, "e1": i}
                for spec in specs:
                    assert_holds(Path(spec.checkpoint), sd)
            acks = trainers.wait_acked(engines=["e0", "e1"], timeout=30)
            assert {e: a["version"] for e, a in acks.items()} == {"e0": 3, "e1": 3}
            (stats,) = trainers.statistics()
            assert stats["published"] == 4 and stats["last_version"] == 3
            with pytest.raises(AckTimeout, match="behind version 4"):
                fleet.wait_for(4, timeout=0.3)
        assert fleet.verify() == {e: {"version": 3, "mismatched": []} for e in ("e0", "e1")}
        assert fleet.sync_now() == {"e0": 3, "e1": 3}
        st = fleet.statuses()["e1"]
        assert st["running"] and st["applied"] == 4 and st["last_error"] is None
        assert st["node"]["node_id"] == node
        (address,) = [n["NodeManagerAddress"] for n in cluster.nodes() if n["NodeID"] == node]
        assert st["status_url"].startswith(f"http://{address}:"), (st["status_url"], address)
        with urllib.request.urlopen(st["status_url"] + "/healthz", timeout=30) as r:
            assert json.loads(r.read())["version"] == 3
        # a second receiver for a checkpoint another one holds: refused, its actor ended
        with pytest.raises(LockHeld):
            start_receivers(root, [ReceiverSpec("e9", specs[0].checkpoint)], ready_timeout=60)
        assert "2 receivers" in repr(fleet)
        assert fleet.stop() == {"e0": 3, "e1": 3}
    assert "stopped" in repr(fleet) and fleet.stop() == {}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_trainer_ranks_and_receivers_by_resource(cluster: Any, tmp_path: Path) -> None:
    """Receivers placed by a custom resource; two trainer ranks each publish half the tensors
    of one version (multi-rank publish through the file rendezvous)."""
    root = tmp_path / "root"
    specs = [
        ReceiverSpec(f"r{i}", str(tmp_path / f"ckpt{i}"), poll_interval=0.05) for i in range(2)
    ]
    fleet = start_receivers(root, specs, placement="resource")
    try:
        sd = mixed_state(1)
        names = sorted(sd)
        half = len(names) // 2
        halves = [{k: sd[k] for k in names[:half]}, {k: sd[k] for k in names[half:]}]
        assert set(halves[0]) | set(halves[1]) == set(sd) and not set(halves[0]) & set(halves[1])
        config = SyncConfig(root=root, bucket_bytes=8192, keyframe_interval=0)
        with start_trainers(config, world_size=2, num_cpus=0, rendezvous_timeout=60) as group:
            with pytest.raises(ConfigError, match="one state dict per rank"):
                group.publish(sd)
            for step in range(3):
                if step:
                    halves = [mutate(h, 0.05, seed=10 * step + r) for r, h in enumerate(halves)]
                results = group.publish(halves)
                assert [r["version"] for r in results] == [step, step]
                fleet.wait_for(step, timeout=60)
                for spec in specs:
                    assert_holds(Path(spec.checkpoint), {**halves[0], **halves[1]})
        assert all(v["mismatched"] == [] for v in fleet.verify().values())
    finally:
        fleet.stop()
