"""Who moves slime's engines to a version: receivers beside them, or sidecars the user runs.

slime's updaters call the engines themselves (pause, reload, resume; gen2 ``/pull_weights``).
With asyncsync a *receiver* beside each engine does: it patches a host-local checkpoint from
the shared root, reloads its SGLang server over HTTP, and acknowledges the version once the
server serves it. The updater waits for those acks. The switch ``--asyncsync-receivers``
(``ASYNCSYNC_SLIME_RECEIVERS``) says where the receivers come from:

* ``ray`` (default in delta mode): :class:`RayReceivers` starts one
  :class:`~asyncsync.training.ray.ReceiverActor` per slime engine, on the engine's Ray node
  (hard affinity), pointed at the engine's URL (``engine.get_url``) and at
  ``<--update-weight-local-checkpoint-dir>/<engine id>``;
* ``sidecar``: :class:`Sidecars`: receivers the user runs (``asyncsync-receiver --sglang-url
  ... --engine-id ...``); the updater waits for ``--asyncsync-engine-ids`` (or any
  ``len(engines)`` of them);
* ``none``: nobody: slime reloads the engines (gen2a and gen2 full mode: ``RayTrainGroup``
  reloads ``<disk_dir>/weight_v{N:06d}``, which the updater writes);
* ``slime`` (gen1 full mode) and engines on several hosts: the updater reloads the engines
  itself through slime's actors (:mod:`~asyncsync.training.slime.reload`, whose
  ``HostReceivers`` is the ``ray`` link the updater builds).

Ray is imported only when the ``ray`` link is used. Before each step the updater calls the
link's :meth:`~EngineLink.check`: the ``ray`` link replaces receivers whose actor died (same
engine id, same node; the new one takes the engine id's lease over and catches up from its
checkpoint) and waits, this step, for the engines whose receivers run; a replaced one is
waited for again once it holds the newest version any of them holds.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncsync.errors import ConfigError, check_seconds
from asyncsync.training.settings import FIELD_SPECS, parse_value
from asyncsync.training.staleness import AckPolicy

if TYPE_CHECKING:
    from asyncsync.training.ray import ReceiverFleet

__all__ = ["EngineLink", "NoEngines", "RayReceivers", "Sidecars", "engine_id_of_url"]

logger = logging.getLogger(__name__)


def engine_id_of_url(url: str) -> str:
    """A stable engine id for the server at ``url``: ``sglang-10.0.0.3-30000``."""
    hostport = re.sub(r"^[a-z]+://", "", url).strip("/[]").replace("]:", ":")
    return "sglang-" + re.sub(r"[^A-Za-z0-9.]+", "-", hostport).strip("-")


class EngineLink:
    """Base: whom ``update_weights`` waits for. ``connect`` returns the ack policy."""

    kind = "none"

    def connect(self, engines: Sequence[Any], base: AckPolicy) -> AckPolicy:
        return base

    def check(self) -> AckPolicy | None:
        """Before each step: mend what can be mended; return whom this step waits for (None:
        the policy :meth:`connect` returned). Raise when nothing can be acknowledged."""
        return None

    def after_ack(self, weight_version: int, view: Path | None) -> None:
        """Move what the receivers do not (called on rank 0 once the version is acknowledged;
        ``view`` is the full mode's ``weight_v`` directory)."""

    def close(self) -> None:
        """Stop what :meth:`connect` started."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__}>"


class NoEngines(EngineLink):
    """slime drives the engines itself: nothing to wait for."""


class Sidecars(EngineLink):
    """Receivers the user runs beside the engines, acking under ``engine_ids``."""

    kind = "sidecar"

    def __init__(self, engine_ids: Sequence[str] | str | None) -> None:
        # ('e0,e1' as the flag gives them; one string was split into its characters, waited
        # for as engines 'e' and '0')
        if not engine_ids:
            self.engine_ids: tuple[str, ...] | None = None
            return
        try:
            self.engine_ids = parse_value(FIELD_SPECS["ack_engines"], engine_ids)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"engine_ids: {exc}") from None

    def connect(self, engines: Sequence[Any], base: AckPolicy) -> AckPolicy:
        if base.waits:
            return base  # the configuration decides whom to wait for
        if self.engine_ids:
            return _policy(base, engines=self.engine_ids)
        return _policy(base, quorum=len(engines)) if engines else base


class RayReceivers(EngineLink):
    """One receiver actor per slime engine, on the engine's node (see the module docstring).

    Args:
        root: the shared root as the engine nodes see it (slime's ``--update-weight-disk-dir``).
        local_checkpoint_dir: the host-local directory; each engine's receiver keeps
            ``<dir>/<engine id>``.
        version_offset: the server's weight version label for root version ``v`` is
            ``v + version_offset`` (slime's ``weight_version``).
        ready_timeout: seconds to wait for every receiver to open when the engines connect
            (:func:`~asyncsync.training.ray.start_receivers`); None: do not wait; inf: no limit.
        spec_options: more :class:`~asyncsync.training.ray.ReceiverSpec` fields
            (``poll_interval``...).
    """

    kind = "ray"

    def __init__(
        self,
        root: str,
        local_checkpoint_dir: str,
        *,
        version_offset: int = 0,
        ready_timeout: float | None = 600.0,
        spec_options: dict[str, Any] | None = None,
    ) -> None:
        self.root = root
        self.local_checkpoint_dir = local_checkpoint_dir.rstrip("/")
        self.version_offset = version_offset
        check_seconds("RayReceivers: ready_timeout", ready_timeout, optional=True, forever=True)
        self.ready_timeout = ready_timeout
        self.spec_options = dict(spec_options or {})
        from asyncsync.training.ray.base import ReceiverSpec

        try:  # checked now, not when the engines connect (a Ray actor's error, a step later)
            ReceiverSpec("spec_options", f"{self.local_checkpoint_dir}/x", engine="sglang",
                         url="http://127.0.0.1:1", version_offset=version_offset,
                         **self.spec_options)  # fmt: skip
        except TypeError as exc:  # an unknown or a repeated field
            raise ConfigError(f"RayReceivers: spec_options: {exc}") from None
        self.fleet: ReceiverFleet | None = None
        self._urls: tuple[str, ...] = ()
        self._base = AckPolicy()
        self._catching_up: set[str] = set()  # replaced receivers not yet at the newest version

    def __repr__(self) -> str:
        return f"<RayReceivers root={self.root!r} fleet={self.fleet!r}>"

    def connect(self, engines: Sequence[Any], base: AckPolicy) -> AckPolicy:
        """Start a receiver beside each engine (again, for new URLs); for the same engines,
        replace the receivers that died."""
        from asyncsync.training.ray import import_ray, start_receivers

        ray = import_ray()
        urls = [u for u in ray.get([e.get_url.remote() for e in engines]) if u]
        if not urls:
            raise ConfigError("none of slime's engines reports a URL (engine.get_url)")
        nodes = ray.get([e.__ray_call__.remote(_node_id) for e in engines])
        if tuple(urls) != self._urls:
            self.close()
            specs = self._specs(engines, urls, nodes)
            self.fleet = start_receivers(self.root, specs, ready_timeout=self.ready_timeout)
            self._urls = tuple(urls)
            logger.info("asyncsync: started receivers beside %d engines: %s", len(specs), urls)
        assert self.fleet is not None
        self._base = base
        return self._waits(self.fleet.replace_dead())

    def _specs(self, engines: Sequence[Any], urls: list[str], nodes: list[str]) -> list[Any]:
        """One receiver per engine, beside it (the ``ReceiverSpec`` list to start)."""
        from asyncsync.training.ray import ReceiverSpec

        return [
            ReceiverSpec(
                engine_id_of_url(url),
                f"{self.local_checkpoint_dir}/{engine_id_of_url(url)}",
                engine="sglang",
                url=url,
                node_id=node,
                version_offset=self.version_offset,
                **self.spec_options,
            )
            for url, node in zip(urls, nodes, strict=False)
        ]

    def check(self) -> AckPolicy | None:
        if self.fleet is None:
            return None
        return self._waits(self.fleet.replace_dead())

    def _waits(self, mended: dict[str, str]) -> AckPolicy:
        """Whom a step waits for: the engines whose receivers run, but a replaced one until it
        holds the newest version one of them holds. The configured engines, if any."""
        assert self.fleet is not None
        base = self._base
        if base.waits:
            return base
        self._catching_up |= {e for e, what in mended.items() if what == "replaced"}
        st = self.fleet.statuses()
        running = {e: s["version"] for e, s in st.items() if s["running"] and s.get("opened")}
        newest = max((v for v in running.values() if v is not None), default=None)
        for e in list(self._catching_up):
            v = running.get(e, -1)
            if e in running and (newest is None or (v is not None and v >= newest)):
                self._catching_up.discard(e)  # caught up: waited for again
        ids = tuple(e for e in running if e not in self._catching_up)
        down = {e: s.get("stopped_by") or s.get("waiting") or "catching up" for e, s in st.items()
                if e not in ids}  # fmt: skip
        if down:
            logger.warning(
                "asyncsync: this step waits for %s only; not for %s (%s)",
                list(ids) or "nobody", down, mended or "being replaced or catching up",
            )  # fmt: skip
        if not ids:
            return AckPolicy(timeout=base.timeout, max_staleness=base.max_staleness)
        return _policy(base, engines=ids)

    def close(self) -> None:
        """Stop the receivers (never raises for a dead receiver or node)."""
        fleet, self.fleet = self.fleet, None
        self._urls = ()
        if fleet is not None:
            fleet.stop()


def _node_id(actor: Any) -> str:
    import ray

    return str(ray.get_runtime_context().get_node_id())


def _policy(base: AckPolicy, **who: Any) -> AckPolicy:
    return AckPolicy(timeout=base.timeout, max_staleness=base.max_staleness, **who)
