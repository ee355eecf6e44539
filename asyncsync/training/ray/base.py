"""What the Ray helpers share: importing Ray, the receiver spec, placement, plain results.

Nothing here imports Ray at module import time; :func:`import_ray` does, with a message that
says how to install it when it is missing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

from asyncsync.errors import AsyncSyncError, ConfigError, check_poll_interval
from asyncsync.format import check_engine_id

__all__ = [
    "DEFAULT_RESOURCE",
    "EngineKind",
    "Placement",
    "ReceiverSpec",
    "engine_nodes",
    "import_ray",
    "placement_options",
    "plain",
    "where",
]

EngineKind = Literal["checkpoint", "sglang", "vllm"]
Placement = Literal["node", "resource"]
ENGINE_KINDS: tuple[EngineKind, ...] = ("checkpoint", "sglang", "vllm")
PLACEMENTS: tuple[Placement, ...] = ("node", "resource")
DEFAULT_RESOURCE = "asyncsync_engine"
RAY_REQUIREMENT = "ray>=2.40"


def import_ray() -> ModuleType:
    """The ``ray`` module, or an ImportError that says how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise ImportError(
            "asyncsync.training.ray needs Ray, which is not installed: "
            f"pip install '{RAY_REQUIREMENT}' (on the driver and on every node of the cluster)"
        ) from exc
    return ray


@dataclass(frozen=True)
class ReceiverSpec:
    """One engine's receiver: which engine, where its checkpoint lives, where to place it.

    It travels to the engine's node, where the engine is built (engines hold files, locks and
    HTTP sessions and cannot be pickled). Paths are paths on that node.

    Args:
        engine_id: the engine's name in acks (``[A-Za-z0-9._-]``, unique per root).
        checkpoint: the node-local checkpoint directory the receiver keeps.
        engine: ``checkpoint`` (a :class:`~receiver.engines.LocalCheckpoint` only),
            ``sglang`` or ``vllm`` (a server at ``url`` that reloads the checkpoint).
        url: the inference server, e.g. ``http://127.0.0.1:30000`` (sglang and vllm only).
        api_key_file: a file on the node holding the server's API key (else the node's
            ``ASYNCSYNC_API_KEY``); the key itself never travels through Ray.
        admin_api_key_file: a file on the node holding SGLang's ``--admin-api-key`` (else the
            node's ``ASYNCSYNC_ADMIN_API_KEY``), sent on the endpoints that change weights, as
            ``asyncsync-receiver --admin-api-key-file`` (sglang only).
        model_path: the checkpoint as the server sees it, when its mount differs.
        node_id: the Ray node (hex id) to run on, for ``placement="node"``; None: any engine
            node not taken by another spec.
        resources: custom resources the actor takes, for ``placement="resource"`` (default:
            one unit of ``DEFAULT_RESOURCE``).
        poll_interval, force_polling: as ``asyncsync-receiver --poll-interval/--force-polling``
            (force polling on NFS and other network filesystems).
        status_port: serve ``/healthz``, ``/readyz``, ``/status``, ``/metrics`` on this port of
            the node (None: not served; 0: any free port), bound to ``status_host``, from before
            the engine is open (meanwhile ``/readyz`` answers 503 saying why: the engine
            starting, a take-over waiting for a held lease).
        agent_options: more :class:`~receiver.agent.ReceiverAgent` keywords
            (``verify_deadline``, ``prefetch`` ...), checked when the spec is made.
        version_offset: the server is told weight version ``v + version_offset`` for root
            version ``v`` (sglang and vllm; slime's ``weight_version`` when it does not start
            at the root's first version).

    Example::

        ReceiverSpec("node3-gpu0", "/local/ckpt", engine="sglang", url="http://127.0.0.1:30000",
                     api_key_file="/etc/asyncsync/sglang-api-key", force_polling=True)
    """

    engine_id: str
    checkpoint: str
    engine: EngineKind = "checkpoint"
    url: str | None = None
    api_key_file: str | None = None
    admin_api_key_file: str | None = None
    model_path: str | None = None
    node_id: str | None = None
    resources: Mapping[str, float] | None = None
    poll_interval: float = 1.0
    force_polling: bool = False
    status_port: int | None = None
    status_host: str = "127.0.0.1"
    agent_options: Mapping[str, Any] = field(default_factory=dict)
    version_offset: int = 0

    def __post_init__(self) -> None:
        try:
            check_engine_id(self.engine_id)
        except AsyncSyncError as exc:  # ManifestError when read from disk; here an argument
            raise ConfigError(str(exc)) from None
        object.__setattr__(self, "checkpoint", os.fspath(self.checkpoint))
        if not self.checkpoint:
            raise ConfigError(f"{self.engine_id}: checkpoint must be a directory path")
        if self.engine not in ENGINE_KINDS:
            raise ConfigError(f"{self.engine_id}: engine must be one of {ENGINE_KINDS}")
        if (self.engine == "checkpoint") != (self.url is None):
            raise ConfigError(
                f"{self.engine_id}: engine {self.engine!r} "
                + ("takes no url" if self.url else "needs the server's url")
            )
        if self.engine == "checkpoint" and (self.api_key_file or self.model_path):
            raise ConfigError(f"{self.engine_id}: api_key_file and model_path need a server url")
        if self.admin_api_key_file is not None and self.engine != "sglang":
            raise ConfigError(
                f"{self.engine_id}: admin_api_key_file is an SGLang option (engine='sglang')"
            )
        if self.engine == "checkpoint" and self.version_offset:
            raise ConfigError(f"{self.engine_id}: version_offset needs a server url")
        check_poll_interval(f"{self.engine_id}: poll_interval", self.poll_interval)
        if self.status_port is not None and not 0 <= self.status_port <= 65535:
            raise ConfigError(f"{self.engine_id}: status_port must be in 0..65535")
        if self.resources is not None:
            object.__setattr__(self, "resources", dict(self.resources))
        object.__setattr__(self, "agent_options", dict(self.agent_options))
        from receiver.options import check_agent_options  # (the agent's own checks)

        # here, on the driver: inside the actor a typo surfaced late, on the engine's node
        check_agent_options(self.agent_options, f"{self.engine_id}: agent_options: ")


def plain(obj: Any) -> Any:
    """A result as plain, picklable, JSON-able data: dataclasses to dicts, paths to strings."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        return {str(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [plain(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    return obj


def where() -> dict[str, Any]:
    """The Ray node (None outside Ray), host and process the caller (an actor) runs in."""
    node_id = None
    with contextlib.suppress(ImportError):
        import ray

        if ray.is_initialized():
            node_id = ray.get_runtime_context().get_node_id()
    return {
        "node_id": node_id,
        "host": socket.gethostname(),
        "pid": os.getpid(),
    }


def engine_nodes(resource: str | None = None) -> list[str]:
    """Hex ids of the connected cluster's alive nodes (those offering ``resource``, if given).

    Example::

        nodes = engine_nodes("GPU")     # every alive node with a GPU
    """
    ray = import_ray()
    return sorted(
        n["NodeID"]
        for n in ray.nodes()
        if n.get("Alive") and (resource is None or n.get("Resources", {}).get(resource, 0) > 0)
    )


def placement_options(
    specs: Sequence[ReceiverSpec], placement: Placement, resource: str
) -> list[dict[str, Any]]:
    """The Ray actor options that place each receiver (see :func:`start_receivers`)."""
    if placement not in PLACEMENTS:
        raise ConfigError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    if placement == "resource":
        options = [{"resources": dict(s.resources or {resource: 1.0})} for s in specs]
        wanted = sorted({name for o in options for name in o["resources"]})
        missing = [r for r in wanted if not engine_nodes(r)]
        if missing:
            raise ConfigError(
                f"no alive Ray node offers {missing}: start each engine node with one unit "
                f"per engine, e.g. ray start --resources='{{\"{missing[0]}\": 1}}'"
            )
        return options

    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    alive = engine_nodes()
    for s in specs:
        if s.node_id is not None and s.node_id not in alive:
            raise ConfigError(f"{s.engine_id}: node {s.node_id} is not an alive Ray node")
    taken = {s.node_id for s in specs if s.node_id is not None}
    free = [n for n in alive if n not in taken]
    unplaced = [s for s in specs if s.node_id is None]
    if len(unplaced) > len(free):
        raise ConfigError(
            f"{len(unplaced)} receivers without node_id need a node each, but only {len(free)} "
            f"alive node(s) are free: give node_id per spec, or use placement='resource'"
        )
    chosen = dict(zip((s.engine_id for s in unplaced), free, strict=False))
    return [
        {
            "scheduling_strategy": NodeAffinitySchedulingStrategy(
                node_id=s.node_id or chosen[s.engine_id], soft=False
            )
        }
        for s in specs
    ]
