"""Trainer ranks as Ray actors that publish into the shared root.

Example::

    group = start_trainers(SyncConfig(root="/shared/weights", ack_quorum=2, max_staleness=1))
    for step in range(steps):
        res, = group.publish(model.state_dict())     # seeds first, then sparse deltas
    group.wait_acked(res["version"], timeout=120)
    group.close()

A :class:`TrainerActor` holds a :class:`~asyncsync.publish.publisher.Publisher` on the actor's event
loop. Weights reach it either as an argument of :meth:`TrainerActor.publish` (copied through
Ray's object store: fine for small models and tests), or, without copies, from the actor's own
model: subclass it, keep the model in the actor, override :meth:`TrainerActor.state_dict`, and
call ``publish()`` with no argument::

    class Trainer(TrainerActor):
        def __init__(self, config, **kw):
            super().__init__(config, **kw)
            self.model = build_model()
        def state_dict(self):
            return self.model.state_dict()
        def train_step(self, batch): ...

    group = start_trainers(config, actor_cls=Trainer, world_size=2)
    group.call("train_step", batch)     # on every rank
    group.publish()                     # each rank publishes its own part of the weights

With ``world_size > 1`` the ranks publish one version together: each rank's state dict holds
its own tensors (distinct names, or slices of one tensor), coordinated through files in the
root (:class:`~asyncsync.publish.rendezvous.FileRendezvous`, with a job token of this group and
the group's publish count as every round's step), and rank 0 commits the manifest.

**Placement.** ``start_trainers(placement=...)`` says where the ranks run: ``"spread"``
(default: Ray's SPREAD strategy, the ranks on distinct nodes where it can, so that one node's
death takes only its ranks), ``"default"`` (Ray's default: the driver's node first while it has
room), or a list of node ids, one per rank (hard affinity). ``TrainerGroup.nodes`` says where
each rank landed. A dead rank (its actor or its node gone) makes ``publish`` raise Ray's
``RayActorError``; ``close()`` never raises for it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from asyncsync.codec import raw_view
from asyncsync.errors import ConfigError, PublishError
from asyncsync.training.config import SyncConfig
from asyncsync.training.ray.base import import_ray, plain, where

if TYPE_CHECKING:
    from asyncsync.publish.publisher import Publisher
    from asyncsync.training.staleness import StalenessGate

__all__ = [
    "TrainerActor",
    "TrainerGroup",
    "TrainerPlacement",
    "pack_state_dict",
    "start_trainers",
    "unpack_state_dict",
]

logger = logging.getLogger(__name__)

# dtypes whose tensors torch (2.13) pickles but cannot unpickle ("UntypedStorage has no
# attribute dtype"): they cross Ray's object store as their bytes
_BYTES_DTYPES = {
    getattr(torch, n)
    for n in (
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
        "uint16",
        "uint32",
        "uint64",
    )
    if hasattr(torch, n)
}


@dataclass(frozen=True)
class _AsBytes:
    """A tensor of a dtype in ``_BYTES_DTYPES``, carried as its int view (:func:`raw_view`:
    the signed int of its width, same shape, contiguous)."""

    data: torch.Tensor
    dtype: str

    def tensor(self) -> torch.Tensor:
        return self.data.view(getattr(torch, self.dtype))


def pack_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """``state_dict`` ready to cross Ray's object store (float8 tensors as bytes), for
    ``TrainerActor.publish.remote(...)`` called on a handle directly."""
    return {
        k: _AsBytes(raw_view(t).contiguous(), str(t.dtype).removeprefix("torch."))
        if t.dtype in _BYTES_DTYPES
        else t
        for k, t in state_dict.items()
    }


def unpack_state_dict(packed: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`pack_state_dict` (plain tensors pass through)."""
    return {k: v.tensor() if isinstance(v, _AsBytes) else v for k, v in packed.items()}


def _config(config: SyncConfig | Mapping[str, Any]) -> SyncConfig:
    if isinstance(config, SyncConfig):
        return config
    if isinstance(config, Mapping):
        return SyncConfig.from_dict(config)
    raise ConfigError(f"config must be a SyncConfig or a mapping, got {type(config).__name__}")


class TrainerActor:
    """The body of one trainer rank's Ray actor (:func:`start_trainers` wraps it).

    Args:
        config: the trainer's :class:`~asyncsync.training.config.SyncConfig` (or a mapping of
            it); its ack policy (``ack_engines``/``ack_quorum``, ``max_staleness``) is applied after
            each publish, as :class:`~asyncsync.training.session.SyncSession` does.
        rank, world_size: this rank of a multi-rank publisher (``world_size`` 1: alone).
        rendezvous_timeout: seconds rank 0 waits for the other ranks at each publish.
        producer: extra fields for each manifest's ``producer`` record.
        job: the token every rank of this group shares (:func:`start_trainers` makes one), so
            that another job's ranks on the same root are never taken for this group's.
    """

    def __init__(
        self,
        config: SyncConfig | Mapping[str, Any],
        *,
        rank: int = 0,
        world_size: int = 1,
        rendezvous_timeout: float = 300.0,
        producer: Mapping[str, Any] | None = None,
        job: str | None = None,
    ) -> None:
        from asyncsync.publish.publisher import Publisher
        from asyncsync.training.factory import publisher_kwargs

        self.config = _config(config)
        self.rank, self.world_size = rank, world_size
        kwargs = publisher_kwargs(
            self.config, Publisher, producer={"rank": rank, **(producer or {})}
        )
        if world_size != 1 or rank != 0:
            from asyncsync.publish.rendezvous import FileRendezvous

            kwargs["coordinator"] = FileRendezvous(
                self.config.root, rank, world_size, timeout=rendezvous_timeout, job=job
            )
        self.publisher: Publisher = Publisher(**kwargs)
        self._gate: StalenessGate | None = None

    def __repr__(self) -> str:
        return f"<TrainerActor rank={self.rank}/{self.world_size} {self.publisher!r}>"

    async def open(self) -> dict[str, Any]:
        """Open the publisher (take this rank's lock on the root); returns where it runs."""
        await self.publisher.open()
        return where()

    def state_dict(self) -> Mapping[str, torch.Tensor]:
        """The weights :meth:`publish` sends when given none: override in a subclass that
        keeps its model in the actor."""
        raise ConfigError(
            "publish() got no state dict: pass one, or subclass TrainerActor and override "
            "state_dict() to return the actor's own model weights"
        )

    async def publish(
        self,
        state_dict: Mapping[str, Any] | None = None,
        *,
        keyframe: bool = False,
        slices: Mapping[str, Any] | None = None,
        step: int | None = None,
    ) -> dict[str, Any]:
        """Seed (this actor's first call) or publish the next version, then wait per the ack
        policy. Returns the :class:`~asyncsync.publish.stats.PublishResult` as a dict, plus ``ack``:
        ``{"target", "seconds", "engines": {engine_id: version}}``.

        ``state_dict``: tensors, or a :func:`pack_state_dict` of them (float8 tensors sent
        through Ray must be packed; :meth:`TrainerGroup.publish` does it); None: this actor's
        own :meth:`state_dict`.

        ``slices`` (multi-rank): :class:`~asyncsync.publish.merge.TensorSlice` per tensor of which
        this rank holds a flat range. ``step``: the round's step, the same on every rank
        (:meth:`TrainerGroup.publish` counts them).
        """
        from asyncsync.training.staleness import StalenessGate

        weights = self.state_dict() if state_dict is None else unpack_state_dict(state_dict)
        await self.publisher.open()
        if self._gate is None:
            res = await self.publisher.seed(weights, slices=slices, step=step)
            self._gate = StalenessGate(self.publisher, self.config.ack_policy, floor=res.version)
        else:
            res = await self.publisher.publish(weights, keyframe=keyframe, slices=slices, step=step)
        wait = await self._gate.wait(res.version)
        out: dict[str, Any] = plain(res)
        out["ack"] = {
            "target": wait.target,
            "seconds": wait.seconds,
            "engines": {e: a.version for e, a in wait.acks.items()},
        }
        return out

    async def wait_acked(
        self,
        version: int | None = None,
        *,
        engines: Sequence[str] | None = None,
        quorum: int | None = None,
        timeout: float | None = None,
    ) -> dict[str, dict[str, Any]]:
        """Wait until ``engines`` (all) or a ``quorum`` hold ``version`` (default: the last
        committed; engines or quorum default to the config's ack policy). The acks as dicts."""
        target = self.publisher.version if version is None else version
        if target is None:
            raise PublishError("nothing published yet: nothing to wait for")
        policy = self.config.ack_policy
        if engines is None and quorum is None:
            engines, quorum = (list(policy.engines) or None), policy.quorum
        acks = await self.publisher.wait_acked(
            target,
            engines=engines,
            quorum=quorum,
            timeout=policy.timeout if timeout is None else timeout,
        )
        return plain(acks)

    def version(self) -> int | None:
        """The last version committed in the root (None before the first)."""
        return self.publisher.version

    def statistics(self) -> dict[str, Any]:
        """The publisher's :class:`~asyncsync.publish.stats.PublisherStats` as a dict."""
        return plain(self.publisher.statistics())

    async def close(self) -> None:
        """Close the publisher (release the root's lock)."""
        await self.publisher.close()


class TrainerGroup:
    """The trainer ranks :func:`start_trainers` started (blocking calls, for drivers).

    ``actors[rank]`` is each rank's Ray actor handle, for methods of a subclass.
    """

    def __init__(
        self,
        root: str,
        actors: Sequence[Any],
        nodes: Sequence[Mapping[str, Any]],
        *,
        job: str | None = None,
        placement: str = "",
    ):
        self.root = root
        self.actors = list(actors)
        self.nodes = [dict(n) for n in nodes]  # where each rank runs: node_id, host, pid
        self.job = job
        self.placement = placement
        self._steps = 0  # every publish is one step of every rank
        self._closed = False

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self.actors)} rank(s)"
        return f"<TrainerGroup root={self.root!r} {state}>"

    def __enter__(self) -> TrainerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def world_size(self) -> int:
        return len(self.actors)

    def call(self, method: str, *args: Any, timeout: float | None = None, **kw: Any) -> list[Any]:
        """Run ``method`` on every rank at once (``train_step`` of a subclass ...)."""
        ray = import_ray()
        return list(
            ray.get([getattr(a, method).remote(*args, **kw) for a in self.actors], timeout=timeout)
        )

    def publish(
        self,
        state_dicts: Mapping[str, torch.Tensor]
        | Sequence[Mapping[str, torch.Tensor]]
        | None = None,
        *,
        keyframe: bool = False,
        slices: Sequence[Mapping[str, Any] | None] | None = None,
        timeout: float | None = None,
    ) -> list[dict[str, Any]]:
        """Publish one version: every rank at once, each with its state dict (a list, one per
        rank; one dict for a single rank; None: each actor's own :meth:`~TrainerActor.state_dict`).
        ``slices``: each rank's :class:`~asyncsync.publish.merge.TensorSlice` mapping (or None).
        Returns each rank's result (:meth:`TrainerActor.publish`); every rank reports the
        version the group committed. Each call is one step of the group's ranks (counted here),
        so a rank whose call failed or came late never joins another call's version."""
        if state_dicts is None or isinstance(state_dicts, Mapping):
            if state_dicts is not None and self.world_size > 1:
                raise ConfigError(f"give one state dict per rank ({self.world_size} ranks)")
            per_rank: list[Any] = [state_dicts] * self.world_size
        else:
            per_rank = list(state_dicts)
            if len(per_rank) != self.world_size:
                raise ConfigError(f"got {len(per_rank)} state dicts for {self.world_size} ranks")
        rank_slices = [None] * self.world_size if slices is None else list(slices)
        if len(rank_slices) != self.world_size:
            raise ConfigError(f"got {len(rank_slices)} slices for {self.world_size} ranks")
        ray = import_ray()
        step, self._steps = self._steps, self._steps + 1
        refs = [
            a.publish.remote(
                None if sd is None else pack_state_dict(sd),
                keyframe=keyframe,
                slices=sl,
                step=step if self.world_size > 1 else None,
            )
            for a, sd, sl in zip(self.actors, per_rank, rank_slices, strict=True)
        ]
        return list(ray.get(refs, timeout=timeout))

    def wait_acked(
        self,
        version: int | None = None,
        *,
        engines: Sequence[str] | None = None,
        quorum: int | None = None,
        timeout: float | None = None,
    ) -> dict[str, dict[str, Any]]:
        """Rank 0's :meth:`TrainerActor.wait_acked`."""
        ray = import_ray()
        ref = self.actors[0].wait_acked.remote(
            version, engines=engines, quorum=quorum, timeout=timeout
        )
        return dict(ray.get(ref))

    def statistics(self) -> list[dict[str, Any]]:
        """Each rank's publisher statistics."""
        return self.call("statistics")

    def close(self) -> None:
        """Close every rank's publisher and end the actors. Idempotent; never raises for a rank
        whose actor or node died (it is logged)."""
        if self._closed:
            return
        ray = import_ray()
        from ray.exceptions import RayError

        try:
            refs = [a.close.remote() for a in self.actors]
            ray.wait(refs, num_returns=len(refs), timeout=60)
            for rank, ref in enumerate(refs):
                try:
                    ray.get(ref, timeout=0)
                except RayError as exc:
                    logger.warning("trainer rank %d was gone at close: %s", rank, exc)
        finally:
            for a in self.actors:
                with contextlib.suppress(Exception):
                    ray.kill(a, no_restart=True)
            self._closed = True


TrainerPlacement = Literal["spread", "default"] | Sequence[str]


def _placement(placement: TrainerPlacement, world_size: int) -> list[dict[str, Any]]:
    """Each rank's Ray scheduling option (see the module docstring)."""
    if isinstance(placement, str):
        if placement not in ("spread", "default"):
            raise ConfigError(
                f"placement must be 'spread', 'default' or one node id per rank, got {placement!r}"
            )
        return [{"scheduling_strategy": placement.upper()}] * world_size
    nodes = list(placement)
    if len(nodes) != world_size:
        raise ConfigError(f"placement names {len(nodes)} nodes for {world_size} ranks")
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from asyncsync.training.ray.base import engine_nodes

    alive = engine_nodes()
    dead = [n for n in nodes if n not in alive]
    if dead:
        raise ConfigError(f"placement names nodes that are not alive Ray nodes: {dead}")
    return [
        {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=n, soft=False)}
        for n in nodes
    ]


def start_trainers(
    config: SyncConfig | Mapping[str, Any],
    *,
    world_size: int = 1,
    actor_cls: type[TrainerActor] = TrainerActor,
    num_cpus: float = 1.0,
    num_gpus: float = 0.0,
    placement: TrainerPlacement = "spread",
    rendezvous_timeout: float = 300.0,
    actor_options: Mapping[str, Any] | None = None,
    **init_kwargs: Any,
) -> TrainerGroup:
    """Start ``world_size`` trainer rank actors (``actor_cls``, a :class:`TrainerActor` or a
    subclass) on the connected Ray cluster and open their publishers.

    ``num_cpus``/``num_gpus`` are each rank's Ray resources; ``placement`` where the ranks run:
    ``"spread"`` (default: on distinct nodes where Ray can), ``"default"`` (Ray's default
    scheduling: the driver's node first) or one node id per rank (hard affinity; see
    :func:`~asyncsync.training.ray.base.engine_nodes`); ``actor_options`` adds Ray actor options
    (a ``scheduling_strategy`` there overrides ``placement``; ``runtime_env`` ...);
    ``init_kwargs`` go to ``actor_cls``. The config's root must be the same shared directory on
    every rank's node. Every rank gets the group's job token (``init_kwargs["job"]``, else a new
    one). ``TrainerGroup.nodes`` says where each rank runs.
    """
    ray = import_ray()
    cfg = _config(config)
    if world_size < 1:
        raise ConfigError(f"world_size must be >= 1, got {world_size}")
    if not (isinstance(actor_cls, type) and issubclass(actor_cls, TrainerActor)):
        raise ConfigError("actor_cls must be TrainerActor or a subclass of it")
    placed = _placement(placement, world_size)
    remote = ray.remote(actor_cls)
    job = init_kwargs.pop("job", None) or f"ray-trainers-{secrets.token_hex(6)}"
    options = {"num_cpus": num_cpus, "num_gpus": num_gpus, "max_restarts": 0}
    actors = [
        remote.options(**{**options, **placed[rank], **(actor_options or {})}).remote(
            cfg,
            rank=rank,
            world_size=world_size,
            rendezvous_timeout=rendezvous_timeout,
            job=job,
            **init_kwargs,
        )
        for rank in range(world_size)
    ]
    try:
        nodes = ray.get([a.open.remote() for a in actors])
    except BaseException:
        for a in actors:
            with contextlib.suppress(Exception):
                ray.kill(a, no_restart=True)
        raise
    how = placement if isinstance(placement, str) else "nodes"
    logger.info(
        "started %d trainer rank(s) publishing into %s (placement %s): %s",
        world_size, cfg.root, how, [n.get("node_id") for n in nodes],
    )  # fmt: skip
    return TrainerGroup(os.fspath(cfg.root), actors, nodes, job=job, placement=how)
