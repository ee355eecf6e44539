"""slime compatibility: slime's ``--update-weight-*`` arguments and a weight updater of its shape.

A slime-like trainer switches to asyncsync by changing one factory call::

    # before: from slime.backends.megatron_utils.update_weight import create_weight_updater
    from asyncsync.training.slime import create_weight_updater

    self.weight_updater = create_weight_updater(
        self.args, self.model, weights_getter=lambda: self.weights_backuper.get("actor"),
        model_name=model_name, quantization_config=quantization_config,
    )
    self.weight_updater.connect_rollout_engines(rollout_engines, rollout_engine_lock)
    self.weight_updater.update_weights()            # blocking, as slime calls it
    metrics = self.weight_updater.pop_metrics()     # perf/update_weights_* as slime names them

Arguments (slime's names; :func:`add_arguments` adds those a parser lacks):

* ``--update-weight-mode full|delta``: ``full`` writes a complete safetensors checkpoint per
  version (slime's disk mode), ``delta`` sparse deltas with keyframes.
* ``--update-weight-transport disk``: the only transport; others are refused, as is
  ``delta`` with ``--colocate``.
* ``--update-weight-disk-dir DIR``: the shared root. ``--update-weight-delta-dir`` is its
  deprecated alias: it warns (``FutureWarning``), and differing values are refused. Both
  attributes of ``args`` are set to the resolved directory, for code that reads either.
* ``--update-weight-disk-keep-files`` (alias ``--update-weight-delta-keep-files``): keep every
  version. Without it, retention keeps the newest ``--update-weight-keep-versions`` (default 4)
  where the install has ``asyncsync.publish.retention``.
* ``--update-weight-encoding``, ``--update-weight-buffer-size`` (bucket bytes),
  ``--update-weight-start-version``, ``--custom-delta-pre-push-path`` (``hook(args,
  version_dir, rollout_engines)``, run before the version is committed) and asyncsync's
  ``--update-weight-{checksum,keyframe-interval,zstd-level,max-in-flight,keep-versions,
  keep-bytes,ack-engines,ack-quorum,ack-timeout,max-staleness}``.

Anything not given on the command line comes from ``ASYNCSYNC_*`` variables or the file
``ASYNCSYNC_CONFIG`` names (see :mod:`asyncsync.training.config`).

Versions: the first ``update_weights()`` seeds (a full version; root version 0 on a new root)
and leaves ``weight_version`` at the start version; each later call publishes the next root
version and sets ``weight_version = start_version + (root version - seed version)``. Zero-diff
updates still commit a version, so engines' versions never fall out of step.

Threading: the publisher runs on a private event loop in a daemon thread
(:class:`asyncsync.training.session.SyncSession`); ``update_weights`` blocks until the version is
committed and the engines are within ``max_staleness`` versions. Only one process publishes
(rank 0 of ``torch.distributed`` when it is initialised): ``weights_getter`` must give that
process the complete, HF-named weights. It is called on every rank and an iterable result is
consumed completely, so gathers inside it run everywhere; other ranks only advance
``weight_version``. Call :meth:`AsyncSyncWeightUpdater.close` (or use ``with``) at the end.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from asyncsync.errors import ConfigError
from asyncsync.publish.hooks import check_import_path, resolve_callable
from asyncsync.training.config import SyncConfig, parse_size
from asyncsync.training.session import SyncSession, SyncStep, Weights, collect_state_dict
from asyncsync.training.staleness import AckPolicy

__all__ = [
    "DEFAULT_KEEP_VERSIONS",
    "AsyncSyncWeightUpdater",
    "add_arguments",
    "create_weight_updater",
    "resolve_deprecated_args",
    "sync_config_from_args",
]

logger = logging.getLogger(__name__)

#: versions kept when ``--update-weight-disk-keep-files`` is not given (slime deletes old files)
DEFAULT_KEEP_VERSIONS = 4

# dest -> SyncConfig field, for the options that map one to one
_FIELDS = {
    "update_weight_mode": "mode",
    "update_weight_transport": "transport",
    "update_weight_encoding": "encoding",
    "update_weight_checksum": "checksum",
    "update_weight_buffer_size": "bucket_bytes",
    "update_weight_max_in_flight": "max_in_flight",
    "update_weight_keyframe_interval": "keyframe_interval",
    "update_weight_zstd_level": "zstd_level",
    "update_weight_keep_versions": "keep_versions",
    "update_weight_keep_bytes": "keep_bytes",
    "update_weight_start_version": "start_version",
    "update_weight_ack_engines": "ack_engines",
    "update_weight_ack_quorum": "ack_quorum",
    "update_weight_ack_timeout": "ack_timeout",
    "update_weight_max_staleness": "max_staleness",
    "colocate": "colocate",
}
_HOOK_DESTS = ("custom_delta_pre_push_path", "custom_update_weight_post_write_path")
_RESOLVED = "_asyncsync_aliases_resolved"


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Add slime's weight-update options, and asyncsync's, to ``parser``.

    Options the parser already defines (slime's own parser defines its names) are skipped, so
    this is safe to call on a slime parser. Values default to None (not given) so that the
    environment and the config file apply.
    """
    group = parser.add_argument_group(
        "weight update (asyncsync, slime-compatible)",
        "Not given here: ASYNCSYNC_<FIELD> variables, then the ASYNCSYNC_CONFIG file, then "
        "defaults.",
    )
    size = parse_size
    options: list[tuple[str, dict[str, Any]]] = [
        (
            "update_weight_mode",
            {"choices": ["full", "delta"], "help": "full checkpoints or deltas"},
        ),
        ("update_weight_transport", {"help": "only 'disk' (the shared directory)"}),
        ("update_weight_encoding", {"help": "delta encoding: xef, indices, deltas, deltas_zstd"}),
        ("update_weight_disk_dir", {"help": "the shared directory (asyncsync root)"}),
        ("update_weight_delta_dir", {"help": "deprecated alias of --update-weight-disk-dir"}),
        ("update_weight_disk_keep_files", {"action": "store_true", "default": None}),
        ("update_weight_delta_keep_files", {"action": "store_true", "default": None}),
        ("custom_delta_pre_push_path", {"help": "hook(args, version_dir, rollout_engines)"}),
        ("update_weight_start_version", {"type": int, "help": "weight_version of the seed"}),
        ("update_weight_buffer_size", {"type": size, "help": "bucket bytes (e.g. 512MiB)"}),
        ("colocate", {"action": "store_true", "default": None, "help": "refused with delta"}),
        ("update_weight_checksum", {"help": "xxh3-128 or xxh3-64"}),
        ("update_weight_keyframe_interval", {"type": int, "help": "full data every N versions"}),
        ("update_weight_zstd_level", {"type": int}),
        ("update_weight_max_in_flight", {"type": int}),
        ("update_weight_keep_versions", {"type": int, "help": "retention (default 4)"}),
        ("update_weight_keep_bytes", {"type": size, "help": "retention by size"}),
        ("update_weight_ack_engines", {"help": "engine ids to wait for (comma-separated)"}),
        ("update_weight_ack_quorum", {"type": int, "help": "or: any N engines"}),
        ("update_weight_ack_timeout", {"help": "seconds, or 'none' (default 600)"}),
        ("update_weight_max_staleness", {"type": int, "help": "versions ahead of engines"}),
    ]
    for dest, kwargs in options:
        kwargs.setdefault("default", None)
        try:
            group.add_argument(_flag(dest), dest=dest, **kwargs)
        except argparse.ArgumentError:
            logger.debug("%s already defined by the parser; keeping its definition", _flag(dest))
    return group


def resolve_deprecated_args(args: argparse.Namespace) -> None:
    """Apply slime's deprecated aliases in place (warning once per alias given).

    ``--update-weight-delta-dir`` fills ``--update-weight-disk-dir`` and is refused when both
    are given and differ; ``--update-weight-delta-keep-files`` fills
    ``--update-weight-disk-keep-files``. Afterwards both names hold the resolved values (and a
    second call neither warns nor changes anything).
    """
    first = not getattr(args, _RESOLVED, False)
    disk = getattr(args, "update_weight_disk_dir", None)
    legacy = getattr(args, "update_weight_delta_dir", None)
    if legacy is not None and first:
        warnings.warn(
            "--update-weight-delta-dir is deprecated; use --update-weight-disk-dir",
            FutureWarning,
            stacklevel=2,
        )
        if disk is not None and _norm(disk) != _norm(legacy):
            raise ConfigError(
                f"--update-weight-disk-dir {disk!r} and its deprecated alias "
                f"--update-weight-delta-dir {legacy!r} disagree; give only --update-weight-disk-dir"
            )
        disk = disk if disk is not None else legacy
    keep = getattr(args, "update_weight_disk_keep_files", None)
    legacy_keep = getattr(args, "update_weight_delta_keep_files", None)
    if legacy_keep and first:
        warnings.warn(
            "--update-weight-delta-keep-files is deprecated; use --update-weight-disk-keep-files",
            FutureWarning,
            stacklevel=2,
        )
    keep = bool(keep or legacy_keep)
    args.update_weight_disk_dir = disk
    args.update_weight_delta_dir = disk
    args.update_weight_disk_keep_files = keep
    args.update_weight_delta_keep_files = keep
    setattr(args, _RESOLVED, True)


def _norm(path: str | os.PathLike[str]) -> str:
    return os.path.normpath(os.path.expanduser(os.fspath(path)))


def sync_config_from_args(
    args: argparse.Namespace, *, environ: Mapping[str, str] | None = None
) -> SyncConfig:
    """The :class:`SyncConfig` that slime-style ``args`` describe (then environment, file).

    Applies :func:`resolve_deprecated_args` to ``args``. Raises ConfigError, naming slime's
    flags, for a transport other than disk, delta with ``--colocate``, a hook path that is not
    an import path, and keep-files together with a retention limit.
    """
    resolve_deprecated_args(args)
    mode = getattr(args, "update_weight_mode", None)
    transport = getattr(args, "update_weight_transport", None)
    if transport is not None and transport != "disk":
        raise ConfigError(
            f"--update-weight-transport {transport!r} is not available with asyncsync, which "
            "moves weights through a shared directory: pass --update-weight-transport disk and "
            "--update-weight-disk-dir DIR, or keep slime's own create_weight_updater for "
            f"{transport}"
        )
    if mode == "delta" and getattr(args, "colocate", False):
        raise ConfigError(
            "--update-weight-mode delta is not supported with --colocate: colocated engines "
            "take the weights in memory and keep no copy a delta could patch. Use "
            "--update-weight-mode full, or run the engines on their own GPUs"
        )
    overrides: dict[str, Any] = {}
    labels: dict[str, str] = {}
    for dest, name in _FIELDS.items():
        value = getattr(args, dest, None)
        if value is not None:
            overrides[name] = value
            labels[name] = _flag(dest)
    if args.update_weight_disk_dir is not None:
        overrides["root"] = args.update_weight_disk_dir
        labels["root"] = "--update-weight-disk-dir"
    keep_files = bool(args.update_weight_disk_keep_files)
    if keep_files:
        limits = [n for n in ("keep_versions", "keep_bytes") if overrides.get(n) is not None]
        if limits:
            raise ConfigError(
                "--update-weight-disk-keep-files keeps every version, but "
                f"{' and '.join(labels[n] for n in limits)} limits them: give one or the other"
            )
        overrides.update(keep_versions=None, keep_bytes=None)
    for dest in _HOOK_DESTS:
        if getattr(args, dest, None):
            check_import_path(getattr(args, dest), what=_flag(dest))
    env = os.environ if environ is None else environ
    config = SyncConfig.load(environ=env, labels=labels, **overrides)
    if not keep_files and not config.retention_requested:
        config = config.replace(keep_versions=DEFAULT_KEEP_VERSIONS)
    return config


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return 0


def _engine_ids(engines: Sequence[Any]) -> list[str] | None:
    """Engine ids of ``engines`` (strings, or objects with a string ``engine_id``), or None."""
    ids = []
    for engine in engines:
        eid = engine if isinstance(engine, str) else getattr(engine, "engine_id", None)
        if not isinstance(eid, str):
            return None
        ids.append(eid)
    return ids


class AsyncSyncWeightUpdater:
    """A weight updater with slime's shape, publishing through asyncsync (module docstring).

    Args:
        args, model, weights_getter, model_name, quantization_config: as slime passes them.
            ``weights_getter()`` returns a state dict or an iterable of ``(name, tensor)``.
        config: the settings (default: :func:`sync_config_from_args` of ``args``).
        rank: this process's rank (default: ``torch.distributed``'s, or 0).
        publisher_rank: the rank that publishes.
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
        rank: int | None = None,
        publisher_rank: int = 0,
    ) -> None:
        self.args = args
        self.model = model
        self.weights_getter = weights_getter
        self.model_name = model_name
        self.quantization_config = quantization_config
        self.update_weight_metrics: dict[str, float] = {}
        self.rollout_engines: list[Any] = []
        self.rollout_engine_lock: Any = None
        config = config if config is not None else sync_config_from_args(args)
        self._push_hook: Callable[..., Any] | None = None
        hook_dest = next((d for d in _HOOK_DESTS if getattr(args, d, None)), None)
        if hook_dest is not None:
            if config.pre_commit_hook is not None:
                raise ConfigError(
                    f"{_flag(hook_dest)} and pre_commit_hook (ASYNCSYNC_PRE_COMMIT_HOOK or the "
                    "config file) are both set; keep one"
                )
            self._push_hook = resolve_callable(getattr(args, hook_dest), what=_flag(hook_dest))
            config = config.replace(pre_commit_hook=self._pre_push)
        self.config = config
        self.weight_version = config.start_version
        self.rank = _rank() if rank is None else rank
        self._updates = 0
        self._offset: int | None = None
        self._session: SyncSession | None = None
        if self.rank == publisher_rank:
            producer = {"framework": "slime", "model_name": model_name}
            self._session = SyncSession(config, producer=producer).open()

    # ------------------------------------------------------------------ slime's interface
    def connect_rollout_engines(
        self,
        rollout_engines: Sequence[Any],
        rollout_engine_lock: Any = None,
        *args: Any,
        engine_ids: Sequence[str] | None = None,
        **kwargs: Any,
    ) -> None:
        """Record the engines; wait for their acks unless the config names engines or a quorum.

        Engines are identified by ``engine_ids``, else by each engine itself when it is a string
        or has a string ``engine_id``; otherwise (Ray actor handles) the updater waits for a
        quorum of ``len(rollout_engines)`` engines. Extra slime arguments are accepted.
        """
        self.rollout_engines = list(rollout_engines)
        self.rollout_engine_lock = rollout_engine_lock
        self._apply_engine_policy(list(engine_ids) if engine_ids is not None else None)

    def disconnect_rollout_engines(self) -> None:
        self.rollout_engines = []
        self.rollout_engine_lock = None
        self._apply_engine_policy(None)

    def update_weights(self) -> None:
        """Publish the weights ``weights_getter()`` returns (seed on the first call), then wait
        per the ack policy. Raises AckTimeout when engines fall behind (the version is
        committed; ``weight_version`` names it)."""
        t0 = time.perf_counter()
        state_dict = collect_state_dict(self.weights_getter())
        t_gather = time.perf_counter() - t0
        if self._session is None:  # not the publishing rank
            if self._updates:
                self.weight_version += 1
            self._updates += 1
            return
        try:
            step = self._session.publish(state_dict)
        finally:
            self._follow_session()
        self._updates += 1
        self._record(step, t_gather, time.perf_counter() - t0)

    def pop_metrics(self) -> dict[str, float]:
        """The last update's metrics (``perf/update_weights_*``), cleared."""
        out, self.update_weight_metrics = self.update_weight_metrics, {}
        return out

    # ------------------------------------------------------------------ lifecycle
    @property
    def session(self) -> SyncSession | None:
        """The publishing session (None on ranks that do not publish)."""
        return self._session

    def close(self) -> None:
        """Close the publisher and its thread (idempotent)."""
        if self._session is not None:
            self._session.close()

    def __enter__(self) -> AsyncSyncWeightUpdater:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"<AsyncSyncWeightUpdater rank={self.rank} weight_version={self.weight_version} "
            f"engines={len(self.rollout_engines)} session={self._session!r}>"
        )

    # ------------------------------------------------------------------ internals
    def _apply_engine_policy(self, ids: list[str] | None) -> None:
        if self._session is None:
            return
        base = self.config.ack_policy
        if base.waits:
            return  # the configuration decides whom to wait for
        ids = ids if ids is not None else _engine_ids(self.rollout_engines)
        who: dict[str, Any] = {}
        if ids:
            who = {"engines": tuple(ids)}
        elif self.rollout_engines:
            who = {"quorum": len(self.rollout_engines)}
        self._session.ack_policy = AckPolicy(
            timeout=base.timeout, max_staleness=base.max_staleness, **who
        )
        logger.info("asyncsync updater: waiting for %s", self._session.ack_policy.describe())

    def _pre_push(self, version_dir: Path) -> Any:
        assert self._push_hook is not None
        return self._push_hook(self.args, str(version_dir), list(self.rollout_engines))

    def _follow_session(self) -> None:
        session = self._session
        assert session is not None
        if session.seed_version is None or session.version is None:
            return
        if self._offset is None:
            self._offset = self.weight_version - session.seed_version
        self.weight_version = session.version + self._offset

    def _record(self, step: SyncStep, gather_s: float, total_s: float) -> None:
        r, ack = step.result, step.ack
        sec = r.seconds
        post = r.delta_bytes
        m = self.update_weight_metrics
        m["perf/update_weights_density"] = r.density
        m["perf/update_weights_wire_bytes"] = float(r.wire_bytes)
        m["perf/update_weights_disk_bytes_pre_compress"] = float(r.raw_bytes)
        m["perf/update_weights_disk_bytes_post_compress"] = float(post)
        m["perf/update_weights_compression_ratio"] = r.raw_bytes / post if post else 1.0
        m["perf/update_weights_gather_ms"] = 1000 * gather_s
        m["perf/update_weights_diff_ms"] = 1000 * sec.get("diff", 0.0)
        m["perf/update_weights_encode_ms"] = 1000 * (sec.get("diff", 0.0) + sec.get("encode", 0.0))
        m["perf/update_weights_write_ms"] = 1000 * sec.get("write", 0.0)
        m["perf/update_weights_commit_ms"] = 1000 * sec.get("commit", 0.0)
        m["perf/update_weights_ack_wait_ms"] = 1000 * ack.seconds
        m["perf/update_weights_finalize_ms"] = 1000 * (sec.get("commit", 0.0) + ack.seconds)
        m["perf/update_weights_total_ms"] = 1000 * total_s
        m["perf/update_weights_flushes_per_rank"] = float(r.shards)
        m["perf/update_weights_changed"] = float(r.changed)
        m["perf/update_weights_elements"] = float(r.total)
        m["perf/update_weights_zero_diff"] = float(r.zero_diff)
        m["perf/update_weights_version"] = float(r.version)
        m["perf/update_weights_weight_version"] = float(self.weight_version)
        if ack.staleness is not None:
            m["perf/update_weights_staleness"] = float(ack.staleness)
        logger.info(
            "[asyncsync v=%d weight_version=%d] %s density=%.3f%% wire=%.1f MB total=%.2fs "
            "ack_wait=%.2fs",
            r.version,
            self.weight_version,
            r.kind,
            100 * r.density,
            r.wire_bytes / 1e6,
            total_s,
            ack.seconds,
        )


def create_weight_updater(
    args: argparse.Namespace,
    model: Any,
    weights_getter: Callable[[], Weights],
    *,
    model_name: str,
    quantization_config: Mapping[str, Any] | None,
) -> AsyncSyncWeightUpdater:
    """slime's factory, for asyncsync: validate ``args``, build the updater, set its version.

    ``weight_version`` starts at ``args.update_weight_start_version`` (or the configured
    ``start_version``, default 0). Refused combinations raise
    :class:`~asyncsync.errors.ConfigError` (see :func:`sync_config_from_args`).
    """
    config = sync_config_from_args(args)
    updater = AsyncSyncWeightUpdater(
        args,
        model,
        weights_getter,
        model_name=model_name,
        quantization_config=quantization_config,
        config=config,
    )
    updater.weight_version = config.start_version
    return updater
