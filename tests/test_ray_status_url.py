"""The status URL a Ray receiver reports names the node it runs on (attack-72): a real cluster
of two raylets on this host (tests/ray_cluster.py), the second at another loopback address
(127.0.0.2), so that the two nodes' addresses differ as two machines' do."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncsync.training.ray import ReceiverSpec, start_receivers
from tests.ray_cluster import TwoNodes, running

pytestmark = [pytest.mark.heavy, pytest.mark.ray_cluster, pytest.mark.timeout(600)]

NODE_B_IP = "127.0.0.2"


@pytest.fixture(scope="module")
def nodes() -> Iterator[TwoNodes]:
    yield from running(NODE_B_IP)


def test_each_receivers_status_url_names_its_own_node(nodes: TwoNodes, tmp_path: Path) -> None:
    """A receiver bound to every interface (``0.0.0.0``) reports ``status_url`` at its node's
    address as Ray knows it, not the loopback (a driver on another node reached its own host
    there) nor the driver's node: each URL names the node its actor runs on, and answers as
    that receiver."""
    import ray

    addresses = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    assert addresses[nodes.node_b] == NODE_B_IP and addresses[nodes.head_node] != NODE_B_IP
    specs = [
        ReceiverSpec(f"e{i}", str(tmp_path / f"ck{i}"), node_id=node, poll_interval=0.05,
                     status_port=0, status_host="0.0.0.0")
        for i, node in enumerate((nodes.head_node, nodes.node_b))
    ]  # fmt: skip
    fleet = start_receivers(tmp_path / "root", specs, ready_timeout=180)
    try:
        statuses = fleet.statuses()
        for i, node in enumerate((nodes.head_node, nodes.node_b)):
            st = statuses[f"e{i}"]
            assert st["node"]["node_id"] == node, st["node"]
            url = st["status_url"]
            assert url.startswith(f"http://{addresses[node]}:"), (url, addresses)
            with urllib.request.urlopen(f"{url}/status", timeout=30) as resp:
                assert json.loads(resp.read())["engine_id"] == f"e{i}"
    finally:
        fleet.stop()
