"""slime's weight-update options and argument rules at two revisions, rewritten for the tests.

``DEFINITIONS[gen]`` is what slime's ``add_argument`` calls define (flag -> default, choices);
``validate(gen, args)`` raises ``ValueError`` (and warns ``UserWarning``) as slime's
``slime/utils/arguments.py`` does at that revision. ``actor_choice(gen, args)`` is the class
``MegatronTrainRayActor.init`` builds (``AssertionError`` where it asserts).
"""

from __future__ import annotations

import argparse
import types
import warnings
from typing import Any

MiB = 1024**2

# flag -> (default, choices or None, action)
DEFINITIONS: dict[str, dict[str, tuple[Any, list[str] | None, str | None]]] = {
    "gen1": {
        "--colocate": (False, None, "store_true"),
        "--update-weight-mode": ("full", ["full", "delta"], None),
        "--update-weight-transport": ("nccl", ["nccl", "disk"], None),
        "--update-weight-disk-dir": (None, None, None),
        "--update-weight-disk-keep-files": (False, None, "store_true"),
        "--update-weight-encoding": ("indices", ["indices", "deltas", "deltas_zstd"], None),
        "--update-weight-delta-dir": (None, None, None),
        "--update-weight-delta-keep-files": (False, None, "store_true"),
        "--custom-delta-pre-push-path": (None, None, None),
        "--update-weight-buffer-size": (512 * MiB, None, None),
    },
    "gen2": {
        "--colocate": (False, None, "store_true"),
        "--update-weight-mode": ("full", ["full", "delta"], None),
        "--update-weight-transport": ("nccl", ["nccl", "disk"], None),
        "--release-train": (False, None, "store_true"),
        "--update-weight-disk-dir": (None, None, None),
        "--update-weight-disk-keep-files": (False, None, "store_true"),
        "--update-weight-delta-encoding": ("xor", ["xor", "overwrite"], None),
        "--update-weight-delta-checksum": ("xxh3-128", ["xxh3-128", "blake3", "adler32"], None),
        "--custom-update-weight-post-write-path": (None, None, None),
        "--update-weight-local-checkpoint-dir": (None, None, None),
        "--update-weight-buffer-size": (512 * MiB, None, None),
    },
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


def _resolve_disk_dir_gen1(args: Any) -> None:
    disk_dir, delta_dir = args.update_weight_disk_dir, args.update_weight_delta_dir
    if disk_dir and delta_dir and disk_dir != delta_dir:
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
            raise ValueError("--update-weight-transport=disk requires --update-weight-disk-dir")
        args.update_weight_disk_dir = disk_dir
        args.update_weight_delta_dir = disk_dir


def validate(gen: str, args: Any) -> None:
    mode, transport, colocate = args.update_weight_mode, args.update_weight_transport, args.colocate
    if gen == "gen1":
        _resolve_disk_dir_gen1(args)
        if mode == "delta":
            if transport not in ("nccl", "disk"):
                raise ValueError(
                    "--update-weight-mode=delta supports only "
                    "--update-weight-transport=nccl or disk"
                )
            if colocate:
                raise ValueError("--update-weight-mode=delta is not supported with --colocate.")
        return
    if transport == "disk" and not args.update_weight_disk_dir:
        raise ValueError("--update-weight-transport=disk requires --update-weight-disk-dir")
    if getattr(args, "release_train", False) and (mode != "full" or transport != "disk"):
        raise ValueError(
            "--release-train requires --update-weight-mode=full and --update-weight-transport=disk."
        )
    if mode == "delta":
        if transport != "disk":
            raise ValueError("--update-weight-mode=delta requires --update-weight-transport=disk")
        if colocate:
            raise ValueError("--update-weight-mode=delta is not supported with --colocate.")
        if not args.update_weight_local_checkpoint_dir:
            raise ValueError(
                "--update-weight-mode=delta requires --update-weight-local-checkpoint-dir"
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
