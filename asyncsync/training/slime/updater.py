"""The weight updater slime's actor drives: :class:`AsyncSyncWeightUpdater`.

slime calls, on every trainer rank::

    updater = cls(args, model, weights_getter=lambda: backuper.get("actor"),
                  model_name=..., quantization_config=...)
    updater.weight_version = args.update_weight_start_version      # gen2's actor does this
    updater.connect_rollout_engines(engines, lock, engine_gpu_counts=..., ...)
    updater.update_weights()                                        # blocking
    metrics = updater.pop_metrics()

Each ``update_weights``: the getter's Megatron shards go through the converter
(:mod:`~asyncsync.training.slime.weights`) to HF-named tensors, every rank publishes its
share of one version (the multi-rank publisher over a gloo group; one rank: a plain one), rank
0 lays a full version out as slime's ``weight_v{N:06d}``, slime's post-write (pre-push) hook
runs on every rank once all the files that rank writes for the version are written (a Future
it returns is waited on), and rank 0 waits until the receivers beside the engines
(:mod:`~asyncsync.training.slime.engines`) acknowledge that their servers serve the version,
then reloads what the receivers do not (:mod:`~asyncsync.training.slime.reload`).

The hook's timing: ranks other than 0 write only their shards (``<root>/v{N:012d}``), and run
it on that directory before the commit; rank 0 runs it after the commit (the manifest is its
last file), on ``<root>/v{N:012d}`` and, in full mode, then on ``weight_v{N:06d}``. So on a
filesystem that shows files only once the hook published them, the manifest never becomes
visible before a shard of its version.

Versions follow slime: full mode adds 1 on every call, the first included; delta mode's first
call seeds (a full version, ``weight_version`` unchanged) and each later one adds 1. A
zero-diff call still commits a version. The servers are told slime's ``weight_version``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import logging
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

from asyncsync.errors import ConfigError
from asyncsync.format import version_dir
from asyncsync.format.store import read_manifest
from asyncsync.publish.distributed import Coordinator, Decide, Message
from asyncsync.publish.hooks import resolve_callable
from asyncsync.training.config import SyncConfig
from asyncsync.training.session import SyncSession, SyncStep, Weights, collect_state_dict
from asyncsync.training.slime.args import SlimeSettings, slime_settings, sync_config_from_args
from asyncsync.training.slime.engines import EngineLink, NoEngines, RayReceivers, Sidecars
from asyncsync.training.slime.reload import (
    HostReceivers,
    SlimeReload,
    engine_hosts,
    multi_host_error,
    run_pre_read,
)
from asyncsync.training.slime.weights import (
    Converter,
    hf_view_dir,
    resolve_converter,
    write_hf_view,
)

__all__ = ["AsyncSyncWeightUpdater"]

logger = logging.getLogger(__name__)

Hook = Callable[[argparse.Namespace, str, list[Any]], Any]


def _dist_rank() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return int(dist.get_rank()), int(dist.get_world_size())
    return 0, 1


class _HookedCoordinator(Coordinator):
    """Runs slime's hook on this rank (not rank 0) after its shards are durable, before it
    reports them for the commit; a failing hook becomes this rank's error in the commit."""

    def __init__(self, inner: Coordinator, run_hook: Callable[[int], None]) -> None:
        self.inner, self.run_hook = inner, run_hook
        self.rank, self.world_size = inner.rank, inner.world_size
        self.broken_grace, self.silence = inner.broken_grace, inner.silence
        self._version: int | None = None

    async def open(self) -> None:
        await self.inner.open()

    def heartbeat(self, key: str) -> AbstractAsyncContextManager[None]:
        return self.inner.heartbeat(key)

    async def abandon(self, step: str, key: str, message: Message) -> None:
        await self.inner.abandon(step, key, message)

    async def exchange(
        self, step: str, key: str | None, message: Message, decide: Decide
    ) -> Message:
        import asyncio

        if step == "commit" and self._version is not None and "error" not in message:
            try:
                await asyncio.to_thread(self.run_hook, self._version)
            except Exception as exc:
                logger.error("rank %d: slime's hook failed: %r", self.rank, exc)
                message = {"error": f"slime's hook failed on rank {self.rank}: {exc!r}"}
        result = await self.inner.exchange(step, key, message, decide)
        if step == "plan":
            self._version = (
                result.get("version") if isinstance(result.get("version"), int) else None
            )
        return result


class AsyncSyncWeightUpdater:
    """slime's weight updater, through asyncsync (see the module docstring).

    Args:
        args, model, weights_getter, model_name, quantization_config: as slime passes them.
        config, settings: default :func:`sync_config_from_args` / :func:`slime_settings` of args.
        rank, world_size: default ``torch.distributed``'s (or 0 of 1).
        coordinator: the ranks' coordinator (default: a gloo group over every rank).
        converter: Megatron shards -> HF tensors (default: :func:`resolve_converter`).
        engine_link: who moves the engines (default: by ``settings.receivers``).
    """

    def __init__(
        self,
        args: argparse.Namespace,
        model: Any,
        weights_getter: Callable[[], Weights],
        *,
        model_name: str,
        quantization_config: Mapping[str, Any] | None,
        config: SyncConfig | None = None,
        settings: SlimeSettings | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        coordinator: Coordinator | None = None,
        converter: Converter | None = None,
        engine_link: EngineLink | None = None,
    ) -> None:
        self.args, self.model, self.weights_getter = args, model, weights_getter
        self.model_name, self.quantization_config = model_name, quantization_config
        # slime's actor sets it after building the updater (gen2a, gen2); gen1's does not, and
        # has no such flag: asyncsync's --update-weight-start-version then counts
        self.weight_version = getattr(args, "update_weight_start_version", None) or 0
        self.update_weight_metrics: dict[str, float] = {}
        self.rollout_engines: list[Any] = []
        self.rollout_engine_lock: Any = None
        self.settings = settings if settings is not None else slime_settings(args)
        config = config if config is not None else sync_config_from_args(args)
        r, ws = _dist_rank()
        self.rank = r if rank is None else rank
        self.world_size = ws if world_size is None else world_size
        Coordinator.check_rank(self.rank, self.world_size)
        self.converter = converter or resolve_converter(self.settings.converter)
        self._hook: Hook | None = None
        if self.settings.hook:
            self._hook = resolve_callable(self.settings.hook, what=self.settings.hook_flag or "")
        if self.rank != 0:
            config = config.replace(ack_engines=(), ack_quorum=None)  # rank 0 waits
        self.config = config
        if self.world_size > 1 and coordinator is None:
            import torch.distributed as dist

            from asyncsync.publish.distributed import TorchDistCoordinator

            if not (dist.is_available() and dist.is_initialized()):
                raise ConfigError(
                    f"world_size {self.world_size} with no coordinator needs torch.distributed "
                    "initialised (init_process_group) on every rank, or pass coordinator="
                )
            coordinator = TorchDistCoordinator(dist.new_group(backend="gloo"))
        if coordinator is not None and self._hook is not None and self.rank != 0:
            coordinator = _HookedCoordinator(coordinator, self._run_hook_for)
        self._updates = 0
        self._offset: int | None = None
        producer = {"framework": "slime", "model_name": model_name, "rank": self.rank}
        # (the link before the session opens: one that failed after left the root's lock held
        # by a stranded loop thread, every retry in the process refused with LockHeld)
        self._link = engine_link if engine_link is not None else self._default_link()
        self._session = SyncSession(config, producer=producer, coordinator=coordinator).open()
        self._view: Path | None = None
        self.all_engine_actors: list[Any] = []

    # ------------------------------------------------------------------ slime's interface
    def connect_rollout_engines(
        self,
        rollout_engines: Sequence[Any],
        rollout_engine_lock: Any = None,
        engine_gpu_counts: Sequence[int] | None = None,
        engine_gpu_offsets: Sequence[int] | None = None,
        engine_parallel_configs: Sequence[Mapping[str, object]] | None = None,
        all_engine_actors: Sequence[Any] | None = None,
        *,
        engine_ids: Sequence[str] | None = None,
    ) -> None:
        """Record the engines; on rank 0 connect their receivers (start them, for ``ray``) and
        wait for them from now on. Takes what every slime revision passes (gen2a:
        ``all_engine_actors``, one actor per engine host; gen2: ``engine_parallel_configs``).
        ``engine_ids`` (sidecars) overrides the configured ids."""
        self.rollout_engines = list(rollout_engines)
        self.rollout_engine_lock = rollout_engine_lock
        self.all_engine_actors = list(all_engine_actors or ())
        if self.rank != 0:
            return
        if engine_ids is not None:
            self._link = Sidecars(engine_ids)
        hosts = engine_hosts(
            self.rollout_engines,
            gpu_counts=engine_gpu_counts,
            gpus_per_node=getattr(self.args, "num_gpus_per_node", None),
            all_engine_actors=all_engine_actors,
        )
        if isinstance(self._link, HostReceivers):
            self._link.hosts = hosts
        elif isinstance(self._link, Sidecars):
            for i, h in enumerate(hosts):
                if h is None or len(h) > 1:
                    raise multi_host_error(
                        i, "receivers you run (sidecars) reload their server on their own"
                    )
        if isinstance(self._link, RayReceivers):
            self._link.version_offset = self._version_offset()
        elif isinstance(self._link, Sidecars) and self._version_offset():
            logger.warning(
                "asyncsync updater: slime's weight_version is the root version %+d: start each "
                "sidecar with `asyncsync-receiver --version-offset %d` so that its server reports "
                "slime's versions",
                self._version_offset(), self._version_offset(),
            )  # fmt: skip
        self._session.ack_policy = self._link.connect(self.rollout_engines, self.config.ack_policy)
        logger.info("asyncsync updater: waiting for %s", self._session.ack_policy.describe())

    def disconnect_rollout_engines(self) -> None:
        """As slime's disk updaters: nothing to tear down (receivers keep their engines)."""

    def update_weights(self) -> None:
        """Publish the weights as the next version and return when the engines serve it.

        Raises what stopped it (``AckTimeout`` naming the engines behind, ``PublishError``);
        a committed version still advances ``weight_version`` and leaves its metrics.
        """
        t0 = time.perf_counter()
        megatron = collect_state_dict(self.weights_getter())
        hf = collect_state_dict(
            self.converter(
                self.args,
                self.model,
                megatron,
                model_name=self.model_name,
                quantization_config=self.quantization_config,
                rank=self.rank,
                world_size=self.world_size,
            )
        )
        t_gather = time.perf_counter() - t0
        offset = self._version_offset()
        self._offset = offset
        before = self._session.version
        n = self._updates  # the round's step: slime calls update_weights on every rank per step
        t_reload = 0.0
        try:
            try:
                waits = self._link.check()  # a dead receiver is replaced; whom this step waits for
            except Exception as exc:  # the round fails on every rank: none publishes this step
                self._session.abstain(exc, step=n)
            if waits is not None:
                self._session.ack_policy = waits
            step = self._session.publish(
                hf, committed=self._committed if self.rank == 0 else None, step=n
            )
            self.weight_version = step.result.version + offset
            if self.rank == 0:
                t1 = time.perf_counter()
                self._link.after_ack(self.weight_version, self._view)
                t_reload = time.perf_counter() - t1
        except BaseException:
            self._failed(before, t_gather, time.perf_counter() - t0)
            raise
        finally:
            self._updates += 1
        self._record(step, t_gather, time.perf_counter() - t0)
        if t_reload:
            self.update_weight_metrics["perf/update_weights_reload_ms"] = 1000 * t_reload

    def pop_metrics(self) -> dict[str, float]:
        """The last update's metrics (``perf/update_weights_*``), cleared."""
        out, self.update_weight_metrics = self.update_weight_metrics, {}
        return out

    # ------------------------------------------------------------------ lifecycle
    @property
    def session(self) -> SyncSession:
        return self._session

    @property
    def engine_link(self) -> EngineLink:
        return self._link

    def close(self) -> None:
        """Stop the receivers this updater started, close the publisher (idempotent)."""
        try:
            self._link.close()
        finally:
            self._session.close()

    def __enter__(self) -> AsyncSyncWeightUpdater:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"<AsyncSyncWeightUpdater rank={self.rank}/{self.world_size} "
            f"weight_version={self.weight_version} engines={len(self.rollout_engines)} "
            f"link={self._link!r} session={self._session!r}>"
        )

    # ------------------------------------------------------------------ internals
    def _default_link(self) -> EngineLink:
        s = self.settings
        if self.rank != 0 or s.receivers == "none":
            return NoEngines()
        if s.receivers == "sidecar":
            return Sidecars(s.engine_ids)
        if s.receivers == "slime":
            return SlimeReload(keep_files=s.keep_files)
        if s.local_checkpoint_dir is None:  # (slime_settings checks it; settings= may not)
            raise ConfigError(
                "receivers 'ray' need a local checkpoint directory "
                "(--update-weight-local-checkpoint-dir): SlimeSettings.local_checkpoint_dir is None"
            )
        return HostReceivers(str(self.config.root), s.local_checkpoint_dir)

    def _version_offset(self) -> int:
        """slime's weight_version of root version v is v + offset."""
        if self._offset is not None:
            return self._offset
        full = 1 if self.config.mode == "full" else 0
        return self.weight_version + full - self._session.publisher.next_version

    def _call_hook(self, directory: str | Path) -> None:
        assert self._hook is not None
        result = self._hook(self.args, str(directory), list(self.rollout_engines))
        if isinstance(result, concurrent.futures.Future) or callable(
            getattr(result, "result", None)
        ):
            result.result()  # gen1: slime waits on the Future before telling engines to load

    def _run_hook_for(self, version: int) -> None:
        """Ranks other than 0: their shards of ``version`` are written (before the commit)."""
        if self._hook is not None:
            self._call_hook(version_dir(self.config.root, version))

    def _committed(self, result: Any) -> None:
        """Rank 0, once ``result``'s version is committed and before the ack wait: the
        ``weight_v`` view, slime's hook on each directory written, gen2a's pre-read hook."""
        assert self._offset is not None
        weight_version = result.version + self._offset
        if self.settings.hf_view:
            self._write_view(result.version, weight_version)
        if self._hook is not None:
            self._call_hook(version_dir(self.config.root, result.version))
            if self.settings.hf_view:
                assert self._view is not None
                self._call_hook(self._view)
        hook = self.settings.pre_read_hook
        if hook and self.rollout_engines:
            hosts = self.all_engine_actors or self.rollout_engines
            run_pre_read(hosts, hook, str(self.config.root), weight_version)

    def _write_view(self, version: int, weight_version: int) -> None:
        root = Path(self.config.root)
        dest = hf_view_dir(root, weight_version)
        write_hf_view(
            version_dir(root, version),
            read_manifest(root, version),
            dest,
            assets_from=getattr(self.args, "hf_checkpoint", None),
        )
        if self._view is not None and self._view != dest and not self.settings.keep_files:
            shutil.rmtree(self._view, ignore_errors=True)  # slime deletes it after the reload
        self._view = dest

    def _failed(self, before: int | None, gather_s: float, total_s: float) -> None:
        m = self.update_weight_metrics = {}
        m["perf/update_weights_failed"] = 1.0
        m["perf/update_weights_gather_ms"] = 1000 * gather_s
        m["perf/update_weights_total_ms"] = 1000 * total_s
        result = self._session.last_result
        if result is not None and result.version != before and self._offset is not None:
            self.weight_version = result.version + self._offset  # committed: it counts
            self._result_metrics(result)
        m["perf/update_weights_weight_version"] = float(self.weight_version)

    def _result_metrics(self, r: Any) -> None:
        sec, post = r.seconds, r.delta_bytes
        m = self.update_weight_metrics
        m["perf/update_weights_density"] = r.density
        m["perf/update_weights_wire_bytes"] = float(r.wire_bytes)
        m["perf/update_weights_disk_bytes_pre_compress"] = float(r.raw_bytes)
        m["perf/update_weights_disk_bytes_post_compress"] = float(post)
        m["perf/update_weights_compression_ratio"] = r.raw_bytes / post if post else 1.0
        m["perf/update_weights_diff_ms"] = 1000 * sec.get("diff", 0.0)
        m["perf/update_weights_encode_ms"] = 1000 * (sec.get("diff", 0.0) + sec.get("encode", 0.0))
        m["perf/update_weights_write_ms"] = 1000 * sec.get("write", 0.0)
        m["perf/update_weights_commit_ms"] = 1000 * sec.get("commit", 0.0)
        m["perf/update_weights_flushes_per_rank"] = float(r.shards)
        m["perf/update_weights_changed"] = float(r.changed)
        m["perf/update_weights_elements"] = float(r.total)
        m["perf/update_weights_zero_diff"] = float(r.zero_diff)
        m["perf/update_weights_version"] = float(r.version)

    def _record(self, step: SyncStep, gather_s: float, total_s: float) -> None:
        r, ack = step.result, step.ack
        self.update_weight_metrics = {}
        self._result_metrics(r)
        m = self.update_weight_metrics
        m["perf/update_weights_gather_ms"] = 1000 * gather_s
        m["perf/update_weights_ack_wait_ms"] = 1000 * ack.seconds
        m["perf/update_weights_finalize_ms"] = 1000 * (r.seconds.get("commit", 0.0) + ack.seconds)
        m["perf/update_weights_total_ms"] = 1000 * total_s
        m["perf/update_weights_weight_version"] = float(self.weight_version)
        if ack.staleness is not None:
            m["perf/update_weights_staleness"] = float(ack.staleness)
        logger.info(
            "[asyncsync v=%d weight_version=%d rank=%d] %s density=%.3f%% wire=%.1f MB "
            "total=%.2fs ack_wait=%.2fs",
            r.version,
            self.weight_version,
            self.rank,
            r.kind,
            100 * r.density,
            r.wire_bytes / 1e6,
            total_s,
            ack.seconds,
        )
