"""Engines the updater itself reloads through slime's Ray handles, and engines on several hosts.

slime's updaters move the engines by calling its ``SGLangEngine`` actors (``pause_generation``,
``flush_cache``, ``update_weights_from_disk(model_path=, weight_version=)``,
``continue_generation``). Two cases here do the same, on rank 0 once a version is committed
(and, for receivers, acknowledged):

* :class:`SlimeReload` (``--asyncsync-receivers slime``, the default of gen1 full mode): slime
  90c212b5c's full disk updater reloads the engines from ``<disk_dir>/weight_v{N:06d}`` itself
  (its ``RayTrainGroup`` does not); so does this link, from the view the updater writes, and
  removes the view afterwards unless ``--update-weight-disk-keep-files``, as slime does.
* :class:`HostReceivers` (``--asyncsync-receivers ray``): an engine that spans several hosts
  (``engine_gpu_counts[i] > --num-gpus-per-node``) loads ``model_path`` on *every* host, so
  every host needs the version in its local checkpoint before the engine reloads. A
  checkpoint-only receiver runs on each of its hosts (ids ``<engine id>.host<k>``, the same
  ``<--update-weight-local-checkpoint-dir>/<engine id>`` on each), and once all of them
  acknowledged, rank 0 reloads the engine through its node-0 handle, as slime's delta updaters
  do. Engines on one host keep a receiver that reloads its own server. The other hosts' actors
  are known only where slime passes them (gen2a's ``all_engine_actors``); elsewhere an engine
  on several hosts is refused with what to do instead.

:func:`run_pre_read` runs gen2a's ``--custom-delta-pre-read-path`` hook
``hook(disk_dir, target_version)`` on every engine host, inside slime's engine actors.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncsync.errors import ConfigError
from asyncsync.training.slime.engines import EngineLink, RayReceivers, _node_id, engine_id_of_url
from asyncsync.training.staleness import AckPolicy

__all__ = ["HostReceivers", "SlimeReload", "engine_hosts", "reload_engines", "run_pre_read"]

logger = logging.getLogger(__name__)


def _get(refs: list[Any]) -> list[Any]:
    from asyncsync.training.ray import import_ray

    return list(import_ray().get(refs))


def reload_engines(engines: Sequence[Any], model_path: str, weight_version: int) -> None:
    """slime's reload of ``engines`` (its ``SGLangEngine`` actor handles) from ``model_path``,
    labelled ``str(weight_version)``; generation resumes also when the reload failed."""
    if not engines:
        return
    _get([e.pause_generation.remote() for e in engines])
    try:
        _get([e.flush_cache.remote() for e in engines])
        _get(
            [
                e.update_weights_from_disk.remote(
                    model_path=model_path, weight_version=str(weight_version)
                )
                for e in engines
            ]
        )
    finally:
        _get([e.continue_generation.remote() for e in engines])


def engine_hosts(
    engines: Sequence[Any],
    *,
    gpu_counts: Sequence[int] | None,
    gpus_per_node: int | None,
    all_engine_actors: Sequence[Any] | None,
) -> list[list[Any] | None]:
    """Each engine's actors, one per host, node 0 first; None where the engine spans several
    hosts whose actors slime did not pass. Hosts per engine as slime counts them
    (``max(1, gpus_per_engine // num_gpus_per_node)``); slime's ``all_engine_actors`` lists
    every engine's hosts in engine order."""
    n = len(engines)
    counted = gpu_counts is not None and bool(gpus_per_node) and len(gpu_counts) == n
    spans = [max(1, int(c) // int(gpus_per_node or 1)) for c in gpu_counts or ()] if counted else []
    spans = spans or [1] * n
    actors = list(all_engine_actors or ())
    if not actors:
        return [[e] if s == 1 else None for e, s in zip(engines, spans, strict=True)]
    if len(actors) != sum(spans):
        if counted or not n or len(actors) % n:
            raise ConfigError(
                f"slime passed {len(actors)} engine actors (all_engine_actors) for {n} engines "
                f"that span {sum(spans)} hosts (engine_gpu_counts {list(gpu_counts or ())}, "
                f"--num-gpus-per-node {gpus_per_node}): which host serves which engine cannot "
                "be told, so no engine is updated half"
            )
        spans = [len(actors) // n] * n  # counts not given: slime's groups are uniform
    out: list[list[Any] | None] = []
    start = 0
    for engine, span in zip(engines, spans, strict=True):
        out.append([engine, *actors[start + 1 : start + span]])
        start += span
    return out


def multi_host_error(index: int, why: str) -> ConfigError:
    return ConfigError(
        f"slime's engine {index} spans several hosts and {why}: every host of such an engine "
        "loads its weights from its own local checkpoint, so each needs a receiver and the "
        "engine may reload only once all of them hold the version. asyncsync does that with "
        "--asyncsync-receivers ray when connect_rollout_engines gets every host's engine actor "
        "(all_engine_actors=, which slime c74877886 passes); otherwise use engines on one host "
        "each, or full mode with slime's own reload (--asyncsync-receivers none, slime "
        "624b824a8, whose /pull_weights reaches every host)"
    )


class SlimeReload(EngineLink):
    """The updater reloads slime's engines from the ``weight_v`` view (module docstring)."""

    kind = "slime"

    def __init__(self, *, keep_files: bool = False) -> None:
        self.keep_files = keep_files
        self.engines: list[Any] = []

    def connect(self, engines: Sequence[Any], base: AckPolicy) -> AckPolicy:
        self.engines = list(engines)
        return base

    def after_ack(self, weight_version: int, view: Path | None) -> None:
        if view is None:
            raise ConfigError("--asyncsync-receivers slime needs full mode's weight_v view")
        reload_engines(self.engines, str(view), weight_version)
        if not self.keep_files:
            shutil.rmtree(view, ignore_errors=True)  # as slime, once the engines reloaded it


class HostReceivers(RayReceivers):
    """:class:`RayReceivers`, with engines on several hosts served as the module docstring says.

    ``hosts`` (set before :meth:`connect`): :func:`engine_hosts` of the engines."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.hosts: list[list[Any] | None] | None = None
        self._multi: list[tuple[Any, str]] = []  # (node-0 handle, model path) to reload

    def connect(self, engines: Sequence[Any], base: AckPolicy) -> AckPolicy:
        hosts = self.hosts or [[e] for e in engines]
        for i, h in enumerate(hosts):
            if h is None:
                raise multi_host_error(i, "slime passed only its node-0 actor")
        if base.max_staleness and any(h and len(h) > 1 for h in hosts):
            raise ConfigError(
                "engines on several hosts are reloaded by the trainer once every host holds the "
                "version, which needs --update-weight-max-staleness 0"
            )
        policy = super().connect(engines, base)
        if self._multi and base.waits and self.fleet is not None:
            # the trainer reloads those engines once every host holds the version: wait for all
            ids = tuple(dict.fromkeys([*(base.engines or ()), *self.fleet.actors]))
            logger.warning("engines on several hosts: waiting for every receiver too: %s", ids)
            policy = AckPolicy(timeout=base.timeout, max_staleness=base.max_staleness, engines=ids)
        return policy

    def check(self) -> AckPolicy | None:
        """A dead receiver is replaced (see :class:`RayReceivers`); with engines on several hosts
        every receiver is still waited for, as the trainer reloads those engines once every
        host holds the version."""
        if not self._multi:
            return super().check()
        if self.fleet is not None:
            self.fleet.replace_dead()
        return None  # the policy connect() returned

    def _specs(self, engines: Sequence[Any], urls: list[str], nodes: list[str]) -> list[Any]:
        from asyncsync.training.ray import ReceiverSpec

        hosts = self.hosts or [[e] for e in engines]
        specs: list[Any] = []
        self._multi = []
        for i, (url, node) in enumerate(zip(urls, nodes, strict=False)):
            actors = hosts[i] if i < len(hosts) else None
            if actors is None or len(actors) <= 1:
                specs += super()._specs([engines[i]], [url], [node])
                continue
            eid = engine_id_of_url(url)
            others = _get([a.__ray_call__.remote(_node_id) for a in actors[1:]])
            for k, host_node in enumerate([node, *others]):
                specs.append(
                    ReceiverSpec(
                        f"{eid}.host{k}",
                        self.host_checkpoint(eid, k),
                        engine="checkpoint",
                        node_id=host_node,
                        **self.spec_options,
                    )
                )
            self._multi.append((engines[i], self.host_checkpoint(eid, 0)))
        return specs

    def host_checkpoint(self, engine_id: str, host: int) -> str:
        """The local checkpoint of ``engine_id`` on its host ``host``: the same path on every
        host, since the engine loads one ``model_path`` everywhere."""
        return f"{self.local_checkpoint_dir}/{engine_id}"

    def after_ack(self, weight_version: int, view: Path | None) -> None:
        for engine, path in self._multi:
            reload_engines([engine], path, weight_version)


def _pre_read(actor: Any, hook: str, disk_dir: str, target_version: int) -> None:
    from asyncsync.publish.hooks import resolve_callable

    resolve_callable(hook, what="--custom-delta-pre-read-path")(disk_dir, target_version)


def run_pre_read(hosts: Sequence[Any], hook: str, disk_dir: str, target_version: int) -> None:
    """``hook(disk_dir, target_version)`` inside each of ``hosts`` (slime's engine actors, one
    per host), as slime c74877886's engines call it before they read a version."""
    _get([h.__ray_call__.remote(_pre_read, hook, disk_dir, target_version) for h in hosts])
