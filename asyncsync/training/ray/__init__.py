"""asyncsync on a Ray cluster: receivers beside the engines, trainer ranks that publish.

::

    import ray
    from asyncsync.training.config import SyncConfig
    from asyncsync.training.ray import ReceiverSpec, engine_nodes, start_receivers, start_trainers

    ray.init(address="auto")
    root = "/shared/weights"                       # the same shared filesystem on every node
    fleet = start_receivers(root, [
        ReceiverSpec(f"engine{i}", "/local/ckpt", node_id=node)
        for i, node in enumerate(engine_nodes("GPU"))
    ])                                             # or placement="resource"
    trainers = start_trainers(SyncConfig(root=root))
    for step in range(steps):
        res, = trainers.publish(model.state_dict())
        fleet.wait_for(res["version"], timeout=120)
    fleet.stop(); trainers.close()

* :func:`start_receivers` starts one :class:`ReceiverActor` per :class:`ReceiverSpec`, on a
  given node (``placement="node"``, hard node affinity) or wherever a custom resource is
  offered (``placement="resource"``: start engine nodes with
  ``ray start --resources='{"asyncsync_engine": 1}'``). The :class:`ReceiverFleet` it returns
  asks their versions and status, waits for a version, verifies checkpoints, stops them.
* :func:`start_trainers` starts trainer ranks (:class:`TrainerActor` or a subclass that keeps
  its model in the actor), spread over distinct nodes by default, or on the nodes the caller
  names (``placement=``); the :class:`TrainerGroup` publishes one version with every rank.
* A receiver whose actor died is reported by ``fleet.statuses()`` and started again under its
  engine id by ``fleet.replace_dead()``; ``fleet.stop()`` and ``trainers.close()`` never raise
  for a dead actor or node.

Ray is imported when these functions run, never by ``import asyncsync``; without Ray they raise
ImportError saying how to install it. deploy/ray/ has a runnable example and a cluster config.
"""

from asyncsync.training.ray.base import (
    DEFAULT_RESOURCE,
    ReceiverSpec,
    engine_nodes,
    import_ray,
)
from asyncsync.training.ray.receivers import ReceiverActor, ReceiverFleet, start_receivers
from asyncsync.training.ray.trainers import (
    TrainerActor,
    TrainerGroup,
    TrainerPlacement,
    pack_state_dict,
    start_trainers,
    unpack_state_dict,
)

__all__ = [
    "DEFAULT_RESOURCE",
    "ReceiverActor",
    "ReceiverFleet",
    "ReceiverSpec",
    "TrainerActor",
    "TrainerGroup",
    "TrainerPlacement",
    "engine_nodes",
    "import_ray",
    "pack_state_dict",
    "start_receivers",
    "start_trainers",
    "unpack_state_dict",
]
