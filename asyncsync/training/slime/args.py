"""slime's ``--update-weight-*`` arguments: their definitions, slime's rules, and the config.

slime's parser has concrete defaults (``--update-weight-mode full``, ``--update-weight-transport
nccl``, ``--update-weight-buffer-size 536870912`` ...), so a namespace alone cannot tell a value
the user gave from a default. The rule here: a value equal to slime's default counts as *not
given* (the ``ASYNCSYNC_*`` environment and the ``ASYNCSYNC_CONFIG`` file then apply), unless
``args`` carries the set of flags that were really given (:func:`record_given`, which the
driver calls on ``sys.argv``; then exactly those win). Mode and transport are the exception:
slime's own code branches on them (the actor's factory, ``RayTrainGroup``), so they always come
from ``args`` and an environment that disagrees is refused.

Three designs of slime's disk weight sync are known (:data:`SLIME_OPTIONS` lists which has
which option; :data:`REVISIONS` the revision each was read at); :func:`slime_generation` tells
them apart by the options a namespace has:

* ``gen1`` (90c212b5c and before): ``--update-weight-encoding``, ``--update-weight-delta-dir``,
  ``--update-weight-delta-keep-files``, ``--custom-delta-pre-push-path``; delta over nccl or disk;
* ``gen2a`` (af3d7fff6 to 474861aaf^, read at c74877886): disk-only delta into a host-local
  checkpoint: ``--update-weight-delta-encoding``, ``--update-weight-delta-checksum``,
  ``--update-weight-local-checkpoint-dir``, ``--release-train``, ``--custom-delta-pre-push-path``
  and ``--custom-delta-pre-read-path``;
* ``gen2`` (474861aaf and later, read at 624b824a8): as ``gen2a`` with
  ``--custom-update-weight-post-write-path`` instead of the two delta hooks.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from asyncsync.errors import ConfigError
from asyncsync.publish.hooks import check_import_path
from asyncsync.training.config import SyncConfig, parse_size

__all__ = [
    "ASYNCSYNC_OPTIONS",
    "DEFAULT_KEEP_VERSIONS",
    "GENERATIONS",
    "RECEIVER_MODES",
    "REVISIONS",
    "SLIME_OPTIONS",
    "SlimeOption",
    "SlimeSettings",
    "add_arguments",
    "given",
    "record_given",
    "resolve_deprecated_args",
    "slime_generation",
    "slime_settings",
    "sync_config_from_args",
    "validate_args",
]

logger = logging.getLogger(__name__)

Generation = Literal["gen1", "gen2a", "gen2"]
#: oldest first
GENERATIONS: tuple[Generation, ...] = ("gen1", "gen2a", "gen2")
#: the slime revision each generation was read at
REVISIONS: dict[Generation, str] = {"gen1": "90c212b5c", "gen2a": "c74877886", "gen2": "624b824a8"}
ReceiverMode = Literal["ray", "sidecar", "slime", "none"]
RECEIVER_MODES: tuple[ReceiverMode, ...] = ("ray", "sidecar", "slime", "none")

#: versions retention keeps without ``--update-weight-disk-keep-files`` (slime deletes each
#: version once the engines applied it; retention never removes one a live engine still needs)
DEFAULT_KEEP_VERSIONS = 1
GIVEN_ATTR = "_asyncsync_given"
_RESOLVED = "_asyncsync_aliases_resolved"


@dataclass(frozen=True)
class SlimeOption:
    """One of slime's weight-update options as slime's parser defines it."""

    dest: str
    default: Any
    generations: tuple[Generation, ...]
    kwargs: Mapping[str, Any]

    @property
    def flag(self) -> str:
        return _flag(self.dest)


_ALL: tuple[Generation, ...] = GENERATIONS
_GEN2: tuple[Generation, ...] = ("gen2a", "gen2")
_STORE_TRUE = {"action": "store_true"}
#: slime's own definitions (names, defaults, choices) at the three revisions, as data
SLIME_OPTIONS: tuple[SlimeOption, ...] = (
    SlimeOption("colocate", False, _ALL, _STORE_TRUE),
    SlimeOption("update_weight_mode", "full", _ALL, {"choices": ["full", "delta"]}),
    SlimeOption("update_weight_transport", "nccl", _ALL, {"choices": ["nccl", "disk"]}),
    SlimeOption("update_weight_disk_dir", None, _ALL, {"type": str}),
    SlimeOption("update_weight_disk_keep_files", False, _ALL, _STORE_TRUE),
    SlimeOption("update_weight_buffer_size", 512 * 1024**2, _ALL, {"type": int}),
    SlimeOption(
        "update_weight_encoding",
        "indices",
        ("gen1",),
        {"choices": ["indices", "deltas", "deltas_zstd"]},
    ),
    SlimeOption("update_weight_delta_dir", None, ("gen1",), {"type": str}),
    SlimeOption("update_weight_delta_keep_files", False, ("gen1",), _STORE_TRUE),
    SlimeOption("custom_delta_pre_push_path", None, ("gen1", "gen2a"), {"type": str}),
    SlimeOption("release_train", False, _GEN2, _STORE_TRUE),
    SlimeOption("update_weight_delta_encoding", "xor", _GEN2, {"choices": ["xor", "overwrite"]}),
    SlimeOption(
        "update_weight_delta_checksum",
        "xxh3-128",
        _GEN2,
        {"choices": ["xxh3-128", "blake3", "adler32"]},
    ),
    SlimeOption("custom_delta_pre_read_path", None, ("gen2a",), {"type": str}),
    SlimeOption("custom_update_weight_post_write_path", None, ("gen2",), {"type": str}),
    SlimeOption("update_weight_local_checkpoint_dir", None, _GEN2, {"type": str}),
)
_SLIME = {o.dest: o for o in SLIME_OPTIONS}

# asyncsync's own options: dest -> (SyncConfig field or None, add_argument kwargs)
ASYNCSYNC_OPTIONS: dict[str, tuple[str | None, dict[str, Any]]] = {
    "update_weight_start_version": ("start_version", {"type": int}),
    "update_weight_checksum": ("checksum", {"help": "xxh3-128 or xxh3-64"}),
    "update_weight_keyframe_interval": ("keyframe_interval", {"type": int}),
    "update_weight_zstd_level": ("zstd_level", {"type": int}),
    "update_weight_max_in_flight": ("max_in_flight", {"type": int}),
    "update_weight_keep_versions": ("keep_versions", {"type": int}),
    "update_weight_keep_bytes": ("keep_bytes", {"type": parse_size}),
    "update_weight_ack_timeout": ("ack_timeout", {"help": "seconds, or 'none' (default 600)"}),
    "update_weight_max_staleness": ("max_staleness", {"type": int}),
    "asyncsync_encoding": ("encoding", {"help": "xef, indices, deltas, deltas_zstd"}),
    "asyncsync_receivers": (None, {"choices": list(RECEIVER_MODES)}),
    "asyncsync_engine_ids": (None, {"help": "sidecar engine ids, comma-separated"}),
    "asyncsync_converter": (None, {"help": "module:function converting to HF names"}),
}
_ENV = {
    "asyncsync_receivers": "ASYNCSYNC_SLIME_RECEIVERS",
    "asyncsync_engine_ids": "ASYNCSYNC_SLIME_ENGINE_IDS",
    "asyncsync_converter": "ASYNCSYNC_SLIME_CONVERTER",
    "update_weight_local_checkpoint_dir": "ASYNCSYNC_SLIME_LOCAL_CHECKPOINT_DIR",
}
#: the hook flag each generation has, and the modes in which slime calls it
_HOOK: dict[Generation, tuple[str, tuple[str, ...]]] = {
    "gen1": ("custom_delta_pre_push_path", ("delta",)),
    "gen2a": ("custom_delta_pre_push_path", ("delta",)),
    "gen2": ("custom_update_weight_post_write_path", ("full", "delta")),
}
#: options only one generation (or the later two) defines, newest first: how
#: :func:`slime_generation` tells them apart
_MARKERS: tuple[tuple[Generation, tuple[str, ...]], ...] = (
    ("gen2", ("custom_update_weight_post_write_path",)),
    ("gen2a", ("custom_delta_pre_read_path",)),
    ("gen2a", ("release_train", "custom_delta_pre_push_path")),  # both: gen2a
    ("gen2", ("release_train",)),
    ("gen2", ("update_weight_delta_encoding",)),
    ("gen1", ("update_weight_encoding",)),
    ("gen1", ("update_weight_delta_dir",)),
    ("gen1", ("custom_delta_pre_push_path",)),
)


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _detect(has: Any) -> Generation | None:
    for gen, dests in _MARKERS:
        if all(has(d) for d in dests):
            return gen
    return None


# ---------------------------------------------------------------------------------- the parser


def add_arguments(
    parser: argparse.ArgumentParser, *, generation: Generation | None = None
) -> argparse._ArgumentGroup:
    """Add slime's weight-update options of ``generation`` (with slime's defaults) and asyncsync's.

    ``generation`` defaults to the one the parser's own options show (slime's parser defines
    them), else the newest. Options the parser already has are kept as they are, so this is
    safe on a slime parser; options of another generation are never added (they would change
    what :func:`slime_generation` says), and asking for another generation than the parser's
    is refused. asyncsync's options default to None (not given); on ``gen1``, which has no
    ``--update-weight-local-checkpoint-dir``, asyncsync adds it (its receivers use it).
    """
    dests = {a.dest for a in parser._actions}
    found = _detect(dests.__contains__)
    if generation is not None and found is not None and generation != found:
        raise ConfigError(
            f"add_arguments(generation={generation!r}): the parser already defines slime's "
            f"{found} options ({REVISIONS[found]}); adding {generation}'s would make the "
            "namespace look like another slime. Drop generation= to keep the parser's"
        )
    if generation is not None and generation not in GENERATIONS:
        raise ConfigError(f"generation must be one of {GENERATIONS}, got {generation!r}")
    gen: Generation = generation or found or GENERATIONS[-1]
    group = parser.add_argument_group("weight update (asyncsync, slime-compatible)")
    for opt in SLIME_OPTIONS:
        if gen in opt.generations or opt.dest == "update_weight_local_checkpoint_dir":
            _add(group, opt.dest, {"default": opt.default, **opt.kwargs})
    for dest, (_, kwargs) in ASYNCSYNC_OPTIONS.items():
        _add(group, dest, {"default": None, **kwargs})
    return group


def _add(group: argparse._ArgumentGroup, dest: str, kwargs: dict[str, Any]) -> None:
    try:
        group.add_argument(_flag(dest), dest=dest, **kwargs)
    except argparse.ArgumentError:
        logger.debug("%s already defined by the parser; keeping its definition", _flag(dest))


def record_given(args: argparse.Namespace, argv: Sequence[str] | None = None) -> set[str]:
    """Record on ``args`` which weight-update options ``argv`` (default ``sys.argv``) gives.

    Afterwards exactly those count as given (:func:`given`), also when equal to slime's default.
    Call it in the driver right after slime parses its arguments; ``args`` carries the record
    to the actors.
    """
    argv = sys.argv[1:] if argv is None else argv
    known = {_flag(d): d for d in (*_SLIME, *ASYNCSYNC_OPTIONS)}
    found = {known[a.split("=", 1)[0]] for a in argv if a.split("=", 1)[0] in known}
    setattr(args, GIVEN_ATTR, sorted(found))
    return found


def given(args: argparse.Namespace, dest: str) -> bool:
    """Whether ``args`` gives ``dest`` (see the module docstring)."""
    value = getattr(args, dest, None)
    record = getattr(args, GIVEN_ATTR, None)
    if record is not None:
        return dest in record and value is not None
    if value is None:
        return False
    opt = _SLIME.get(dest)
    return opt is None or value != opt.default


def slime_generation(args: argparse.Namespace) -> Generation:
    """Which slime design ``args`` comes from, by the options it has (module docstring);
    the newest when it has none of them (a namespace built by hand)."""
    return _detect(lambda d: hasattr(args, d)) or GENERATIONS[-1]


# ---------------------------------------------------------------------------------- slime's rules


def resolve_deprecated_args(args: argparse.Namespace) -> None:
    """slime's ``--update-weight-delta-dir`` alias (gen1), applied in place, as slime does.

    Differing values are refused; the alias warns (``UserWarning``, slime's words); with disk
    transport both attributes then hold the resolved directory. A second call changes nothing.
    ``--update-weight-delta-keep-files`` is not deprecated in slime: it stays its own flag.
    """
    if getattr(args, _RESOLVED, False):
        return
    disk = getattr(args, "update_weight_disk_dir", None)
    legacy = getattr(args, "update_weight_delta_dir", None)
    if disk and legacy and disk != legacy:  # as slime: the strings, so "/d" and "/d/" differ
        raise ConfigError(
            "--update-weight-delta-dir is deprecated alias for --update-weight-disk-dir; "
            "please set only one of them or set both to the same path."
        )
    if legacy:
        warnings.warn(
            "--update-weight-delta-dir is deprecated and will be removed in a future release; "
            "use --update-weight-disk-dir instead.",
            UserWarning,
            stacklevel=2,
        )
    disk = disk or legacy
    if getattr(args, "update_weight_transport", None) == "disk":
        if not disk:
            raise ConfigError(
                "--update-weight-transport=disk requires --update-weight-disk-dir to point at "
                "a filesystem shared between the trainer and the rollout engines."
            )
        args.update_weight_disk_dir = disk
        if hasattr(args, "update_weight_delta_dir") or slime_generation(args) == "gen1":
            args.update_weight_delta_dir = disk
    setattr(args, _RESOLVED, True)


def validate_args(args: argparse.Namespace) -> None:
    """slime's weight-update checks of its own generation, with slime's messages (ConfigError,
    a ValueError, where slime raises ValueError). gen2a and gen2 check the same."""
    gen = slime_generation(args)
    mode = getattr(args, "update_weight_mode", "full")
    transport = getattr(args, "update_weight_transport", "nccl")
    colocate = bool(getattr(args, "colocate", False))
    if gen == "gen1":
        resolve_deprecated_args(args)
        if mode == "delta":
            if transport not in ("nccl", "disk"):
                raise ConfigError(
                    "--update-weight-mode=delta supports only --update-weight-transport=nccl or "
                    f"disk, got {transport!r}."
                )
            if colocate:
                raise ConfigError(_COLOCATE.format("sparse encode"))
        return
    if transport == "disk" and not getattr(args, "update_weight_disk_dir", None):
        raise ConfigError(
            "--update-weight-transport=disk requires --update-weight-disk-dir to point at "
            "a filesystem shared between the trainer and the rollout engines."
        )
    if getattr(args, "release_train", False) and (mode != "full" or transport != "disk"):
        raise ConfigError(
            "--release-train requires --update-weight-mode=full and --update-weight-transport=disk."
        )
    if mode == "delta":
        if transport != "disk":
            raise ConfigError(
                "--update-weight-mode=delta requires --update-weight-transport=disk, "
                f"got {transport!r}."
            )
        if colocate:
            raise ConfigError(_COLOCATE.format("encode"))
        if not getattr(args, "update_weight_local_checkpoint_dir", None):
            raise ConfigError(
                "--update-weight-mode=delta requires --update-weight-local-checkpoint-dir "
                "(a rollout-host-local NVMe directory)."
            )


_COLOCATE = (
    "--update-weight-mode=delta is not supported with --colocate. Colocate transfers weights "
    "via CUDA IPC (only a handle crosses processes), so the delta bookkeeping (snapshot + diff "
    "+ {}) is pure overhead."
)


# ---------------------------------------------------------------------------------- the config


@dataclass(frozen=True)
class SlimeSettings:
    """What the updater needs beyond :class:`SyncConfig` (resolved by :func:`slime_settings`).

    receivers: who moves the engines to each version (docs/INTEGRATION.md, "Engines"):
        ``ray`` (a receiver actor beside each engine, started by the updater), ``sidecar``
        (receivers the user runs, acking under ``engine_ids``), ``slime`` (the updater reloads
        slime's engines from ``weight_v{N:06d}`` through their Ray handles, as gen1's full disk
        updater does) or ``none`` (slime's ``RayTrainGroup`` reloads ``weight_v{N:06d}``: gen2a
        and gen2 full mode).
    hook: slime's post-write hook (gen2) or pre-push hook (gen1, gen2a) where slime calls it
        (gen1, gen2a: delta mode only), else None; ``pre_read_hook``: gen2a's
        ``--custom-delta-pre-read-path`` (delta mode).
    """

    generation: Generation
    receivers: ReceiverMode
    engine_ids: tuple[str, ...] | None
    local_checkpoint_dir: str | None
    converter: str | None
    hook: str | None
    hook_flag: str | None
    keep_files: bool
    hf_view: bool  # write <disk_dir>/weight_v{N:06d} (full mode: slime reads it)
    pre_read_hook: str | None = None


def slime_settings(
    args: argparse.Namespace, *, environ: Mapping[str, str] | None = None
) -> SlimeSettings:
    env = os.environ if environ is None else environ
    gen = slime_generation(args)
    mode = getattr(args, "update_weight_mode", "full")

    def pick(dest: str) -> Any:
        value = getattr(args, dest, None)
        return value if value not in (None, "") else (env.get(_ENV[dest]) or None)

    local = pick("update_weight_local_checkpoint_dir")
    receivers = pick("asyncsync_receivers") or _default_receivers(gen, mode, local)
    if receivers not in RECEIVER_MODES:
        raise ConfigError(
            f"--asyncsync-receivers (or {_ENV['asyncsync_receivers']}) must be one of "
            f"{RECEIVER_MODES}, got {receivers!r}"
        )
    _check_receivers(gen, mode, receivers, local)
    ids_raw = pick("asyncsync_engine_ids")
    hook_dest, hook_modes = _HOOK[gen]
    hook = getattr(args, hook_dest, None) or None
    if hook:
        check_import_path(hook, what=_flag(hook_dest))
        if mode not in hook_modes:
            logger.warning(
                "%s is not called in %s mode: slime %s calls it in %s mode only",
                _flag(hook_dest), mode, REVISIONS[gen], "/".join(hook_modes),
            )  # fmt: skip
            hook = None
    pre_read = getattr(args, "custom_delta_pre_read_path", None) or None
    if pre_read:
        check_import_path(pre_read, what="--custom-delta-pre-read-path")
    return SlimeSettings(
        generation=gen,
        receivers=receivers,
        engine_ids=_ids(ids_raw) if ids_raw else None,
        local_checkpoint_dir=local,
        converter=pick("asyncsync_converter"),
        hook=hook,
        hook_flag=_flag(hook_dest) if hook else None,
        keep_files=_keep_files(args),
        hf_view=mode == "full",
        pre_read_hook=pre_read if mode == "delta" else None,
    )


def _default_receivers(gen: Generation, mode: str, local: str | None) -> ReceiverMode:
    if mode != "full":
        return "ray"
    if gen != "gen1":
        return "none"  # RayTrainGroup reloads weight_v{N:06d}
    return "ray" if local else "slime"  # gen1's full disk updater reloads the engines itself


def _check_receivers(gen: Generation, mode: str, receivers: str, local: str | None) -> None:
    """Refuse a receiver mode under which nobody (or somebody twice) would move the engines."""
    why = None
    if receivers == "none" and mode == "delta":
        why = (
            "in delta mode slime's engines read only slime's own delta format, so with "
            "--asyncsync-receivers none nothing would ever update them"
        )
    elif receivers == "none" and gen == "gen1":
        why = (
            "slime 90c212b5c's RayTrainGroup does not reload the engines (its full disk "
            "updater does), so with --asyncsync-receivers none nothing would update them"
        )
    elif receivers == "slime" and (mode != "full" or gen != "gen1"):
        why = (
            "--asyncsync-receivers slime reloads the engines from the full weight_v view, "
            + ("which delta mode does not write" if mode != "full" else
               f"which slime {REVISIONS[gen]}'s RayTrainGroup already does (use none)")
        )  # fmt: skip
    if why:
        ways = "ray (with a host-local checkpoint directory) or sidecar"
        if mode == "full":
            ways = "slime (the default)" if gen == "gen1" else "none (the default)"
            ways += ", ray or sidecar"
        raise ConfigError(f"{why}; use {ways}")
    if receivers == "ray" and not local:
        where = (
            "ASYNCSYNC_SLIME_LOCAL_CHECKPOINT_DIR=DIR in the environment (slime 90c212b5c's "
            "parser has no --update-weight-local-checkpoint-dir; "
            "asyncsync.training.slime.add_arguments adds one)"
            if gen == "gen1"
            else "--update-weight-local-checkpoint-dir DIR"
        )
        raise ConfigError(
            "asyncsync starts a receiver beside each engine (--asyncsync-receivers ray), which "
            f"keeps a host-local checkpoint the engine reloads: give {where}, a directory on "
            "every engine host; or use receivers you run yourself (--asyncsync-receivers "
            "sidecar, or ASYNCSYNC_SLIME_RECEIVERS=sidecar)"
        )


def _ids(raw: str | Iterable[str]) -> tuple[str, ...]:
    items = raw.split(",") if isinstance(raw, str) else list(raw)
    return tuple(i.strip() for i in items if i.strip())


def sync_config_from_args(
    args: argparse.Namespace, *, environ: Mapping[str, str] | None = None
) -> SyncConfig:
    """The :class:`SyncConfig` slime's ``args`` describe, then the environment, then the file.

    Applies slime's checks (:func:`validate_args`) first. Only disk transport is asyncsync's:
    slime's own updaters keep nccl and colocate (:func:`.create_weight_updater`
    routes them there), so a namespace for them is refused here with a message saying so.
    gen2a's and gen2's options are mapped or refused, never ignored:
    ``--update-weight-delta-encoding overwrite`` is what every asyncsync encoding does (changed
    positions, new bytes); ``xor`` given explicitly is refused;
    ``--update-weight-delta-checksum`` other than ``xxh3-128`` is refused.
    """
    env = os.environ if environ is None else environ
    validate_args(args)
    mode = getattr(args, "update_weight_mode", "full")
    transport = getattr(args, "update_weight_transport", "nccl")
    if transport != "disk" or (
        getattr(args, "colocate", False) and slime_generation(args) == "gen1"
    ):
        raise ConfigError(
            f"asyncsync replaces slime's disk updaters only (got --update-weight-transport "
            f"{transport!r}{' with --colocate' if getattr(args, 'colocate', False) else ''}): "
            "slime's own updater serves this; use asyncsync.training.slime.create_weight_updater, "
            "which routes it there, or pass --update-weight-transport disk"
        )
    env_mode = env.get("ASYNCSYNC_MODE")
    if env_mode and env_mode != mode:
        raise ConfigError(
            f"ASYNCSYNC_MODE={env_mode} disagrees with --update-weight-mode {mode}: slime "
            "chooses its updater by the flag, so the flag decides; unset ASYNCSYNC_MODE"
        )
    overrides: dict[str, Any] = {
        "mode": mode,
        "transport": "disk",
        "root": args.update_weight_disk_dir,
    }
    labels = {
        "mode": "--update-weight-mode",
        "transport": "--update-weight-transport",
        "root": "--update-weight-disk-dir",
    }

    def take(field: str, dest: str, value: Any = None) -> None:
        overrides[field] = getattr(args, dest) if value is None else value
        labels[field] = _flag(dest)

    if given(args, "update_weight_buffer_size"):
        take("bucket_bytes", "update_weight_buffer_size")
    if given(args, "update_weight_encoding"):
        take("encoding", "update_weight_encoding")
    delta_encoding = getattr(args, "update_weight_delta_encoding", None)
    if given(args, "update_weight_delta_encoding") and delta_encoding != "overwrite":
        raise ConfigError(
            f"--update-weight-delta-encoding {delta_encoding}: asyncsync has no xor encoding; "
            "every asyncsync encoding stores the changed positions and their new bytes, which "
            "is idempotent like 'overwrite'. Pass overwrite or drop the flag (and choose the "
            "position coding with --asyncsync-encoding if you like)"
        )
    checksum = getattr(args, "update_weight_delta_checksum", None)
    if checksum not in (None, "xxh3-128"):
        raise ConfigError(
            f"--update-weight-delta-checksum {checksum}: asyncsync checksums with xxh3-128 or "
            "xxh3-64 (--update-weight-checksum); drop the flag or pass xxh3-128"
        )
    for dest, (field, _) in ASYNCSYNC_OPTIONS.items():
        if field is not None and getattr(args, dest, None) is not None:
            if field in overrides and dest == "asyncsync_encoding":
                raise ConfigError("give --update-weight-encoding or --asyncsync-encoding, not both")
            take(field, dest)
    if getattr(args, "colocate", False):
        take("colocate", "colocate")
    keep_files = _keep_files(args)
    if keep_files:
        limits = [labels[n] for n in ("keep_versions", "keep_bytes") if n in overrides]
        if limits:
            raise ConfigError(
                "--update-weight-disk-keep-files keeps every version, but "
                f"{' and '.join(limits)} limits them: give one or the other"
            )
        overrides.update(keep_versions=None, keep_bytes=None)
    config = SyncConfig.load(environ=env, labels=labels, **overrides)
    if not keep_files and not config.retention_requested:
        config = config.replace(keep_versions=DEFAULT_KEEP_VERSIONS)
    return config


def _keep_files(args: argparse.Namespace) -> bool:
    # slime's two flags, both current in gen1 (neither is deprecated there)
    return bool(getattr(args, "update_weight_disk_keep_files", False)) or bool(
        getattr(args, "update_weight_delta_keep_files", False)
    )
