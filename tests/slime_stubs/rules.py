"""slime's weight-update facts at three revisions, written down for the tests (no slime code).

Read from slime's source at each revision (``git show <rev>:<file>``):

* ``gen1`` = 90c212b5c (2026-07-02): ``slime/utils/arguments.py`` (options,
  ``_resolve_update_weight_disk_dir``, ``_validate_update_weight_args``),
  ``backends/megatron_utils/actor.py`` (the updater choice, ``connect_rollout_engines`` call),
  ``update_weight/update_weight_from_disk.py`` and ``update_weight_from_distributed_delta.py``;
* ``gen2a`` = c74877886 (2026-07-06): the same files plus ``update_weight_from_disk_delta.py``,
  ``ray/actor_group.py`` (``RayTrainGroup``'s full-disk reload), ``ray/rollout.py``
  (``all_engine_actors``) and ``backends/sglang_utils/sglang_engine.py``
  (``sync_local_checkpoint``, the pre-read hook);
* ``gen2`` = 624b824a8 (2026-08-21): the same files (``pull_weights`` instead of
  ``sync_local_checkpoint``, the post-write hook).

``DEFINITIONS[gen]`` is what slime's ``add_argument`` calls define (flag -> default, choices,
action); ``validate(gen, args)`` raises ``ValueError`` (and warns ``UserWarning``) with slime's
messages; ``actor_choice(gen, args)`` is the class ``MegatronTrainRayActor.init`` builds
(``AssertionError`` where it asserts). The other tables are the call sequences and contracts.
"""

from __future__ import annotations

import argparse
import types
import warnings
from typing import Any

MiB = 1024**2
GENS = ("gen1", "gen2a", "gen2")
REVISION = {"gen1": "90c212b5c", "gen2a": "c74877886", "gen2": "624b824a8"}

_COMMON: dict[str, tuple[Any, list[str] | None, str | None]] = {
    "--colocate": (False, None, "store_true"),
    "--update-weight-mode": ("full", ["full", "delta"], None),
    "--update-weight-transport": ("nccl", ["nccl", "disk"], None),
    "--update-weight-disk-dir": (None, None, None),
    "--update-weight-disk-keep-files": (False, None, "store_true"),
    "--update-weight-buffer-size": (512 * MiB, None, None),
}
_GEN2_COMMON: dict[str, tuple[Any, list[str] | None, str | None]] = {
    "--release-train": (False, None, "store_true"),
    "--update-weight-delta-encoding": ("xor", ["xor", "overwrite"], None),
    "--update-weight-delta-checksum": ("xxh3-128", ["xxh3-128", "blake3", "adler32"], None),
    "--update-weight-local-checkpoint-dir": (None, None, None),
}
# flag -> (default, choices or None, action)
DEFINITIONS: dict[str, dict[str, tuple[Any, list[str] | None, str | None]]] = {
    "gen1": {
        **_COMMON,
        "--update-weight-encoding": ("indices", ["indices", "deltas", "deltas_zstd"], None),
        "--update-weight-delta-dir": (None, None, None),
        "--update-weight-delta-keep-files": (False, None, "store_true"),
        "--custom-delta-pre-push-path": (None, None, None),
    },
    "gen2a": {
        **_COMMON,
        **_GEN2_COMMON,
        "--custom-delta-pre-push-path": (None, None, None),
        "--custom-delta-pre-read-path": (None, None, None),
    },
    "gen2": {
        **_COMMON,
        **_GEN2_COMMON,
        "--custom-update-weight-post-write-path": (None, None, None),
    },
}
#: options beside the weight-update ones that the updaters read (same at the three revisions)
OTHERS: dict[str, Any] = {"num_gpus_per_node": 8, "hf_checkpoint": None}

#: the actor sets ``weight_updater.weight_version = getattr(args, "update_weight_start_version",
#: 0)`` right after building it (gen1's actor does not: its updaters start at 0)
ACTOR_SETS_START_VERSION = {"gen1": False, "gen2a": True, "gen2": True}
#: the keywords the actor passes to ``connect_rollout_engines(engines, lock, **kw)``
CONNECT_KWARGS = {
    "gen1": ("engine_gpu_counts", "engine_gpu_offsets"),
    "gen2a": ("engine_gpu_counts", "engine_gpu_offsets", "all_engine_actors"),
    "gen2": ("engine_gpu_counts", "engine_gpu_offsets", "engine_parallel_configs"),
}
#: slime's post-write / pre-push hook ``hook(args, version_dir, rollout_engines)``: its flag, the
#: modes whose updater calls it, whether a returned Future is waited on (gen1: rank 0 waits for
#: its own before telling engines to load), and what the first delta call (which only takes the
#: snapshot) does with it
HOOKS = {
    "gen1": {
        "flag": "custom_delta_pre_push_path",
        "modes": ("delta",),
        "future": True,
        "seed": None,  # not called
        "per_version": "per publish batch (5), every rank, weight_v dir, before the engine RPCs",
    },
    "gen2a": {
        "flag": "custom_delta_pre_push_path",
        "modes": ("delta",),
        "future": False,
        "seed": "rank 0, disk dir, after wiping it",
        "per_version": "once, every rank, weight_v dir, after the index (its last file)",
    },
    "gen2": {
        "flag": "custom_update_weight_post_write_path",
        "modes": ("full", "delta"),
        "future": False,
        "seed": "rank 0, disk dir, after wiping it",
        "per_version": "once, every rank, weight_v dir, after every file",
    },
}
#: gen2a's read-side hook ``hook(disk_dir, target_version)``, called by each host's engine actor
#: in ``sync_local_checkpoint`` (delta mode) before it reads the version
PRE_READ = {"gen1": None, "gen2a": "custom_delta_pre_read_path", "gen2": None}
#: who reloads the engines in full disk mode: gen1's updater itself (pause, flush,
#: update_weights_from_disk(model_path=weight_v dir, weight_version=str(N)), rmtree unless
#: keep-files, continue); later, ``RayTrainGroup`` after the actors return
FULL_RELOAD = {"gen1": "updater", "gen2a": "RayTrainGroup", "gen2": "RayTrainGroup"}
#: the calls of ``update_weights_from_disk`` on an engine for a full version (gen1's updater)
FULL_RELOAD_CALLS = ("pause_generation", "flush_cache", "update_weights_from_disk")
#: the first delta-mode ``update_weights`` takes the snapshot only: no version, no files;
#: gen2a/gen2 wipe ``--update-weight-disk-dir`` first (rank 0)
FIRST_DELTA_CALL_WIPES_DIR = {"gen1": False, "gen2a": True, "gen2": True}
#: engines the updater gets: the node-0 actor of each; gen2a also one actor per host
ALL_HOSTS_PASSED = {"gen1": False, "gen2a": True, "gen2": False}
#: slime's converter, ``HfWeightIteratorDirect(args=, model=, model_name=,
#: quantization_config=[, transform_ue8m0=])`` (its ``__init__(*args, **kwargs)`` passes
#: everything to ``HfWeightIteratorBase.__init__``) and ``get_hf_weight_chunks(weights,
#: progress_desc=[, should_convert_chunk=, param_info_buckets=])``: the parameters each has
ITERATOR_INIT = {
    "gen1": ("args", "model", "model_name", "quantization_config"),
    "gen2a": ("args", "model", "model_name", "quantization_config"),
    "6d485c423": ("args", "model", "model_name", "quantization_config"),
    "gen2": ("args", "model", "model_name", "quantization_config", "transform_ue8m0"),
}
ITERATOR_CHUNKS = {
    "gen1": ("megatron_local_weights", "progress_desc"),
    "gen2a": ("megatron_local_weights", "progress_desc"),
    "6d485c423": (
        "megatron_local_weights",
        "progress_desc",
        "should_convert_chunk",
        "param_info_buckets",
    ),
    "gen2": (
        "megatron_local_weights",
        "progress_desc",
        "should_convert_chunk",
        "param_info_buckets",
    ),
}


def parser(gen: str) -> argparse.ArgumentParser:
    """A parser with slime's weight-update options of ``gen`` (and nothing else)."""
    p = argparse.ArgumentParser()
    for flag, (default, choices, action) in DEFINITIONS[gen].items():
        if action:
            p.add_argument(flag, action=action, default=default)
        elif flag == "--update-weight-buffer-size":
            p.add_argument(flag, type=int, default=default)
        else:
            p.add_argument(flag, type=str, default=default, choices=choices)
    return p


def namespace(gen: str, **values: Any) -> types.SimpleNamespace:
    """slime's defaults of ``gen`` for every weight-update option, overridden by ``values``."""
    ns = vars(parser(gen).parse_args([]))
    ns.update(values)
    return types.SimpleNamespace(**ns)


_DISK_DIR = (
    "--update-weight-transport=disk requires --update-weight-disk-dir to point at "
    "a filesystem shared between the trainer and the rollout engines."
)
_COLOCATE = (
    "--update-weight-mode=delta is not supported with --colocate. Colocate transfers "
    "weights via CUDA IPC (only a handle crosses processes), so the delta bookkeeping "
    "(snapshot + diff + {}) is pure overhead."
)


def _resolve_disk_dir_gen1(args: Any) -> None:
    disk_dir, delta_dir = args.update_weight_disk_dir, args.update_weight_delta_dir
    if disk_dir and delta_dir and disk_dir != delta_dir:  # plain string comparison
        raise ValueError(
            "--update-weight-delta-dir is deprecated alias for --update-weight-disk-dir; "
            "please set only one of them or set both to the same path."
        )
    if delta_dir:
        warnings.warn(
            "--update-weight-delta-dir is deprecated and will be removed in a future release; "
            "use --update-weight-disk-dir instead.",
            UserWarning,
            stacklevel=2,
        )
    disk_dir = disk_dir or delta_dir
    if args.update_weight_transport == "disk":
        if not disk_dir:
            raise ValueError(_DISK_DIR)
        args.update_weight_disk_dir = disk_dir
        args.update_weight_delta_dir = disk_dir


def validate(gen: str, args: Any) -> None:
    mode, transport, colocate = args.update_weight_mode, args.update_weight_transport, args.colocate
    if gen == "gen1":
        _resolve_disk_dir_gen1(args)
        if mode == "delta":
            if transport not in ("nccl", "disk"):
                raise ValueError(
                    "--update-weight-mode=delta supports only --update-weight-transport=nccl or "
                    f"disk, got {transport!r}."
                )
            if colocate:
                raise ValueError(_COLOCATE.format("sparse encode"))
        return
    # gen2a and gen2: the same checks, inside slime_validate_args
    if transport == "disk" and not args.update_weight_disk_dir:
        raise ValueError(_DISK_DIR)
    if getattr(args, "release_train", False) and (mode != "full" or transport != "disk"):
        raise ValueError(
            "--release-train requires --update-weight-mode=full and --update-weight-transport=disk."
        )
    if mode == "delta":
        if transport != "disk":
            raise ValueError(
                "--update-weight-mode=delta requires --update-weight-transport=disk, "
                f"got {transport!r}."
            )
        if colocate:
            raise ValueError(_COLOCATE.format("encode"))
        if not args.update_weight_local_checkpoint_dir:
            raise ValueError(
                "--update-weight-mode=delta requires --update-weight-local-checkpoint-dir "
                "(a rollout-host-local NVMe directory)."
            )


def actor_choice(gen: str, args: Any) -> str:
    mode, transport, colocate = args.update_weight_mode, args.update_weight_transport, args.colocate
    if gen == "gen1":
        if colocate:
            assert mode == "full", "--update-weight-mode=delta is not supported with --colocate"
            return "UpdateWeightFromTensor"
        if mode == "delta":
            return "UpdateWeightFromDistributedDelta"
        if transport == "disk":
            return "UpdateWeightFromDisk"
        assert transport == "nccl"
        return "UpdateWeightFromDistributed"
    if mode == "delta":
        assert not colocate, "--update-weight-mode=delta is not supported with --colocate"
        assert transport == "disk", (
            "--update-weight-mode=delta requires --update-weight-transport=disk"
        )
        return "UpdateWeightFromDiskDelta"
    if transport == "disk":
        return "UpdateWeightFromDisk"
    if colocate:
        return "UpdateWeightFromTensor"
    assert transport == "nccl"
    return "UpdateWeightFromDistributed"
